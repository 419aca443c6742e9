// Failed: the dead letters (runs that ended failed or expired), grouped by template and error
// code, newest first, with a bulk rerun (POST /v1/runs/{id}/rerun for each chosen run).

import { ApiError, cached, collect, post, session } from "../api.js";
import { ago, announce, badge, confirmDialog, field, fill, h, localTime, pageHead, runLink, select, toast } from "../dom.js";

// Dead letters read per status; the page says when there are more.
const MAX_PER_STATUS = 1000;
const RERUNS_AT_ONCE = 4;

export async function render(ctx) {
  const templateType = ctx.query.get("templateType") || "";
  const [failed, expired, templates] = await Promise.all([
    collect("/v1/runs", { status: "failed", templateType }, { max: MAX_PER_STATUS, signal: ctx.signal }),
    collect("/v1/runs", { status: "expired", templateType }, { max: MAX_PER_STATUS, signal: ctx.signal }),
    cached("/v1/templates").catch(() => []),
  ]);
  const groups = group([...failed.items, ...expired.items]);
  const canRerun = session.can("runs:write");

  const filter = h("form", { class: "filters", role: "search", "aria-label": "Filter dead letters" },
    field("Template", select("failed-templateType", templates.map((t) => t.type), { value: templateType })),
    h("div", { class: "form-actions" }, h("button", { type: "submit", class: "btn primary" }, "Apply")));
  filter.addEventListener("submit", (event) => {
    event.preventDefault();
    const chosen = filter.elements["failed-templateType"].value;
    ctx.navigate(chosen ? `#/failed?templateType=${encodeURIComponent(chosen)}` : "#/failed");
  });

  const boxes = [];
  const rerunButton = h("button", { type: "button", class: "btn primary", id: "failed-rerun", disabled: true }, "Rerun selected");
  const status = h("p", { class: "muted small", id: "failed-status", role: "status" });
  const chosenRuns = () => boxes.filter((b) => b.box.checked).flatMap((b) => b.group.runs);
  const refreshButton = () => {
    const n = chosenRuns().length;
    rerunButton.disabled = n === 0;
    rerunButton.textContent = n ? `Rerun ${n} selected run${n === 1 ? "" : "s"}` : "Rerun selected";
  };
  rerunButton.addEventListener("click", async () => {
    const runs = chosenRuns();
    const choice = await confirmDialog({
      title: `Rerun ${runs.length} run${runs.length === 1 ? "" : "s"}?`,
      message: "Each becomes a new run with the same template version, scope and payload. The failed runs stay as they are.",
      confirmLabel: `Rerun ${runs.length}`,
    });
    if (!choice.ok) return;
    rerunButton.disabled = true;
    const outcome = await rerunAll(runs, (done) => { status.textContent = `Rerunning… ${done} of ${runs.length}`; });
    const message = `${outcome.created.length} rerun${outcome.created.length === 1 ? "" : "s"} created` +
      (outcome.refused.length ? `, ${outcome.refused.length} refused` : "") + ".";
    fill(status, message, outcome.refused.length
      ? h("ul", {}, outcome.refused.map(([run, error]) => h("li", {}, runLink(run.id), ` ${error.code}: ${error.message}`)))
      : "");
    announce(message);
    toast(message, outcome.refused.length ? "error" : "info");
    for (const b of boxes) b.box.checked = false;
    refreshButton();
  });

  const rows = groups.map((g, i) => {
    const box = h("input", { type: "checkbox", id: `failed-group-${i}`, "aria-label": `Select ${g.runs.length} ${g.templateType} runs with ${g.code}` });
    box.addEventListener("change", refreshButton);
    boxes.push({ box, group: g });
    return h("tr", {},
      canRerun ? h("td", {}, box) : null,
      h("td", {}, h("a", { href: `#/templates/${encodeURIComponent(g.templateType)}` }, g.templateType)),
      h("td", {}, h("code", {}, g.code)),
      h("td", {}, Object.entries(g.statuses).map(([s, n]) => h("span", {}, badge(s, `${s} ${n}`), " "))),
      h("td", { class: "num" }, String(g.runs.length)),
      h("td", {}, h("div", { class: "small" }, g.message || "—"),
        h("details", { class: "small" }, h("summary", {}, `Runs (${g.runs.length})`),
          h("ul", {}, g.runs.slice(0, 200).map((r) => h("li", {}, runLink(r.id), h("span", { class: "muted" }, ` ${r.scope}:${r.scopeId} · ${localTime(r.updateAt)}`)))),
          g.runs.length > 200 ? h("p", { class: "muted" }, `and ${g.runs.length - 200} more`) : null)),
      h("td", { class: "nowrap", title: localTime(g.last) }, ago(g.last)),
    );
  });
  const truncated = failed.truncated || expired.truncated;
  fill(ctx.main,
    pageHead("Failed runs", { sub: "dead letters: failed and expired, by template and error code" }),
    filter,
    truncated ? h("div", { class: "note" }, `Only the latest ${MAX_PER_STATUS} failed and ${MAX_PER_STATUS} expired runs are grouped here.`) : null,
    h("section", { class: "card", "aria-label": "Dead letters" },
      canRerun ? h("div", { class: "form-actions" }, rerunButton, status) : null,
      h("div", { class: "table-wrap" }, h("table", {},
        h("thead", {}, h("tr", {},
          canRerun ? h("th", { scope: "col" }, h("span", { class: "visually-hidden" }, "Select")) : null,
          ["Template", "Error code", "Status", "Runs", "Latest message", "Last"].map((c) => h("th", { scope: "col", class: c === "Runs" ? "num" : null }, c)))),
        h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", { class: "empty", colspan: canRerun ? 7 : 6 }, "No failed or expired run. ")))))),
  );
}

function group(runs) {
  const groups = new Map();
  for (const run of runs) {
    const code = run.error?.code || "none";
    const key = `${run.templateType}\u0000${code}`;
    if (!groups.has(key)) groups.set(key, { templateType: run.templateType, code, runs: [], statuses: {}, message: null, last: null });
    const g = groups.get(key);
    g.runs.push(run);
    g.statuses[run.status] = (g.statuses[run.status] || 0) + 1;
    if (!g.last || run.updateAt > g.last) {
      g.last = run.updateAt;
      g.message = run.error?.message || null;
    }
  }
  for (const g of groups.values()) g.runs.sort((a, b) => (a.updateAt < b.updateAt ? 1 : -1));
  return [...groups.values()].sort((a, b) => b.runs.length - a.runs.length || (a.last < b.last ? 1 : -1));
}

async function rerunAll(runs, progress) {
  const created = [];
  const refused = [];
  let next = 0;
  let done = 0;
  async function lane() {
    while (next < runs.length) {
      const run = runs[next++];
      try {
        created.push(await post(`/v1/runs/${encodeURIComponent(run.id)}/rerun`, {}));
      } catch (error) {
        if (!(error instanceof ApiError)) throw error;
        refused.push([run, error]);
      }
      progress(++done);
    }
  }
  await Promise.all(Array.from({ length: Math.min(RERUNS_AT_ONCE, runs.length) }, lane));
  return { created, refused };
}
