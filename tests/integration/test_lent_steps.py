"""Steps of one run on different workers at once: a run's holder lends a ready step whose
handler only another worker offers, while its own steps run (docs/architecture.md, "Lent
steps"). Real worker processes, each offering one branch's handler."""

import asyncio
import signal
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from jobplane.backends import Backends
from jobplane.model import Run, RunStatus
from jobplane.runs import RunRequest, RunService
from jobplane.settings import Settings
from tests.integration.conftest import Register
from tests.integration.flow import until
from tests.integration.processes import spawn, terminate
from tests.integration.test_flows import overlap, steps, trail_of
from tests.integration.workers import settled

ONE, TWO = "tests.integration.branch_one", "tests.integration.branch_two"


def diamond() -> list[dict[str, Any]]:
    """a → (b, c) → d: b's handler only worker "one" offers, c's only worker "two"."""
    return [
        {"id": "a", "handler": "builtin.noop"},
        {"id": "b", "handler": f"{ONE}:b", "needs": ["a"]},
        {"id": "c", "handler": f"{TWO}:c", "needs": ["a"]},
        {"id": "d", "handler": "builtin.echo", "needs": ["b", "c"]},
    ]


def worker(settings: Settings, tmp_path: Path, name: str, **env: str) -> subprocess.Popen[bytes]:
    """Worker "one" offers b's handler, "two" c's; both offer the builtins."""
    module = ONE if name.startswith("one") else TWO
    log = tmp_path / f"{name}.log"
    return spawn(settings, "worker", log, JOBPLANE_HANDLERS=module, JOBPLANE_WORKER_ID=name, **env)


@asynccontextmanager
async def fleet(settings: Settings, tmp_path: Path) -> AsyncIterator[list[subprocess.Popen[bytes]]]:
    """The scheduler, which reaps; the test adds its workers to the list it is given."""
    procs = [spawn(settings, "scheduler", tmp_path / "scheduler.log")]
    try:
        yield procs
    finally:
        for proc in procs:
            terminate(proc)


async def create(backends: Backends, payload: dict[str, Any]) -> tuple[RunService, Run]:
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("flow", "user", "u1", payload), "user:t")
    return service, run


async def branches_running(backends: Backends, run: Run, lent_to: str | None = None) -> None:
    """Until b runs on "one" and c is lent (claimed by `lent_to`, when named)."""

    async def holds() -> bool:
        now = await backends.store.runs.get(run.id)
        if now is None or steps(now)["b"] != "running":
            return False
        c = now.progress.steps[2]
        if lent_to is None:
            return c.lease is not None
        return c.status == "running" and c.lease is not None and c.lease.worker_id == lent_to

    await until(holds, within=30)


