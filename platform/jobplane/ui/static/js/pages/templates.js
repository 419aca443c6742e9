// Templates: the latest version of each; one template's versions with a diff between any two,
// its enabled state and payload schema; and the "create run" form generated from that schema.

import { ApiError, api, cached, forget, get, post, session } from "../api.js";
import { lineDiff, withContext } from "../diff.js";
import { badge, card, confirmDialog, errorBox, facts, field, fill, h, json, pageHead, select, table, time, toast } from "../dom.js";
import {
  SchemaForm, clearMark, errorField, focusFirstInvalid, mark, problemSummary, requiredScope, scopeFields, withError,
} from "../form.js";

const typePath = (type) => `/v1/templates/${encodeURIComponent(type)}`;

// -- the list --------------------------------------------------------------------------------

export async function renderList(ctx) {
  forget("/v1/templates");
  const templates = await cached("/v1/templates");
  const canRun = session.can("runs:write");
  fill(ctx.main,
    pageHead("Templates", { sub: "the latest version of each" }),
    h("section", { class: "card", "aria-label": "Templates" }, table(
      [
        { label: "Type", cell: (t) => h("a", { href: `#/templates/${encodeURIComponent(t.type)}` }, t.type) },
        { label: "Name", cell: (t) => t.name || h("span", { class: "muted" }, "—") },
        { label: "Version", class: "num", cell: (t) => `v${t.version}` },
        { label: "State", cell: (t) => badge(t.enabled ? "enabled" : "disabled") },
        { label: "Queue", cell: (t) => h("span", { class: "mono" }, t.queue) },
        { label: "Steps", class: "num", cell: (t) => t.steps.length },
        { label: "Schedulable", cell: (t) => (t.schedulable ? "yes" : "no") },
        { label: "Updated", cell: (t) => time(t.updateAt) },
        {
          label: h("span", { class: "visually-hidden" }, "Actions"),
          cell: (t) => (canRun && t.enabled
            ? h("a", { class: "btn small", href: `#/templates/${encodeURIComponent(t.type)}/run`, "aria-label": `Create a run of ${t.type}` }, "Create run")
            : null),
        },
      ],
      templates,
      { empty: "No template is registered yet (jobplane templates apply DIR)." },
    )),
  );
}

// -- one template ------------------------------------------------------------------------------

// Fields that say when or whether, not what: left out of a diff.
const NOT_DEFINITION = new Set(["version", "createAt", "updateAt", "enabled"]);

function definition(template) {
  return Object.fromEntries(Object.entries(template).filter(([k]) => !NOT_DEFINITION.has(k)));
}

function sortedJson(value) {
  const sort = (v) => (Array.isArray(v) ? v.map(sort)
    : v && typeof v === "object" ? Object.fromEntries(Object.keys(v).sort().map((k) => [k, sort(v[k])])) : v);
  return JSON.stringify(sort(value), null, 2);
}

