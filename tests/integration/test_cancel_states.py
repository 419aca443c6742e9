"""Cancel between two steps, and cancels racing a run's completion."""

import asyncio
import contextlib
import random
from itertools import pairwise

from jobplane.backends import Backends
from jobplane.errors import ResourceInvalidState
from jobplane.model import ALLOWED, TERMINAL, RunStatus, StepStatus
from jobplane.runs import RunRequest, RunService
from jobplane.settings import Settings
from jobplane.worker import StepContext, registry
from tests.integration.conftest import Register
from tests.integration.workers import running, settled


@registry.register("test.until_cancel_asked")
async def until_cancel_asked(ctx: StepContext) -> str:
    """Ends normally (no checkpoint) once the run's cancel is asked: the cancel then lands
    between this step and the next."""
    async with asyncio.timeout(20):
        while not ctx.cancelled:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    return "finished"


async def test_a_cancel_between_steps_keeps_the_finished_step_and_skips_the_rest(
    backends: Backends, settings: Settings, register: Register
) -> None:
    steps = [
        {"id": "first", "handler": "test.until_cancel_asked"},
        {"id": "second", "handler": "builtin.noop"},
    ]
    await register(steps=steps)
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("t_noop", "user", "u", {}), "user:a")
    async with running(backends, settings):
        async with asyncio.timeout(20):
            while (await service.get(run.id)).status != RunStatus.RUNNING:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        await service.cancel(run.id, "user:a", "enough")
        [done] = await settled(backends.store, [run.id], within=20)
    assert done.status == RunStatus.CANCELLED
    assert [s.status for s in done.progress.steps] == [StepStatus.SUCCEEDED, StepStatus.SKIPPED]
    assert done.outputs == {"first": "finished"}


async def test_cancels_racing_completion_end_in_one_terminal_state(
    backends: Backends, settings: Settings, register: Register
) -> None:
    await register(steps=[{"id": "nap", "handler": "builtin.sleep"}])
    service = RunService(backends.store, backends.queue)
    ids = []
    async with running(backends, settings, workers=2):
        for _ in range(30):
            request = RunRequest("t_noop", "user", "u", {"sleepSeconds": 0.05})
            run, _ = await service.create(request, "user:a")
            ids.append(run.id)
            async with asyncio.timeout(20):
                while (await service.get(run.id)).status not in {RunStatus.RUNNING, *TERMINAL}:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
            await asyncio.sleep(random.uniform(0.03, 0.08))  # around the step's end
            with contextlib.suppress(ResourceInvalidState):  # finished first: a 409
                await service.cancel(run.id, "user:a", "race")
        runs = await settled(backends.store, ids, within=30)
    outcomes = {r.status for r in runs}
    assert outcomes <= {RunStatus.SUCCEEDED, RunStatus.CANCELLED}
    for run in runs:
        trail = [
            e for e in await backends.store.trail.events_of(run.id) if e.type == "status_changed"
        ]
        moves = [(e.from_, e.to) for e in trail]
        assert all(prev[1] == nxt[0] for prev, nxt in pairwise(moves)), moves
        assert all(to in ALLOWED[from_] for from_, to in moves if from_), moves
        assert sum(to in TERMINAL for _, to in moves) == 1, moves
        assert moves[-1][1] == run.status
        if run.status == RunStatus.SUCCEEDED:  # a cancel request is never followed by success
            assert RunStatus.CANCEL_REQUESTED not in [to for _, to in moves], moves
