"""The CLI's HTTP client: one call per command, errors as one readable line; and what the
commands that call the API share (the options given, the scope to make in, pages printed)."""

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


class CLIError(Exception):
    """Shown to the user as one line, `<Code>: <message>`; the command exits non-zero.

    Codes are the API's own, plus `Unavailable` (no answer from the server) and
    `InvalidArgument` (bad local input), so scripts can match on one vocabulary.
    """

    def __init__(self, code: str, message: str) -> None:
        # Server messages may span lines (a YAML parser's, say); a terminal line must not.
        self.code, self.message = code, " ".join(message.split())
        super().__init__(f"{self.code}: {self.message}")


class APIClient:
    def __init__(self, url: str, key: str | None, timeout: float = 30) -> None:
        self.keyed = bool(key)
        headers = {"authorization": f"Bearer {key}"} if key else {}
        try:
            self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)
        except httpx.InvalidURL as exc:
            raise CLIError("InvalidArgument", f"--url {url!r}: {exc}") from exc

    def __enter__(self) -> "APIClient":
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            # A timeout's text is often empty: its class name is then the only clue.
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise CLIError("Unavailable", f"cannot reach {self.http.base_url} ({reason})") from exc
        if response.status_code >= 400:
            error = api_error(response)
            if error.code == "Unauthorized" and not self.keyed:
                raise CLIError(error.code, f"{error.message}: set JOBPLANE_API_KEY or pass --key")
            raise error
        if response.status_code == 204:  # done, and nothing to say
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise CLIError(
                "Unavailable", f"{response.url} answered {response.status_code} without JSON"
            ) from exc

    def messages(self, path: str) -> Iterator[str]:
        """The data of each message of the Server-Sent Events stream at `path`, until the server
        ends it; a refusal is the API's error, and a stream that breaks is `Unavailable`. The
        API's keep-alives (every 15 s) keep an idle stream within the client's read timeout."""
        try:
            with self.http.stream("GET", path, headers={"accept": "text/event-stream"}) as response:
                if response.status_code >= 400:
                    response.read()
                    raise api_error(response)
                data: list[str] = []
                for line in response.iter_lines():
                    if line == "":  # a message ends
                        if data:
                            yield "\n".join(data)
                        data = []
                    elif line.startswith("data:"):  # the other fields the CLI does not need
                        data.append(line.removeprefix("data:").removeprefix(" "))
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise CLIError("Unavailable", f"the stream {path} broke ({reason})") from exc

    def pages(self, path: str, params: dict[str, Any], every: bool) -> Iterator[Any]:
        """The pages of a list: the first one, or with `every` each one to the end."""
        while True:
            page = self.call("GET", path, params=params)
            yield page
            if not (every and page.get("nextCursor")):
                return
            params = {**params, "cursor": page["nextCursor"]}


def api_error(response: httpx.Response) -> CLIError:
    try:
        error = response.json()["error"]
        code, message = error["code"], error["message"]
    except (ValueError, KeyError, TypeError):
        return CLIError(f"HTTP {response.status_code}", response.text[:200] or "(no body)")
    return CLIError(code, _said_once(message, error.get("details") or {}))


def segment(value: str) -> str:
    """`value` as one segment of a path: ids and types come from the user, and a `/` or `?` in
    one must not change the route."""
    return quote(value, safe="")


def located(problem: dict[str, Any]) -> str:
    """A problem of `details.errors`, after its pointer; one with none is the whole body's."""
    pointer, message = problem.get("pointer"), problem.get("message")
    return f"{pointer}: {message}" if pointer else str(message)


def _said_once(message: str, details: dict[str, Any]) -> str:
    """The message, then the details it does not say already: a field whose problem is the
    message itself (a one-field refusal) only has its pointer put before the message."""
    rest = dict(details)
    problems = rest.pop("errors", [])
    repeated = [p["pointer"] for p in problems if p.get("message") == message and p.get("pointer")]
    notes = [located(p) for p in problems if p.get("message") != message]
    notes += [f"{k}: {v if isinstance(v, str) else json.dumps(v)}" for k, v in rest.items()]
    said = f"{', '.join(repeated)}: {message}" if repeated else message
    return f"{said} ({'; '.join(notes)})" if notes else said


def present(**fields: Any) -> dict[str, Any]:
    """Only the options given: the API tells an absent field from a null one."""
    return {k: v for k, v in fields.items() if v is not None}


def scope_of(args: argparse.Namespace, client: APIClient) -> tuple[str, str]:
    """The scope a new run or schedule is made in: as given; else the key's only scope (a user
    key's with one); else system:cli."""
    if args.scope is None and args.scope_id is None:
        me = client.call("GET", "/v1/api-keys/me")
        if len(me["scopes"]) == 1:
            scope, _, scope_id = me["scopes"][0].partition(":")
            return scope, scope_id
    return args.scope or "system", args.scope_id or "cli"


def made_in_scope(client: APIClient, path: str, body: dict[str, Any]) -> Any:
    """POST `body` to `path`; a refusal of the scope says how to name another."""
    try:
        return client.call("POST", path, json=body)
    except CLIError as exc:
        if exc.code != "Forbidden" or "scope" not in exc.message:
            raise
        raise CLIError(exc.code, f"{exc.message} (pass --scope and --scope-id)") from None


def print_pages(
    client: APIClient,
    path: str,
    params: dict[str, Any],
    every: bool,
    model: type[M],
    line: Callable[[M], str],
    header: str | None = None,
) -> None:
    more = False
    for page in client.pages(path, params, every):
        if header is not None:  # only once the API has answered: a refusal prints no table
            print(header)
            header = None
        for item in page["items"]:
            print(line(model.model_validate(item)), flush=True)
        more = page.get("nextCursor") is not None
    if more and not every:
        # On stderr, so a script reading the rows sees only rows.
        print("(more on the next page: --all lists them all)", file=sys.stderr)
