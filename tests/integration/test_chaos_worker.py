"""Worker processes under chaos: a run that kills every worker that takes it, a worker frozen
past its lease (a zombie) that wakes up while another worker holds the run, and SIGTERM while
a step runs. Every worker and scheduler here is a real `python -m jobplane` process.
"""

import asyncio
import os
import signal
import subprocess
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path

import pytest

from jobplane.backends import Backends
from jobplane.model import TERMINAL, Event, Run, RunStatus, StepStatus
from jobplane.runs import RunRequest, RunService
from jobplane.settings import Settings
from jobplane.worker import registry
from tests.integration.conftest import Register
from tests.integration.processes import spawn, terminate
from tests.integration.workers import settled

ROOT = Path(__file__).resolve().parents[2]
# Bounds for what takes a few seconds on a laptop: a 2-core CI machine shared with other jobs
# may need many times that to start Python processes and expire leases.
WITHIN = 60.0
POLL = 0.05
SLEEPY = [
    {"id": "nap", "handler": "builtin.sleep"},
    {"id": "after", "handler": "builtin.echo"},
]
RETRIES = {"maxAttempts": 3, "backoffSeconds": [0]}


def quick(settings: Settings) -> Settings:
    """Short leases, so that a lost worker is noticed within seconds (as test_recovery)."""
    return settings.model_copy(
        update={"lease_seconds": 1.5, "heartbeat_seconds": 0.3, "reconcile_seconds": 0.5}
    )


def stepping(run: Run) -> bool:
    """Running, with a step whose start is on record (the worker is inside the handler)."""
    busy = any(s.status == StepStatus.RUNNING for s in run.progress.steps)
    return run.status == RunStatus.RUNNING and busy


async def until(
    backends: Backends,
    run_id: str,
    ok: Callable[[Run], bool],
    within: float = WITHIN,
    each: Callable[[], None] = lambda: None,
) -> Run:
    """Poll MongoDB, as a user would, until the run satisfies `ok`; fail after `within` s.

    `each` is called at every poll (to look after processes meanwhile).
    """
    async with asyncio.timeout(within):
        while True:
            run = await backends.store.runs.get(run_id)
            if run is not None and ok(run):
                return run
            each()
            await asyncio.sleep(POLL)


async def exited(proc: subprocess.Popen[bytes], within: float = WITHIN) -> int:
    async with asyncio.timeout(within):
        while (code := proc.poll()) is None:  # noqa: ASYNC110
            await asyncio.sleep(POLL)
    return code


def moves(events: list[Event]) -> list[tuple[RunStatus | None, RunStatus | None]]:
    return [(e.from_, e.to) for e in events if e.type == "status_changed"]


def transitions(events: list[Event]) -> list[tuple[str, str]]:
    """(transition, actor) of every status change, in the order MongoDB applied them."""
    return [(e.metadata["transition"], e.actor) for e in events if e.type == "status_changed"]


