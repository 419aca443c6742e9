// The dashboard's shell: sign-in, navigation and the hash router (#/runs, #/runs/<id>, ...).
// Each page is a module with `render(ctx)`; leaving a page aborts `ctx.signal`, which stops
// its polling and its requests in flight.

import { ApiError, get, onUnauthorized, session, signIn, signOut } from "./api.js";
import { clear, errorBox, fill, h, loading } from "./dom.js";
import * as audit from "./pages/audit.js";
import * as failed from "./pages/failed.js";
import * as overview from "./pages/overview.js";
import * as queues from "./pages/queues.js";
import * as run from "./pages/run.js";
import * as runs from "./pages/runs.js";
import * as schedules from "./pages/schedules.js";
import * as templates from "./pages/templates.js";

const ROUTES = [
  { path: /^\/?$/, render: overview.render, nav: "overview" },
  { path: /^\/runs$/, render: runs.render, nav: "runs", needs: "runs:read" },
  { path: /^\/runs\/([^/]+)$/, render: run.render, nav: "runs", needs: "runs:read" },
  { path: /^\/failed$/, render: failed.render, nav: "failed", needs: "runs:read" },
  { path: /^\/templates$/, render: templates.renderList, nav: "templates", needs: "templates:read" },
  { path: /^\/templates\/([^/]+)$/, render: templates.renderDetail, nav: "templates", needs: "templates:read" },
  { path: /^\/templates\/([^/]+)\/run$/, render: templates.renderCreateRun, nav: "templates", needs: "runs:write" },
  { path: /^\/schedules$/, render: schedules.renderList, nav: "schedules", needs: "schedules:read" },
  { path: /^\/schedules\/new$/, render: schedules.renderCreate, nav: "schedules", needs: "schedules:write" },
  { path: /^\/schedules\/([^/]+)$/, render: schedules.renderDetail, nav: "schedules", needs: "schedules:read" },
  // Not gated here: a key that may not read queues gets the API's own refusal, which names
  // the permission it lacks.
  { path: /^\/queues$/, render: queues.render, nav: "queues" },
  { path: /^\/audit$/, render: audit.render, nav: "audit", needs: "events:read" },
];

const NAV = [
  ["overview", "Overview", "#/", null],
  ["runs", "Runs", "#/runs", "runs:read"],
  ["failed", "Failed", "#/failed", "runs:read"],
  ["templates", "Templates", "#/templates", "templates:read"],
  ["schedules", "Schedules", "#/schedules", "schedules:read"],
  ["queues", "Queues", "#/queues", "queues:read"],
  ["audit", "Audit", "#/audit", "events:read"],
];

const app = document.getElementById("app");
let main = null;
let leaving = null;
let lastRoute = null;

function parseHash() {
  const raw = location.hash.replace(/^#/, "") || "/";
  const at = raw.indexOf("?");
  const path = at < 0 ? raw : raw.slice(0, at);
  return { path, query: new URLSearchParams(at < 0 ? "" : raw.slice(at + 1)) };
}

export function navigate(hash) {
  if (location.hash === hash) route();
  else location.hash = hash;
}

// -- sign-in --------------------------------------------------------------------------------

function showLogin(notice) {
  leaving?.abort();
  main = null;
  document.title = "Sign in · jobplane";
  const input = h("input", {
    type: "password", id: "login-key", name: "key", autocomplete: "off", spellcheck: "false",
    "aria-describedby": "login-help", required: true,
  });
  const problem = h("p", { class: "error", id: "login-error", role: "alert" });
  const button = h("button", { type: "submit", class: "btn primary" }, "Sign in");
  const form = h(
    "form",
    { class: "card", "aria-labelledby": "login-title", novalidate: true },
    h("div", { class: "brand" }, h("img", { src: "favicon.svg", alt: "" }), "jobplane"),
    h("h1", { id: "login-title" }, "Sign in"),
    notice ? h("div", { class: "note", role: "status" }, notice) : null,
    h("div", { class: "field" }, h("label", { for: "login-key" }, "API key"), input,
      h("span", { class: "hint", id: "login-help" },
        "Kept in this browser tab only (session storage) and sent only to this server's API. ",
        "Keys are made with ", h("code", {}, "jobplane keys create"), ".")),
    problem,
    button,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const key = input.value.trim();
    problem.textContent = "";
    input.removeAttribute("aria-invalid");
    if (!key) {
      problem.textContent = "Enter an API key.";
      input.setAttribute("aria-invalid", "true");
      input.focus();
      return;
    }
    button.disabled = true;
    button.textContent = "Signing in…";
    try {
      const found = await get("/v1/overview", {}, { key });
      signIn(key);
      learn(found);
      route();
    } catch (error) {
      const refused = error instanceof ApiError && error.status === 401;
      problem.textContent = refused ? "This key was refused. Check it and try again." : `${error.code || "Error"}: ${error.message}`;
      input.setAttribute("aria-invalid", "true");
      input.focus();
    } finally {
      button.disabled = false;
      button.textContent = "Sign in";
    }
  });
  fill(app, h("div", { class: "login" }, form));
  input.focus();
}

