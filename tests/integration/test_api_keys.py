"""API keys listed and revoked: no secret ever shown again, a revoked key refused by every API
process (a real second one included), and each creation and revocation an audited event."""

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from jobplane.backends import Backends
from jobplane.devstack import free_port
from jobplane.settings import Settings
from tests.integration.api_client import error_of
from tests.integration.conftest import Client
from tests.integration.db import raw
from tests.integration.processes import spawn, terminate

ADMIN = "test-admin-key"  # the `settings` fixture's admin key
KEY_SCOPE = {"scope": "system", "scopeId": "api keys"}


async def made(admin: httpx.AsyncClient, name: str, role: str, *scopes: str) -> dict[str, Any]:
    response = await admin.post(
        "/v1/api-keys", json={"name": name, "role": role, "scopes": list(scopes)}
    )
    assert response.status_code == 201, response.text
    key: dict[str, Any] = response.json()
    return key


def secret_of(key: dict[str, Any]) -> str:
    """The secret part of `jp_<keyId>_<secret>` (which may itself hold `_`)."""
    return str(key["key"]).split("_", 2)[2]


async def test_any_key_reads_who_it_is(client_for: Client) -> None:
    admin = client_for(ADMIN)
    alice = await made(admin, "alice", "user", "user:alice", "account:acme")
    auditor = await made(admin, "audit", "auditor")
    me = (await client_for(alice["key"]).get("/v1/api-keys/me")).json()
    assert me == {"name": "alice", "role": "user", "scopes": ["account:acme", "user:alice"]}
    seen = (await client_for(auditor["key"]).get("/v1/api-keys/me")).json()
    assert seen == {"name": "audit", "role": "auditor", "scopes": []}
    bootstrap = (await admin.get("/v1/api-keys/me")).json()
    assert bootstrap == {"name": "admin", "role": "admin", "scopes": []}
    error_of(await client_for("jp_nope_nope").get("/v1/api-keys/me"), 401, "Unauthorized")


async def test_the_list_shows_every_key_and_never_a_secret(
    client_for: Client, backends: Backends
) -> None:
    admin = client_for(ADMIN)
    keys = [
        await made(admin, "ci", "author"),
        await made(admin, "alice", "user", "user:alice", "account:acme"),
        await made(admin, "audit", "auditor"),
    ]
    response = await admin.get("/v1/api-keys")
    assert response.status_code == 200, response.text
    listed = response.json()
    assert listed["nextCursor"] is None
    assert [k["id"] for k in listed["items"]] == [k["id"] for k in reversed(keys)]
    alice = listed["items"][1]
    assert alice == {
        "id": keys[1]["id"],
        "name": "alice",
        "role": "user",
        "scopes": ["user:alice", "account:acme"],
        "createdBy": "user:admin",
        "createAt": keys[1]["createAt"],
        "revokedAt": None,
        "revokedBy": None,
    }
    stored = await raw(backends.store).api_keys.find().to_list()
    for secret in [secret_of(k) for k in keys] + [d["secretHash"] for d in stored]:
        assert secret not in response.text

    first = (await admin.get("/v1/api-keys", params={"limit": 2})).json()
    assert [k["name"] for k in first["items"]] == ["audit", "alice"]
    rest = await admin.get("/v1/api-keys", params={"limit": 2, "cursor": first["nextCursor"]})
    assert [k["name"] for k in rest.json()["items"]] == ["ci"]
    assert rest.json()["nextCursor"] is None


async def test_a_revoked_key_is_refused_and_stays_listed(
    client_for: Client, backends: Backends
) -> None:
    admin = client_for(ADMIN)
    ci, other = await made(admin, "ci", "author"), await made(admin, "other", "author")
    holder = client_for(ci["key"])
    assert (await holder.get("/v1/templates")).status_code == 200

    # Two revokes at once: both answer the one revocation, which writes one event.
    answers = await asyncio.gather(*(admin.delete(f"/v1/api-keys/{ci['id']}") for _ in "ab"))
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    revoked = answers[0].json()
    assert answers[1].json() == revoked
    assert (revoked["id"], revoked["name"], revoked["revokedBy"]) == (ci["id"], "ci", "user:admin")
    assert revoked["revokedAt"] >= ci["createAt"] and "key" not in revoked

    error = error_of(await holder.get("/v1/templates"), 401, "Unauthorized")
    assert error["message"] == "API key 'ci' was revoked" and error["details"] == {}
    # Only the holder of the secret learns that: a wrong secret is just unknown.
    forged = client_for(ci["key"][:-2] + ("AA" if not ci["key"].endswith("AA") else "BB"))
    assert error_of(await forged.get("/v1/templates"), 401, "Unauthorized")["message"] == (
        "unknown API key"
    )
    assert (await client_for(other["key"]).get("/v1/templates")).status_code == 200

    listed = {k["name"]: k for k in (await admin.get("/v1/api-keys")).json()["items"]}
    assert listed["ci"] == revoked and listed["other"]["revokedAt"] is None
    again = await admin.delete(f"/v1/api-keys/{ci['id']}")
    assert again.status_code == 200 and again.json() == revoked
    revocations = {"jobId": ci["id"], "type": "api_key_revoked"}
    assert await raw(backends.store).events.count_documents(revocations) == 1

    for unknown in ("0123456789abcdef01234567", "nope"):
        error_of(await admin.delete(f"/v1/api-keys/{unknown}"), 404, "NotFound")


