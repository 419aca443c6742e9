"""GET /v1/overview, the dashboard's first page: scoped like GET /v1/runs, any key may read it,
and every query it makes is served by an index."""

import asyncio
from datetime import datetime
from typing import Any

import httpx
from redis.asyncio import Redis

from jobplane.api import create_app
from jobplane.backends import Backends
from jobplane.devstack import free_port
from jobplane.queue.redis import RedisQueue
from jobplane.settings import Settings
from jobplane.store import MongoStore
from tests.integration.api_client import error_of
from tests.integration.conftest import Client, Register
from tests.integration.db import raw
from tests.integration.workers import running, settled

FAIL = [{"id": "boom", "handler": "builtin.fail"}]


async def _key(admin: httpx.AsyncClient, name: str, role: str, scopes: list[str]) -> str:
    made = await admin.post("/v1/api-keys", json={"name": name, "role": role, "scopes": scopes})
    assert made.status_code == 201, made.text
    return str(made.json()["key"])


async def _run(admin: httpx.AsyncClient, template: str, scope_id: str, **body: Any) -> str:
    request = {"templateType": template, "scope": "user", "scopeId": scope_id, **body}
    made = await admin.post("/v1/runs", json=request)
    assert made.status_code == 201, made.text
    return str(made.json()["id"])


def _counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {row["status"]: row["count"] for row in rows}


async def test_a_user_key_counts_only_its_own_scopes(
    client_for: Client, register: Register, backends: Backends, settings: Settings
) -> None:
    await register("t_fail", steps=FAIL)
    await register("t_noop")
    assert settings.admin_key is not None
    admin = client_for(settings.admin_key)
    user = client_for(await _key(admin, "u1", "user", ["user:u1"]))
    finished = [
        await _run(admin, "t_fail", "u1", payload={"fatal": True}),
        await _run(admin, "t_fail", "u1", payload={"fatal": True}),
        await _run(admin, "t_noop", "u1"),
        await _run(admin, "t_fail", "u2", payload={"fatal": True}),
    ]
    async with running(backends, settings):
        await settled(backends.store, finished)
    await _run(admin, "t_noop", "u2", delaySeconds=3600)

    mine = (await user.get("/v1/overview")).json()
    assert mine["caller"] == {
        "name": "u1",
        "role": "user",
        "scopes": ["user:u1"],
        "permissions": [
            "events:read",
            "runs:read",
            "runs:write",
            "schedules:read",
            "schedules:write",
            "templates:read",
            "webhooks:read",
            "webhooks:write",
        ],
    }
    runs = mine["runs"]
    assert _counts(runs["finishedLastHour"]) == {
        "succeeded": 1,
        "failed": 2,
        "cancelled": 0,
        "expired": 0,
    }
    assert set(_counts(runs["active"]).values()) == {0}
    assert [s["status"] for s in runs["active"]] == [
        "pending",
        "queued",
        "running",
        "waiting_worker",
        "waiting_children",
        "cancel_requested",
    ]
    assert len(runs["perMinute"]) == 60
    assert sum(m["created"] for m in runs["perMinute"]) == 3
    assert sum(m["failed"] for m in runs["perMinute"]) == 2
    [failing] = runs["failingTemplates"]
    assert (failing["templateType"], failing["failed"], failing["expired"]) == ("t_fail", 2, 0)
    assert [(e["code"], e["count"]) for e in failing["errors"]] == [("fatal", 2)]
    assert "fatal by request" in failing["errors"][0]["message"]

    everyone = (await admin.get("/v1/overview")).json()
    assert _counts(everyone["runs"]["finishedLastHour"])["failed"] == 3
    assert _counts(everyone["runs"]["active"])["queued"] == 1
    assert sum(m["created"] for m in everyone["runs"]["perMinute"]) == 5
    # No worker runs in this test: the delayed run waits for its handler too.
    assert everyone["queues"] == [
        {
            "name": "default",
            "ready": 0,
            "delayed": 1,
            "oldestReadyAgeSeconds": 0.0,
            "waitingForHandlers": [{"handler": "builtin.noop", "runs": 1}],
        }
    ]
    assert everyone["backends"] == {"mongodb": True, "redis": True}


async def test_workers_list_the_runs_they_hold_that_the_key_may_see(
    client_for: Client, register: Register, backends: Backends, settings: Settings
) -> None:
    await register("t_sleep", steps=[{"id": "nap", "handler": "builtin.sleep"}])
    assert settings.admin_key is not None
    admin = client_for(settings.admin_key)
    other = client_for(await _key(admin, "u9", "user", ["user:u9"]))
    run_id = await _run(admin, "t_sleep", "u1", payload={"sleepSeconds": 30})
    async with running(backends, settings) as [worker]:
        overview = await _until_held(admin)
        [held] = overview["workers"]["holding"]
        assert (held["workerId"], held["alive"]) == (worker.id, True)
        assert [(r["id"], r["templateType"], r["status"]) for r in held["runs"]] == [
            (run_id, "t_sleep", "running")
        ]
        assert overview["workers"]["alive"] == 1
        theirs = (await other.get("/v1/overview")).json()["workers"]
        assert (theirs["alive"], theirs["holding"]) == (1, [])
        await admin.post(f"/v1/runs/{run_id}/cancel", json={})
        await settled(backends.store, [run_id])


