// One run: its steps as live progress bars, payload, result and the error it ended with, the
// errors of earlier attempts, attempts and lease, its event trail, and cancel / rerun. The run's
// stream (GET /v1/runs/{id}/stream) brings each change while the run is active; GET
// /v1/runs/{id} is polled every second while the stream is down, and while the run waits to
// start. The trail is read again whenever the run's version moves.

import { ApiError, get, post, session } from "../api.js";
import { announce, badge, card, confirmDialog, duration, errorBox, facts, fill, following, h, json, pageHead, progressBar, runLink, table, TERMINAL, time, toast } from "../dom.js";
import { follow } from "../sse.js";

const POLL_MS = 1000;
// The statuses of a run that could start: the only ones with a `waitingFor`.
const CLAIMABLE = new Set(["pending", "queued"]);

export async function render(ctx) {
  const id = ctx.params[0];
  const path = `/v1/runs/${encodeURIComponent(id)}`;
  let run = await get(path, {}, { signal: ctx.signal });
  const [template, events] = await Promise.all([
    get(`/v1/templates/${encodeURIComponent(run.templateType)}/versions/${run.templateVersion}`, {}, { signal: ctx.signal }).catch(() => null),
    get(`${path}/events`, {}, { signal: ctx.signal }),
  ]);
  const view = new RunView(ctx, template);
  view.update(run, events);

  // The stream and a poll may answer out of order: a run older than the one shown is dropped.
  const show = async (fresh) => {
    if (fresh.version < run.version) return;
    if (fresh.version !== run.version) {
      const trail = await get(`${path}/events`, {}, { signal: ctx.signal });
      if (fresh.version < run.version) return;
      view.update(fresh, trail);
    } else if (JSON.stringify(fresh.waitingFor) !== JSON.stringify(run.waitingFor)) {
      // Why a run waits is not stored, so it changes without the run's version: a queue
      // paused or resumed, a worker that came or went.
      view.update(fresh);
    }
    run = fresh;
  };
  let live = false;
  follow(`${path}/stream`, {
    signal: ctx.signal,
    onMessage: (message) => show(JSON.parse(message.data)),
    onMode: (mode) => {
      live = mode === "live";
      view.follows(mode);
    },
    // The stream ends after a terminal status; otherwise it broke.
    done: () => TERMINAL.has(run.status),
  });
  ctx.every(POLL_MS, async () => {
    // The stream sends the run only when its version moves, so it never says a new
    // `waitingFor`: a run waiting to start is asked for all the same.
    if (!live || CLAIMABLE.has(run.status)) await show(await get(path, {}, { signal: ctx.signal }));
    // A finished run does not change again; its page stops asking.
    return !TERMINAL.has(run.status);
  });
  view.onChange = (changed) => {
    run = changed;
  };
}

class RunView {
  constructor(ctx, template) {
    this.ctx = ctx;
    this.template = template;
    this.run = null;
    this.onChange = () => {};
    this.note = h("span", { class: "live-note", id: "run-live" });
    this.head = h("div");
    this.summary = h("section", { class: "card", "aria-label": "Progress" });
    this.details = h("div", { class: "grid cols-2" });
    this.data = h("div", { class: "stack" });
    this.timeline = h("section", { class: "card", "aria-label": "Event timeline" });
    fill(ctx.main, h("div", { class: "stack" }, this.head, this.summary, this.details, this.data, this.timeline));
  }

  update(run, events) {
    const before = this.run;
    this.run = run;
    if (before && before.status !== run.status) announce(`The run is now ${run.status.replace("_", " ")}.`);
    const focused = document.activeElement?.id;
    this.drawHead(run);
    this.drawProgress(run);
    this.drawDetails(run);
    this.drawData(run);
    if (events) this.drawTimeline(events);
    if (focused) document.getElementById(focused)?.focus();
  }

  drawHead(run) {
    const actions = [];
    if (session.can("runs:write") && !TERMINAL.has(run.status) && run.status !== "cancel_requested") {
      const cancel = h("button", { type: "button", class: "btn danger", id: "run-cancel" }, "Cancel run");
      cancel.addEventListener("click", () => this.cancel());
      actions.push(cancel);
    }
    if (session.can("runs:write") && TERMINAL.has(run.status)) {
      const rerun = h("button", { type: "button", class: "btn primary", id: "run-rerun" }, "Rerun");
      rerun.addEventListener("click", () => this.rerun());
      actions.push(rerun);
    }
    const name = this.template?.name || run.templateType;
    fill(this.head,
      pageHead(h("span", {}, "Run ", h("span", { class: "mono" }, run.id)), { actions }),
      h("p", { class: "muted", id: "run-status-line" },
        h("span", { id: "run-status" }, badge(run.status)), " ",
        h("a", { href: `#/templates/${encodeURIComponent(run.templateType)}?v=${run.templateVersion}` }, name),
        ` v${run.templateVersion} · ${run.scope}:${run.scopeId}`,
        run.phase && !TERMINAL.has(run.status) ? ` · step ${run.phase}` : "",
        TERMINAL.has(run.status) ? null : this.note),
    );
    document.title = `Run ${run.id} · jobplane`;
  }