async def test_branches_whose_handlers_live_on_different_workers_run_at_once(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register("flow", steps=diamond())
    # Each branch waits, once started, until the other has started too.
    meet = {"b": {"meet": {"dir": str(tmp_path), "with": "c"}}}
    meet["c"] = {"meet": {"dir": str(tmp_path), "with": "b"}}
    _, run = await create(backends, meet)
    async with fleet(settings, tmp_path) as procs:
        procs.append(worker(settings, tmp_path, "one"))
        procs.append(worker(settings, tmp_path, "two"))
        [done] = await settled(backends.store, [run.id], within=60)
    assert done.status == RunStatus.SUCCEEDED
    assert set(steps(done).values()) == {"succeeded"}
    assert done.outputs["b"] == {"ranBy": "one"} and done.outputs["c"] == {"ranBy": "two"}
    assert overlap(done, "b", "c"), "b and c ran at the same time, each on its worker"
    d, b, c = (next(s for s in done.progress.steps if s.id == i) for i in "dbc")
    assert d.started_at and b.completed_at and c.completed_at
    assert d.started_at >= max(b.completed_at, c.completed_at), "d started after both"
    [lent] = await trail_of(backends, run.id, "step_lent")
    [claimed] = await trail_of(backends, run.id, "step_claimed")
    assert lent["metadata"]["step"] == claimed["metadata"]["step"]
    holder, borrower = lent["actor"], claimed["actor"]
    assert {holder, borrower} == {"worker:one", "worker:two"}
    finished = [e["metadata"]["step"] for e in await trail_of(backends, run.id, "step_finished")]
    assert sorted(finished) == ["a", "b", "c", "d"], "each success written once"
    assert all(s.lease is None for s in done.progress.steps), "every lease settled"
    assert [s.attempt for s in done.progress.steps] == [1, 1, 1, 1]


async def test_a_borrower_killed_mid_step_fails_that_try_and_the_retry_redoes_only_it(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    """Worker "two" is SIGKILLed while it runs c, lent by "one", which runs b. c's lease runs
    out, "one" takes c back (`lease_expired`), lets b finish, and the run is tried again: b's
    output is kept, and only c runs again, on a new "two"."""
    await register("flow", steps=diamond(), retryPolicy={"maxAttempts": 2, "backoffSeconds": [0]})
    _, run = await create(backends, {"b": {"sleep": 8}, "c": {"sleep": [60, 0.2]}})
    async with fleet(settings, tmp_path) as procs:
        procs.append(worker(settings, tmp_path, "one"))
        await branches_running(backends, run)
        two = worker(settings, tmp_path, "two")
        try:
            await branches_running(backends, run, lent_to="two")
        finally:
            two.send_signal(signal.SIGKILL)
            two.wait()
        procs.append(worker(settings, tmp_path, "two-again"))
        [done] = await settled(backends.store, [run.id], within=90)
    assert done.status == RunStatus.SUCCEEDED
    assert [(a.error.code, a.error.step) for a in done.attempts] == [("lease_expired", "c")]
    assert done.outputs["b"] == {"ranBy": "one"}
    assert done.outputs["c"] == {"ranBy": "two-again"}
    started = [e["metadata"]["step"] for e in await trail_of(backends, run.id, "step_started")]
    assert started.count("b") == 1, "b ran once"
    [taken] = await trail_of(backends, run.id, "step_taken_back")
    assert taken["actor"] == "worker:one" and "step lease of two ran out" in taken["message"]
    assert [s.attempt for s in done.progress.steps] == [1, 1, 2, 1]


async def test_a_holder_killed_while_its_step_is_lent_leaves_that_step_running(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    """Worker "one" is SIGKILLed while it runs b and "two" runs c. The reaper queues the run
    again; c goes on under its own lease, and the run's next holder writes c's end from its
    report: c ran once, b twice, and the run succeeds."""
    await register("flow", steps=diamond(), retryPolicy={"maxAttempts": 2, "backoffSeconds": [0]})
    _, run = await create(backends, {"b": {"sleep": [60, 0.2]}, "c": {"sleep": 3}})
    async with fleet(settings, tmp_path) as procs:
        one = worker(settings, tmp_path, "one")
        try:
            await branches_running(backends, run)
            procs.append(worker(settings, tmp_path, "two"))
            await branches_running(backends, run, lent_to="two")
        finally:
            one.send_signal(signal.SIGKILL)
            one.wait()
        procs.append(worker(settings, tmp_path, "one-again"))
        [done] = await settled(backends.store, [run.id], within=90)
    assert done.status == RunStatus.SUCCEEDED
    assert [(a.error.code, a.error.step) for a in done.attempts] == [("lease_expired", "b")]
    assert done.outputs["b"] == {"ranBy": "one-again"} and done.outputs["c"] == {"ranBy": "two"}
    claims = await trail_of(backends, run.id, "step_claimed")
    assert [c["metadata"]["step"] for c in claims] == ["c"], "c was claimed, and ran, once"
    finished = [e["metadata"]["step"] for e in await trail_of(backends, run.id, "step_finished")]
    assert sorted(finished) == ["a", "b", "c", "d"], "each success written once"
    assert [s.attempt for s in done.progress.steps] == [1, 2, 1, 1]


async def test_a_cancel_stops_the_lent_step_on_its_worker(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register("flow", steps=diamond())
    service, run = await create(backends, {"b": {"sleep": 60}, "c": {"sleep": 60}})
    async with fleet(settings, tmp_path) as procs:
        procs.append(worker(settings, tmp_path, "one"))
        await branches_running(backends, run)
        procs.append(worker(settings, tmp_path, "two"))
        await branches_running(backends, run, lent_to="two")
        await service.cancel(run.id, "user:t", "enough")
        [done] = await settled(backends.store, [run.id], within=30)
    assert done.status == RunStatus.CANCELLED
    assert steps(done) == {"a": "succeeded", "b": "cancelled", "c": "cancelled", "d": "skipped"}
    # The holder acknowledged it once c's borrower had stopped, not the reaper at the grace.
    moves = await trail_of(backends, run.id, "status_changed")
    [moved] = [e for e in moves if e["to"] == "cancelled"]
    assert moved["metadata"]["transition"] == "acknowledge_cancel"
    assert moved["actor"] == "worker:one"
    c = done.progress.steps[2]
    assert c.started_at and c.completed_at and (c.completed_at - c.started_at).total_seconds() < 30


async def test_a_branch_failing_for_good_stops_the_lent_one_and_fails_the_run(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register("flow", steps=diamond())
    payload = {"b": {"sleep": 4, "fail": True}, "c": {"sleep": 60}}
    _, run = await create(backends, payload)
    async with fleet(settings, tmp_path) as procs:
        procs.append(worker(settings, tmp_path, "one"))
        await branches_running(backends, run)
        procs.append(worker(settings, tmp_path, "two"))
        [done] = await settled(backends.store, [run.id], within=30)
    assert done.status == RunStatus.FAILED
    assert done.error is not None and done.error.step == "b" and done.error.code == "fatal"
    assert steps(done) == {"a": "succeeded", "b": "failed", "c": "cancelled", "d": "pending"}
    claims = await trail_of(backends, run.id, "step_claimed")
    assert [c["actor"] for c in claims] == ["worker:two"], "c ran on two until asked to stop"


async def test_a_cancel_takes_back_a_lent_step_nobody_claimed(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register("flow", steps=diamond())
    service, run = await create(backends, {"b": {"sleep": 60}, "c": {"sleep": 60}})
    async with fleet(settings, tmp_path) as procs:
        procs.append(worker(settings, tmp_path, "one"))  # nobody offers c's handler
        await branches_running(backends, run)
        await service.cancel(run.id, "user:t", "enough")
        [done] = await settled(backends.store, [run.id], within=settings.lease_seconds)
    assert done.status == RunStatus.CANCELLED
    assert steps(done) == {"a": "succeeded", "b": "cancelled", "c": "skipped", "d": "skipped"}
    [taken] = await trail_of(backends, run.id, "step_taken_back")
    assert taken["message"] == "its run stops"


async def test_a_lent_step_nobody_claims_is_taken_back_and_the_run_handed_on(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    """With b done and c lent but unclaimed for a lease's length, the holder takes c back
    and hands the run on to c's lane, where it waits without a slot until "two" comes."""
    await register("flow", steps=diamond())
    _, run = await create(backends, {"b": {"sleep": 0.5}, "c": {"sleep": 0.5}})

    async def handed_on() -> bool:
        now = await backends.store.runs.get(run.id)
        return now is not None and now.status == RunStatus.QUEUED and now.handler == f"{TWO}:c"

    async with fleet(settings, tmp_path) as procs:
        procs.append(worker(settings, tmp_path, "one"))
        await until(handed_on, within=settings.lease_seconds + 15)
        procs.append(worker(settings, tmp_path, "two"))
        [done] = await settled(backends.store, [run.id], within=30)
    assert done.status == RunStatus.SUCCEEDED
    assert done.outputs["c"] == {"ranBy": "two"}
    [taken] = await trail_of(backends, run.id, "step_taken_back")
    assert taken["message"] == f"no worker offering '{TWO}:c' claimed it"
    assert await trail_of(backends, run.id, "step_claimed") == [], "two ran it as the holder"
    assert [s.attempt for s in done.progress.steps] == [1, 1, 1, 1], "taken back, not tried"


async def test_a_lent_step_longer_than_its_lease_keeps_it_by_its_borrowers_heartbeat(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register("flow", steps=diamond())
    c_sleeps = 2 * settings.lease_seconds
    _, run = await create(backends, {"b": {"sleep": 1}, "c": {"sleep": c_sleeps}})
    async with fleet(settings, tmp_path) as procs:
        procs.append(worker(settings, tmp_path, "one"))
        await branches_running(backends, run)
        procs.append(worker(settings, tmp_path, "two"))
        [done] = await settled(backends.store, [run.id], within=c_sleeps + 30)
    assert done.status == RunStatus.SUCCEEDED and done.attempts == []
    assert done.outputs["c"] == {"ranBy": "two"}
    assert await trail_of(backends, run.id, "step_taken_back") == []


async def test_runs_waiting_for_their_lent_steps_leave_the_slots_to_those_steps(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    """Two workers of two slots, twelve diamonds at once: every run lends a branch to the
    other worker. A run that only watches its lent step holds no slot, so neither worker fills
    up with runs waiting for steps only the other could take: no lent step waits long enough
    to be taken back."""
    await register("flow", steps=diamond())
    service = RunService(backends.store, backends.queue)
    payload = {"b": {"sleep": 0.5}, "c": {"sleep": 0.5}}
    requests = [RunRequest("flow", "user", f"u{i}", payload) for i in range(12)]

    async def both_waiting() -> bool:
        return len(await backends.queue.live_workers()) == 2

    async with fleet(settings, tmp_path) as procs:
        for name in ("one", "two"):
            procs.append(worker(settings, tmp_path, name, JOBPLANE_WORKER_CONCURRENCY="2"))
        # Both wait for work, so each claims runs before any is lent: both fill up at once.
        await until(both_waiting)
        await asyncio.sleep(0.5)
        made = await service.create_many(requests, "user:t")
        ids = [m[0].id for m in made if isinstance(m, tuple)]
        assert len(ids) == 12
        done = await settled(backends.store, ids, within=120)
    assert {r.status for r in done} == {RunStatus.SUCCEEDED}
    for run in done:
        assert await trail_of(backends, run.id, "step_taken_back") == [], run.id
    lent = [r for r in done if await trail_of(backends, r.id, "step_claimed")]
    assert len(lent) == 12, "every run lent a branch"
