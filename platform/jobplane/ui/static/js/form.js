// A form generated from a template's payload schema (JSON Schema): one labelled control per
// property, nested objects as fieldsets, anything else as JSON text. The server validates;
// its 422 answer names each bad field by JSON pointer, which `showErrors` puts next to it.

import { session } from "./api.js";
import { h, select } from "./dom.js";

const KINDS = new Set(["string", "integer", "number", "boolean", "object"]);

function kindOf(schema) {
  if (Array.isArray(schema.enum)) return "enum";
  let type = schema.type;
  if (Array.isArray(type)) type = type.find((t) => t !== "null") || type[0];
  if (!type && schema.properties) type = "object";
  if (type === "object" && !schema.properties) return "json";
  return KINDS.has(type) ? type : "json";
}

function slug(text) {
  return text.replace(/[^A-Za-z0-9_-]/g, "_");
}

// "'sleepSeconds' is a required property" names a field below the pointer it is reported at.
function requiredField(message) {
  const match = /^'(.+)' is a required property$/.exec(message || "");
  return match ? match[1] : null;
}

export class SchemaForm {
  constructor(schema, { idPrefix = "payload", pointer = "/payload", initial = {} } = {}) {
    this.schema = schema || {};
    this.idPrefix = idPrefix;
    this.pointer = pointer;
    this.controls = [];
    this.asJson = false;
    const structured = kindOf(this.schema) === "object";
    this.fields = structured
      ? h("div", { class: "schema-fields" }, this.objectFields(this.schema, [], initial))
      : h("div", { class: "schema-fields" }, h("p", { class: "muted small" },
        "This template's schema names no fields; write the payload as JSON."));
    this.jsonArea = h("textarea", { id: `${idPrefix}-json`, rows: 8, spellcheck: "false", "aria-describedby": `${idPrefix}-json-error` }, JSON.stringify(initial, null, 2));
    this.jsonError = h("span", { class: "error", id: `${idPrefix}-json-error`, hidden: true });
    this.jsonField = h("div", { class: "field", hidden: structured },
      h("label", { for: `${idPrefix}-json` }, "Payload (JSON)"), this.jsonArea, this.jsonError);
    this.asJson = !structured;
    const toggle = h("input", { type: "checkbox", id: `${idPrefix}-as-json`, checked: !structured, disabled: !structured });
    toggle.addEventListener("change", () => this.switchMode(toggle.checked));
    this.element = h(
      "div",
      { class: "schema-form" },
      this.fields,
      this.jsonField,
      structured ? h("div", { class: "field check" }, toggle, h("label", { for: `${idPrefix}-as-json` }, "Edit the payload as JSON")) : null,
    );
  }

  objectFields(schema, path, initial) {
    const required = new Set(schema.required || []);
    return Object.entries(schema.properties || {}).map(([name, sub]) =>
      this.fieldFor(name, sub || {}, [...path, name], required.has(name), initial ? initial[name] : undefined));
  }

  fieldFor(name, schema, path, required, initial) {
    const kind = kindOf(schema);
    const id = `${this.idPrefix}-${path.map(slug).join("-")}`;
    const label = schema.title || name;
    if (kind === "object") {
      return h("fieldset", { "data-pointer": this.pointerOf(path) },
        h("legend", {}, label, required ? h("span", { class: "req" }, " (required)") : null),
        schema.description ? h("p", { class: "hint" }, schema.description) : null,
        this.objectFields(schema, path, initial || {}));
    }
    const value = initial !== undefined ? initial : schema.default;
    let input;
    if (kind === "enum") {
      input = h("select", { id }, h("option", { value: "" }, required ? "Choose…" : "(not set)"),
        schema.enum.map((v, i) => h("option", { value: String(i), selected: value !== undefined && JSON.stringify(v) === JSON.stringify(value) }, String(v))));
    } else if (kind === "boolean") {
      input = h("input", { type: "checkbox", id, checked: value === true });
    } else if (kind === "integer" || kind === "number") {
      input = h("input", {
        type: "number", id, step: kind === "integer" ? "1" : "any",
        min: schema.minimum, max: schema.maximum, value: value ?? "", inputmode: kind === "integer" ? "numeric" : "decimal",
      });
    } else if (kind === "string") {
      input = h("input", { type: "text", id, value: value ?? "", maxlength: schema.maxLength, placeholder: schema.format || "" });
    } else {
      input = h("textarea", { id, rows: 3, spellcheck: "false", placeholder: "JSON" }, value === undefined ? "" : JSON.stringify(value, null, 2));
    }
    const error = h("span", { class: "error", id: `${id}-error`, hidden: true });
    const hints = [schema.description, rangeHint(schema, kind)].filter(Boolean).join(" · ");
    const hint = hints ? h("span", { class: "hint", id: `${id}-hint` }, hints) : null;
    input.setAttribute("aria-describedby", [hint ? `${id}-hint` : null, `${id}-error`].filter(Boolean).join(" "));
    if (required) input.setAttribute("aria-required", "true");
    const control = { path, pointer: this.pointerOf(path), kind, schema, input, error, required };
    this.controls.push(control);
    // "(required)" is for the eye; assistive technology hears aria-required instead.
    const text = h("label", { for: id }, label, required ? h("span", { class: "req", "aria-hidden": "true" }, " (required)") : null,
      kind === "json" ? h("span", { class: "hint" }, " JSON") : null);
    if (kind === "boolean") {
      return h("div", { class: "field" }, h("div", { class: "field check" }, input, text), hint, error);
    }
    return h("div", { class: "field" }, text, input, hint, error);
  }

