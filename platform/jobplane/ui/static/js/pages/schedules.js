// Schedules: the list with next fire times in the schedule's zone and in UTC; pause, resume
// and trigger; one schedule's next 10 fires and recent runs; and a form to create one.

import { ApiError, cached, get, post, session } from "../api.js";
import { badge, card, confirmDialog, errorBox, facts, field, fill, h, json, pageHead, select, table, time, toast, utcTime, zonedTime } from "../dom.js";
import {
  clearMark, errorField, focusFirstInvalid, mark, problemSummary, requiredScope, scopeFields, withError,
} from "../form.js";
import { runsTable } from "./runs.js";

const PAGE_SIZE = 25;
const schedulePath = (id) => `/v1/schedules/${encodeURIComponent(id)}`;

function nextFire(s) {
  if (!s.enabled) return h("span", { class: "muted" }, "paused");
  if (!s.nextRunAt) return h("span", { class: "muted" }, "—");
  return h("div", {},
    h("div", { class: "nowrap" }, zonedTime(s.nextRunAt, s.timezone), h("span", { class: "muted" }, ` ${s.timezone}`)),
    h("div", { class: "muted small nowrap" }, utcTime(s.nextRunAt)));
}

// Pause / resume and trigger buttons; `done(schedule)` redraws after a change.
function actionsFor(ctx, s, done, { small = false } = {}) {
  if (!session.can("schedules:write")) return [];
  const cls = ["btn", small && "small"];
  const toggle = h("button", { type: "button", class: cls, id: `schedule-${s.enabled ? "pause" : "resume"}-${s.id}`, "aria-label": `${s.enabled ? "Pause" : "Resume"} schedule ${s.id}` },
    s.enabled ? "Pause" : "Resume");
  toggle.addEventListener("click", async () => {
    toggle.disabled = true;
    try {
      const changed = await post(`${schedulePath(s.id)}/${s.enabled ? "pause" : "resume"}`, {});
      toast(`Schedule ${changed.enabled ? "resumed" : "paused"}.`);
      done(changed);
    } catch (error) {
      toggle.disabled = false;
      toast(error.message, "error");
    }
  });
  const trigger = h("button", { type: "button", class: cls, "aria-label": `Trigger schedule ${s.id} now` }, "Trigger now");
  trigger.addEventListener("click", async () => {
    const choice = await confirmDialog({
      title: "Trigger this schedule now?",
      message: `A run of ${s.templateType} is created at once, with the schedule's payload template.`,
      confirmLabel: "Create the run",
    });
    if (!choice.ok) return;
    try {
      const created = await post(`${schedulePath(s.id)}/trigger`, {});
      toast(`Run created: ${created.id}`);
      ctx.navigate(`#/runs/${encodeURIComponent(created.id)}`);
    } catch (error) {
      toast(`Not triggered: ${error.message}`, "error");
    }
  });
  return [toggle, trigger];
}

// -- the list ---------------------------------------------------------------------------------

const previous = new Map();

export async function renderList(ctx) {
  const filters = { templateType: ctx.query.get("templateType") || "", enabled: ctx.query.get("enabled") || "" };
  const cursor = ctx.query.get("cursor") || "";
  const [page, templates] = await Promise.all([
    get("/v1/schedules", { ...filters, limit: PAGE_SIZE, cursor }, { signal: ctx.signal }),
    cached("/v1/templates").catch(() => []),
  ]);
  const hashFor = (extra) => {
    const params = new URLSearchParams(Object.entries({ ...filters, ...extra }).filter(([, v]) => v)).toString();
    return `#/schedules${params ? `?${params}` : ""}`;
  };
  const form = h("form", { class: "filters", role: "search", "aria-label": "Filter schedules" },
    field("Template", select("s-templateType", templates.filter((t) => t.schedulable || t.type === filters.templateType).map((t) => t.type), { value: filters.templateType })),
    field("State", select("s-enabled", [["true", "enabled"], ["false", "paused"]], { value: filters.enabled })),
    h("div", { class: "form-actions" }, h("button", { type: "submit", class: "btn primary" }, "Apply"),
      h("a", { class: "btn", href: "#/schedules" }, "Clear")));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const chosen = { templateType: form.elements["s-templateType"].value, enabled: form.elements["s-enabled"].value };
    const params = new URLSearchParams(Object.entries(chosen).filter(([, v]) => v)).toString();
    ctx.navigate(`#/schedules${params ? `?${params}` : ""}`);
  });
  const key = JSON.stringify(filters);
  const stack = previous.get(key) || [];
  const pager = h("nav", { class: "pager", "aria-label": "Pages" });
  if (cursor) {
    const newer = h("a", { class: "btn small", href: hashFor({ cursor: stack.at(-1) || "" }) }, "← Newer");
    newer.addEventListener("click", () => previous.set(key, stack.slice(0, -1)));
    pager.append(h("a", { class: "btn small", href: hashFor({}) }, "Newest"), newer);
  }
  if (page.nextCursor) {
    const older = h("a", { class: "btn small", href: hashFor({ cursor: page.nextCursor }) }, "Older →");
    older.addEventListener("click", () => previous.set(key, [...stack, cursor]));
    pager.append(older);
  }
  const actions = session.can("schedules:write") ? [h("a", { class: "btn primary", href: "#/schedules/new" }, "New schedule")] : [];
  const redraw = () => ctx.navigate(location.hash);
  fill(ctx.main,
    pageHead("Schedules", { actions }),
    form,
    h("section", { class: "card", "aria-label": "Schedules" }, table(
      [
        {
          label: "Schedule",
          cell: (s) => h("div", {},
            h("a", { href: `#/schedules/${encodeURIComponent(s.id)}`, "aria-label": `schedule ${s.id}` }, s.templateType),
            h("div", { class: "muted small mono nowrap" }, `${s.scope}:${s.scopeId}`)),
        },
        { label: "Cron", cell: (s) => h("div", {}, h("code", {}, s.cron), h("div", { class: "muted small" }, s.timezone)) },
        { label: "State", cell: (s) => badge(s.enabled ? "enabled" : "paused") },
        { label: "Next fire (zone / UTC)", cell: nextFire },
        { label: "Last run", cell: (s) => (s.lastRunId ? h("a", { href: `#/runs/${encodeURIComponent(s.lastRunId)}`, class: "mono" }, time(s.lastRunAt)) : h("span", { class: "muted" }, "—")) },
        { label: h("span", { class: "visually-hidden" }, "Actions"), cell: (s) => h("div", { class: "form-actions" }, actionsFor(ctx, s, redraw, { small: true })) },
      ],
      page.items,
      { empty: "No schedule matches." },
    ), pager),
  );
}