export async function renderDetail(ctx) {
  const type = ctx.params[0];
  const latest = await get(typePath(type), {}, { signal: ctx.signal });
  const shown = Number(ctx.query.get("v")) || latest.version;
  const first = Math.max(1, latest.version - 29); // the 30 latest versions are listed
  const versions = await Promise.all(
    Array.from({ length: latest.version - first + 1 }, (_, i) => first + i).map((v) =>
      (v === latest.version ? latest : get(`${typePath(type)}/versions/${v}`, {}, { signal: ctx.signal }))),
  );
  const template = versions.find((t) => t.version === shown) || await get(`${typePath(type)}/versions/${shown}`);

  const actions = [];
  if (session.can("runs:write") && latest.enabled) {
    actions.push(h("a", { class: "btn primary", href: `#/templates/${encodeURIComponent(type)}/run` }, "Create run"));
  }
  if (session.can("templates:write")) {
    const toggle = h("button", { type: "button", class: ["btn", latest.enabled && "danger"], id: "template-toggle" },
      latest.enabled ? "Disable" : "Enable");
    toggle.addEventListener("click", async () => {
      const choice = await confirmDialog({
        title: `${latest.enabled ? "Disable" : "Enable"} ${type}?`,
        message: latest.enabled
          ? "New runs and schedule fires of every version are refused; runs already created go on."
          : "New runs and schedule fires are accepted again.",
        confirmLabel: latest.enabled ? "Disable" : "Enable",
        danger: latest.enabled,
      });
      if (!choice.ok) return;
      try {
        await post(`${typePath(type)}/${latest.enabled ? "disable" : "enable"}`, {});
        forget("/v1/templates");
        toast(`${type} ${latest.enabled ? "disabled" : "enabled"}.`);
        ctx.navigate(location.hash);
      } catch (error) {
        toast(error.message, "error");
      }
    });
    actions.push(toggle);
  }

  const versionPick = select("template-version", versions.map((t) => [String(t.version), `v${t.version}${t.version === latest.version ? " (latest)" : ""}`]),
    { value: String(shown), any: null });
  versionPick.addEventListener("change", () => ctx.navigate(`#/templates/${encodeURIComponent(type)}?v=${versionPick.value}`));

  fill(ctx.main, h("div", { class: "stack" },
    pageHead(template.name || type, {
      sub: h("span", {}, h("span", { class: "mono" }, type), " · ", badge(latest.enabled ? "enabled" : "disabled")),
      actions,
    }),
    h("div", { class: "filters" }, field("Showing version", versionPick)),
    h("div", { class: "grid cols-2" },
      card("Definition", facts([
        ["Description", template.description || null],
        ["Version", `v${template.version}${template.version === latest.version ? " (latest)" : ""}`],
        ["Registered", time(template.createAt)],
        ["Queue", h("span", { class: "mono" }, template.queue)],
        ["Priority", String(template.priority)],
        ["Concurrency", template.concurrencyPolicy],
        ["Dedupe keys", template.dedupeKeys.length ? template.dedupeKeys.join(", ") : null],
        ["Repeatable", template.repeatable ? "yes" : "no"],
        ["Schedulable", template.schedulable ? "yes" : "no"],
        ["Run timeout", template.timeoutSeconds ? `${template.timeoutSeconds} s` : "none"],
        ["Retries", retryText(template.retryPolicy)],
        ["Cancel", template.cancelPolicy.supported ? `cooperative, grace ${template.cancelPolicy.graceSeconds} s` : "not supported"],
      ])),
      card("Payload schema", json(template.payloadSchema)),
    ),
    card("Steps", table(
      [
        { label: "#", class: "num", cell: (s) => template.steps.indexOf(s) + 1 },
        { label: "Id", cell: (s) => h("span", { class: "mono" }, s.id) },
        { label: "Name", cell: (s) => s.name || "—" },
        { label: "Handler", cell: (s) => h("span", { class: "mono" }, s.handler) },
        { label: "Worker", cell: (s) => s.workerType },
        { label: "Timeout", class: "num", cell: (s) => (s.timeoutSeconds ? `${s.timeoutSeconds} s` : "—") },
        { label: "Cancelable", cell: (s) => (s.cancelable ? "yes" : "no") },
      ],
      template.steps,
    )),
    versionsCard(ctx, type, versions, latest),
  ));
}

function retryText(policy) {
  if (policy.maxAttempts <= 1) return "no retries";
  if (policy.backoffSeconds) return `${policy.maxAttempts} attempts, backoff ${policy.backoffSeconds.join(", ")} s`;
  return `${policy.maxAttempts} attempts, exponential from ${policy.initialSeconds} s ×${policy.multiplier} up to ${policy.maxSeconds} s, ${policy.jitter} jitter`;
}

function versionsCard(ctx, type, versions, latest) {
  const options = versions.map((t) => [String(t.version), `v${t.version}`]);
  const to = Number(ctx.query.get("to")) || latest.version;
  const from = Number(ctx.query.get("from")) || Math.max(1, to - 1);
  const fromPick = select("diff-from", options, { value: String(from), any: null });
  const toPick = select("diff-to", options, { value: String(to), any: null });
  const form = h("form", { class: "filters", "aria-label": "Compare versions" },
    field("From", fromPick), field("To", toPick),
    h("div", { class: "form-actions" }, h("button", { type: "submit", class: "btn" }, "Compare")));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const v = ctx.query.get("v");
    ctx.navigate(`#/templates/${encodeURIComponent(type)}?${v ? `v=${v}&` : ""}from=${fromPick.value}&to=${toPick.value}`);
  });
  const a = versions.find((t) => t.version === from);
  const b = versions.find((t) => t.version === to);
  let diff;
  if (!a || !b) diff = h("p", { class: "muted" }, "Choose two of the versions listed.");
  else if (from === to) diff = h("p", { class: "muted" }, "Choose two different versions.");
  else {
    const lines = lineDiff(sortedJson(definition(a)), sortedJson(definition(b)));
    const changed = lines.filter((l) => l.op !== "same").length;
    diff = changed
      ? h("div", { class: "diff", role: "region", "aria-label": `Changes from v${from} to v${to}`, tabindex: "0" },
        withContext(lines).map((l) => h("div", { class: l.op }, l.text)))
      : h("p", { class: "muted" }, `v${from} and v${to} define the same template.`);
  }
  return card(
    ["Versions", `${latest.version} in all`],
    table(
      [
        { label: "Version", cell: (t) => h("a", { href: `#/templates/${encodeURIComponent(type)}?v=${t.version}` }, `v${t.version}`) },
        { label: "Registered", cell: (t) => time(t.createAt) },
        { label: "Steps", class: "num", cell: (t) => t.steps.length },
        { label: "Description", cell: (t) => t.description || "—" },
      ],
      [...versions].reverse(),
    ),
    h("h3", {}, "Differences"),
    form,
    diff,
  );
}

