// Overview: runs by status, the last hour per minute, queues, failing templates, workers and
// the scheduler, from GET /v1/overview. Read again soon after entries reach the audit trail's
// stream (GET /v1/events/stream), and every 30 seconds for what the trail does not record
// (workers coming and going, the progress of held runs, the scheduler's ticks); every 5
// seconds while that stream is down, or for a key that may not read it.

import { get, session } from "../api.js";
import { runsChart } from "../chart.js";
import { ago, badge, card, duration, facts, fill, following, h, localTime, pageHead, progressBar, runLink, table, time } from "../dom.js";
import { follow } from "../sse.js";

const REFRESH_MS = 5000;
const LIVE_REFRESH_MS = 30000;
// Entries come in bursts (a run's start writes several): one refresh at most this often.
const GAP_MS = 500;

export async function render(ctx) {
  const note = h("span", { class: "live-note", id: "overview-live" });
  draw(ctx, await get("/v1/overview", {}, { signal: ctx.signal }), note);
  let last = Date.now();
  let wanted = false;
  let refreshing = false;
  // A refresh GAP_MS after the last one began, never two at once; one asked for meanwhile
  // follows the one under way, which may have read the overview before what it was asked for.
  const refresh = async () => {
    wanted = true;
    if (refreshing) return;
    refreshing = true;
    while (wanted && !ctx.signal.aborted) {
      await new Promise((resolve) => setTimeout(resolve, Math.max(0, last + GAP_MS - Date.now())));
      wanted = false;
      last = Date.now();
      try {
        const focused = document.activeElement?.id;
        draw(ctx, await get("/v1/overview", {}, { signal: ctx.signal }), note);
        if (focused) document.getElementById(focused)?.focus();
      } catch (error) {
        if (error.name !== "AbortError") console.warn("refresh failed", error);
      }
    }
    refreshing = false;
  };

  let live = false;
  if (session.can("events:read")) {
    let missed = false;
    follow("/v1/events/stream", {
      signal: ctx.signal,
      onMessage: () => { refresh(); },
      onMode: (mode) => {
        // What reached the trail while the stream was down, it did not say.
        if (mode === "live" && missed) refresh();
        missed = mode === "polling";
        live = mode === "live";
        following(note, mode, REFRESH_MS);
      },
    });
  } else {
    following(note, "polling", REFRESH_MS);
  }
  ctx.every(REFRESH_MS, () => {
    if (!live || Date.now() - last >= LIVE_REFRESH_MS) refresh();
  });
}

function draw(ctx, data, note) {
  const refresh = h("button", { type: "button", class: "btn", id: "overview-refresh" }, "Refresh");
  refresh.addEventListener("click", async () => draw(ctx, await get("/v1/overview", {}, { signal: ctx.signal }), note));
  const sections = [
    pageHead("Overview", {
      sub: [`Updated ${localTime(data.generatedAt).slice(11)}`, note],
      actions: [refresh],
    }),
  ];
  if (!data.backends.redis) {
    sections.push(h("div", { class: "alert", role: "alert" },
      "Redis did not answer: queue, worker and scheduler figures are missing."));
  }
  if (data.runs) {
    sections.push(statusTiles(data.runs), card(
      ["Runs per minute", "last 60 minutes"],
      runsChart(data.runs.perMinute),
    ));
  } else {
    sections.push(h("div", { class: "note" }, `A ${data.caller.role} key does not read runs, so run figures are not shown.`));
  }
  sections.push(
    h("div", { class: "grid cols-2" }, queuesCard(data), schedulerCard(data)),
    h("div", { class: "grid cols-2" }, data.runs ? failingCard(data.runs) : null, workersCard(data)),
  );
  // A refresh keeps what the reader opened.
  const open = [...ctx.main.querySelectorAll("details[open][id]")].map((d) => d.id);
  fill(ctx.main, h("div", { class: "stack" }, sections));
  for (const id of open) document.getElementById(id)?.setAttribute("open", "");
}

function tile(status, count) {
  return h(
    "a",
    { class: "tile", href: `#/runs?status=${status}`, id: `tile-${status}`, "aria-label": `${count} ${status.replace("_", " ")}` },
    h("div", { class: "label" }, h("span", { class: ["dot", `c-${status}`] }), status.replace("_", " ")),
    h("div", { class: "n" }, String(count)),
  );
}

function statusTiles(runs) {
  return h(
    "section",
    { "aria-label": "Runs by status", class: "status-row" },
    h("div", {}, h("div", { class: "tiles-head" }, h("h2", {}, "Active now")),
      h("div", { class: "tiles five" }, runs.active.map((s) => tile(s.status, s.count)))),
    h("div", {}, h("div", { class: "tiles-head" }, h("h2", {}, "Finished"), h("span", { class: "muted small" }, "in the last hour")),
      h("div", { class: "tiles" }, runs.finishedLastHour.map((s) => tile(s.status, s.count)))),
  );
}