// -- one schedule -----------------------------------------------------------------------------

export async function renderDetail(ctx) {
  const id = ctx.params[0];
  const [schedule, preview, recent] = await Promise.all([
    get(schedulePath(id), {}, { signal: ctx.signal }),
    get(`${schedulePath(id)}/preview`, { count: 10 }, { signal: ctx.signal }),
    session.can("runs:read") ? get("/v1/runs", { scheduleId: id, limit: 10 }, { signal: ctx.signal }) : null,
  ]);
  draw(ctx, schedule, preview, recent);
}

function draw(ctx, s, preview, recent) {
  const redraw = () => ctx.navigate(location.hash);
  fill(ctx.main, h("div", { class: "stack" },
    pageHead(h("span", {}, "Schedule ", h("span", { class: "mono" }, s.id)), {
      sub: h("span", { id: "schedule-state" }, badge(s.enabled ? "enabled" : "paused")),
      actions: actionsFor(ctx, s, redraw),
    }),
    h("div", { class: "grid cols-2" },
      card("Schedule", facts([
        ["Template", h("a", { href: `#/templates/${encodeURIComponent(s.templateType)}` }, s.templateType)],
        ["Scope", h("span", { class: "mono" }, `${s.scope}:${s.scopeId}`)],
        ["Cron", h("code", {}, s.cron)],
        ["Time zone", s.timezone],
        ["State", badge(s.enabled ? "enabled" : "paused")],
        ["Next fire", s.enabled && s.nextRunAt ? h("span", {}, `${zonedTime(s.nextRunAt, s.timezone)} ${s.timezone}`, h("br"), h("span", { class: "muted" }, utcTime(s.nextRunAt))) : "—"],
        ["Last fire", s.lastRunAt ? time(s.lastRunAt) : null],
        ["Last run", s.lastRunId ? h("a", { href: `#/runs/${encodeURIComponent(s.lastRunId)}`, class: "mono" }, s.lastRunId) : null],
        ["Misfires", s.misfirePolicy === "catch_up" ? `catch up (at most ${s.catchUpLimit})` : s.misfirePolicy.replace("_", " ")],
        ["Overlap", s.overlapPolicy],
        ["Created", h("span", {}, time(s.createAt), ` by ${s.createdBy}`)],
        ["Updated", time(s.updateAt)],
      ]), h("h3", {}, "Payload template"), json(s.payloadTemplate)),
      card(["Next 10 fires", s.enabled ? "" : "when resumed"], table(
        [
          { label: "#", class: "num", cell: (t) => preview.times.indexOf(t) + 1 },
          { label: `In ${preview.timezone}`, cell: (t) => h("span", { class: "nowrap" }, zonedTime(t.local, preview.timezone)) },
          { label: "In UTC", cell: (t) => h("span", { class: "nowrap" }, zonedTime(t.utc, "UTC")) },
        ],
        preview.times,
        { empty: "This cron never fires again." },
      )),
    ),
    recent
      ? card(["Recent runs", h("a", { href: `#/runs?scheduleId=${encodeURIComponent(s.id)}` }, "all runs of this schedule")],
        runsTable(recent.items, { empty: "This schedule has not made a run yet." }))
      : null,
  ));
}

// -- create -----------------------------------------------------------------------------------