// -- create a run ------------------------------------------------------------------------------

export async function renderCreateRun(ctx) {
  const type = ctx.params[0];
  const latest = await get(typePath(type), {}, { signal: ctx.signal });
  const chosen = Number(ctx.query.get("v")) || latest.version;
  const template = chosen === latest.version ? latest : await get(`${typePath(type)}/versions/${chosen}`, {}, { signal: ctx.signal });
  const versionPick = select("run-version", Array.from({ length: latest.version }, (_, i) => latest.version - i)
    .map((v) => [String(v), v === latest.version ? `v${v} (latest)` : `v${v}`]), { value: String(chosen), any: null });
  versionPick.addEventListener("change", () => ctx.navigate(`#/templates/${encodeURIComponent(type)}/run?v=${versionPick.value}`));

  const payload = new SchemaForm(template.payloadSchema, { idPrefix: "payload", pointer: "/payload" });
  const scope = scopeFields("run");
  const extra = {
    priority: h("input", { type: "number", id: "run-priority", min: -100, max: 100, step: 1, placeholder: String(template.priority) }),
    delaySeconds: h("input", { type: "number", id: "run-delaySeconds", min: 0, step: "any" }),
    idempotencyKey: h("input", { type: "text", id: "run-idempotencyKey", maxlength: 200 }),
  };
  const own = { ...scope.controls, ...Object.fromEntries(Object.entries(extra).map(([k, input]) => [k, withError(input)])) };
  const summary = h("div", { id: "run-form-errors", tabindex: "-1" });
  const submit = h("button", { type: "submit", class: "btn primary", id: "run-submit" }, "Create run");
  const form = h(
    "form",
    { class: "card", novalidate: true, "aria-label": `New run of ${type}` },
    summary,
    h("div", { class: "row" }, field("Template version", versionPick), scope.element),
    h("fieldset", {}, h("legend", {}, "Payload"), payload.element),
    h("details", {}, h("summary", {}, "Priority, delay and idempotency key"),
      h("div", { class: "row" },
        errorField("Priority", own.priority, "-100 to 100; the template's by default"),
        errorField("Delay (seconds)", own.delaySeconds, "start no sooner than this"),
        errorField("Idempotency key", own.idempotencyKey, "a repeat returns the first run"))),
    h("div", { class: "form-actions" }, submit, h("a", { class: "btn", href: `#/templates/${encodeURIComponent(type)}` }, "Back to the template")),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    fill(summary);
    payload.clearErrors();
    for (const c of Object.values(own)) clearMark(c);
    const { value, problems } = payload.read();
    const body = { templateType: type, templateVersion: template.version, ...scope.read(), payload: value };
    for (const [name, input] of Object.entries(extra)) {
      if (input.value === "") continue;
      body[name] = input.type === "number" ? Number(input.value) : input.value;
    }
    problems.push(...requiredScope(body));
    if (problems.length) {
      showProblems(problems);
      return;
    }
    submit.disabled = true;
    try {
      const { status, data: created } = await api("POST", "/v1/runs", { body, withStatus: true });
      toast(status === 200 ? "This idempotency key already made a run; here it is." : "Run created.");
      ctx.navigate(`#/runs/${encodeURIComponent(created.id)}`);
    } catch (error) {
      if (!(error instanceof ApiError)) throw error;
      if (error.code === "ValidationFailed") showProblems(error.fieldErrors);
      else {
        const active = error.details && error.details.activeRunId;
        fill(summary, errorBox(error, { title: "The run was not created." }));
        if (active) summary.firstChild.append(" ", h("a", { href: `#/runs/${encodeURIComponent(active)}` }, "Open the active run."));
        summary.focus();
      }
    } finally {
      submit.disabled = false;
    }
  });

  function showProblems(problems) {
    let left = payload.showErrors(problems);
    left = left.filter((p) => {
      const name = p.pointer.replace(/^\//, "").split("/")[0];
      const control = own[name];
      if (!control) return true;
      mark(control.input, control.error, p.message);
      return false;
    });
    fill(summary, problemSummary("The run was not created.", problems.length - left.length, left));
    focusFirstInvalid(form, summary);
  }

  fill(ctx.main, h("div", { class: "stack" },
    pageHead(`Create a run`, { sub: h("span", {}, "of ", h("a", { href: `#/templates/${encodeURIComponent(type)}` }, template.name || type)) }),
    latest.enabled ? null : h("div", { class: "alert", role: "alert" }, "This template is disabled: the API will refuse new runs."),
    form,
  ));
}
