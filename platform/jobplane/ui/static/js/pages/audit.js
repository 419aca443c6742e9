// Audit: GET /v1/events with its filters (jobId, type, scope, scopeId, actor, from, to), in
// time order, a page at a time; and the same search exported as CSV.

import { collect, get } from "../api.js";
import { announce, field, fill, h, pageHead, runLink, select, time, toast } from "../dom.js";

const PAGE_SIZE = 100;
const EXPORT_MAX = 50000;
const TEXT_FILTERS = ["jobId", "type", "scopeId", "actor"];
const PLACEHOLDERS = { jobId: "an id", type: "e.g. status_changed", scopeId: "e.g. user_123", actor: "e.g. user:alice, scheduler" };
const EVENT_TYPES = [
  "created", "status_changed", "step_started", "step_finished", "progress", "cancel_requested",
  "lease_expired", "stale_write_rejected", "fire_skipped", "queue_paused", "queue_resumed",
];

// datetime-local text is the browser's wall clock; the API wants an instant with an offset.
function instant(local) {
  return local ? new Date(local).toISOString() : "";
}

function localInput(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  const pad = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}T${pad(d.getHours())}:${pad(d.getMinutes())}`;
}

export async function render(ctx) {
  if (![...ctx.query.keys()].length) {
    // First visit: the last 24 hours, which the form shows and can widen.
    ctx.replace(`#/audit?from=${encodeURIComponent(new Date(Date.now() - 86400000).toISOString())}`);
    return;
  }
  const query = {};
  for (const name of [...TEXT_FILTERS, "scope", "from", "to"]) query[name] = ctx.query.get(name) || "";

  const inputs = Object.fromEntries(TEXT_FILTERS.map((name) => [name, h("input", {
    type: "text", id: `a-${name}`, name: `a-${name}`, value: query[name], spellcheck: "false",
    list: name === "type" ? "a-types" : undefined, placeholder: PLACEHOLDERS[name],
  })]));
  const scope = select("a-scope", ["user", "account", "system"], { value: query.scope });
  const from = h("input", { type: "datetime-local", id: "a-from", value: localInput(query.from) });
  const to = h("input", { type: "datetime-local", id: "a-to", value: localInput(query.to) });
  const form = h("form", { class: "filters", role: "search", "aria-label": "Search events" },
    field("Run, schedule or key id", inputs.jobId),
    field("Type", inputs.type),
    h("datalist", { id: "a-types" }, EVENT_TYPES.map((t) => h("option", { value: t }))),
    field("Scope", scope),
    field("Scope id", inputs.scopeId),
    field("Actor", inputs.actor),
    field("From (local time)", from),
    field("To (local time)", to),
    h("div", { class: "form-actions" },
      h("button", { type: "submit", class: "btn primary" }, "Search"),
      h("a", { class: "btn", href: "#/audit" }, "Clear")));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const chosen = { scope: scope.value, from: instant(from.value), to: instant(to.value) };
    for (const name of TEXT_FILTERS) chosen[name] = inputs[name].value.trim();
    const params = new URLSearchParams(Object.entries(chosen).filter(([, v]) => v));
    // An empty search is still a search: it lists the whole trail from its start.
    ctx.navigate(`#/audit?${params.toString() || "all=1"}`);
  });

  const filters = Object.fromEntries(Object.entries(query).filter(([, v]) => v));
  const body = h("tbody");
  const more = h("button", { type: "button", class: "btn", id: "audit-more", hidden: true }, "Load more");
  const count = h("span", { class: "muted small", role: "status" });
  const exportButton = h("button", { type: "button", class: "btn", id: "audit-export" }, "Export CSV");
  let cursor = null;
  let shown = 0;

  async function load() {
    const page = await get("/v1/events", { ...filters, limit: PAGE_SIZE, cursor }, { signal: ctx.signal });
    for (const event of page.items) body.append(row(event));
    shown += page.items.length;
    cursor = page.nextCursor;
    more.hidden = !cursor;
    count.textContent = `${shown} event${shown === 1 ? "" : "s"}${cursor ? " so far" : ""}`;
    if (!shown) fill(body, h("tr", {}, h("td", { class: "empty", colspan: 7 }, "No event matches.")));
  }
  more.addEventListener("click", async () => {
    more.disabled = true;
    try {
      await load();
    } finally {
      more.disabled = false;
    }
  });
  exportButton.addEventListener("click", async () => {
    exportButton.disabled = true;
    try {
      const { items, truncated } = await collect("/v1/events", filters, {
        max: EXPORT_MAX, onPage: (n) => { exportButton.textContent = `Exporting… ${n}`; },
      });
      download(`jobplane-events-${new Date().toISOString().replace(/[:.]/g, "-")}.csv`, toCsv(items));
      const message = `Exported ${items.length} events${truncated ? ` (the first ${EXPORT_MAX}; narrow the search for the rest)` : ""}.`;
      toast(message);
      announce(message);
    } catch (error) {
      toast(`Export failed: ${error.message}`, "error");
    } finally {
      exportButton.disabled = false;
      exportButton.textContent = "Export CSV";
    }
  });

  const results = h("section", { class: "card", "aria-label": "Events" },
    h("div", { class: "form-actions" }, count, h("span", { class: "spacer" }), exportButton),
    h("div", { class: "table-wrap" }, h("table", { class: "dense" },
      h("thead", {}, h("tr", {}, ["Time", "Type", "Run / schedule / queue / key", "Move", "Actor", "Scope", "Message and details"].map((c) => h("th", { scope: "col" }, c)))),
      body)),
    h("div", { class: "pager" }, more));
  fill(ctx.main,
    pageHead("Audit", { sub: "the job_events trail, oldest first" }),
    form,
    results,
  );
  await load();
}