export async function renderCreate(ctx) {
  const templates = (await cached("/v1/templates")).filter((t) => t.schedulable);
  const zones = typeof Intl.supportedValuesOf === "function" ? Intl.supportedValuesOf("timeZone") : [];
  const here = Intl.DateTimeFormat().resolvedOptions().timeZone || "UTC";
  const own = {
    templateType: withError(select("schedule-templateType", templates.map((t) => t.type), { value: ctx.query.get("templateType") || templates[0]?.type || "", any: null })),
    cron: withError(h("input", { type: "text", id: "schedule-cron", value: "0 9 * * 1-5", spellcheck: "false", "aria-required": "true" })),
    timezone: withError(h("input", { type: "text", id: "schedule-timezone", value: here, list: "schedule-zones", spellcheck: "false" })),
    payloadTemplate: withError(h("textarea", { id: "schedule-payloadTemplate", rows: 6, spellcheck: "false" }, "{}")),
    misfirePolicy: withError(select("schedule-misfirePolicy", [["run_once", "run once"], ["skip", "skip"], ["catch_up", "catch up"]], { value: "run_once", any: null })),
    catchUpLimit: withError(h("input", { type: "number", id: "schedule-catchUpLimit", value: 10, min: 1, max: 1000, step: 1 })),
    overlapPolicy: withError(select("schedule-overlapPolicy", ["allow", "skip", "queue"], { value: "allow", any: null })),
  };
  const paused = h("input", { type: "checkbox", id: "schedule-paused" });
  const scope = scopeFields("schedule");
  const controls = { ...own, ...scope.controls };
  const summary = h("div", { id: "schedule-form-errors", tabindex: "-1" });
  const submit = h("button", { type: "submit", class: "btn primary", id: "schedule-submit" }, "Create schedule");
  const form = h("form", { class: "card schedule-form", novalidate: true, "aria-label": "New schedule" },
    templates.length ? null : h("div", { class: "note" }, "No template is schedulable (a template says so with schedulable: true)."),
    summary,
    h("div", { class: "row" }, errorField("Template", own.templateType, "schedulable templates"), scope.element),
    h("div", { class: "row" },
      errorField("Cron", own.cron, "5 fields (minute hour day month weekday), 6 with seconds last, or @hourly, @daily…"),
      errorField("Time zone", own.timezone, "IANA, e.g. Asia/Taipei")),
    h("datalist", { id: "schedule-zones" }, zones.map((z) => h("option", { value: z }))),
    errorField("Payload template (JSON)", own.payloadTemplate, "strings may use {{scheduledFor}}, {{scheduleId}} and {{scopeId}}"),
    h("div", { class: "row" },
      errorField("Misfires", own.misfirePolicy, "fire times missed while the scheduler was down"),
      errorField("Catch-up limit", own.catchUpLimit, "with catch up"),
      errorField("Overlap", own.overlapPolicy, "while the previous run is active")),
    h("div", { class: "field check" }, paused, h("label", { for: "schedule-paused" }, "Create it paused")),
    h("div", { class: "form-actions" }, submit, h("a", { class: "btn", href: "#/schedules" }, "Cancel")),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    fill(summary);
    for (const c of Object.values(controls)) clearMark(c);
    const missing = requiredScope(scope.read());
    if (missing.length) {
      show(missing);
      return;
    }
    let payloadTemplate;
    try {
      payloadTemplate = JSON.parse(own.payloadTemplate.input.value.trim() || "{}");
    } catch (error) {
      show([{ pointer: "/payloadTemplate", message: `not valid JSON: ${error.message}` }]);
      return;
    }
    const body = {
      templateType: own.templateType.input.value,
      ...scope.read(),
      cron: own.cron.input.value.trim(),
      timezone: own.timezone.input.value.trim(),
      payloadTemplate,
      misfirePolicy: own.misfirePolicy.input.value,
      overlapPolicy: own.overlapPolicy.input.value,
      enabled: !paused.checked,
    };
    if (body.misfirePolicy === "catch_up") body.catchUpLimit = Number(own.catchUpLimit.input.value);
    submit.disabled = true;
    try {
      const created = await post("/v1/schedules", body);
      toast("Schedule created.");
      ctx.navigate(`#/schedules/${encodeURIComponent(created.id)}`);
    } catch (error) {
      if (!(error instanceof ApiError)) throw error;
      if (error.code === "ValidationFailed") show(error.fieldErrors);
      else {
        fill(summary, errorBox(error, { title: "The schedule was not created." }));
        summary.focus();
      }
    } finally {
      submit.disabled = false;
    }
  });

  function show(problems) {
    const left = problems.filter((p) => {
      const name = p.pointer.replace(/^\//, "").split("/")[0];
      const control = controls[name];
      if (!control) return true;
      const where = p.pointer.slice(name.length + 1);
      mark(control.input, control.error, where ? `${where}: ${p.message}` : p.message);
      return false;
    });
    fill(summary, problemSummary("The schedule was not created.", problems.length - left.length, left));
    focusFirstInvalid(form, summary);
  }

  fill(ctx.main, h("div", { class: "stack" }, pageHead("New schedule"), form));
}
