// Building the page: elements, times, statuses, dialogs and notices. Text always goes in as
// text nodes (never as HTML), so nothing a payload or an error message holds can run.

const SVG_NS = "http://www.w3.org/2000/svg";

function build(element, attrs, children) {
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") element.setAttribute("class", Array.isArray(value) ? value.filter(Boolean).join(" ") : value);
    else if (name === "text") element.textContent = value;
    else if (name.startsWith("on") && typeof value === "function") element.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(element.dataset, value);
    else if (name === "value" && "value" in element) element.value = value;
    else if (name === "checked" || name === "selected" || name === "disabled") element[name] = Boolean(value);
    else element.setAttribute(name, value === true ? "" : String(value));
  }
  append(element, children);
  return element;
}

export function append(element, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return element;
}

// h("a", {href: "#/runs"}, "Runs"): an element with attributes and children.
export function h(tag, attrs, ...children) {
  return build(document.createElement(tag), attrs, children);
}

export function svg(tag, attrs, ...children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

// Replaces an element's children; like `append`, it skips null, undefined and false.
export function fill(element, ...children) {
  element.replaceChildren();
  return append(element, children);
}

export function clear(element) {
  element.replaceChildren();
  return element;
}

// -- times -------------------------------------------------------------------------------------

const pad = (n) => String(n).padStart(2, "0");

// "2026-07-07 17:47:03" in the browser's zone.
export function localTime(iso) {
  if (!iso) return "—";
  const d = new Date(iso);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

// The same instant on the wall clock of an IANA zone ("UTC" included).
export function zonedTime(iso, zone) {
  if (!iso) return "—";
  try {
    const parts = new Intl.DateTimeFormat("en-CA", {
      timeZone: zone, year: "numeric", month: "2-digit", day: "2-digit",
      hour: "2-digit", minute: "2-digit", second: "2-digit", hourCycle: "h23",
    }).formatToParts(new Date(iso));
    const part = (type) => parts.find((p) => p.type === type).value;
    return `${part("year")}-${part("month")}-${part("day")} ${part("hour")}:${part("minute")}:${part("second")}`;
  } catch {
    return iso;
  }
}

export function utcTime(iso) {
  return iso ? `${zonedTime(iso, "UTC")} UTC` : "—";
}

// <time> showing local time, with UTC on hover (and for screen readers, the datetime).
export function time(iso) {
  if (!iso) return h("span", { class: "muted" }, "—");
  return h("time", { datetime: iso, title: utcTime(iso), class: "nowrap" }, localTime(iso));
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "—";
  const s = Math.max(0, seconds);
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.round((s % 86400) / 3600)} h`;
}

export function ago(iso) {
  if (!iso) return "—";
  const seconds = (Date.now() - new Date(iso).getTime()) / 1000;
  return seconds >= 0 ? `${duration(seconds)} ago` : `in ${duration(-seconds)}`;
}

// -- statuses and small parts -----------------------------------------------------------------

export const RUN_STATUSES = [
  "pending", "queued", "running", "waiting_worker", "waiting_children", "cancel_requested",
  "succeeded", "failed", "cancelled", "expired",
];
export const TERMINAL = new Set(["succeeded", "failed", "cancelled", "expired"]);

export function badge(status, label) {
  return h("span", { class: ["badge", `s-${status}`], "data-status": status }, label ?? status.replace("_", " "));
}

// The end of an ObjectId: its counter, which tells apart runs made in the same second.
export function shortId(id) {
  return id && id.length > 10 ? `…${id.slice(-8)}` : id;
}

export function runLink(id, { full = false } = {}) {
  return h("a", { href: `#/runs/${encodeURIComponent(id)}`, class: "mono nowrap", title: id, "aria-label": `run ${id}` }, full ? id : shortId(id));
}

export function progressBar(percentage, { label, status, thin = false } = {}) {
  const value = Math.max(0, Math.min(100, Math.round(Number(percentage) || 0)));
  const fill = h("span");
  fill.style.width = `${value}%`;
  return h(
    "div",
    {
      class: ["bar", thin && "thin", status],
      role: "progressbar",
      "aria-valuemin": 0,
      "aria-valuemax": 100,
      "aria-valuenow": value,
      "aria-label": label,
    },
    fill,
  );
}

// Says, after a page's other facts, how it follows changes: "live" while an API stream brings
// them, or how often it asks while the stream is down. `data-live` holds the mode.
export function following(note, mode, everyMs) {
  const live = mode === "live";
  note.dataset.live = mode;
  note.title = live ? "Changes show as they happen." : "The live stream is down: this page asks again, and retries the stream.";
  note.textContent = live ? " · live" : ` · refreshes every ${everyMs / 1000} s`;
}

export function json(value) {
  return h("pre", { class: "json" }, JSON.stringify(value, null, 2));
}

// A card with a heading; `title` may be [heading, aside] for a note at the heading's right.
export function card(title, ...children) {
  const [text, aside] = Array.isArray(title) ? title : [title, null];
  return h("section", { class: "card", "aria-label": typeof text === "string" ? text : undefined },
    text ? h("h2", {}, text, aside ? h("span", { class: "aside" }, aside) : null) : null, ...children);
}

export function table(columns, rows, { empty = "Nothing to show.", caption } = {}) {
  const head = h("thead", {}, h("tr", {}, columns.map((c) => h("th", { scope: "col", class: c.class }, c.label))));
  const body = h("tbody");
  for (const row of rows) {
    body.append(h("tr", {}, columns.map((c) => h("td", { class: c.class }, c.cell(row)))));
  }
  if (!rows.length) body.append(h("tr", {}, h("td", { class: "empty", colspan: columns.length }, empty)));
  return h("div", { class: "table-wrap" }, h("table", {}, caption ? h("caption", {}, caption) : null, head, body));
}

export function facts(pairs) {
  const list = h("dl", { class: "facts" });
  for (const [term, value] of pairs) {
    if (value === undefined) continue;
    list.append(h("dt", {}, term), h("dd", {}, value === null || value === "" ? h("span", { class: "muted" }, "—") : value));
  }
  return list;
}

export function pageHead(title, { sub, actions = [] } = {}) {
  document.title = `${typeof title === "string" ? title : "jobplane"} · jobplane`;
  return h(
    "div",
    { class: "page-head" },
    h("h1", { tabindex: "-1" }, title),
    sub ? h("span", { class: "sub" }, sub) : null,
    actions.length ? h("div", { class: "actions" }, actions) : null,
  );
}

export function errorBox(error, { title } = {}) {
  const problems = error.fieldErrors || [];
  return h(
    "div",
    { class: "alert", role: "alert" },
    title ? h("strong", {}, title, " ") : null,
    error.code ? h("code", {}, error.code) : null,
    error.code ? ": " : null,
    error.message,
    problems.length
      ? h("ul", {}, problems.map((p) => h("li", {}, h("code", {}, p.pointer || "/"), " ", p.message)))
      : null,
  );
}

export function loading(what = "Loading…") {
  return h("p", { class: "spinner", role: "status" }, what);
}

// -- notices ------------------------------------------------------------------------------------

export function announce(message) {
  const region = document.getElementById("announcer");
  region.textContent = "";
  // A change after a tick is announced even when the text repeats.
  setTimeout(() => { region.textContent = message; }, 50);
}

export function toast(message, kind = "info") {
  const area = document.getElementById("toasts");
  const note = h("div", { class: ["toast", kind === "error" && "error"] }, message);
  area.append(note);
  setTimeout(() => note.remove(), kind === "error" ? 8000 : 4000);
}

// A modal confirmation; resolves to {ok, reason}. `reason` asks for an optional text, at most
// `reason.maxLength` characters (the API's limit for it).
export function confirmDialog({ title, message, confirmLabel = "Confirm", danger = false, reason = null }) {
  return new Promise((resolve) => {
    const reasonInput = reason
      ? h("input", { type: "text", id: "confirm-reason", maxlength: reason.maxLength || 1000, placeholder: reason.placeholder || "" })
      : null;
    const confirm = h("button", { type: "submit", class: ["btn", danger ? "danger solid" : "primary"], value: "ok" }, confirmLabel);
    // Not a submit button, so Enter in the reason field confirms rather than cancels.
    const cancel = h("button", { type: "button", class: "btn" }, "Cancel");
    const dialog = h(
      "dialog",
      { "aria-labelledby": "confirm-title", "aria-describedby": "confirm-message" },
      h(
        "form",
        { method: "dialog" },
        h("h2", { id: "confirm-title" }, title),
        h("p", { id: "confirm-message" }, message),
        reasonInput
          ? h("div", { class: "field" }, h("label", { for: "confirm-reason" }, reason.label), reasonInput)
          : null,
        h(
          "div",
          { class: "form-actions" },
          cancel,
          confirm,
        ),
      ),
    );
    cancel.addEventListener("click", () => dialog.close("cancel"));
    dialog.addEventListener("close", () => {
      const ok = dialog.returnValue === "ok";
      dialog.remove();
      resolve({ ok, reason: reasonInput ? reasonInput.value.trim() : null });
    });
    document.body.append(dialog);
    dialog.showModal();
    (reasonInput || confirm).focus();
  });
}

// Selects of run statuses, scopes and the like, with an "any" choice first.
export function select(id, options, { value = "", any = "Any", label } = {}) {
  const element = h(
    "select",
    { id, name: id, "aria-label": label },
    any === null ? null : h("option", { value: "" }, any),
    options.map((o) => {
      const [v, text] = Array.isArray(o) ? o : [o, o];
      return h("option", { value: v, selected: v === value }, text);
    }),
  );
  element.value = value;
  return element;
}

export function field(label, control, { hint, id } = {}) {
  const forId = id || control.id;
  return h(
    "div",
    { class: "field" },
    h("label", { for: forId }, label),
    control,
    hint ? h("span", { class: "hint" }, hint) : null,
  );
}