# -- a poison run ----------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_run_that_kills_its_worker_expires_after_max_attempts(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register(
        steps=[{"id": "poison", "handler": "chaos.kill_own_process"}], retryPolicy=RETRIES
    )
    await register("t_fine")
    fast = quick(settings).model_copy(update={"handlers": ["tests.integration.chaos_handlers"]})
    kills = tmp_path / "kills.txt"
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": pythonpath, "CHAOS_KILLS": str(kills)}
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("t_noop", "user", "u"), "user:a")

    scheduler = spawn(fast, "scheduler", tmp_path / "scheduler.log")
    dead: list[subprocess.Popen[bytes]] = []
    worker = spawn(fast, "worker", tmp_path / "worker-0.log", **env)

    def replace_if_dead() -> None:
        # A supervisor's job (systemd, Kubernetes): a worker that died is started again.
        nonlocal worker
        assert scheduler.poll() is None, "the scheduler died"
        if worker.poll() is not None:
            dead.append(worker)
            assert len(dead) <= 3, "the poison run killed more workers than it has attempts"
            worker = spawn(fast, "worker", tmp_path / f"worker-{len(dead)}.log", **env)

    def over(r: Run) -> bool:
        return r.status in TERMINAL

    try:
        await until(backends, run.id, over, within=3 * WITHIN, each=replace_if_dead)
        # The run is over. A worker that takes an ordinary run afterwards was polling the
        # queue all along, and the poison run got no fourth claim meanwhile.
        fine, _ = await service.create(RunRequest("t_fine", "user", "u"), "user:a")
        fine = await until(backends, fine.id, over, each=replace_if_dead)
        assert fine.status == RunStatus.SUCCEEDED
        assert worker.poll() is None, "the worker that ran the ordinary run is alive"
    finally:
        terminate(worker)
        terminate(scheduler)

    done = await backends.store.runs.get(run.id)
    assert done is not None and done.status == RunStatus.EXPIRED
    # The lease is gone; the worker it killed last stays named as its last holder.
    assert done.attempt == 3 and done.lease_token is None and done.locked_by is not None
    assert done.error is not None and done.error.code == "lease_expired"
    assert [(a.attempt, a.error.code) for a in done.attempts] == [
        (n, "lease_expired") for n in (1, 2, 3)
    ]
    # Each attempt ran the handler in a process of its own, and that process died of it.
    assert [p.returncode for p in dead] == [-signal.SIGKILL] * 3
    lines = [line.split() for line in kills.read_text().splitlines()]
    assert lines == [[str(p.pid), run.id, str(n)] for n, p in enumerate(dead, 1)]

    events = await backends.store.trail.events_of(run.id)
    claims = [e for e in events if e.metadata.get("transition") == "claim"]
    assert [e.metadata["attempt"] for e in claims] == [1, 2, 3]
    assert len({e.actor for e in claims}) == 3, "three different worker processes"
    assert [e.type for e in events].count("lease_expired") == 3
    assert transitions(events) == [
        ("claim", claims[0].actor),
        ("reap_requeue", "reaper"),
        ("claim", claims[1].actor),
        ("reap_requeue", "reaper"),
        ("claim", claims[2].actor),
        ("reap_expire", "reaper"),
    ]
    assert [to for _, to in moves(events) if to in TERMINAL] == [RunStatus.EXPIRED]
    assert all(a[1] == b[0] for a, b in pairwise(moves(events))), "no hole in the trail"


# -- a zombie --------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_worker_frozen_past_its_lease_cannot_write_after_waking_up(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register(steps=SLEEPY, retryPolicy=RETRIES)
    fast = quick(settings)
    run, _ = await RunService(backends.store, backends.queue).create(
        RunRequest("t_noop", "user", "u", {"sleepSeconds": 4}), "user:a"
    )
    scheduler = spawn(fast, "scheduler", tmp_path / "scheduler.log")
    zombie = spawn(fast, "worker", tmp_path / "zombie.log", JOBPLANE_WORKER_ID="zombie")
    healthy: subprocess.Popen[bytes] | None = None
    try:
        await until(backends, run.id, lambda r: stepping(r) and r.locked_by == "zombie")
        # Frozen mid-step (a stop-the-world pause, a suspended VM): no heartbeat, no writes.
        zombie.send_signal(signal.SIGSTOP)
        healthy = spawn(fast, "worker", tmp_path / "healthy.log", JOBPLANE_WORKER_ID="healthy")
        # The reaper requeues the run once the lease passed, and the other worker takes it.
        await until(backends, run.id, lambda r: stepping(r) and r.locked_by == "healthy")
        zombie.send_signal(signal.SIGCONT)

        async def rejected() -> list[Event]:
            events = await backends.store.trail.events_of(run.id)
            return [e for e in events if e.type == "stale_write_rejected"]

        # The zombie's step goes on where it froze, so it writes (progress, heartbeat) at once.
        async with asyncio.timeout(WITHIN):
            while not await rejected():  # noqa: ASYNC110
                await asyncio.sleep(POLL)
        [done] = await settled(backends.store, [run.id], within=WITHIN)
        assert zombie.poll() is None, "the zombie lost a run, not its life"
    finally:
        if zombie.poll() is None:
            zombie.send_signal(signal.SIGCONT)  # a stopped process would ignore SIGTERM
        codes = [terminate(p) for p in (zombie, healthy, scheduler) if p is not None]
    assert codes == [0, 0, 0], "every process drained and exited cleanly"

    assert done.status == RunStatus.SUCCEEDED and done.attempt == 2
    assert [s.status for s in done.progress.steps] == [StepStatus.SUCCEEDED] * 2
    events = await backends.store.trail.events_of(run.id)
    assert transitions(events) == [
        ("claim", "worker:zombie"),
        ("reap_requeue", "reaper"),
        ("claim", "worker:healthy"),
        ("complete", "worker:healthy"),
    ]
    assert [e.type for e in events].count("lease_expired") == 1
    stale = [e for e in events if e.type == "stale_write_rejected"]
    assert stale and all(
        e.actor == "worker:zombie" and e.metadata["worker"] == "zombie" for e in stale
    )
    # Nothing the zombie wrote reached the run after the healthy worker's claim.
    taken = next(
        e.run_version
        for e in events
        if e.metadata.get("transition") == "claim" and e.actor == "worker:healthy"
    )
    late = [e for e in events if e.actor == "worker:zombie" and e.type != "stale_write_rejected"]
    assert late and all(e.run_version < taken for e in late)
    finished = [
        (e.metadata["step"], e.actor)
        for e in events
        if e.type == "step_finished" and e.metadata.get("status") != "failed"
    ]
    assert Counter(finished) == {("nap", "worker:healthy"): 1, ("after", "worker:healthy"): 1}