onUnauthorized(() => {
  signOut();
  showLogin("The API refused your key (it may have been revoked). Sign in again.");
});

// What the shell keeps from the overview for every page: who the key is, where traces are shown.
function learn(overview) {
  session.identity = overview.caller;
  session.traceUrl = overview.traceUrl;
}

// -- layout ----------------------------------------------------------------------------------

function layout() {
  if (main) return;
  const who = session.identity;
  const skip = h("a", { class: "skip-link", href: "#/" }, "Skip to content");
  skip.addEventListener("click", (event) => {
    event.preventDefault();
    main.focus();
  });
  const out = h("button", { type: "button", class: "btn small" }, "Sign out");
  out.addEventListener("click", () => {
    signOut();
    location.hash = "#/";
    showLogin("You signed out.");
  });
  main = h("main", { id: "main", tabindex: "-1" });
  fill(app,
    skip,
    h(
      "div",
      { class: "layout" },
      h(
        "aside",
        { class: "sidebar" },
        h("div", { class: "sidebar-inner" },
        h("div", { class: "brand" }, h("img", { src: "favicon.svg", alt: "" }), "jobplane"),
        h("nav", { "aria-label": "Main" }, h("ul", {},
          NAV.filter(([, , , needs]) => !needs || session.can(needs)).map(([id, label, href]) =>
            h("li", {}, h("a", { href, "data-nav": id }, label))))),
        h("div", { class: "who", "aria-label": "Signed in as" },
          h("strong", {}, who.name),
          `${who.role} key`,
          who.role === "user" ? h("div", { class: "scopes" }, who.scopes.join(", ")) : null),
        out,
      )),
      main,
    ),
  );
}

function markNav(id) {
  for (const link of app.querySelectorAll("[data-nav]")) {
    if (link.dataset.nav === id) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
}

// -- routing ----------------------------------------------------------------------------------

async function route() {
  if (!session.key) {
    showLogin();
    return;
  }
  if (!session.identity) {
    try {
      learn(await get("/v1/overview"));
    } catch (error) {
      if (error instanceof ApiError && error.status === 401) return; // onUnauthorized showed sign-in
      fill(app, h("main", { class: "boot" }, errorBox(error, { title: "The dashboard could not start." })));
      return;
    }
  }
  layout();
  leaving?.abort();
  const controller = new AbortController();
  leaving = controller;
  const { path, query } = parseHash();
  const found = ROUTES.map((r) => ({ r, m: r.path.exec(path) })).find((x) => x.m);
  const samePage = lastRoute !== null && found && lastRoute.path === found.r.path;
  const focused = samePage && document.activeElement ? document.activeElement.id : null;
  lastRoute = found ? found.r : null;
  markNav(found ? found.r.nav : null);
  clear(main).append(loading());
  if (!found) {
    fill(main, h("h1", { tabindex: "-1" }, "Not found"), h("p", {}, "No page here. ", h("a", { href: "#/" }, "Go to the overview.")));
    return;
  }
  if (found.r.needs && !session.can(found.r.needs)) {
    fill(main,
      h("h1", { tabindex: "-1" }, "Not allowed"),
      h("p", {}, `A ${session.identity.role} key may not use ${found.r.needs}.`),
    );
    return;
  }
  const ctx = {
    main,
    params: found.m.slice(1).map(decodeURIComponent),
    query,
    signal: controller.signal,
    navigate,
    // Shows another address in place of this one (no new history entry).
    replace: (hash) => location.replace(hash),
    // Calls `fn` every `ms` until the page is left or `fn` returns false; never two at once.
    every(ms, fn) {
      const tick = async () => {
        if (controller.signal.aborted) return;
        let again = true;
        try {
          again = (await fn()) !== false;
        } catch (error) {
          if (error.name === "AbortError") return;
          console.warn("refresh failed", error);
        }
        if (again && !controller.signal.aborted) timer = setTimeout(tick, ms);
      };
      let timer = setTimeout(tick, ms);
      controller.signal.addEventListener("abort", () => clearTimeout(timer));
    },
  };
  try {
    await found.r.render(ctx);
  } catch (error) {
    if (controller.signal.aborted || error.name === "AbortError") return;
    if (error instanceof ApiError && error.status === 401) return;
    fill(main, h("h1", { tabindex: "-1" }, "Something went wrong"), errorBox(error));
  }
  if (controller.signal.aborted) return;
  const again = focused && document.getElementById(focused);
  if (again) again.focus();
  else main.querySelector("h1")?.focus();
}

window.addEventListener("hashchange", route);
route();
