"""Workers claim only runs whose current step's handler they offer.

A mixed fleet (workers with different handler sets on one queue) runs every step on a worker
that offers its handler, spends no attempt on a missing one, and a run no live worker can
serve waits, saying so in `waitingFor`, until one that can arrives.
"""

import asyncio
import subprocess
from pathlib import Path
from typing import Any

from bson import ObjectId

from jobplane.backends import Backends
from jobplane.metrics import read_state
from jobplane.model import RunStatus, WaitingFor
from jobplane.queue.entry import QueueEntry
from jobplane.runs import RunRequest, RunService
from jobplane.runs.waiting import Waiting
from jobplane.settings import Settings
from jobplane.worker import StepContext, Worker
from jobplane.worker.handlers import HandlerRegistry
from tests.integration.conftest import Client, Register
from tests.integration.db import raw
from tests.integration.processes import spawn, terminate
from tests.integration.workers import settled

CPU = "tests.integration.fleet_cpu"
GPU = "tests.integration.fleet_gpu"
PREPARE = "fleet.prepare"  # registered by name in CPU
RENDER = f"{GPU}:render"  # offered by its module:function name in GPU
STEPS = [
    {"id": "prepare", "handler": PREPARE},
    {"id": "render", "handler": RENDER},
    {"id": "finish", "handler": "builtin.echo"},
]


def worker(settings: Settings, logs: Path, worker_id: str, module: str) -> subprocess.Popen[bytes]:
    """A `jobplane worker` process that loads `module` and calls itself `worker_id`."""
    log = logs / f"{worker_id}.log"
    return spawn(settings, "worker", log, JOBPLANE_HANDLERS=module, JOBPLANE_WORKER_ID=worker_id)


async def alive(backends: Backends, *worker_ids: str) -> None:
    async with asyncio.timeout(60):
        while True:
            if set(worker_ids) <= set(await backends.queue.live_workers()):
                return
            await asyncio.sleep(0.05)


