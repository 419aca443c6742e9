// Runs: GET /v1/runs with its filters (status, template, scope, scope id, schedule, parent), newest
// first, a page at a time. The filters and the page live in the address (#/runs?status=...).

import { cached, get, session } from "../api.js";
import { badge, field, fill, h, pageHead, progressBar, RUN_STATUSES, runLink, select, table, time } from "../dom.js";

const PAGE_SIZE = 25;
const FILTERS = ["status", "templateType", "scope", "scopeId", "scheduleId", "parentRunId"];
// The cursors of the pages before this one, per filter set, for "Newer".
const previous = new Map();

export async function render(ctx) {
  const filters = Object.fromEntries(FILTERS.map((f) => [f, ctx.query.get(f) || ""]));
  const cursor = ctx.query.get("cursor") || "";
  const [page, templates] = await Promise.all([
    get("/v1/runs", { ...filters, limit: PAGE_SIZE, cursor }, { signal: ctx.signal }),
    cached("/v1/templates").catch(() => []),
  ]);
  const filterKey = new URLSearchParams(Object.entries(filters).filter(([, v]) => v)).toString();
  const hashFor = (extra) => {
    const params = new URLSearchParams(Object.entries({ ...filters, ...extra }).filter(([, v]) => v));
    const text = params.toString();
    return `#/runs${text ? `?${text}` : ""}`;
  };

  const form = filterForm(filters, templates);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const chosen = Object.fromEntries(FILTERS.map((f) => [f, form.elements[`f-${f}`].value.trim()]));
    const params = new URLSearchParams(Object.entries(chosen).filter(([, v]) => v)).toString();
    ctx.navigate(`#/runs${params ? `?${params}` : ""}`);
  });

  const stack = previous.get(filterKey) || [];
  const pager = h("nav", { class: "pager", "aria-label": "Pages" });
  if (cursor) {
    const newer = h("a", { class: "btn small", href: hashFor({ cursor: stack.at(-1) || "" }) }, "← Newer");
    newer.addEventListener("click", () => previous.set(filterKey, stack.slice(0, -1)));
    pager.append(h("a", { class: "btn small", href: hashFor({}) }, "Newest"), newer);
  }
  if (page.nextCursor) {
    const older = h("a", { class: "btn small", href: hashFor({ cursor: page.nextCursor }), id: "runs-older" }, "Older →");
    older.addEventListener("click", () => previous.set(filterKey, [...stack, cursor]));
    pager.append(older);
  }
  pager.append(h("span", { class: "muted small" }, `${page.items.length} run${page.items.length === 1 ? "" : "s"} on this page`));

  const actions = [];
  if (session.can("runs:write")) actions.push(h("a", { class: "btn primary", href: "#/templates" }, "New run…"));
  fill(ctx.main,
    pageHead("Runs", { sub: session.scopes ? `in your scopes: ${session.identity.scopes.join(", ")}` : null, actions }),
    form,
    h("section", { class: "card", "aria-label": "Runs" }, runsTable(page.items), pager),
  );
}

function filterForm(filters, templates) {
  const text = (name, label, placeholder) => field(label, h("input", {
    type: "text", id: `f-${name}`, name: `f-${name}`, value: filters[name], placeholder,
  }));
  const types = templates.map((t) => t.type);
  if (filters.templateType && !types.includes(filters.templateType)) types.push(filters.templateType);
  return h(
    "form",
    { class: "filters", role: "search", "aria-label": "Filter runs" },
    field("Status", select("f-status", RUN_STATUSES, { value: filters.status })),
    field("Template", select("f-templateType", types, { value: filters.templateType })),
    field("Scope", select("f-scope", ["user", "account", "system"], { value: filters.scope })),
    text("scopeId", "Scope id", "e.g. user_123"),
    text("scheduleId", "Schedule id", ""),
    text("parentRunId", "Parent run id", "a map step's children"),
    h("div", { class: "form-actions" },
      h("button", { type: "submit", class: "btn primary" }, "Apply"),
      h("a", { class: "btn", href: "#/runs" }, "Clear")),
  );
}

export function runsTable(runs, { empty = "No run matches these filters." } = {}) {
  return table(
    [
      { label: "Run", cell: (r) => runLink(r.id) },
      { label: "Template", cell: (r) => h("span", {}, r.templateType, h("span", { class: "muted" }, ` v${r.templateVersion}`)) },
      { label: "Scope", cell: (r) => h("span", { class: "mono" }, `${r.scope}:${r.scopeId}`) },
      { label: "Status", cell: (r) => badge(r.status) },
      {
        label: "Progress",
        cell: (r) => h("div", { class: "bar-row" },
          progressBar(r.progress.percentage, { thin: true, status: r.status, label: `Run ${r.id} progress` }),
          h("span", { class: "pct" }, `${Math.round(r.progress.percentage)}%`)),
      },
      { label: "Attempt", class: "num", cell: (r) => `${r.attempt}/${r.maxAttempts}` },
      { label: "Created", cell: (r) => time(r.createAt) },
      { label: "Updated", cell: (r) => time(r.updateAt) },
    ],
    runs,
    { empty },
  );
}