function queuesCard(data) {
  return card(
    "Queues",
    table(
      [
        { label: "Queue", cell: (q) => h("span", { class: "mono" }, q.name) },
        { label: "Ready", class: "num", cell: (q) => q.ready },
        { label: "Delayed", class: "num", cell: (q) => q.delayed },
        { label: "Oldest ready", class: "num", cell: (q) => (q.ready ? duration(q.oldestReadyAgeSeconds) : "—") },
        { label: "Waiting for a handler", cell: handlerWaits },
      ],
      data.queues,
      { empty: data.backends.redis ? "No queue is named by a template yet." : "Unknown: Redis did not answer." },
    ),
  );
}

// "12 runs wait for reports.render": handlers no live worker offers on the queue.
function handlerWaits(q) {
  if (!q.waitingForHandlers.length) return "—";
  return h("ul", { class: "plain" }, q.waitingForHandlers.map((w) => h("li", { class: "waiting", "data-handler": w.handler },
    `${w.runs} ${w.runs === 1 ? "run waits" : "runs wait"} for `, h("code", {}, w.handler), "; no worker offers it")));
}

function schedulerCard(data) {
  const s = data.scheduler;
  const leader = s.leader
    ? h("span", {}, badge("alive", "leader"), " ", h("span", { class: "mono" }, s.leader))
    : data.backends.redis ? badge("gone", "no scheduler holds the lock") : "unknown";
  return card(
    "Scheduler",
    facts([
      ["Leader", leader],
      ["Lock expires in", s.lockTtlSeconds === null ? null : duration(s.lockTtlSeconds)],
      ["Last tick", s.lastTickAt ? h("span", {}, time(s.lastTickAt), h("span", { class: "muted" }, ` (${ago(s.lastTickAt)})`)) : "never"],
      ["Backends", h("span", {}, badge(data.backends.mongodb ? "alive" : "gone", "MongoDB"), " ",
        badge(data.backends.redis ? "alive" : "gone", "Redis"))],
    ]),
  );
}

function failingCard(runs) {
  return card(
    ["Failing templates", "failed or expired, last 24 h"],
    table(
      [
        {
          label: "Template",
          cell: (f) => h("div", {},
            h("a", { href: `#/failed?templateType=${encodeURIComponent(f.templateType)}` }, f.templateType),
            h("div", { class: "muted small", title: localTime(f.lastAt) }, `last ${ago(f.lastAt)}`)),
        },
        { label: "Failed", class: "num", cell: (f) => f.failed },
        { label: "Expired", class: "num", cell: (f) => f.expired },
        {
          label: "Top errors",
          cell: (f) => f.errors.slice(0, 3).map((e) => h("div", { class: "small nowrap", title: e.message || "" },
            h("code", {}, e.code), h("span", { class: "muted" }, ` × ${e.count}`))),
        },
      ],
      runs.failingTemplates,
      { empty: "No run failed or expired in the last 24 hours." },
    ),
  );
}

function workersCard(data) {
  const w = data.workers;
  let summary = "Unknown: Redis did not answer.";
  if (w.alive !== null) {
    const rest = w.alive - w.holding.filter((x) => x.alive).length;
    const others = data.caller.role === "user" ? "idle or working outside your scopes" : "idle";
    summary = `${w.alive} alive, holding ${w.runsHeld} run${w.runsHeld === 1 ? "" : "s"}` + (rest > 0 ? `; ${rest} ${others}` : "");
  }
  const gone = "Not among the live workers in Redis: the worker stopped (its lease will run out and the run be recovered), or it is an external worker, which reports through the API.";
  return card(
    ["Workers", summary],
    table(
      [
        {
          label: "Worker",
          cell: (x) => h("div", {}, h("div", { class: "mono small nowrap" }, x.workerId),
            x.alive === null ? null : h("div", { title: x.alive ? "" : gone }, badge(x.alive ? "alive" : "gone", x.alive ? "alive" : "not seen"))),
        },
        {
          label: "Current runs",
          cell: (x) => x.runs.map((r) => h("div", { class: "held" },
            runLink(r.id), h("span", { class: "muted small ellipsis", title: r.templateType }, r.templateType),
            progressBar(r.percentage, { thin: true, label: `Run ${r.id} progress` }),
            h("span", { class: "pct" }, `${Math.round(r.percentage)}%`))),
        },
      ],
      w.holding,
      { empty: "No worker holds a run right now." },
    ),
  );
}
