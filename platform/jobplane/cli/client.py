"""The CLI's HTTP client: one call per command, errors as one readable line."""

import json
from typing import Any

import httpx


class CLIError(Exception):
    """Shown to the user as one line; the command exits non-zero."""


class APIClient:
    def __init__(self, url: str, key: str | None, timeout: float = 30) -> None:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise CLIError(f"cannot reach {self.http.base_url}: {exc}") from exc
        if response.status_code >= 400:
            raise CLIError(describe_error(response))
        return response.json()


def describe_error(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:200]}"
    line = f"{error['code']}: {error['message']}"
    problems = error.get("details", {}).get("errors")
    if problems:
        line += " (" + "; ".join(f"{p['pointer'] or '/'}: {p['message']}" for p in problems) + ")"
    elif error.get("details"):
        line += " " + json.dumps(error["details"])
    return line
