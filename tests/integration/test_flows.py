"""Flows beyond a line (`needs`, `when`, `onFailure`, per-step retries), run by real worker
processes: steps whose needs are met run side by side, and a retry redoes only what failed."""

import signal
from pathlib import Path
from typing import Any

import httpx
from bson import ObjectId

from jobplane.backends import Backends
from jobplane.model import Run, RunStatus, StepStatus
from jobplane.runs import RunRequest, RunService
from jobplane.settings import Settings
from tests.integration.conftest import Register
from tests.integration.db import raw
from tests.integration.flow import until, workers
from tests.integration.processes import spawn
from tests.integration.workers import settled


def diamond(b: dict[str, Any] | None = None, c: dict[str, Any] | None = None) -> list[Any]:
    """a → (b, c) → d; b and c sleep `payload.sleepSeconds` unless given other fields."""
    return [
        {"id": "a", "handler": "builtin.noop"},
        {"id": "b", "handler": "builtin.sleep", "needs": ["a"], **(b or {})},
        {"id": "c", "handler": "builtin.sleep", "needs": ["a"], **(c or {})},
        {"id": "d", "handler": "builtin.echo", "needs": ["b", "c"]},
    ]


async def run_once(
    backends: Backends, settings: Settings, tmp_path: Path, payload: dict[str, Any]
) -> Run:
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("flow", "user", "u1", payload), "user:t")
    async with workers(settings, tmp_path, count=1, scheduler=False):
        [done] = await settled(backends.store, [run.id], within=60)
    return done


def steps(run: Run) -> dict[str, StepStatus]:
    return {s.id: s.status for s in run.progress.steps}


def overlap(run: Run, first: str, second: str) -> bool:
    one, two = (next(s for s in run.progress.steps if s.id == i) for i in (first, second))
    assert one.started_at and one.completed_at and two.started_at and two.completed_at
    return one.started_at < two.completed_at and two.started_at < one.completed_at


async def trail_of(backends: Backends, run_id: str, kind: str) -> list[dict[str, Any]]:
    await backends.store.trail.flush()
    doc = await raw(backends.store).runs.find_one({"_id": ObjectId(run_id)})
    assert doc is not None
    return [e for e in doc["trail"] if e["type"] == kind]