  follows(mode) {
    following(this.note, mode, POLL_MS);
  }

  drawProgress(run) {
    const names = new Map((this.template?.steps || []).map((s) => [s.id, s]));
    const steps = run.progress.steps.length
      ? run.progress.steps
      : (this.template?.steps || []).map((s) => ({ id: s.id, status: "pending", percentage: 0 }));
    const list = h("ol", { class: "steps", "aria-label": "Steps" });
    for (const step of steps) {
      const spec = names.get(step.id);
      const label = spec?.name || step.id;
      const took = step.startedAt
        ? duration(((step.completedAt ? new Date(step.completedAt) : new Date()) - new Date(step.startedAt)) / 1000)
        : null;
      list.append(h(
        "li",
        { "data-step": step.id },
        h("div", {},
          h("div", { class: "step-name" }, label, " ", spec?.name ? h("span", { class: "mono" }, step.id) : null),
          h("div", { class: "step-meta" }, spec ? stepWork(spec) : "")),
        h("div", {},
          h("div", { class: "bar-row" },
            progressBar(step.percentage, { label: `Step ${label}`, status: step.status }),
            h("span", { class: "pct" }, `${Math.round(step.percentage)}%`)),
          step.message ? h("div", { class: "step-meta" }, step.message) : null,
          step.map ? childrenNote(run, step) : null),
        h("div", { class: "right" }, badge(step.status), took ? h("div", { class: "step-meta" }, took) : null),
        step.error ? h("div", { class: "step-error" }, step.error) : null,
      ));
    }
    const graph = stepGraph(steps, names);
    fill(this.summary,
      h("h2", {}, "Progress"),
      h("div", { class: "bar-row" },
        progressBar(run.progress.percentage, { label: "Run progress", status: run.status }),
        h("span", { class: "pct", id: "run-percentage" }, `${Math.round(run.progress.percentage)}%`)),
      run.progress.summary ? h("p", { class: "muted small" }, run.progress.summary) : null,
      run.waitingFor ? waitingNote(run) : null,
      graph,
      list,
    );
  }

  drawDetails(run) {
    const link = (hash, text) => h("a", { href: hash, class: "mono" }, text);
    fill(this.details,
      card("Run", facts([
        ["Status", badge(run.status)],
        ["Attempt", `${run.attempt} of ${run.maxAttempts}`],
        ["Attempt started", run.attemptStartedAt ? time(run.attemptStartedAt) : undefined],
        ["Queue", h("span", { class: "mono" }, run.queue)],
        ["Priority", String(run.priority)],
        ["Waiting for", run.waitingFor ? `${run.waitingFor.reason}: ${run.waitingFor.detail}` : undefined],
        ["Created", time(run.createAt)],
        ["Not before", run.notBefore ? time(run.notBefore) : undefined],
        ["Started", time(run.startedAt)],
        ["Completed", run.completedAt ? time(run.completedAt) : undefined],
        ["Deadline", run.deadline ? time(run.deadline) : undefined],
        ["Schedule", run.scheduleId ? link(`#/schedules/${encodeURIComponent(run.scheduleId)}`, run.scheduleId) : undefined],
        ["Scheduled for", run.scheduledFor ? time(run.scheduledFor) : undefined],
        ["Rerun of", run.rerunOf ? runLink(run.rerunOf, { full: true }) : undefined],
        ["Idempotency key", run.idempotencyKey ? h("span", { class: "mono" }, run.idempotencyKey) : undefined],
        ["Dedupe key", run.dedupeKey ? h("span", { class: "mono" }, run.dedupeKey) : undefined],
        ["Trace", run.traceId ? trace(run.traceId) : undefined],
      ])),
      card("Lease", facts([
        [TERMINAL.has(run.status) ? "Last held by" : "Held by", run.lockedBy ? h("span", { class: "mono" }, run.lockedBy) : "no worker"],
        ["Lease until", run.lockedUntil ? time(run.lockedUntil) : undefined],
        ["Last heartbeat", run.heartbeatAt ? time(run.heartbeatAt) : undefined],
        ["External worker", run.externalType ? h("span", { class: "mono" }, run.externalType) : undefined],
        ["Cancel requested", run.cancelRequestedAt ? time(run.cancelRequestedAt) : undefined],
        ["Cancel by", run.cancelRequestedBy || undefined],
        ["Cancel reason", run.cancelReason || undefined],
      ])),
    );
  }

