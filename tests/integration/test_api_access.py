"""Who may do what: API keys, roles and scopes, table-driven over every route."""

import secrets
from typing import Any

import httpx
import pytest

from jobplane.backends import Backends
from jobplane.settings import Settings
from tests.integration.api_client import error_of
from tests.integration.conftest import Client
from tests.integration.db import raw

NOOP = {"type": "t_noop", "steps": [{"id": "only", "handler": "builtin.noop"}]}
ROLES = ["admin", "author", "user", "auditor"]


async def _keys(client_for: Client, settings: Settings) -> dict[str, httpx.AsyncClient]:
    """A client per role; the user key is bound to `user:u1` (and `account:acme`)."""
    assert settings.admin_key is not None
    root = client_for(settings.admin_key)
    clients = {}
    for role in ROLES:
        scopes = ["user:u1", "account:acme"] if role == "user" else []
        made = await root.post(
            "/v1/api-keys", json={"name": f"k-{role}", "role": role, "scopes": scopes}
        )
        assert made.status_code == 201, made.text
        assert made.json()["key"].startswith("jp_")
        clients[role] = client_for(made.json()["key"])
    return clients


@pytest.fixture
async def world(client_for: Client, settings: Settings, backends: Backends) -> dict[str, Any]:
    """Keys of every role, the noop template, and a finished run in `user:u1` and `user:u2`."""
    clients = await _keys(client_for, settings)
    admin = clients["admin"]
    assert (await admin.post("/v1/templates", json=NOOP)).status_code == 201
    runs = {}
    for scope_id in ("u1", "u2"):
        body = {"templateType": "t_noop", "scope": "user", "scopeId": scope_id}
        run = (await admin.post("/v1/runs", json=body)).json()
        cancelled = await admin.post(f"/v1/runs/{run['id']}/cancel", json={"reason": "setup"})
        assert cancelled.json()["status"] == "cancelled"
        runs[scope_id] = run["id"]
    await backends.store.trail.flush()  # the audit query reads the copies in `job_events`
    return {"clients": clients, "mine": runs["u1"], "theirs": runs["u2"]}


# (method, path, body, expected status per role: admin, author, user, auditor)
# `{mine}` is a run in the user key's scope, `{theirs}` one outside it: a user key gets 404 for
# it (not 403), so ids do not tell it what exists.
TABLE: list[tuple[str, str, Any, tuple[int, int, int, int]]] = [
    ("POST", "/v1/api-keys", {"name": "new", "role": "auditor"}, (201, 403, 403, 403)),
    ("POST", "/v1/templates", {**NOOP, "description": "v2"}, (201, 201, 403, 403)),
    ("GET", "/v1/templates", None, (200, 200, 200, 200)),
    ("GET", "/v1/templates/t_noop", None, (200, 200, 200, 200)),
    ("GET", "/v1/templates/t_noop/versions/1", None, (200, 200, 200, 200)),
    ("POST", "/v1/templates/t_noop/disable", None, (200, 200, 403, 403)),
    ("POST", "/v1/templates/t_noop/enable", None, (200, 200, 403, 403)),
    (
        "POST",
        "/v1/runs",
        {"templateType": "t_noop", "scope": "user", "scopeId": "u1"},
        (201, 403, 201, 403),
    ),
    (
        "POST",
        "/v1/runs",
        {"templateType": "t_noop", "scope": "user", "scopeId": "u2"},
        (201, 403, 403, 403),
    ),
    (
        "POST",
        "/v1/runs",
        {"templateType": "t_noop", "scope": "account", "scopeId": "acme"},
        (201, 403, 201, 403),
    ),
    ("GET", "/v1/runs", None, (200, 403, 200, 200)),
    ("GET", "/v1/runs?scope=user&scopeId=u2", None, (200, 403, 403, 200)),
    ("GET", "/v1/runs/{mine}", None, (200, 403, 200, 200)),
    ("GET", "/v1/runs/{theirs}", None, (200, 403, 404, 200)),
    ("GET", "/v1/runs/{mine}/events", None, (200, 403, 200, 200)),
    ("GET", "/v1/runs/{theirs}/events", None, (200, 403, 404, 200)),
    ("POST", "/v1/runs/{mine}/rerun", None, (201, 403, 201, 403)),
    ("POST", "/v1/runs/{theirs}/rerun", None, (201, 403, 404, 403)),
    ("POST", "/v1/runs/{theirs}/cancel", {"reason": "x"}, (409, 403, 404, 403)),
    ("GET", "/v1/events", None, (200, 403, 200, 200)),
    ("GET", "/v1/events?scope=user&scopeId=u2", None, (200, 403, 403, 200)),
    ("GET", "/v1/events?scope=system&scopeId=api%20keys", None, (200, 403, 403, 200)),
    ("GET", "/v1/api-keys", None, (200, 403, 403, 403)),
    ("DELETE", "/v1/api-keys/0123456789abcdef01234567", None, (404, 403, 403, 403)),
]