  pointerOf(path) {
    return this.pointer + path.map((p) => `/${p}`).join("");
  }

  switchMode(asJson) {
    if (asJson) {
      const { value } = this.readFields();
      this.jsonArea.value = JSON.stringify(value, null, 2);
    } else {
      try {
        this.fill(JSON.parse(this.jsonArea.value || "{}"));
      } catch {
        // Unparsable JSON stays in the text area; the fields keep what they had.
      }
    }
    this.asJson = asJson;
    this.fields.hidden = asJson;
    this.jsonField.hidden = !asJson;
    this.clearErrors();
  }

  fill(payload) {
    for (const c of this.controls) {
      let value = payload;
      for (const p of c.path) value = value && typeof value === "object" ? value[p] : undefined;
      if (c.kind === "boolean") c.input.checked = value === true;
      else if (c.kind === "enum") c.input.value = value === undefined ? "" : String(c.schema.enum.findIndex((v) => JSON.stringify(v) === JSON.stringify(value)));
      else if (c.kind === "json") c.input.value = value === undefined ? "" : JSON.stringify(value, null, 2);
      else c.input.value = value === undefined ? "" : String(value);
    }
  }

  // The payload, and the problems found before sending it (text that is not a number or JSON).
  read() {
    if (!this.asJson) return this.readFields();
    try {
      const value = JSON.parse(this.jsonArea.value.trim() || "{}");
      if (value === null || typeof value !== "object" || Array.isArray(value)) {
        return { value: {}, problems: [{ pointer: this.pointer, message: "the payload must be a JSON object" }] };
      }
      return { value, problems: [] };
    } catch (error) {
      return { value: {}, problems: [{ pointer: this.pointer, message: `not valid JSON: ${error.message}` }] };
    }
  }

  readFields() {
    const value = {};
    const problems = [];
    for (const c of this.controls) {
      let v;
      if (c.kind === "boolean") {
        v = c.input.checked ? true : c.required ? false : undefined;
      } else if (c.kind === "enum") {
        v = c.input.value === "" ? undefined : c.schema.enum[Number(c.input.value)];
      } else if (c.kind === "integer" || c.kind === "number") {
        if (c.input.validity.badInput) problems.push({ pointer: c.pointer, message: "not a number" });
        v = c.input.value === "" ? undefined : Number(c.input.value);
      } else if (c.kind === "string") {
        v = c.input.value === "" ? undefined : c.input.value;
      } else if (c.input.value.trim() !== "") {
        try {
          v = JSON.parse(c.input.value);
        } catch (error) {
          problems.push({ pointer: c.pointer, message: `not valid JSON: ${error.message}` });
        }
      }
      if (v === undefined) continue;
      let target = value;
      for (const p of c.path.slice(0, -1)) target = target[p] ??= {};
      target[c.path.at(-1)] = v;
    }
    return { value, problems };
  }

  clearErrors() {
    for (const c of [...this.controls, { input: this.jsonArea, error: this.jsonError }]) {
      c.input.removeAttribute("aria-invalid");
      c.error.hidden = true;
      c.error.textContent = "";
    }
  }

  // Shows each problem next to its field; returns those no field of this form owns.
  showErrors(problems) {
    const left = [];
    for (const problem of problems) {
      const shown = this.asJson ? this.showOnJson(problem) : this.showOnField(problem);
      if (!shown) left.push(problem);
    }
    return left;
  }

  showOnJson(problem) {
    if (!problem.pointer.startsWith(this.pointer)) return false;
    const where = problem.pointer.slice(this.pointer.length) || "/";
    mark(this.jsonArea, this.jsonError, `${where}: ${problem.message}`);
    return true;
  }