  drawData(run) {
    const parts = [card("Payload", json(run.payload))];
    if (run.result !== null && run.result !== undefined) parts.push(card("Result", json(run.result)));
    if (run.error) parts.push(errorCard(run.error));
    // The attempt a failed or expired run ended with is its error, above.
    const earlier = run.attempts.filter((a) => a.attempt !== run.error?.attempt);
    fill(this.data,
      h("div", { class: run.error || run.result != null ? "grid cols-2" : "" }, parts),
      earlier.length ? attemptsCard(earlier) : null);
  }

  drawTimeline(events) {
    const list = h("ol", { class: "timeline", "aria-label": "Events, oldest first" });
    for (const e of events) {
      const move = e.from && e.to ? ` ${e.from} → ${e.to}` : e.to ? ` → ${e.to}` : e.from ? ` from ${e.from}` : "";
      const meta = Object.keys(e.metadata || {}).length ? JSON.stringify(e.metadata) : "";
      list.append(h(
        "li",
        {},
        h("div", { class: "when" }, time(e.createAt)),
        h("div", {},
          h("span", { class: "what" }, e.type), h("span", { class: "muted" }, move),
          h("div", { class: "meta" }, e.actor, e.message ? ` · ${e.message}` : ""),
          meta ? h("div", { class: "meta mono" }, meta) : null),
      ));
    }
    fill(this.timeline,
      h("h2", {}, "Event timeline", h("span", { class: "aside" }, `${events.length} event${events.length === 1 ? "" : "s"}`)),
      events.length ? list : h("p", { class: "muted" }, "No events yet."),
    );
  }

  async cancel() {
    const running = !["pending", "queued"].includes(this.run.status);
    const choice = await confirmDialog({
      title: "Cancel this run?",
      message: running
        ? "Its worker stops at the next checkpoint; until then the run shows cancel requested."
        : "It has not started, so it is cancelled at once.",
      confirmLabel: "Cancel run",
      danger: true,
      reason: { label: "Reason (optional)", placeholder: "why it is cancelled" },
    });
    if (!choice.ok) return;
    try {
      const body = choice.reason ? { reason: choice.reason } : {};
      const changed = await post(`/v1/runs/${encodeURIComponent(this.run.id)}/cancel`, body);
      toast(changed.status === "cancelled" ? "Run cancelled." : "Cancel requested; waiting for the worker.");
      this.onChange(changed);
      this.update(changed, await get(`/v1/runs/${encodeURIComponent(this.run.id)}/events`));
    } catch (error) {
      this.refused("The run was not cancelled", error);
    }
  }

  async rerun() {
    const choice = await confirmDialog({
      title: "Rerun this run?",
      message: "A new run starts with the same template version, scope, payload and priority.",
      confirmLabel: "Rerun",
    });
    if (!choice.ok) return;
    try {
      const created = await post(`/v1/runs/${encodeURIComponent(this.run.id)}/rerun`, {});
      toast(`Rerun created: ${created.id}`);
      this.ctx.navigate(`#/runs/${encodeURIComponent(created.id)}`);
    } catch (error) {
      this.refused("The rerun was not created", error);
    }
  }

  refused(what, error) {
    if (!(error instanceof ApiError)) throw error;
    toast(`${what}: ${error.message}`, "error");
    this.head.append(errorBox(error, { title: `${what}.` }));
  }
}

// Why a run that could start does not (`waitingFor`), said where the progress would be.
function waitingNote(run) {
  const { reason, detail } = run.waitingFor;
  const queue = h("code", {}, run.queue);
  const said = {
    queue_paused: () => ["Its queue ", queue, " is paused: the run starts once the queue is resumed.",
      session.can("queues:read") ? [" ", h("a", { href: "#/queues" }, "See the queues.")] : null],
    handler: () => ["No live worker on queue ", queue, " offers handler ", h("code", {}, detail),
      ": the run starts once one does."],
    concurrency: () => ["Waits for the run holding its dedupe key ", h("code", {}, detail), " to end."],
    max_running: () => [`Held back by its template's maxRunning (${detail}): the run starts when one of them ends.`],
    lock: () => [`Waits for a lock its step needs (${detail}): the run starts once it is let go.`],
    rate_limit: () => [`Held back by its template's rate limit (${detail}).`],
  }[reason];
  // A reason newer than this page is still said, in the API's words.
  return h("p", { class: "waiting", role: "status", "data-reason": reason }, ...(said ? said() : [`Waiting (${reason}): ${detail}.`]));
}