async def _until_held(admin: httpx.AsyncClient) -> dict[str, Any]:
    """The overview once a worker holds a run."""
    async with asyncio.timeout(20):
        while True:
            overview: dict[str, Any] = (await admin.get("/v1/overview")).json()
            if overview["workers"]["holding"]:
                return overview
            await asyncio.sleep(0.05)


async def test_the_scheduler_leader_and_its_last_tick(
    client_for: Client, backends: Backends, settings: Settings
) -> None:
    assert settings.admin_key is not None
    admin = client_for(settings.admin_key)
    scheduler = (await admin.get("/v1/overview")).json()["scheduler"]
    assert scheduler == {"leader": None, "lockTtlSeconds": 0.0, "lastTickAt": None}
    # A scheduler renews the lock, for its whole TTL, as each of its ticks begins.
    queue = backends.queue
    took = backends.store.clock.now()
    await queue.locks.take_singleton("scheduler", "scheduler-7", settings.scheduler_lock_seconds)
    scheduler = (await admin.get("/v1/overview")).json()["scheduler"]
    assert scheduler["leader"] == "scheduler-7"
    assert 0 < scheduler["lockTtlSeconds"] <= settings.scheduler_lock_seconds
    ticked = datetime.fromisoformat(scheduler["lastTickAt"])
    assert abs((ticked - took).total_seconds()) < 0.5


async def test_any_key_may_read_it_and_an_author_sees_no_runs(
    client_for: Client, settings: Settings
) -> None:
    assert settings.admin_key is not None
    admin = client_for(settings.admin_key)
    author = client_for(await _key(admin, "writer", "author", []))
    overview = (await author.get("/v1/overview")).json()
    assert overview["runs"] is None
    assert overview["caller"]["role"] == "author"
    assert overview["workers"]["holding"] == []
    error_of(await client_for("").get("/v1/overview"), 401, "Unauthorized")
    error_of(await client_for("jp_x_y").get("/v1/overview"), 401, "Unauthorized")


async def test_it_says_where_the_dashboard_links_a_trace(
    client_for: Client, backends: Backends, settings: Settings
) -> None:
    """JOBPLANE_TRACE_URL as set, for any key: the dashboard's run page links a run's trace id
    with it. Null when unset."""
    assert settings.admin_key is not None
    admin = client_for(settings.admin_key)
    author = client_for(await _key(admin, "writer", "author", []))
    assert (await author.get("/v1/overview")).json()["traceUrl"] is None

    template = "https://jaeger.example/trace/{traceId}"
    linked = settings.model_copy(update={"trace_url": template})
    transport = httpx.ASGITransport(app=create_app(linked, backends))
    headers = {"authorization": f"Bearer {settings.admin_key}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        response = await client.get("/v1/overview", headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["traceUrl"] == template


async def test_redis_down_leaves_its_figures_out(backends: Backends, settings: Settings) -> None:
    down = Redis.from_url(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    cut_off = Backends(backends.store, RedisQueue(down, backends.queue.keys))
    transport = httpx.ASGITransport(app=create_app(settings, cut_off))
    headers = {"authorization": f"Bearer {settings.admin_key}"}
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            response = await client.get("/v1/overview", headers=headers)
    finally:
        await down.aclose()
    assert response.status_code == 200, response.text
    overview = response.json()
    assert overview["backends"] == {"mongodb": True, "redis": False}
    assert overview["queues"] == []
    assert overview["workers"] == {"alive": None, "runsHeld": None, "holding": []}
    assert overview["scheduler"] == {"leader": None, "lockTtlSeconds": None, "lastTickAt": None}
    assert overview["runs"]["active"]  # MongoDB's figures are still there


async def test_every_query_is_served_by_an_index(
    client_for: Client, register: Register, store: MongoStore, settings: Settings
) -> None:
    """The profiler records each command on the runs; none may scan the whole collection."""
    await register("t_noop")
    assert settings.admin_key is not None
    admin = client_for(settings.admin_key)
    user = client_for(await _key(admin, "u1", "user", ["user:u1", "account:acme"]))
    for scope_id in ("u1", "u2"):
        await _run(admin, "t_noop", scope_id)
    await store.db.command("profile", 2)
    try:
        for client in (admin, user):
            assert (await client.get("/v1/overview")).status_code == 200
    finally:
        await store.db.command("profile", 0)
    profiled = await store.db["system.profile"].find({"ns": raw(store).runs.full_name}).to_list()
    assert len(profiled) >= 10  # five reads of the runs per overview
    scans = [p for p in profiled if "COLLSCAN" in p.get("planSummary", "")]
    assert not scans, scans


async def test_the_dashboard_is_served_with_a_strict_policy(client_for: Client) -> None:
    anyone = client_for("")
    page = await anyone.get("/ui/")
    assert page.status_code == 200
    assert '<script type="module" src="js/main.js">' in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["cache-control"] == "no-cache"
    script = await anyone.get("/ui/js/main.js")
    assert script.headers["content-type"].split(";")[0] in {
        "text/javascript",
        "application/javascript",
    }
    assert (await anyone.get("/ui", follow_redirects=False)).headers["location"].endswith("/ui/")
    error_of(await anyone.get("/ui/missing.js"), 404, "NotFound")
