"""`concurrencyLimit` and `cancel_previous`: how many runs of one dedupe key are active at once,
decided by MongoDB's unique index on (key, place), whatever happens to Redis."""

import asyncio
from pathlib import Path
from typing import Any

import httpx

from jobplane.backends import Backends
from jobplane.model import TERMINAL, RunStatus
from jobplane.runs import RunRequest, RunService
from jobplane.settings import Settings
from tests.conftest import sync_redis
from tests.integration.api_client import error_of
from tests.integration.conftest import Register
from tests.integration.db import raw
from tests.integration.flow import peak, sampled, started, started_spans, until, workers
from tests.integration.workers import running, settled

KEYED = {"dedupeKeys": ["payload.partner"]}
SLEEP = [{"id": "work", "handler": "builtin.sleep"}]


def body(partner: str = "acme", **payload: Any) -> dict[str, Any]:
    return {
        "templateType": "sync",
        "scope": "account",
        "scopeId": "a1",
        "payload": {"partner": partner, **payload},
    }


async def test_reject_same_scope_admits_concurrency_limit_runs_of_50_concurrent_creates(
    api: httpx.AsyncClient, backends: Backends, register: Register
) -> None:
    await register("sync", concurrencyPolicy="reject_same_scope", concurrencyLimit=3, **KEYED)
    answers = await asyncio.gather(*(api.post("/v1/runs", json=body()) for _ in range(50)))
    winners = sorted(a.json()["id"] for a in answers if a.status_code == 201)
    assert len(winners) == 3
    for refused in (a for a in answers if a.status_code != 201):
        conflict = error_of(refused, 409, "ConcurrencyConflict")
        assert conflict["details"]["activeRunId"] == winners[0], "the oldest holder is named"
    places = await raw(backends.store).runs.distinct("dedupeSlot")
    assert sorted(places) == [1, 2], "the first place is stored as before places existed"
    # Another partner is another key; a place freed is taken again.
    assert (await api.post("/v1/runs", json=body("globex"))).status_code == 201
    await api.post(f"/v1/runs/{winners[1]}/cancel")
    assert (await api.post("/v1/runs", json=body())).status_code == 201
    error_of(await api.post("/v1/runs", json=body()), 409, "ConcurrencyConflict")


async def test_a_limit_of_one_stores_keys_as_before(
    api: httpx.AsyncClient, backends: Backends, register: Register
) -> None:
    await register("sync", concurrencyPolicy="reject_same_scope", **KEYED)
    first = (await api.post("/v1/runs", json=body())).json()
    error_of(await api.post("/v1/runs", json=body()), 409, "ConcurrencyConflict")
    doc = await raw(backends.store).runs.find_one({})
    assert doc is not None and "dedupeSlot" not in doc and "concurrencyLimit" not in doc
    assert first["dedupeKey"] == '["sync","account","a1","acme"]'