@pytest.mark.parametrize(("method", "path", "body", "expected"), TABLE, ids=lambda v: str(v)[:40])
@pytest.mark.parametrize("role", ROLES)
async def test_each_role_on_each_route(
    world: dict[str, Any],
    backends: Backends,
    role: str,
    method: str,
    path: str,
    body: Any,
    expected: tuple[int, int, int, int],
) -> None:
    client = world["clients"][role]
    url = path.format(mine=world["mine"], theirs=world["theirs"])
    runs_before = await raw(backends.store).runs.count_documents({})
    response = await client.request(method, url, json=body)
    status = expected[ROLES.index(role)]
    assert response.status_code == status, response.text
    if status == 403:
        error_of(response, 403, "Forbidden")
    if status == 404:
        error_of(response, 404, "NotFound")
    if status >= 400:  # a denied call changes nothing
        assert await raw(backends.store).runs.count_documents({}) == runs_before


async def test_a_user_key_sees_only_its_scopes(world: dict[str, Any]) -> None:
    user, auditor = world["clients"]["user"], world["clients"]["auditor"]
    listed = (await user.get("/v1/runs")).json()["items"]
    assert [r["id"] for r in listed] == [world["mine"]]
    assert len((await auditor.get("/v1/runs")).json()["items"]) == 2
    events = (await user.get("/v1/events")).json()["items"]
    assert events and {e["jobId"] for e in events} == {world["mine"]}
    # The keys' own events too, in a scope no user key can be bound to.
    seen = {e["scopeId"] for e in (await auditor.get("/v1/events")).json()["items"]}
    assert seen == {"u1", "u2", "api keys"}


async def test_events_name_the_key_that_caused_them(world: dict[str, Any]) -> None:
    user = world["clients"]["user"]
    body = {"templateType": "t_noop", "scope": "user", "scopeId": "u1"}
    run = (await user.post("/v1/runs", json=body)).json()
    await user.post(f"/v1/runs/{run['id']}/cancel", json={"reason": "changed my mind"})
    done = (await user.get(f"/v1/runs/{run['id']}")).json()
    assert done["cancelRequestedBy"] == "user:k-user" and done["cancelReason"] == "changed my mind"
    actors = {e["actor"] for e in (await user.get(f"/v1/runs/{run['id']}/events")).json()}
    assert actors == {"user:k-user"}


@pytest.mark.parametrize(
    ("body", "pointer"),
    [
        ({"name": "u", "role": "user"}, ""),  # a user key needs scopes
        ({"name": "a", "role": "auditor", "scopes": ["user:u1"]}, ""),
        ({"name": "u", "role": "user", "scopes": ["planet:earth"]}, "/scopes/0"),
        ({"name": "u", "role": "root"}, "/role"),
        ({"name": "has space", "role": "admin"}, "/name"),
        ({"name": "u", "role": "admin", "extra": 1}, "/extra"),
        ({"name": 7, "role": "admin"}, "/name"),
    ],
)
async def test_bad_keys_are_refused(
    client_for: Client, settings: Settings, backends: Backends, body: Any, pointer: str
) -> None:
    assert settings.admin_key is not None
    response = await client_for(settings.admin_key).post("/v1/api-keys", json=body)
    error = error_of(response, 422, "ValidationFailed")
    assert any(e["pointer"].startswith(pointer) for e in error["details"]["errors"])
    assert await raw(backends.store).api_keys.count_documents({}) == 0


async def test_key_names_are_unique_and_secrets_are_stored_hashed(
    client_for: Client, settings: Settings, backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A secret is URL-safe base64, which may hold `_`, the key's separator: here every one does.
    urlsafe = secrets.token_urlsafe
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: f"_{urlsafe(n)}__")
    assert settings.admin_key is not None
    admin = client_for(settings.admin_key)
    made = (await admin.post("/v1/api-keys", json={"name": "ci", "role": "auditor"})).json()
    again = await admin.post("/v1/api-keys", json={"name": "ci", "role": "admin"})
    error_of(again, 409, "ResourceInvalidState")
    [stored] = await raw(backends.store).api_keys.find().to_list()
    secret = made["key"].split("_", 2)[2]
    assert secret.startswith("_")
    assert made["key"] not in str(stored) and secret not in str(stored)
    # A key with the right id but a wrong secret is not a key.
    forged = made["key"][:-1] + ("B" if made["key"].endswith("A") else "A")
    error_of(await client_for(forged).get("/v1/runs"), 401, "Unauthorized")
    error_of(await client_for("jp_nothex_secret").get("/v1/runs"), 401, "Unauthorized")
    assert (await client_for(made["key"]).get("/v1/runs")).status_code == 200
