// The public HTTP API, as the dashboard calls it: the signed-in key on every request, errors
// as ApiError with docs/contract.md's {code, message, details}. Nothing here reaches past /v1.

const KEY_ITEM = "jobplane.apiKey";

// The API's root: the dashboard is served at <root>/ui/, so a proxy may mount both under a path.
const ROOT = location.pathname.replace(/\/ui(\/.*)?$/, "");

export class ApiError extends Error {
  constructor(status, code, message, details) {
    super(message);
    this.status = status;
    this.code = code;
    this.details = details || {};
  }

  // The bad fields of a 422 ValidationFailed: [{pointer, message}].
  get fieldErrors() {
    return Array.isArray(this.details.errors) ? this.details.errors : [];
  }
}

// The key lives in this tab's sessionStorage only: closing the tab forgets it.
export const session = {
  key: sessionStorage.getItem(KEY_ITEM),
  identity: null,
  // Where a run's trace is shown, `{traceId}` in place of its id (GET /v1/overview); null: nowhere.
  traceUrl: null,
  can(permission) {
    return Boolean(this.identity && this.identity.permissions.includes(permission));
  },
  // The scopes a user key is bound to, as [scope, scopeId]; null for roles that see all.
  get scopes() {
    if (!this.identity || this.identity.role !== "user") return null;
    return this.identity.scopes.map((s) => [s.slice(0, s.indexOf(":")), s.slice(s.indexOf(":") + 1)]);
  },
};

export function signIn(key) {
  sessionStorage.setItem(KEY_ITEM, key);
  session.key = key;
}

export function signOut() {
  sessionStorage.removeItem(KEY_ITEM);
  session.key = null;
  session.identity = null;
  session.traceUrl = null;
  cache.clear();
}

let unauthorized = () => {};

// Called when the API refuses the key (revoked, or the server's admin key changed).
export function onUnauthorized(handler) {
  unauthorized = handler;
}

export function url(path, query) {
  const target = new URL(ROOT + path, location.origin);
  for (const [name, value] of Object.entries(query || {})) {
    if (value !== undefined && value !== null && value !== "") target.searchParams.set(name, value);
  }
  return target;
}

export async function api(method, path, { body, query, signal, key, withStatus = false } = {}) {
  const headers = { Accept: "application/json", Authorization: `Bearer ${key ?? session.key}` };
  const init = { method, headers, signal, cache: "no-store" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(url(path, query), init);
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ApiError(0, "Unreachable", "The API could not be reached; check the server and your network.", {});
  }
  if (response.status === 204) return withStatus ? { status: 204, data: null } : null;
  const text = await response.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!response.ok) {
    const error = (data && data.error) || {};
    const failure = new ApiError(
      response.status,
      error.code || `HTTP ${response.status}`,
      error.message || text.slice(0, 300) || response.statusText,
      error.details,
    );
    if (response.status === 401 && key === undefined) unauthorized(failure);
    throw failure;
  }
  return withStatus ? { status: response.status, data } : data;
}

export const get = (path, query, options = {}) => api("GET", path, { ...options, query });
export const post = (path, body, options = {}) => api("POST", path, { ...options, body });

// Every item of a cursor-paginated list, up to `max`; `onPage(count)` reports progress.
export async function collect(path, query, { max = 1000, pageSize = 500, signal, onPage } = {}) {
  const items = [];
  let cursor = null;
  do {
    const limit = Math.min(pageSize, max - items.length);
    const page = await get(path, { ...query, limit, cursor }, { signal });
    items.push(...page.items);
    cursor = page.nextCursor;
    if (onPage) onPage(items.length);
  } while (cursor && items.length < max);
  return { items, truncated: Boolean(cursor) };
}

const cache = new Map();

// A GET answered from memory for `ttlMs` (the template list, which pages read often).
export async function cached(path, ttlMs = 30000) {
  const hit = cache.get(path);
  if (hit && Date.now() - hit.at < ttlMs) return hit.value;
  const value = await get(path);
  cache.set(path, { at: Date.now(), value });
  return value;
}

export function forget(path) {
  cache.delete(path);
}
