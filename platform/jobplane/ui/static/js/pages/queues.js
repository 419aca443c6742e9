// Queues: what each holds and whether an operator paused it, from GET /v1/queues, refreshed
// every 5 seconds; pause (with an optional reason, kept in the audit trail) and resume.

import { get, post, session } from "../api.js";
import { ago, badge, confirmDialog, duration, errorBox, fill, h, localTime, pageHead, table, time, toast } from "../dom.js";

const REFRESH_MS = 5000;
// The API's limit on a pause's reason.
const REASON_MAX = 500;

export async function render(ctx) {
  let items = (await get("/v1/queues", {}, { signal: ctx.signal })).items;
  // Counts the answers of pauses and resumes: a refresh asked before one of them answered may
  // hold the queue as it was, and would undo the row the answer drew.
  let changes = 0;
  let redisDown = null;

  const updated = h("span", {});
  const refresh = h("button", { type: "button", class: "btn", id: "queues-refresh" }, "Refresh");
  const redisNote = h("div");
  const status = h("p", { class: "muted", id: "queues-status", role: "status" });
  const problem = h("div");
  const list = h("section", { class: "card", "aria-label": "Queues" });

  function draw() {
    const focused = document.activeElement?.id;
    updated.textContent = `Updated ${localTime(new Date().toISOString()).slice(11)} · refreshes every ${REFRESH_MS / 1000} s`;
    // Only when it changes, so an assistive reader hears the alert once, not every refresh.
    const down = items.some((q) => q.ready === null);
    if (down !== redisDown) {
      redisDown = down;
      fill(redisNote, down
        ? h("div", { class: "alert", role: "alert" }, "Redis did not answer: ready and delayed runs and the oldest ready age are unknown (—).")
        : null);
    }
    fill(list, table(columns(), items, { empty: "No queue yet: no template names one and none was paused." }));
    if (focused) document.getElementById(focused)?.focus();
  }

  async function reload() {
    const seen = changes;
    const fresh = await get("/v1/queues", {}, { signal: ctx.signal });
    if (seen !== changes) return;
    items = fresh.items;
    draw();
  }

  function columns() {
    const cols = [
      { label: "Queue", cell: (q) => h("span", { class: "mono" }, q.queue) },
      { label: "Ready", class: "num", cell: (q) => count(q.ready) },
      { label: "Delayed", class: "num", cell: (q) => count(q.delayed) },
      { label: "Running", class: "num", cell: (q) => String(q.running) },
      { label: "Oldest ready", class: "num nowrap", cell: oldestReady },
      { label: "State", cell: state },
    ];
    if (session.can("queues:write")) {
      cols.push({ label: h("span", { class: "visually-hidden" }, "Actions"), cell: actionFor });
    }
    return cols;
  }

  function actionFor(q) {
    const verb = q.paused ? "resume" : "pause";
    const label = q.paused ? "Resume" : "Pause";
    const button = h("button", { type: "button", class: "btn small", id: `queue-${verb}-${q.queue}`, "aria-label": `${label} queue ${q.queue}` }, label);
    button.addEventListener("click", async () => {
      let body = {};
      if (!q.paused) {
        const choice = await confirmDialog({
          title: `Pause queue ${q.queue}?`,
          message: "None of its runs starts until it is resumed. It still accepts runs (creates, schedule fires, retries), and runs already started go on.",
          confirmLabel: "Pause queue",
          danger: true,
          reason: { label: "Reason (optional)", placeholder: "why it is paused; kept in the audit trail", maxLength: REASON_MAX },
        });
        if (!choice.ok) return;
        if (choice.reason) body = { reason: choice.reason };
      }
      button.disabled = true;
      await change(q.queue, verb, body);
      button.disabled = false;
    });
    return button;
  }

  async function change(queue, verb, body) {
    fill(problem);
    try {
      const item = await post(`/v1/queues/${encodeURIComponent(queue)}/${verb}`, body);
      changes += 1;
      items = items.map((q) => (q.queue === item.queue ? item : q));
      draw();
      const message = item.paused
        ? `Queue ${item.queue} paused${item.pauseReason ? ` (${item.pauseReason})` : ""}: none of its runs starts until it is resumed.`
        : `Queue ${item.queue} resumed: its runs start again.`;
      status.textContent = message;
      toast(message);
      document.getElementById(`queue-${item.paused ? "resume" : "pause"}-${item.queue}`)?.focus();
    } catch (error) {
      if (error.name === "AbortError") return;
      const what = `Queue ${queue} was not ${verb === "pause" ? "paused" : "resumed"}`;
      toast(`${what}: ${error.message}`, "error");
      fill(problem, errorBox(error, { title: `${what}.` }));
    }
  }

  refresh.addEventListener("click", async () => {
    refresh.disabled = true;
    try {
      await reload();
    } catch (error) {
      if (error.name !== "AbortError") toast(`Not refreshed: ${error.message}`, "error");
    } finally {
      refresh.disabled = false;
    }
  });

  fill(ctx.main, h("div", { class: "stack" },
    pageHead("Queues", { sub: updated, actions: [refresh] }),
    redisNote,
    h("div", {}, status, problem),
    list,
  ));
  draw();
  ctx.every(REFRESH_MS, reload);
}

// A count Redis did not give (it did not answer) is unknown, not zero.
function count(n) {
  return n === null ? h("span", { class: "muted", title: "unknown: Redis did not answer" }, "—") : String(n);
}

function oldestReady(q) {
  if (q.ready === null) return count(null);
  return q.ready ? duration(q.oldestReadyAgeSeconds) : h("span", { class: "muted" }, "—");
}

function state(q) {
  if (!q.paused) return badge("active");
  return h("div", {},
    badge("paused"),
    h("div", { class: "small" }, "by ", h("span", { class: "mono" }, q.pausedBy || "unknown"), " ",
      time(q.pausedAt), h("span", { class: "muted" }, ` (${ago(q.pausedAt)})`)),
    h("div", { class: "small reason" }, q.pauseReason ? `Reason: ${q.pauseReason}` : h("span", { class: "muted" }, "No reason given.")));
}
