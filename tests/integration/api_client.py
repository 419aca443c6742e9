"""Checks of docs/contract.md's error shape."""

from typing import Any

import httpx


def error_of(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}
    assert body["error"]["code"] == code
    error: dict[str, Any] = body["error"]
    return error


def pointers(error: dict[str, Any]) -> list[str]:
    return [e["pointer"] for e in error["details"]["errors"]]