  showOnField(problem) {
    let pointer = problem.pointer;
    const missing = requiredField(problem.message);
    if (missing) pointer = `${pointer}/${missing}`;
    // The field itself, or the nearest field above the pointer (an item of a JSON list).
    const owner = this.controls
      .filter((c) => pointer === c.pointer || pointer.startsWith(`${c.pointer}/`))
      .sort((a, b) => b.pointer.length - a.pointer.length)[0];
    if (!owner) return false;
    const message = missing ? "required" : pointer === owner.pointer ? problem.message : `${pointer.slice(owner.pointer.length)}: ${problem.message}`;
    mark(owner.input, owner.error, message);
    return true;
  }

  firstInvalid() {
    return this.element.querySelector('[aria-invalid="true"]');
  }
}

// Marks a control invalid with its message (several messages for one control add up).
export function mark(input, error, message) {
  input.setAttribute("aria-invalid", "true");
  error.hidden = false;
  error.textContent = error.textContent ? `${error.textContent}; ${message}` : message;
}

function rangeHint(schema, kind) {
  if (kind !== "integer" && kind !== "number") return schema.maxLength ? `at most ${schema.maxLength} characters` : "";
  const { minimum: lo, maximum: hi } = schema;
  if (lo !== undefined && hi !== undefined) return `${lo} to ${hi}`;
  if (lo !== undefined) return `at least ${lo}`;
  if (hi !== undefined) return `at most ${hi}`;
  return "";
}

// -- the parts of the run and schedule forms -------------------------------------------------

// What a refused form says above its fields: how many problems are shown next to their fields,
// and the rest (those no field owns) listed.
export function problemSummary(title, inline, left) {
  const where = inline ? `${inline} problem${inline === 1 ? " is" : "s are"} shown next to ${inline === 1 ? "its field" : "their fields"}.` : "";
  return h("div", { class: "alert", role: "alert" },
    h("strong", {}, title, " "), where,
    left.length ? h("ul", {}, left.map((p) => h("li", {}, h("code", {}, p.pointer || "/"), " ", p.message))) : null);
}

// Moves focus to the first field marked invalid, opening a folded section that hides it.
export function focusFirstInvalid(form, fallback) {
  const first = form.querySelector('[aria-invalid="true"]');
  if (!first) {
    fallback.focus();
    return;
  }
  for (let up = first.closest("details"); up; up = up.parentElement.closest("details")) up.open = true;
  first.focus();
}

// Scope and scope id: a user key picks one of its scopes, other keys name any.
export function scopeFields(prefix) {
  const scopes = session.scopes;
  if (scopes) {
    const pick = select(`${prefix}-scopeRef`, session.identity.scopes, { value: session.identity.scopes[0], any: null });
    const control = withError(pick);
    return {
      element: errorField("Scope", control, "the scopes of your key"),
      controls: { scope: control, scopeId: control },
      read: () => {
        const ref = pick.value;
        return { scope: ref.slice(0, ref.indexOf(":")), scopeId: ref.slice(ref.indexOf(":") + 1) };
      },
    };
  }
  const scope = withError(select(`${prefix}-scope`, ["user", "account", "system"], { value: "user", any: null }));
  const scopeId = withError(h("input", { type: "text", id: `${prefix}-scopeId`, "aria-required": "true", placeholder: "e.g. user_123" }));
  return {
    element: h("div", { class: "row" }, errorField("Scope", scope),
      errorField(h("span", {}, "Scope id", h("span", { class: "req", "aria-hidden": "true" }, " (required)")), scopeId)),
    controls: { scope, scopeId },
    read: () => ({ scope: scope.input.value, scopeId: scopeId.input.value.trim() }),
  };
}

// A scope id is needed before anything else can be checked (the API refuses the body first).
export function requiredScope(chosen) {
  return chosen.scopeId ? [] : [{ pointer: "/scopeId", message: "required" }];
}

export function withError(input) {
  const error = h("span", { class: "error", id: `${input.id}-error`, hidden: true });
  input.setAttribute("aria-describedby", `${input.id}-error`);
  return { input, error };
}

export function errorField(label, control, hint) {
  const hintId = `${control.input.id}-hint`;
  if (hint) control.input.setAttribute("aria-describedby", `${hintId} ${control.input.id}-error`);
  return h("div", { class: "field" }, h("label", { for: control.input.id }, label), control.input,
    hint ? h("span", { class: "hint", id: hintId }, hint) : null, control.error);
}

export function clearMark(control) {
  control.input.removeAttribute("aria-invalid");
  control.error.hidden = true;
  control.error.textContent = "";
}