async def test_a_diamond_runs_its_branches_side_by_side_and_fans_in(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register("flow", steps=diamond())
    run = await run_once(backends, settings, tmp_path, {"sleepSeconds": 1})
    assert run.status == RunStatus.SUCCEEDED
    assert set(steps(run).values()) == {StepStatus.SUCCEEDED}
    assert overlap(run, "b", "c"), "b and c ran at the same time"
    d, b, c = (next(s for s in run.progress.steps if s.id == i) for i in "dbc")
    assert d.started_at and b.completed_at and c.completed_at
    assert d.started_at >= max(b.completed_at, c.completed_at), "d started after both"
    assert run.outputs["b"] == run.outputs["c"] == {"sleptSeconds": 1}
    assert run.result == {"sleepSeconds": 1}, "the last step's output, as for a line"
    assert [s.attempt for s in run.progress.steps] == [1, 1, 1, 1]
    assert run.progress.percentage == 100


async def test_a_false_when_skips_its_step_and_its_dependents_still_run(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register(
        "flow",
        steps=[
            {"id": "a", "handler": "builtin.noop"},
            {"id": "b", "handler": "builtin.echo", "when": "payload.big && run.attempt == 1"},
            {"id": "c", "handler": "builtin.echo", "when": "has(outputs.b) || payload.n > 1.5"},
        ],
    )
    skipped = await run_once(backends, settings, tmp_path, {"big": False, "n": 2})
    assert skipped.status == RunStatus.SUCCEEDED
    assert steps(skipped) == {"a": "succeeded", "b": "skipped", "c": "succeeded"}
    assert skipped.progress.steps[1].message == "when 'payload.big && run.attempt == 1' is false"
    [event] = await trail_of(backends, skipped.id, "step_skipped")
    assert event["metadata"] == {"step": "b"}
    ran = await run_once(backends, settings, tmp_path, {"big": True, "n": 1})
    assert steps(ran) == {"a": "succeeded", "b": "succeeded", "c": "succeeded"}


async def test_a_when_that_fails_as_it_runs_fails_the_run_with_when_error(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register(
        "flow",
        steps=[{"id": "a", "handler": "builtin.noop", "when": "payload.missing > 1"}],
        retryPolicy={"maxAttempts": 3},
    )
    run = await run_once(backends, settings, tmp_path, {})
    assert run.status == RunStatus.FAILED
    assert run.error is not None and (run.error.code, run.error.step) == ("WhenError", "a")
    assert "missing" in run.error.message
    assert run.attempt == 1, "not retried: the same payload gives the same error"


async def test_a_step_failing_for_good_cancels_the_steps_beside_it_and_fails_the_run(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register("flow", steps=diamond(c={"handler": "builtin.fail"}))
    run = await run_once(backends, settings, tmp_path, {"sleepSeconds": 5, "fatal": True})
    assert run.status == RunStatus.FAILED
    assert steps(run) == {"a": "succeeded", "b": "cancelled", "c": "failed", "d": "pending"}
    assert run.error is not None and (run.error.code, run.error.step) == ("fatal", "c")
    b = run.progress.steps[1]
    assert b.started_at and b.completed_at
    assert (b.completed_at - b.started_at).total_seconds() < 4, "b stopped on its cancel"


async def test_on_failure_continue_skips_the_dependents_and_the_run_succeeds(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register("flow", steps=diamond(c={"handler": "builtin.fail", "onFailure": "continue"}))
    run = await run_once(backends, settings, tmp_path, {"sleepSeconds": 0.5, "fatal": True})
    assert run.status == RunStatus.SUCCEEDED
    assert steps(run) == {"a": "succeeded", "b": "succeeded", "c": "failed", "d": "skipped"}
    c = run.progress.steps[2]
    assert c.error == "jobplane.worker.context.FatalError: builtin.fail: fatal by request"
    assert run.progress.steps[3].message == "needs 'c', which failed"
    assert run.error is None and run.result is None, "d, the last step, did not run"


async def test_a_retry_redoes_only_the_failed_branch(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register(
        "flow",
        steps=diamond(c={"handler": "builtin.fail"}),
        retryPolicy={"maxAttempts": 2, "backoffSeconds": [0]},
    )
    run = await run_once(backends, settings, tmp_path, {"sleepSeconds": 1, "failTimes": 1})
    assert run.status == RunStatus.SUCCEEDED
    assert set(steps(run).values()) == {StepStatus.SUCCEEDED}
    assert run.outputs["b"] == {"sleptSeconds": 1}
    assert [s.attempt for s in run.progress.steps] == [1, 1, 2, 1]
    started = [e["metadata"]["step"] for e in await trail_of(backends, run.id, "step_started")]
    assert started.count("b") == 1, "b ran once"
    assert [a.error.step for a in run.attempts] == ["c"]


async def test_a_step_with_its_own_retry_policy_is_retried_by_it(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register(
        "flow",
        steps=[
            {"id": "a", "handler": "builtin.noop"},
            {
                "id": "flaky",
                "handler": "builtin.fail",
                "retryPolicy": {"maxAttempts": 3, "backoffSeconds": [0]},
            },
        ],
    )
    run = await run_once(backends, settings, tmp_path, {"failTimes": 2})
    assert run.status == RunStatus.SUCCEEDED, "the template allows 1 attempt, the step 3"
    assert [s.attempt for s in run.progress.steps] == [1, 3]


async def test_a_worker_killed_in_a_branch_has_only_that_branch_run_again(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    """b sleeps 3 s, c 0.2 s; the worker is SIGKILLed while b runs, after c succeeded. The
    reaper queues the run again; another worker runs b, then d. c's output is kept, and each
    step's success is written once."""
    await register(
        "flow",
        steps=diamond(c={"handler": "builtin.echo"}),
        retryPolicy={"maxAttempts": 2, "backoffSeconds": [0]},
    )
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("flow", "user", "u1", {"sleepSeconds": 3}), "user:t")

    async def in_b() -> bool:
        now = await backends.store.runs.get(run.id)
        return now is not None and steps(now)["b"] == "running" and steps(now)["c"] == "succeeded"

    async with workers(settings, tmp_path, count=0):  # the scheduler, which reaps
        first = spawn(settings, "worker", tmp_path / "first.log", JOBPLANE_WORKER_ID="first")
        try:
            await until(in_b, within=30)
            first.send_signal(signal.SIGKILL)
        finally:
            first.wait()
        async with workers(settings, tmp_path, count=1, scheduler=False):
            [done] = await settled(backends.store, [run.id], within=60)
    assert done.status == RunStatus.SUCCEEDED
    assert [a.error.code for a in done.attempts] == ["lease_expired"]
    assert done.outputs["c"] == {"sleepSeconds": 3}
    finished = [e["metadata"]["step"] for e in await trail_of(backends, run.id, "step_finished")]
    assert sorted(finished) == ["a", "b", "c", "d"], "each success written once"
    assert [s.attempt for s in done.progress.steps] == [1, 2, 1, 1]


async def test_the_api_shows_each_steps_needs_and_tries(
    api: httpx.AsyncClient, register: Register
) -> None:
    await register("flow", steps=diamond())
    line = await register("line", steps=[{"id": "x", "handler": "h"}, {"id": "y", "handler": "h"}])
    assert line.graph.linear
    body = {"templateType": "flow", "scope": "user", "scopeId": "u1", "payload": {}}
    created = (await api.post("/v1/runs", json=body)).json()
    shown = (await api.get(f"/v1/runs/{created['id']}")).json()["progress"]["steps"]
    assert [(s["id"], s["needs"], s["attempt"]) for s in shown] == [
        ("a", [], 0),
        ("b", ["a"], 0),
        ("c", ["a"], 0),
        ("d", ["b", "c"], 0),
    ]
    body["templateType"] = "line"
    made = (await api.post("/v1/runs", json=body)).json()
    assert [s["needs"] for s in made["progress"]["steps"]] == [[], ["x"]]


async def test_a_cancel_stops_every_running_branch(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register("flow", steps=diamond())
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("flow", "user", "u1", {"sleepSeconds": 20}), "user:t")

    async def both_running() -> bool:
        now = await backends.store.runs.get(run.id)
        return now is not None and steps(now)["b"] == steps(now)["c"] == "running"

    async with workers(settings, tmp_path, count=1, scheduler=False):
        await until(both_running, within=30)
        await service.cancel(run.id, "user:t", "enough")
        [done] = await settled(backends.store, [run.id], within=30)
    assert done.status == RunStatus.CANCELLED
    assert steps(done) == {"a": "succeeded", "b": "cancelled", "c": "cancelled", "d": "skipped"}


async def test_steps_skipped_together_are_written_in_one_write(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register(
        "flow",
        steps=diamond(b={"when": "payload.sleepSeconds > 5"}, c={"when": "false"}),
    )
    run = await run_once(backends, settings, tmp_path, {"sleepSeconds": 1})
    assert steps(run) == {"a": "succeeded", "b": "skipped", "c": "skipped", "d": "succeeded"}
    skipped = await trail_of(backends, run.id, "step_skipped")
    assert [e["metadata"]["step"] for e in skipped] == ["b", "c"]
    assert skipped[0]["runVersion"] == skipped[1]["runVersion"], "one write"
    assert run.progress.percentage == 100