// The run's trace id; a link into the trace viewer when the server names one
// (JOBPLANE_TRACE_URL), opened beside the dashboard.
function trace(id) {
  if (!session.traceUrl) return h("span", { class: "mono" }, id);
  // split/join rather than replace: a replacement string would read `$` patterns.
  const href = session.traceUrl.split("{traceId}").join(encodeURIComponent(id));
  return h("a", { href, class: "mono", target: "_blank", rel: "noopener" }, id);
}

function errorCard(error) {
  const lines = tracebackLines(error);
  return h(
    "section",
    { class: "card", "aria-label": "Error" },
    h("h2", {}, "Error"),
    facts([
      ["Code", h("code", {}, error.code)],
      ["Message", error.message],
      ["Step", error.step || undefined],
      ["Attempt", String(error.attempt)],
    ]),
    lines.length
      ? h("div", {},
        h("h3", {}, "Traceback summary"),
        h("pre", { class: "block", "aria-label": "Last line of the traceback" }, lines.at(-1)),
        tracebackDetails(error, "Full traceback"))
      : null,
  );
}

function attemptsCard(attempts) {
  return card(["Earlier attempts", `${attempts.length} ended in an error`], table(
    [
      { label: "Attempt", class: "num", cell: (a) => String(a.attempt) },
      { label: "Step", cell: (a) => (a.error.step ? h("span", { class: "mono" }, a.error.step) : "—") },
      { label: "Error", cell: (a) => h("div", {}, h("code", {}, a.error.code), ` ${a.error.message}`, tracebackDetails(a.error, "Traceback")) },
      { label: "Started", cell: (a) => time(a.startedAt) },
      { label: "Ended", cell: (a) => time(a.endedAt) },
      { label: "Took", class: "num nowrap", cell: (a) => (a.startedAt ? duration((new Date(a.endedAt) - new Date(a.startedAt)) / 1000) : "—") },
    ],
    attempts,
  ));
}

function tracebackLines(error) {
  return (error.traceback || "").trimEnd().split("\n").filter(Boolean);
}

function tracebackDetails(error, summary) {
  const lines = tracebackLines(error);
  if (!lines.length) return null;
  return h("details", {}, h("summary", {}, `${summary} (${lines.length} lines)`), h("pre", { class: "block" }, error.traceback));
}

// What does a step's work: its handler, an external worker's, or a map's children.
function stepWork(spec) {
  if (spec.workerType === "map") return `map over ${spec.map.items} → ${spec.map.template}`;
  return `${spec.handler}${spec.workerType === "external" ? " (external)" : ""}`;
}

// A map step's children: how many ended which way, and a link to their list.
function childrenNote(run, step) {
  const m = step.map;
  const ended = (m.succeeded ?? 0) + (m.failed ?? 0);
  return h("div", { class: "step-meta", "data-children": step.id },
    `children ${ended}/${m.total}: ${m.succeeded ?? 0} succeeded, ${m.failed ?? 0} failed, ${m.active ?? 0} active · `,
    h("a", { href: `#/runs?parentRunId=${encodeURIComponent(run.id)}` }, "list them"));
}

// The steps as boxes in layers by what they need (a step is one layer below the deepest step
// it needs), coloured by status; drawn only when the steps are not a line.
function stepGraph(steps, names) {
  const needs = new Map(steps.map((s, i) => [s.id, s.needs ?? (i ? [steps[i - 1].id] : [])]));
  const line = steps.every((s, i) => {
    const wanted = needs.get(s.id);
    return i === 0 ? wanted.length === 0 : wanted.length === 1 && wanted[0] === steps[i - 1].id;
  });
  if (line) return null;
  const depth = new Map();
  const depthOf = (id) => {
    if (!depth.has(id)) {
      depth.set(id, 0); // a cycle cannot be registered; this only guards the recursion
      depth.set(id, Math.max(-1, ...needs.get(id).map(depthOf)) + 1);
    }
    return depth.get(id);
  };
  const layers = [];
  for (const step of steps) (layers[depthOf(step.id)] ??= []).push(step);
  return h("div", { class: "graph", "aria-label": "Steps by what they need", role: "group" },
    ...layers.map((layer, i) => h("div", { class: "layer", "data-layer": String(i + 1) },
      ...layer.map((step) => h("div", {
        class: ["node", `s-${step.status}`],
        "data-node": step.id,
        title: needs.get(step.id).length ? `needs ${needs.get(step.id).join(", ")}` : "needs nothing",
      }, h("span", { class: "node-name" }, names.get(step.id)?.name || step.id), " ",
        step.map ? h("span", { class: "node-count" }, `${(step.map.succeeded ?? 0) + (step.map.failed ?? 0)}/${step.map.total}`) : null,
        badge(step.status))))));
}
