"""External steps: the round trip through the HTTP API, cancel, an expired external lease, and
the reference `jobplane external-worker` as a process."""

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY

from jobplane.api import create_app
from jobplane.backends import Backends
from jobplane.model import RunStatus, StepStatus
from jobplane.runs import RunRequest, RunService
from jobplane.runs.external import ExternalSteps
from jobplane.settings import Settings
from jobplane.worker import StepContext, registry
from jobplane.worker.external import ExternalWorker
from tests.integration.api_client import error_of
from tests.integration.conftest import Client, Register
from tests.integration.workers import running, settled

STEPS = [
    {"id": "fetch", "handler": "builtin.echo"},
    {"id": "render", "handler": "test.ext_double", "workerType": "external"},
    {"id": "store", "handler": "builtin.noop"},
]


@registry.register("test.ext_double")
async def ext_double(ctx: StepContext) -> dict[str, Any]:
    ctx.progress(50, "halfway")
    return {"doubled": 2 * ctx.outputs["fetch"]["n"]}


async def create(backends: Backends, payload: dict[str, Any]) -> str:
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("t_noop", "user", "u", payload), "user:a")
    return run.id


async def until_status(backends: Backends, run_id: str, status: RunStatus) -> None:
    async with asyncio.timeout(30):
        while (await backends.store.runs.get(run_id)).status != status:  # type: ignore[union-attr]  # noqa: ASYNC110
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def external(api: httpx.AsyncClient, worker_id: str = "ext-1") -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(
        ExternalWorker(api, "external", worker_id, wait_seconds=0.5).run(stop)
    )
    try:
        yield
    finally:
        stop.set()
        await task