async def test_a_key_can_revoke_itself_and_the_bootstrap_key_stays(client_for: Client) -> None:
    """Even the last stored admin key: a leaked key must be revocable, and the bootstrap key
    (JOBPLANE_ADMIN_KEY) is the way back in."""
    ops = await made(client_for(ADMIN), "ops", "admin")
    own = client_for(ops["key"])
    answer = await own.delete(f"/v1/api-keys/{ops['id']}")
    assert answer.status_code == 200 and answer.json()["revokedBy"] == "user:ops"
    error_of(await own.get("/v1/api-keys"), 401, "Unauthorized")
    assert (await client_for(ADMIN).get("/v1/api-keys")).status_code == 200


async def test_creation_and_revocation_are_audited_with_the_actor(client_for: Client) -> None:
    admin = client_for(ADMIN)
    ops = await made(admin, "ops", "admin")
    alice = await made(client_for(ops["key"]), "alice", "user", "user:alice")
    assert (await client_for(ops["key"]).delete(f"/v1/api-keys/{alice['id']}")).status_code == 200
    # A refused create writes no event.
    taken = await admin.post("/v1/api-keys", json={"name": "ops", "role": "auditor"})
    error_of(taken, 409, "ResourceInvalidState")
    audit = client_for((await made(admin, "audit", "auditor"))["key"])

    trail = (await audit.get("/v1/events", params={"jobId": alice["id"]})).json()["items"]
    assert [(e["type"], e["actor"]) for e in trail] == [
        ("api_key_created", "user:ops"),
        ("api_key_revoked", "user:ops"),
    ]
    for event in trail:
        assert {k: event[k] for k in KEY_SCOPE} == KEY_SCOPE
        assert event["metadata"] == {"name": "alice", "role": "user", "scopes": ["user:alice"]}
    assert trail[0]["message"] == "API key alice (user) created"
    assert trail[1]["message"] == "API key alice (user) revoked"

    created = (await audit.get("/v1/events", params={"type": "api_key_created"})).json()["items"]
    assert [(e["metadata"]["name"], e["actor"]) for e in created] == [
        ("ops", "user:admin"),
        ("alice", "user:ops"),
        ("audit", "user:admin"),
    ]
    every = await audit.get("/v1/events", params={"scope": "system", "scopeId": "api keys"})
    assert len(every.json()["items"]) == 4
    assert secret_of(alice) not in every.text

    # A user key never sees them: its scopes cannot name theirs.
    bob = client_for((await made(admin, "bob", "user", "user:bob", "system:api-keys"))["key"])
    assert (await bob.get("/v1/events")).json()["items"] == []
    asked = await bob.get("/v1/events", params={"scope": "system", "scopeId": "api keys"})
    error_of(asked, 403, "Forbidden")


async def test_a_second_api_process_refuses_a_revoked_key_within_a_second(
    url: str, settings: Settings, tmp_path: Path
) -> None:
    """The key is revoked through this process's API; a real `jobplane api` process, which
    accepted the key just before, refuses it within a second."""
    port, log = free_port(), tmp_path / "api.log"
    proc = spawn(settings, "api", log, "--port", str(port))
    try:
        async with (
            httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}) as here,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as there,
        ):
            async with asyncio.timeout(60):
                while not await ready(there):
                    assert proc.poll() is None, log.read_text()
                    await asyncio.sleep(0.1)
            key = await made(here, "ci", "author")
            bearer = {"authorization": f"Bearer {key['key']}"}
            assert (await there.get("/v1/templates", headers=bearer)).status_code == 200

            assert (await here.delete(f"/v1/api-keys/{key['id']}")).status_code == 200
            revoked = time.monotonic()
            while (answer := await there.get("/v1/templates", headers=bearer)).status_code == 200:
                assert time.monotonic() - revoked < 1.0, "still accepted a second later"
            error_of(answer, 401, "Unauthorized")
    finally:
        terminate(proc)


async def ready(api: httpx.AsyncClient) -> bool:
    try:
        return (await api.get("/readyz")).status_code == 200
    except httpx.TransportError:
        return False
