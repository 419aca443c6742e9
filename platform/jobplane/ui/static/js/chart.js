// The overview's chart: runs per minute over the last hour, drawn as inline SVG. Finished runs
// are stacked bars by outcome, created runs a line; the same figures are in a table below it.

import { h, svg } from "./dom.js";

const OUTCOMES = ["succeeded", "failed", "cancelled", "expired"];
const W = 960;
const H = 200;
const M = { top: 10, right: 8, bottom: 22, left: 34 };

function niceMax(value) {
  if (value <= 4) return 4;
  const magnitude = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) {
    if (step * magnitude >= value) return step * magnitude;
  }
  return value;
}

const hhmm = (iso) => {
  const d = new Date(iso);
  return `${String(d.getHours()).padStart(2, "0")}:${String(d.getMinutes()).padStart(2, "0")}`;
};

export function runsChart(minutes) {
  const finished = (m) => OUTCOMES.reduce((sum, o) => sum + m[o], 0);
  const top = niceMax(Math.max(...minutes.map((m) => Math.max(m.created, finished(m))), 0));
  const plotW = W - M.left - M.right;
  const plotH = H - M.top - M.bottom;
  const slot = plotW / minutes.length;
  const y = (n) => M.top + plotH - (n / top) * plotH;
  const totals = { created: 0, finished: 0, failed: 0 };
  for (const m of minutes) {
    totals.created += m.created;
    totals.finished += finished(m);
    totals.failed += m.failed + m.expired;
  }
  const summary =
    `Runs per minute over the last hour: ${totals.created} created, ${totals.finished} finished, ` +
    `${totals.failed} failed or expired.`;

  const parts = [svg("title", {}, summary)];
  for (const fraction of [0, 0.5, 1]) {
    const value = Math.round(top * fraction);
    parts.push(
      svg("line", { class: fraction ? "grid-line" : "axis", x1: M.left, x2: W - M.right, y1: y(value), y2: y(value) }),
      svg("text", { class: "tick", x: M.left - 6, y: y(value) + 3, "text-anchor": "end" }, String(value)),
    );
  }
  minutes.forEach((m, i) => {
    const x = M.left + i * slot + 1;
    let base = 0;
    const bars = [];
    for (const outcome of OUTCOMES) {
      if (!m[outcome]) continue;
      bars.push(svg("rect", {
        class: outcome, x, width: Math.max(1, slot - 2),
        y: y(base + m[outcome]), height: y(base) - y(base + m[outcome]),
      }));
      base += m[outcome];
    }
    const detail = `${hhmm(m.at)}: ${m.created} created, ` + OUTCOMES.map((o) => `${m[o]} ${o}`).join(", ");
    // A full-height hit area, so the tooltip shows on empty minutes too.
    parts.push(svg("g", {}, svg("title", {}, detail),
      svg("rect", { x: x - 1, y: M.top, width: slot, height: plotH, fill: "transparent" }), bars));
    if (i % 10 === 0 || i === minutes.length - 1) {
      const anchor = i === 0 ? "start" : i === minutes.length - 1 ? "end" : "middle";
      const at = i === 0 ? x : i === minutes.length - 1 ? x + slot - 2 : x + slot / 2;
      parts.push(svg("text", { class: "tick", x: at, y: H - 6, "text-anchor": anchor }, hhmm(m.at)));
    }
  });
  const points = minutes.map((m, i) => `${M.left + i * slot + slot / 2},${y(m.created)}`).join(" ");
  parts.push(svg("polyline", { class: "created", points }));

  const rows = minutes.filter((m) => m.created || finished(m));
  return h(
    "div",
    { class: "chart" },
    svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": summary }, parts),
    h("div", { class: "legend", "aria-hidden": "true" },
      h("span", {}, h("i", { class: "line" }), "created"),
      OUTCOMES.map((o) => h("span", {}, h("i", { class: o }), o))),
    h("details", { class: "small", id: "chart-table" },
      h("summary", {}, "Show as a table"),
      rows.length
        ? h("table", {},
          h("thead", {}, h("tr", {}, ["Minute", "Created", ...OUTCOMES].map((c) => h("th", { scope: "col" }, c)))),
          h("tbody", {}, rows.map((m) => h("tr", {}, h("td", {}, hhmm(m.at)), h("td", { class: "num" }, m.created),
            OUTCOMES.map((o) => h("td", { class: "num" }, m[o]))))))
        : h("p", { class: "muted" }, "No run was created or finished in the last hour.")),
  );
}
