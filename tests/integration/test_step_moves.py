"""Every step lease move against every state of a step's lease, on the real database.

`model/status.py`'s `STEP_MOVES` is walked move by move: each moves a lent step's lease from
its sources only (a claimed step is taken back only once its lease ran out), fenced by the
lease its writer holds, and never changes the run's status.
"""

from datetime import timedelta
from typing import Any

import pytest
from bson import ObjectId

from jobplane.model import (
    STEP_MOVES,
    Run,
    RunStatus,
    StepLease,
    StepLeaseState,
    StepOutcome,
    StepStatus,
)
from jobplane.store import Lease, MongoStore
from tests.integration.conftest import Register
from tests.integration.db import raw
from tests.integration.runs import run_in

L = StepLeaseState
# A step lease as a test sets it up: its state, and for a claimed one whether it ran out.
SETUPS = [
    (L.NONE, False),
    (L.LENT, False),
    (L.CLAIMED, False),
    (L.CLAIMED, True),
    (L.REPORTED, False),
]
BORROWER, STEP_TOKEN = "b1", "step-token"


def state_of(lease: StepLease | None) -> StepLeaseState:
    if lease is None:
        return L.NONE
    if lease.outcome is not None:
        return L.REPORTED
    return L.CLAIMED if lease.token is not None else L.LENT


async def lent(
    store: MongoStore, register: Register, state: StepLeaseState, expired: bool
) -> tuple[Run, Lease, Lease]:
    """A running run whose step 0's lease is in `state`; its holder's lease and the step's."""
    template = await register(
        steps=[{"id": "only", "handler": "h"}, {"id": "next", "handler": "h"}]
    )
    now = store.clock.now()
    run, holder = await run_in(store, template, RunStatus.RUNNING, lockedUntil=now + timedelta(60))
    lease: dict[str, Any] = {"handler": "h", "attempt": 1, "lentAt": now}
    if state in (L.CLAIMED, L.REPORTED):
        lease["workerId"] = BORROWER
    if state == L.CLAIMED:
        lease |= {"token": STEP_TOKEN, "until": now + timedelta(seconds=-1 if expired else 60)}
    if state == L.REPORTED:
        lease["outcome"] = {"status": "succeeded", "output": 1, "startedAt": now}
    if state != L.NONE:
        await raw(store).runs.update_one(
            {"_id": ObjectId(run.id)}, {"$set": {"progress.steps.0.lease": lease}}
        )
    return run, holder, Lease(run.id, BORROWER, STEP_TOKEN, step=0)


async def move(
    store: MongoStore, name: str, holder: Lease, step: Lease, state: StepLeaseState
) -> bool:
    """Make the move `name` as its writer would; whether it took place."""
    outcome = StepOutcome(status=StepStatus.SUCCEEDED, output=2, started_at=store.clock.now())
    match name:
        case "lend":
            return await store.lending.lend(holder, 0, "only", "h", 1) is None
        case "claim_step":
            return await store.lending.claim([(holder.run_id, 0)], "b2", 5) != []
        case "give_back":
            return await store.lending.give_back(step, "only") is None
        case "report_step":
            return await store.lending.report(step, outcome) is None
        case "take_back":
            token = STEP_TOKEN if state == L.CLAIMED else None
            return await store.lending.take_back(holder, 0, "only", token, "why") is None
        case "settle":  # any end the holder writes of the step
            ended = await store.leases.finish_step(holder, 0, "only", 2, 50, next_handler="h")
            return ended is None
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(STEP_MOVES))
async def test_each_step_move_moves_only_from_its_sources(
    store: MongoStore, register: Register, name: str
) -> None:
    m = STEP_MOVES[name]
    for state, expired in SETUPS:
        run, holder, step = await lent(store, register, state, expired)
        moved = await move(store, name, holder, step, state)
        after = await store.runs.get(run.id)
        assert after is not None and after.status == RunStatus.RUNNING, "no move ends the run"
        now = state_of(after.progress.steps[0].lease)
        allowed = state in m.sources and not (
            name == "take_back" and state == L.CLAIMED and not expired
        )
        if name == "settle":
            allowed = True  # the holder's end of a step settles whatever lease it had
            assert now == L.NONE
        if allowed:
            assert moved, (name, state, expired)
            assert now == m.target or name == "settle", (name, state, now)
        else:
            assert not moved, (name, state, expired)
            assert after.version == run.version, "a refused move writes nothing"
            assert now == state


async def test_a_step_move_is_fenced_by_its_writers_lease(
    store: MongoStore, register: Register
) -> None:
    """A holder whose run lease was given away, or a borrower whose step lease was, writes
    nothing."""
    run, holder, _ = await lent(store, register, L.CLAIMED, expired=True)
    stale_holder = Lease(run.id, holder.worker_id, "another", known=holder.known)
    assert await store.lending.take_back(stale_holder, 0, "only", STEP_TOKEN, "why") is not None
    stale_step = Lease(run.id, BORROWER, "another", step=0)
    outcome = StepOutcome(status=StepStatus.SUCCEEDED, output=2, started_at=store.clock.now())
    assert await store.lending.report(stale_step, outcome) is not None
    after = await store.runs.get(run.id)
    assert after is not None and after.version == run.version
    events = [e.type for e in await store.trail.events_of(run.id)]
    assert events.count("stale_write_rejected") == 2, "each superseded write is on the record"


async def test_a_lent_step_asked_to_stop_before_its_claim_is_not_claimed(
    store: MongoStore, register: Register
) -> None:
    run, holder, _ = await lent(store, register, L.LENT, expired=False)
    assert await store.lending.ask_stop(holder, 0) is None
    assert await store.lending.claim([(run.id, 0)], "b2", 5) == []
    after = await store.runs.get(run.id)
    assert after is not None and state_of(after.progress.steps[0].lease) == L.LENT