async def test_queued_runs_are_admitted_oldest_first_as_places_free(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register("sync", concurrencyPolicy="queue_same_scope", concurrencyLimit=2, **KEYED)
    made = [(await api.post("/v1/runs", json=body())).json() for _ in range(5)]
    assert [r["status"] for r in made] == ["queued", "queued", "pending", "pending", "pending"]
    assert made[2]["waitingFor"] == {"reason": "concurrency", "detail": made[2]["dedupeWait"]}
    await api.post(f"/v1/runs/{made[0]['id']}/cancel")
    admitted = (await api.get(f"/v1/runs/{made[2]['id']}")).json()
    assert (admitted["status"], admitted["dedupeSlot"]) == ("queued", None), "the freed place"
    assert (await api.get(f"/v1/runs/{made[3]['id']}")).json()["status"] == "pending"
    async with running(backends, settings, scheduler=True):
        done = await settled(backends.store, [r["id"] for r in made[1:]], within=30)
    assert {r.status for r in done} == {RunStatus.SUCCEEDED}


async def test_no_more_than_concurrency_limit_runs_of_a_key_are_active_across_worker_processes(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    """Two worker processes and a scheduler, 24 runs of one key with 3 places and 6 of
    another; Redis is wiped in the middle. At no sampled moment, nor in the runs' trails, are
    more than 3 of a key active, and every run succeeds."""
    await register(
        "sync", concurrencyPolicy="queue_same_scope", concurrencyLimit=3, steps=SLEEP, **KEYED
    )
    service = RunService(backends.store, backends.queue)
    ids: dict[str, list[str]] = {"acme": [], "globex": []}
    for i in range(30):
        partner = "acme" if i % 5 else "globex"
        request = RunRequest("sync", "account", "a1", {"partner": partner, "sleepSeconds": 0.2})
        ids[partner].append((await service.create(request, "user:t"))[0].id)
    key = (await service.get(ids["acme"][0])).dedupe_key
    holding = {"dedupeKey": key, "status": {"$nin": sorted(TERMINAL)}}
    filters = {"holding": holding, "started": started({"dedupeKey": key})}
    async with sampled(backends.store, filters) as peaks, workers(settings, tmp_path):
        await asyncio.sleep(1.5)
        with sync_redis(settings.redis_url or "") as redis:
            redis.flushall()
        runs = await settled(backends.store, [*ids["acme"], *ids["globex"]], within=120)
    assert {r.status for r in runs} == {RunStatus.SUCCEEDED}
    assert peaks == {"holding": 3, "started": 3}
    assert peak(await started_spans(backends.store, ids["acme"])) == 3
    assert peak(await started_spans(backends.store, ids["globex"])) <= 3


async def test_cancel_previous_leaves_only_the_newest_running(
    api: httpx.AsyncClient,
    backends: Backends,
    settings: Settings,
    register: Register,
    tmp_path: Path,
) -> None:
    """Two worker processes and a scheduler: each newer run displaces the one before, and of
    ten created at once only the newest goes on."""
    await register("sync", concurrencyPolicy="cancel_previous", steps=SLEEP, **KEYED)
    async with workers(settings, tmp_path):
        first = (await api.post("/v1/runs", json=body(sleepSeconds=30))).json()
        await _until(backends, first["id"], RunStatus.RUNNING)
        second = (await api.post("/v1/runs", json=body(sleepSeconds=30))).json()
        # It is written waiting for the key; a worker that stops the displaced run quickly
        # has it admitted before the create answers.
        created = (await backends.store.trail.events_of(second["id"]))[0]
        assert created.to == RunStatus.PENDING, created
        assert second["status"] in ("pending", "queued")
        if second["status"] == "pending":
            assert second["waitingFor"]["reason"] == "concurrency"
        await _until(backends, second["id"], RunStatus.RUNNING)
        # Ten at once: only the newest of them goes on. Each sleeps long enough that none
        # can finish before the last is created, however slowly a busy machine answers.
        answers = await asyncio.gather(
            *(api.post("/v1/runs", json=body(sleepSeconds=5)) for _ in range(10))
        )
        burst = sorted(a.json()["id"] for a in answers)
        done = await settled(backends.store, [first["id"], second["id"], *burst], within=60)
    by_id = {r.id: r for r in done}
    assert by_id[first["id"]].status == RunStatus.CANCELLED
    assert by_id[second["id"]].status == RunStatus.CANCELLED
    assert by_id[burst[-1]].status == RunStatus.SUCCEEDED
    assert {by_id[i].status for i in burst[:-1]} == {RunStatus.CANCELLED}
    # The displaced runs' events name the run that displaced them.
    events = await backends.store.trail.events_of(first["id"])
    asked = [e for e in events if e.type == "cancel_requested"]
    assert asked and asked[0].metadata["displacedBy"] == second["id"]
    assert by_id[first["id"]].cancel_reason == f"displaced by run {second['id']} " + (
        "(concurrencyPolicy cancel_previous)"
    )
    for run_id in burst[:-1]:
        # Cancelled while waiting, or asked to stop if it had taken the key meanwhile.
        events = await backends.store.trail.events_of(run_id)
        named = {e.metadata.get("displacedBy") for e in events} - {None}
        assert named and named <= set(burst), run_id


async def _until(backends: Backends, run_id: str, status: RunStatus) -> None:
    async def reached() -> bool:
        run = await backends.store.runs.get(run_id)
        return run is not None and run.status == status

    await until(reached)