// What an event is about: a run, a schedule (fire_*), a queue (queue_*, by its name) or an API
// key (api_key_*, no page of its own).
function subject(e) {
  if (e.type.startsWith("fire_")) return h("a", { href: `#/schedules/${encodeURIComponent(e.jobId)}`, class: "mono" }, e.jobId);
  if (e.type.startsWith("queue_")) return h("a", { href: "#/queues", class: "mono" }, e.jobId);
  if (e.type.startsWith("api_key_")) return h("span", { class: "mono" }, e.jobId);
  return runLink(e.jobId);
}

function row(e) {
  return h("tr", {},
    h("td", { class: "nowrap" }, time(e.createAt)),
    h("td", {}, h("code", {}, e.type)),
    h("td", { class: "ident" }, subject(e)),
    h("td", { class: "nowrap" }, e.from && e.to ? `${e.from} → ${e.to}` : e.to ? `→ ${e.to}` : ""),
    h("td", { class: "mono small ident" }, e.actor),
    h("td", { class: "mono small ident" }, e.scope ? `${e.scope}:${e.scopeId}` : ""),
    h("td", { class: "wrap" }, e.message || "",
      Object.keys(e.metadata || {}).length ? h("div", { class: "mono muted small" }, JSON.stringify(e.metadata)) : null),
  );
}

const COLUMNS = ["createAt", "type", "jobId", "from", "to", "actor", "scope", "scopeId", "message", "metadata", "runVersion", "id"];

// RFC 4180 CSV. A cell a spreadsheet would read as a formula (=, +, -, @, tab, CR first) gets
// a leading apostrophe, so an event's text cannot run in the auditor's spreadsheet.
export function toCsv(events) {
  const cell = (value) => {
    let text = value === null || value === undefined ? "" : typeof value === "object" ? JSON.stringify(value) : String(value);
    if (/^[=+\-@\t\r]/.test(text)) text = `'${text}`;
    return /[",\r\n]/.test(text) ? `"${text.replace(/"/g, '""')}"` : text;
  };
  const lines = [COLUMNS.join(",")];
  for (const e of events) {
    lines.push(COLUMNS.map((c) => cell(c === "metadata" && !Object.keys(e.metadata || {}).length ? "" : e[c])).join(","));
  }
  return `${lines.join("\r\n")}\r\n`;
}

function download(name, text) {
  const link = h("a", { href: URL.createObjectURL(new Blob([text], { type: "text/csv;charset=utf-8" })), download: name });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 10000);
}
