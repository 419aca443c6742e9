// The API's live streams (Server-Sent Events), read with fetch(): EventSource cannot send the
// Authorization header the API needs. A page follows a stream while it is open and polls while
// it is down; `follow` says which, and opens the stream again a while after it broke.

import { ApiError, session, url } from "./api.js";

// How long after a stream broke it is opened again.
const RETRY_MS = 5000;

// Reads the stream at `path` until the server ends it; rejects when it breaks (a network
// error, a refusal). `onOpen()` once the API accepted it, then `onMessage({event, id, data})`
// for each message, awaited: the next message waits, so a page takes them in order.
async function stream(path, { signal, onOpen, onMessage }) {
  const headers = { Accept: "text/event-stream", Authorization: `Bearer ${session.key}` };
  const response = await fetch(url(path), { headers, signal, cache: "no-store" });
  if (!response.ok) {
    throw new ApiError(response.status, `HTTP ${response.status}`, `The stream ${path} was refused.`, {});
  }
  onOpen();
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let rest = "";
  let fields = {};
  let data = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      // A chunk may end between the "\r" and the "\n" of one line end: that "\r" waits.
      const text = rest + value;
      const whole = text.endsWith("\r") ? text.slice(0, -1) : text;
      const lines = whole.split(/\r\n|\r|\n/);
      rest = lines.pop() + text.slice(whole.length);
      for (const line of lines) {
        if (line === "") {
          if (data.length) await onMessage({ event: fields.event || "message", id: fields.id ?? null, data: data.join("\n") });
          fields = {};
          data = [];
        } else if (!line.startsWith(":")) { // a comment is a keep-alive
          const at = line.indexOf(":");
          const name = at < 0 ? line : line.slice(0, at);
          const value = at < 0 ? "" : line.slice(at + 1).replace(/^ /, "");
          if (name === "data") data.push(value);
          else fields[name] = value;
        }
      }
    }
  } finally {
    // Ends the request when a message's handler failed, or the page left.
    reader.cancel().catch(() => {});
  }
}

// Keeps the stream at `path` open until `done()` or `signal` aborts: `onMode("live")` each
// time it opens, `onMode("polling")` each time it breaks or ends before `done()`, and it is
// opened again RETRY_MS later. Meanwhile the page polls.
export async function follow(path, { signal, onMessage, onMode, done = () => false }) {
  while (!signal.aborted && !done()) {
    try {
      await stream(path, { signal, onOpen: () => onMode("live"), onMessage });
    } catch (error) {
      if (signal.aborted) return;
      console.warn(`the stream ${path} broke`, error);
    }
    if (signal.aborted || done()) return;
    onMode("polling");
    await new Promise((resolve) => {
      const wake = () => { clearTimeout(timer); resolve(); };
      const timer = setTimeout(() => { signal.removeEventListener("abort", wake); resolve(); }, RETRY_MS);
      signal.addEventListener("abort", wake, { once: true });
    });
  }
}