async def test_an_external_step_runs_between_inline_steps(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register(steps=STEPS)
    run_id = await create(backends, {"n": 21})
    async with running(backends, settings), external(api):
        [done] = await settled(backends.store, [run_id], within=30)
    assert done.status == RunStatus.SUCCEEDED
    assert done.outputs["render"] == {"doubled": 42}
    assert [s.status for s in done.progress.steps] == [StepStatus.SUCCEEDED] * 3
    assert done.attempt == 1, "handing a run back and forth spends no attempt"
    moves = [
        (e.metadata.get("transition"), e.actor)
        for e in await backends.store.trail.events_of(run_id)
        if e.type == "status_changed"
    ]
    names = [name for name, _ in moves]
    assert names == ["claim", "wait_worker", "resume", "release", "claim", "complete"]
    assert moves[2][1] == "worker:ext-1" and moves[3][1] == "worker:ext-1"


async def waiting_step(backends: Backends, settings: Settings, payload: dict[str, Any]) -> str:
    """A run whose external step waits for a worker (its inline worker has let go)."""
    run_id = await create(backends, payload)
    async with running(backends, settings):
        await until_status(backends, run_id, RunStatus.WAITING_WORKER)
    return run_id


async def claim(api: httpx.AsyncClient, worker_id: str = "w1") -> dict[str, Any]:
    body = {"workerId": worker_id, "waitSeconds": 5}
    response = await api.post("/v1/external/external/claim", json=body)
    assert response.status_code == 200, response.text
    claimed: dict[str, Any] = response.json()
    return claimed


async def test_refusals_keep_the_run_as_it_was(
    api: httpx.AsyncClient,
    client_for: Client,
    backends: Backends,
    settings: Settings,
    register: Register,
) -> None:
    await register(steps=STEPS)
    nothing = await api.post(
        "/v1/external/external/claim", json={"workerId": "w", "waitSeconds": 0}
    )
    assert nothing.status_code == 204
    bad = await api.post("/v1/external/external/claim", json={"workerId": "w", "waitSeconds": "5"})
    error_of(bad, 422, "ValidationFailed")
    run_id = await waiting_step(backends, settings, {"n": 1})
    made = await api.post("/v1/api-keys", json={"name": "u", "role": "user", "scopes": ["user:u"]})
    user = client_for(made.json()["key"])
    forbidden = await user.post("/v1/external/external/claim", json={"workerId": "w"})
    error_of(forbidden, 403, "Forbidden")
    assert (
        await api.post("/v1/external/gpu/claim", json={"workerId": "w", "waitSeconds": 0})
    ).status_code == 204

    claimed = await claim(api)
    assert claimed["runId"] == run_id and claimed["stepId"] == "render"
    assert claimed["run"]["outputs"] == {"fetch": {"n": 1}}
    forged = {"workerId": "w1", "leaseToken": "not-the-token"}
    for action in ("heartbeat", "complete", "fail"):
        body = {**forged, "message": "x"} if action == "fail" else forged
        answer = await api.post(f"/v1/runs/{run_id}/steps/render/{action}", json=body)
        error_of(answer, 409, "ResourceInvalidState")
    lease = {"workerId": "w1", "leaseToken": claimed["leaseToken"]}
    error_of(await api.post(f"/v1/runs/{run_id}/steps/nope/complete", json=lease), 404, "NotFound")
    wrong_step = await api.post(f"/v1/runs/{run_id}/steps/fetch/complete", json=lease)
    error_of(wrong_step, 409, "ResourceInvalidState")
    run = await backends.store.runs.get(run_id)
    assert run is not None and run.status == RunStatus.RUNNING and run.locked_by == "w1"
    rejected = [
        e for e in await backends.store.trail.events_of(run_id) if e.type == "stale_write_rejected"
    ]
    assert rejected, "forged calls are on the record"


async def test_cancel_reaches_the_external_worker_and_its_complete_is_refused(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register(steps=STEPS)
    run_id = await waiting_step(backends, settings, {"n": 2})
    claimed = await claim(api)
    lease = {"workerId": "w1", "leaseToken": claimed["leaseToken"]}
    beat = (
        await api.post(
            f"/v1/runs/{run_id}/steps/render/heartbeat", json={**lease, "percentage": 30}
        )
    ).json()
    assert beat["cancelRequested"] is False
    asked = await api.post(f"/v1/runs/{run_id}/cancel", json={"reason": "not needed"})
    assert asked.json()["status"] == "cancel_requested"
    beat = (await api.post(f"/v1/runs/{run_id}/steps/render/heartbeat", json=lease)).json()
    assert beat["cancelRequested"] is True
    late = await api.post(f"/v1/runs/{run_id}/steps/render/complete", json={**lease, "output": 1})
    error_of(late, 409, "ResourceInvalidState")
    run = await backends.store.runs.get(run_id)
    assert run is not None and run.status == RunStatus.CANCELLED
    assert [s.status for s in run.progress.steps] == [
        StepStatus.SUCCEEDED,
        StepStatus.CANCELLED,
        StepStatus.SKIPPED,
    ]
    assert "render" not in run.outputs


async def test_a_cancel_while_no_external_worker_holds_the_step_ends_at_the_next_tick(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register(steps=STEPS)
    run_id = await waiting_step(backends, settings, {"n": 3})
    asked = await api.post(f"/v1/runs/{run_id}/cancel", json={"reason": "nobody came"})
    assert asked.json()["status"] == "cancel_requested"
    async with running(backends, settings, scheduler=True):
        [done] = await settled(backends.store, [run_id], within=20)
    assert done.status == RunStatus.CANCELLED
    nothing = await api.post(
        "/v1/external/external/claim", json={"workerId": "w", "waitSeconds": 0}
    )
    assert nothing.status_code == 204


async def test_an_expired_external_lease_goes_back_to_the_queue(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register(steps=STEPS, retryPolicy={"maxAttempts": 3, "backoffSeconds": [0]})
    quick = settings.model_copy(update={"lease_seconds": 1, "heartbeat_seconds": 0.3})
    run_id = await waiting_step(backends, quick, {"n": 4})
    transport = httpx.ASGITransport(app=create_app(quick, backends))
    headers = {"authorization": f"Bearer {settings.admin_key}"}
    async with httpx.AsyncClient(
        transport=transport, base_url="http://t", headers=headers
    ) as short:
        first = await claim(short, "silent")
        async with running(backends, quick, scheduler=True):
            # The silent worker never heartbeats: the reaper requeues, an inline worker hands
            # the step out again, and a live external worker finishes the run.
            async with external(short, "alive"):
                [done] = await settled(backends.store, [run_id], within=30)
        late = {"workerId": "silent", "leaseToken": first["leaseToken"], "output": 0}
        error_of(
            await short.post(f"/v1/runs/{run_id}/steps/render/complete", json=late),
            409,
            "ResourceInvalidState",
        )
    assert done.status == RunStatus.SUCCEEDED and done.attempt == 2
    # The lost lease ended attempt 1 with an error; the run's own outcome has none.
    assert done.error is None
    lost = [(a.attempt, a.error.code, a.error.step) for a in done.attempts]
    assert lost == [(1, "lease_expired", "render")]
    events = await backends.store.trail.events_of(run_id)
    assert [e.type for e in events].count("lease_expired") == 1
    resumed = [e.actor for e in events if e.metadata.get("transition") == "resume"]
    assert resumed == ["worker:silent", "worker:alive"]


@pytest.mark.slow
async def test_the_reference_external_worker_as_a_process(
    url: str, backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    (tmp_path / "ext_handlers.py").write_text(
        "from jobplane.worker import handler\n\n"
        "@handler('test.ext_double')\n"
        "def double(ctx):\n"
        "    ctx.heartbeat()\n"
        "    return {'doubled': 2 * ctx.outputs['fetch']['n']}\n"
    )
    await register(steps=STEPS)
    run_id = await create(backends, {"n": 5})
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "JOBPLANE_URL": url,
        "JOBPLANE_API_KEY": str(settings.admin_key),
    }
    argv = [
        "-m",
        "jobplane",
        "external-worker",
        "--handlers",
        "ext_handlers",
        "--worker-id",
        "proc",
    ]
    log = (tmp_path / "external.log").open("w")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *argv, env=env, stdout=log, stderr=log
    )
    try:
        async with running(backends, settings):
            [done] = await settled(backends.store, [run_id], within=60)
    finally:
        proc.terminate()
        code = await asyncio.wait_for(proc.wait(), 30)
        log.close()
    assert done.status == RunStatus.SUCCEEDED, (tmp_path / "external.log").read_text()
    assert done.outputs["render"] == {"doubled": 10}
    assert code == 0, "SIGTERM stops it cleanly"
    actors = {e.actor for e in await backends.store.trail.events_of(run_id)}
    assert "worker:proc" in actors


async def test_a_run_finished_by_an_external_worker_is_counted(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register("t_ext_last", steps=STEPS[:2])
    labels = {"template": "t_ext_last", "status": "succeeded"}
    before = REGISTRY.get_sample_value("jobplane_runs_finished_total", labels) or 0
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("t_ext_last", "user", "u", {"n": 1}), "user:a")
    async with running(backends, settings), external(api):
        [done] = await settled(backends.store, [run.id], within=30)
    assert done.status == RunStatus.SUCCEEDED
    assert REGISTRY.get_sample_value("jobplane_runs_finished_total", labels) == before + 1


async def test_a_claim_whose_caller_went_away_takes_nothing(
    backends: Backends, settings: Settings, register: Register
) -> None:
    """An external worker that stops abandons its long poll: the API's poll must not then
    lease it a step, which would wait for the lease to expire."""
    await register(steps=STEPS)
    run_id = await waiting_step(backends, settings, {"n": 1})
    steps = ExternalSteps(backends.store, backends.queue, settings.lease_seconds)

    async def gone() -> bool:
        return True

    assert await steps.claim("external", "stopped", 30, gone) is None
    run = await backends.store.runs.get(run_id)
    assert run is not None and run.status == RunStatus.WAITING_WORKER
    claimed = await steps.claim("external", "alive", 0)
    assert claimed is not None and claimed.run.id == run_id