async def test_a_mixed_fleet_runs_each_step_on_a_worker_that_offers_its_handler(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register("render", steps=STEPS)
    await register("prepare_only", steps=STEPS[:1])
    await register("render_only", steps=STEPS[1:2])
    service = RunService(backends.store, backends.queue)
    ids = [
        (await service.create(RunRequest(kind, "user", "u", {"n": i}), "user:a"))[0].id
        for i in range(8)
        for kind in ("render", "prepare_only", "render_only")
    ]
    workers = [
        worker(settings, tmp_path, "cpu", CPU),
        worker(settings, tmp_path, "gpu", GPU),
    ]
    try:
        runs = await settled(backends.store, ids, within=120)
    finally:
        for proc in workers:
            terminate(proc)
    assert {r.status for r in runs} == {RunStatus.SUCCEEDED}
    assert {r.attempt for r in runs} == {1}, "no attempt spent on a missing handler"
    ran_by = {"prepare": {"worker:cpu"}, "render": {"worker:gpu"}}
    for run in runs:
        events = await backends.store.trail.events_of(run.id)
        transitions = {e.metadata.get("transition") for e in events}
        assert not transitions & {"retry", "fail"}, run.id
        for e in events:
            if e.type == "step_started" and e.metadata["step"] in ran_by:
                assert {e.actor} <= ran_by[e.metadata["step"]], (run.id, e)
    rendered = [r for r in runs if r.template_type == "render"]
    assert all(r.outputs["render"]["prepared"] == {"preparedBy": "cpu"} for r in rendered)


async def test_a_run_waits_for_its_handler_and_starts_when_a_worker_offers_it(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register("render_only", steps=STEPS[1:2])
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("render_only", "user", "u"), "user:a")
    waiting = Waiting(backends.store, backends.queue, max_age=0)
    cpu = worker(settings, tmp_path, "cpu", CPU)
    try:
        await alive(backends, "cpu")
        [seen] = await waiting.explain([await service.get(run.id)])
        assert seen.waiting_for == WaitingFor(reason="handler", detail=RENDER)
        gauges = {
            (s.name, tuple(s.labels.values())): s.value
            for family in await read_state(backends.store, backends.queue, ["default"])
            for s in family.samples
        }
        assert gauges[("jobplane_runs_waiting_for_handler", ("default", RENDER))] == 1
        await asyncio.sleep(1)  # a poll or more of the CPU worker's
        untouched = await service.get(run.id)
        assert (untouched.version, untouched.attempt) == (run.version, 0), "nothing spins"

        gpu = worker(settings, tmp_path, "gpu", GPU)
        try:
            [done] = await settled(backends.store, [run.id], within=60)
        finally:
            terminate(gpu)
    finally:
        terminate(cpu)
    assert done.status == RunStatus.SUCCEEDED and done.attempt == 1
    assert (await waiting.explain([done]))[0].waiting_for is None


async def test_a_worker_hands_on_a_run_whose_step_it_lacks_without_spending_an_attempt(
    backends: Backends, settings: Settings, register: Register
) -> None:
    """A run in the queue's own lane (one queued before workers advertised handlers) is
    claimed by any worker; one that lacks its step's handler hands it to that lane."""
    await register(
        steps=[{"id": "one", "handler": "builtin.noop"}, {"id": "two", "handler": "x.two"}]
    )
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("t_noop", "user", "u"), "user:a")
    await backends.queue.remove(QueueEntry.of(run))
    await raw(backends.store).runs.update_one(
        {"_id": ObjectId(run.id)}, {"$unset": {"handler": ""}}
    )
    legacy = run.model_copy(update={"handler": None})
    await backends.queue.push([QueueEntry.of(legacy)], backends.store.clock.now())

    async def noop(ctx: StepContext) -> None:
        return None

    async def two(ctx: StepContext) -> dict[str, Any]:
        return {"after": ctx.outputs["one"]}

    lacking, having = HandlerRegistry(), HandlerRegistry()
    lacking.register("builtin.noop")(noop)
    having.register("x.two")(two)
    stop = asyncio.Event()
    first = asyncio.create_task(
        Worker(backends.store, backends.queue, settings, lacking, "lacking").run(stop, 1)
    )
    try:
        async with asyncio.timeout(30):
            while True:
                handed = await service.get(run.id)
                if handed.handler == "x.two" and handed.status == RunStatus.QUEUED:
                    break
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await first
    assert handed.attempt == 0 and handed.progress.steps[0].status == "succeeded"
    [release] = [
        e
        for e in await backends.store.trail.events_of(run.id)
        if e.metadata.get("transition") == "release"
    ]
    assert release.actor == "worker:lacking" and release.message == "handed on for handler 'x.two'"

    stop = asyncio.Event()
    second = asyncio.create_task(
        Worker(backends.store, backends.queue, settings, having, "having").run(stop, 1)
    )
    try:
        [done] = await settled(backends.store, [run.id], within=30)
    finally:
        stop.set()
        await second
    assert done.status == RunStatus.SUCCEEDED and done.attempt == 1
    assert done.outputs == {"one": None, "two": {"after": None}}


async def test_registering_a_template_no_live_worker_can_run_warns(
    backends: Backends, settings: Settings, client_for: Client
) -> None:
    admin = client_for(settings.admin_key or "")
    spec: dict[str, Any] = {"type": "t_lonely", "steps": [{"id": "s", "handler": "nobody.offers"}]}
    answer = await admin.post("/v1/templates", json=spec)
    assert answer.status_code == 201, answer.text
    assert answer.json()["warnings"] == [
        "no live worker offers handler 'nobody.offers' on queue 'default': its runs wait "
        "until one does"
    ]
    created = await admin.post(
        "/v1/runs", json={"templateType": "t_lonely", "scope": "user", "scopeId": "u"}
    )
    assert created.json()["waitingFor"] == {"reason": "handler", "detail": "nobody.offers"}
    read = await admin.get(f"/v1/runs/{created.json()['id']}")
    assert read.json()["waitingFor"] == {"reason": "handler", "detail": "nobody.offers"}
    listed = await admin.get("/v1/runs")
    assert listed.json()["items"][0]["waitingFor"] == read.json()["waitingFor"]
    [queue] = (await admin.get("/v1/overview")).json()["queues"]
    assert queue["waitingForHandlers"] == [{"handler": "nobody.offers", "runs": 1}]

    await backends.queue.mark_alive("w", 30, 0, ["default"], ["nobody.offers"])
    await asyncio.sleep(1.1)  # the API reads the worker registry at most once a second
    served = await admin.post("/v1/templates", json={**spec, "description": "v2"})
    assert served.status_code == 201 and served.json()["warnings"] == []
