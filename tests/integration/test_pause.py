"""Pausing a queue: it keeps accepting runs and starts none until resumed, whatever happens to
Redis meanwhile; each pause and resume is audited."""

import asyncio
from pathlib import Path
from typing import Any

import httpx

from jobplane.backends import Backends
from jobplane.model import RunStatus
from jobplane.settings import Settings
from tests.conftest import sync_redis
from tests.integration.api_client import error_of
from tests.integration.conftest import Client, Register
from tests.integration.flow import until, workers
from tests.integration.workers import running, settled


def body(queue_template: str = "t_noop", **fields: Any) -> dict[str, Any]:
    return {"templateType": queue_template, "scope": "user", "scopeId": "u1", **fields}


async def queue_item(api: httpx.AsyncClient, name: str) -> dict[str, Any]:
    listed = (await api.get("/v1/queues")).json()["items"]
    [item] = [i for i in listed if i["queue"] == name]
    return item


async def test_a_paused_queue_starts_nothing_until_resumed_even_after_redis_is_wiped(
    api: httpx.AsyncClient,
    backends: Backends,
    settings: Settings,
    register: Register,
    tmp_path: Path,
) -> None:
    await register("t_noop", queue="reports")
    await register("other", queue="default")
    paused = await api.post("/v1/queues/reports/pause", json={"reason": "partner outage"})
    assert paused.status_code == 200, paused.text
    assert paused.json()["paused"] and paused.json()["pauseReason"] == "partner outage"
    async with workers(settings, tmp_path, JOBPLANE_QUEUES="default,reports"):
        made = [(await api.post("/v1/runs", json=body())).json() for _ in range(6)]
        assert {r["status"] for r in made} == {"queued"}, "a paused queue accepts runs"
        assert made[0]["waitingFor"] == {
            "reason": "queue_paused",
            "detail": "queue reports is paused",
        }
        other = (await api.post("/v1/runs", json=body("other"))).json()
        await settled(backends.store, [other["id"]], within=60)  # other queues go on
        await asyncio.sleep(1.5)
        with sync_redis(settings.redis_url or "") as redis:
            redis.flushall()
        await asyncio.sleep(2.5)  # workers and the scheduler tick after the wipe
        for run in made:
            found = await backends.store.runs.get(run["id"])
            assert found is not None and found.status == RunStatus.QUEUED, found
            assert found.attempt == 0, "never claimed"
        item = await queue_item(api, "reports")
        assert (item["paused"], item["ready"], item["running"]) == (True, 6, 0)
        resumed = await api.post("/v1/queues/reports/resume")
        assert resumed.status_code == 200 and not resumed.json()["paused"]
        done = await settled(backends.store, [r["id"] for r in made], within=60)
    assert {r.status for r in done} == {RunStatus.SUCCEEDED}
    assert {r.attempt for r in done} == {1}


async def test_pause_and_resume_are_audited_and_repeats_change_nothing(
    api: httpx.AsyncClient, register: Register
) -> None:
    await register("t_noop", queue="reports")
    await api.post("/v1/queues/reports/pause", json={"reason": "maintenance"})
    again = await api.post("/v1/queues/reports/pause")
    assert again.json()["pauseReason"] == "maintenance", "the first pause stands"
    await api.post("/v1/queues/reports/resume")
    await api.post("/v1/queues/reports/resume")
    events = (await api.get("/v1/events", params={"jobId": "reports"})).json()["items"]
    assert [(e["type"], e["actor"]) for e in events] == [
        ("queue_paused", "user:admin"),
        ("queue_resumed", "user:admin"),
    ]
    assert events[0]["metadata"]["reason"] == "maintenance"
    assert (events[0]["scope"], events[0]["scopeId"]) == ("system", "job queues")


async def test_queues_are_listed_and_only_admins_may_touch_them(
    api: httpx.AsyncClient,
    client_for: Client,
    backends: Backends,
    settings: Settings,
    register: Register,
) -> None:
    await register("t_noop", queue="reports")
    listed = (await api.get("/v1/queues")).json()["items"]
    assert [i["queue"] for i in listed] == ["default", "reports"]
    assert listed[1] == {
        "queue": "reports",
        "ready": 0,
        "delayed": 0,
        "running": 0,
        "oldestReadyAgeSeconds": 0.0,
        "paused": False,
        "pausedBy": None,
        "pauseReason": None,
        "pausedAt": None,
    }
    error_of(await api.post("/v1/queues/nowhere/pause"), 404, "NotFound")
    error_of(await api.post("/v1/queues/reports/pause", json={"why": "x"}), 422, "ValidationFailed")
    key = (await api.post("/v1/api-keys", json={"name": "aud", "role": "auditor"})).json()["key"]
    auditor = client_for(key)
    error_of(await auditor.get("/v1/queues"), 403, "Forbidden")
    error_of(await auditor.post("/v1/queues/reports/pause"), 403, "Forbidden")
    # Runs of a started worker count as running.
    await register("slow", steps=[{"id": "s", "handler": "builtin.sleep"}])
    run = (await api.post("/v1/runs", json=body("slow", payload={"sleepSeconds": 3}))).json()
    async with running(backends, settings):

        async def started() -> bool:
            return (await queue_item(api, "default"))["running"] == 1

        await until(started)
        await api.post(f"/v1/runs/{run['id']}/cancel")