# -- SIGTERM ---------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_sigterm_releases_a_run_whose_step_outlasts_the_drain(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register(steps=SLEEPY, retryPolicy=RETRIES)
    run, _ = await RunService(backends.store, backends.queue).create(
        RunRequest("t_noop", "user", "u", {"sleepSeconds": 30}), "user:a"
    )
    assert run.attempt == 0
    worker = spawn(
        settings,
        "worker",
        tmp_path / "worker.log",
        "--drain-seconds",
        "0.5",
        JOBPLANE_WORKER_ID="drained",
    )
    try:
        claimed = await until(backends, run.id, stepping)
        assert claimed.attempt == 1 and claimed.locked_by == "drained"
        worker.send_signal(signal.SIGTERM)
        assert await exited(worker) == 0
    finally:
        terminate(worker)

    released = await backends.store.runs.get(run.id)
    assert released is not None and released.status == RunStatus.QUEUED
    assert released.attempt == 0, "a drained run does not spend an attempt"
    assert released.locked_by is None and released.lease_token is None
    assert [s.status for s in released.progress.steps] == [StepStatus.PENDING] * 2
    events = await backends.store.trail.events_of(run.id)
    assert transitions(events)[-2:] == [("claim", "worker:drained"), ("release", "worker:drained")]
    assert "lease_expired" not in [e.type for e in events]
    popped = await backends.queue.pop(
        settings.queues, 10, backends.store.clock.now(), handlers=registry.offered()
    )
    assert popped.run_ids == [run.id], "the released run is back in Redis"


@pytest.mark.slow
async def test_sigterm_lets_a_step_that_ends_within_the_drain_finish(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register(steps=SLEEPY, retryPolicy=RETRIES)
    run, _ = await RunService(backends.store, backends.queue).create(
        RunRequest("t_noop", "user", "u", {"sleepSeconds": 3}), "user:a"
    )
    worker = spawn(
        settings,
        "worker",
        tmp_path / "worker.log",
        "--drain-seconds",
        "30",
        JOBPLANE_WORKER_ID="drained",
    )
    try:
        await until(backends, run.id, stepping)
        signalled = datetime.now(UTC)
        worker.send_signal(signal.SIGTERM)
        assert await exited(worker) == 0
    finally:
        terminate(worker)

    done = await backends.store.runs.get(run.id)
    assert done is not None and done.status == RunStatus.SUCCEEDED and done.attempt == 1
    assert [s.status for s in done.progress.steps] == [StepStatus.SUCCEEDED] * 2
    nap = done.progress.steps[0]
    assert nap.completed_at is not None and signalled < nap.completed_at, "SIGTERM came mid-step"
    assert transitions(await backends.store.trail.events_of(run.id)) == [
        ("claim", "worker:drained"),
        ("complete", "worker:drained"),
    ]
