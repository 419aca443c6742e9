"""Several worker processes draining one queue: every run is claimed and finished once."""

import asyncio
from pathlib import Path

import pytest

from jobplane.backends import Backends
from jobplane.model import ALLOWED, RunStatus
from jobplane.runs import RunRequest, RunService
from jobplane.settings import Settings
from tests.integration.conftest import Register
from tests.integration.db import raw
from tests.integration.processes import spawn, terminate
from tests.integration.workers import create_many

RUNS = 2000
WORKERS = 4


@pytest.mark.slow
async def test_four_worker_processes_claim_each_run_exactly_once(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register()
    service = RunService(backends.store, backends.queue)
    request = RunRequest("t_noop", "system", "race")
    ids = await create_many(service, request, RUNS, "user:test")
    workers = [
        # Frequent heartbeats overlap completions all the time: a heartbeat must never mistake
        # a run finishing under it for a lost lease.
        spawn(
            settings,
            "worker",
            tmp_path / f"worker{i}.log",
            JOBPLANE_WORKER_CONCURRENCY="16",
            JOBPLANE_HEARTBEAT_SECONDS="0.1",
        )
        for i in range(WORKERS)
    ]
    try:
        runs = raw(backends.store).runs
        async with asyncio.timeout(180):
            while await runs.count_documents({"status": RunStatus.SUCCEEDED}) < RUNS:
                assert all(w.poll() is None for w in workers), "a worker died"
                await asyncio.sleep(0.2)
    finally:
        codes = [terminate(w) for w in workers]
    assert codes == [0] * WORKERS, "workers drain and exit 0 on SIGTERM"

    assert await raw(backends.store).runs.count_documents({}) == RUNS
    assert await raw(backends.store).runs.count_documents({"status": RunStatus.SUCCEEDED}) == RUNS
    claims = await raw(backends.store).events.aggregate(
        [
            {"$match": {"type": "status_changed", "to": RunStatus.RUNNING}},
            {"$group": {"_id": "$jobId", "n": {"$sum": 1}}},
        ]
    )
    per_run = {doc["_id"]: doc["n"] async for doc in claims}
    assert per_run == dict.fromkeys(ids, 1), "exactly one claim per run"
    finishes = await raw(backends.store).events.count_documents(
        {"type": "status_changed", "to": RunStatus.SUCCEEDED}
    )
    assert finishes == RUNS
    assert await raw(backends.store).events.count_documents({"type": "stale_write_rejected"}) == 0
    for i in range(WORKERS):
        assert "lease lost" not in (tmp_path / f"worker{i}.log").read_text()
    trails: dict[str, list[tuple[str, str]]] = {}
    cursor = (
        raw(backends.store)
        .events.find({"type": "status_changed"})
        .sort([("jobId", 1), ("runVersion", 1), ("_id", 1)])
    )
    async for event in cursor:
        trails.setdefault(event["jobId"], []).append((event["from"], event["to"]))
    for trail in trails.values():
        status = RunStatus.QUEUED
        for from_, to in trail:
            assert from_ == status and RunStatus(to) in ALLOWED[status], trail
            status = RunStatus(to)
        assert status == RunStatus.SUCCEEDED
    by_worker = await raw(backends.store).runs.distinct("lockedBy")
    assert len(by_worker) == WORKERS, "every process took part"
