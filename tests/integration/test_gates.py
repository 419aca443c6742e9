"""Admissions under `maxRunning` (`store/gates.py`): a template's gate lists every run started
under its cap, a claim takes a run only before its admission's fence, and what a process that
died left admitted is swept, never what a started run holds."""

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import pytest
from bson import ObjectId

from jobplane.backends import Backends
from jobplane.clock import ManualClock
from jobplane.model import Run, RunError, RunStatus, StartLimits, Template
from jobplane.settings import Settings
from jobplane.store import MongoStore, Moved, NewRun
from jobplane.store import gates as gates_module
from jobplane.store.gates import MongoGateStore, Place
from tests.integration.conftest import Register
from tests.integration.db import raw
from tests.integration.runs import reap

ERROR = RunError(code="boom", message="boom", step="only")


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(datetime(2026, 3, 7, tzinfo=UTC))


def limited(run: Run) -> tuple[str, StartLimits]:
    assert run.start_limits is not None
    return run.id, run.start_limits


def gate(store: MongoStore) -> MongoGateStore:
    assert isinstance(store.gates, MongoGateStore)
    return store.gates


async def new_runs(store: MongoStore, template: Template, n: int) -> list[Run]:
    return [await store.runs.insert(NewRun(template, "user", f"u{i}"), "user:a") for i in range(n)]


async def status(store: MongoStore, run_id: str) -> RunStatus:
    run = await store.runs.get(run_id)
    assert run is not None
    return run.status


async def test_every_way_out_of_the_started_statuses_gives_the_place_back(
    timed: MongoStore, clock: ManualClock, register: Register
) -> None:
    """Each write that moves a run out of `running`, `waiting_worker` or `cancel_requested`
    frees its place; one between started statuses keeps it."""
    template = await register("capped", maxRunning=10, retryPolicy={"maxAttempts": 3})
    runs = await new_runs(timed, template, 7)
    claimed, held = await timed.transitions.claim_limited(
        list(map(limited, runs)), "w1", 30, clock.now()
    )
    assert held == [] and len(claimed) == 7
    assert await timed.gates.admitted("capped") == 7
    leases = {run.id: lease for run, lease in claimed}
    by_id = {run.id: run for run, _ in claimed}
    ids = [r.id for r in runs]

    ends: list[Callable[[], Awaitable[object]]] = [
        lambda: timed.transitions.complete(leases[ids[0]], 0, "only", 1, 1),
        lambda: timed.transitions.fail(leases[ids[1]], 0, ERROR),
        lambda: timed.transitions.retry(leases[ids[2]], 0, ERROR, clock.now()),
        lambda: timed.transitions.release(leases[ids[3]]),
    ]
    for i, end in enumerate(ends):
        assert isinstance(await end(), Moved)
        assert await timed.gates.admitted("capped") == 6 - i

    # Out to an external worker and back: started all along, so the place stays.
    lease = leases[ids[4]]
    assert isinstance(await timed.transitions.wait_worker(lease, 0, "only", "ext"), Moved)
    resumed = await timed.transitions.resume("ext", "x1", 30)
    assert resumed is not None
    assert await timed.gates.admitted("capped") == 3
    assert isinstance(await timed.transitions.complete(resumed[1], 0, "only", 1, 1), Moved)
    assert await timed.gates.admitted("capped") == 2

    # A cancel asked keeps it; the acknowledgement frees it.
    assert isinstance(await timed.transitions.request_cancel(ids[5], "user:a", "stop"), Moved)
    assert await timed.gates.admitted("capped") == 2
    assert isinstance(await timed.transitions.acknowledge_cancel(leases[ids[5]], False), Moved)
    assert await timed.gates.admitted("capped") == 1

    # The reaper's writes free it too: the run's lease ran out.
    clock.advance(31)
    expired = await timed.runs.get(ids[6])
    assert expired is not None and by_id[ids[6]].id == expired.id
    assert isinstance(await reap(timed, expired), Moved)
    assert await timed.gates.admitted("capped") == 0


async def test_a_claim_past_its_admissions_fence_takes_nothing_and_gives_the_place_back(
    store: MongoStore, register: Register, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim the server sees after its admission's fence (a worker that stalled between the
    two) starts nothing: the run stays queued for the next pop, and the place is free."""
    template = await register("capped", maxRunning=1)
    [run] = await new_runs(store, template, 1)
    monkeypatch.setattr(gates_module, "ADMISSION_SECONDS", -1.0)
    claimed, held = await store.transitions.claim_limited(
        [limited(run)], "w1", 30, store.clock.now()
    )
    assert (claimed, held) == ([], [])
    assert await status(store, run.id) == RunStatus.QUEUED
    assert await store.gates.admitted("capped") == 0


async def test_a_run_popped_twice_starts_once_and_the_other_place_goes_back(
    store: MongoStore, register: Register
) -> None:
    """A run popped twice (the reconciler pushed it again) is given two places by two
    concurrent claims; one claim takes it, and the other's place goes back at once."""
    template = await register("capped", maxRunning=5)
    [run] = await new_runs(store, template, 1)
    outcomes = await asyncio.gather(
        *(
            store.transitions.claim_limited([limited(run)], f"w{i}", 30, store.clock.now())
            for i in range(2)
        )
    )
    assert sorted(len(claimed) for claimed, _ in outcomes) == [0, 1]
    assert [held for _, held in outcomes] == [[], []]
    assert await store.gates.admitted("capped") == 1


async def test_the_sweep_takes_back_dead_admissions_and_keeps_started_runs_places(
    store: MongoStore, register: Register, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A place admitted by a process that died before its claim, and one a run's end never
    gave back, are taken back once no claim can use them; a started run's place is kept."""
    template = await register("capped", maxRunning=3)
    started, dead_claim, dead_end = await new_runs(store, template, 3)
    [(_, lease)], _ = await store.transitions.claim_limited(
        [limited(started)], "w1", 30, store.clock.now()
    )
    placed, _ = await gate(store).admit("capped", [(ObjectId(dead_claim.id), 3)])
    assert len(placed) == 1, "died before its claim"
    [(_, ended)], _ = await store.transitions.claim_limited(
        [limited(dead_end)], "w2", 30, store.clock.now()
    )
    # Its end written, its place not given back: the process died between the two writes.
    gates = raw(store).gates
    doc = await gates.find_one({"_id": "capped"})
    run_doc = await raw(store).runs.find_one({"_id": ObjectId(dead_end.id)})
    assert doc is not None and run_doc is not None
    [entry] = [e for e in doc["admitted"] if e["token"] == run_doc["admissionToken"]]
    assert isinstance(await store.transitions.complete(ended, 0, "only", 1, 1), Moved)
    await gates.update_one({"_id": "capped"}, {"$push": {"admitted": entry}})
    assert await store.gates.admitted("capped") == 3

    assert await store.gates.sweep("capped") == 0, "too young: a claim may still use them"
    monkeypatch.setattr(gates_module, "SWEEP_AFTER_SECONDS", 0.0)
    await asyncio.sleep(0.01)
    assert await store.gates.sweep("capped") == 2
    assert await store.gates.admitted("capped") == 1
    assert await status(store, started.id) == RunStatus.RUNNING
    assert isinstance(await store.transitions.complete(lease, 0, "only", 1, 1), Moved)
    assert await store.gates.admitted("capped") == 0


async def test_a_stalled_claimer_whose_place_was_swept_starts_nothing(
    store: MongoStore, register: Register, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A zombie claimer: admitted, then stalled past its fence while the sweep took its place
    back and another worker took the template's only place. When it wakes, its claim starts
    nothing, so the cap of one holds."""
    template = await register("capped", maxRunning=1)
    late, other = await new_runs(store, template, 2)
    monkeypatch.setattr(gates_module, "ADMISSION_SECONDS", 0.2)
    monkeypatch.setattr(gates_module, "SWEEP_AFTER_SECONDS", 0.3)
    gates = gate(store)
    admit = gates.admit
    admitted = asyncio.Event()
    woken = asyncio.Event()

    async def stalls(*args: object) -> tuple[list[tuple[ObjectId, Place]], list[ObjectId]]:
        answer = await admit(*args)  # type: ignore[arg-type]
        admitted.set()
        await woken.wait()
        return answer

    monkeypatch.setattr(gates, "admit", stalls)
    zombie = asyncio.create_task(
        store.transitions.claim_limited([limited(late)], "zombie", 30, store.clock.now())
    )
    await admitted.wait()
    monkeypatch.setattr(gates, "admit", admit)
    await asyncio.sleep(0.4)
    assert await store.gates.sweep("capped") == 1
    [(_, lease)], _ = await store.transitions.claim_limited(
        [limited(other)], "w1", 30, store.clock.now()
    )
    woken.set()
    assert await zombie == ([], [])
    assert await status(store, late.id) == RunStatus.QUEUED
    assert await status(store, other.id) == RunStatus.RUNNING
    assert await store.gates.admitted("capped") == 1
    assert lease.run_id == other.id


async def test_concurrent_claims_of_many_workers_admit_no_more_than_the_cap(
    store: MongoStore, register: Register
) -> None:
    """Forty claimers at once over the same hundred runs (every run popped by two of them):
    the gate admits five, each run at most once, and five start."""
    template = await register("capped", maxRunning=5)
    runs = await new_runs(store, template, 100)
    batches = [runs[i::20] for i in range(20)] * 2
    outcomes = await asyncio.gather(
        *(
            store.transitions.claim_limited(list(map(limited, b)), f"w{i}", 30, store.clock.now())
            for i, b in enumerate(batches)
        )
    )
    claimed = [run.id for leased, _ in outcomes for run, _ in leased]
    assert len(claimed) == len(set(claimed)) == 5
    assert await store.gates.admitted("capped") == 5
    statuses = [await status(store, r.id) for r in runs]
    assert statuses.count(RunStatus.RUNNING) == 5


class Monotonic:
    """A monotonic clock for the gate's spares that moves only when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def spare_clock(monkeypatch: pytest.MonkeyPatch) -> Monotonic:
    clock = Monotonic()
    monkeypatch.setattr(gates_module, "time", clock)
    return clock


async def test_a_claim_under_a_large_cap_takes_spares_which_later_claims_start_runs_in(
    store: MongoStore, register: Register, spare_clock: Monotonic
) -> None:
    """Under a cap of `SPARE_MIN_CAP` or more, a grant adds `SPARES` places this process
    keeps; the next claims start their runs in them without a grant of their own, a run that
    ends leaves its place to the process's spares, and the spares go back as it stops."""
    template = await register("capped", maxRunning=100)
    first, *rest = await new_runs(store, template, 3)
    gates = gate(store)
    grants = 0
    grant = gates._grant

    async def counted(*args: object) -> list[Place]:
        nonlocal grants
        grants += 1
        return await grant(*args)  # type: ignore[arg-type]

    gates._grant = counted  # type: ignore[method-assign]
    [_], _ = await store.transitions.claim_limited([limited(first)], "w1", 30, store.clock.now())
    assert grants == 1
    assert await store.gates.admitted("capped") == 1 + gates_module.SPARES
    later, held = await store.transitions.claim_limited(
        list(map(limited, rest)), "w1", 30, store.clock.now()
    )
    assert len(later) == 2 and held == []
    assert grants == 1, "the spares' places, not a grant of their own"
    assert await store.gates.admitted("capped") == 1 + gates_module.SPARES
    assert await store.gates.give_back_spares() == {}, "all fresh: kept"
    left = gates_module.SPARES - 2
    assert await store.gates.give_back_spares(everything=True) == {"capped": left}
    assert await store.gates.admitted("capped") == 3
    for _, lease in later:
        assert isinstance(await store.transitions.complete(lease, 0, "only", 1, 1), Moved)
    assert await store.gates.admitted("capped") == 3, "kept as spares by the process"
    assert await store.gates.give_back_spares(everything=True) == {"capped": 2}
    assert await store.gates.admitted("capped") == 1


async def test_spares_are_granted_only_under_a_large_cap_and_a_gate_at_most_half_full(
    store: MongoStore, register: Register, spare_clock: Monotonic
) -> None:
    """A small cap is there to be reached: no place of it idles as a spare. Nor does a large
    cap's gate past half full grant spares."""
    small = await register("small", maxRunning=gates_module.SPARE_MIN_CAP - 1)
    [run] = await new_runs(store, small, 1)
    [_], _ = await store.transitions.claim_limited([limited(run)], "w1", 30, store.clock.now())
    assert await store.gates.admitted("small") == 1

    cap = gates_module.SPARE_MIN_CAP
    large = await register("large", maxRunning=cap)
    runs = await new_runs(store, large, cap // 2 + 1)
    claimed, _ = await store.transitions.claim_limited(
        list(map(limited, runs)), "w1", 30, store.clock.now()
    )
    assert len(claimed) == cap // 2 + 1
    assert await store.gates.admitted("large") == cap // 2 + 1
    assert await store.gates.give_back_spares(everything=True) == {}


async def test_spares_too_old_to_use_are_given_back_and_not_used(
    store: MongoStore, register: Register, spare_clock: Monotonic
) -> None:
    """A spare near its fence is not used: the claim asks a grant, and the heartbeat's
    give-back takes the old spares back."""
    template = await register("capped", maxRunning=1000)
    first, second = await new_runs(store, template, 2)
    await store.transitions.claim_limited([limited(first)], "w1", 30, store.clock.now())
    spares = gates_module.SPARES
    assert await store.gates.admitted("capped") == 1 + spares
    spare_clock.now += gates_module.ADMISSION_SECONDS * gates_module.SPARE_SHARE
    [(run, _)], _ = await store.transitions.claim_limited(
        [limited(second)], "w1", 30, store.clock.now()
    )
    assert run.id == second.id
    assert await store.gates.admitted("capped") == 2 + 2 * spares
    assert await store.gates.give_back_spares() == {"capped": spares}
    assert await store.gates.admitted("capped") == 2 + spares


async def test_claims_of_two_processes_with_spares_never_pass_the_cap(
    store: MongoStore, register: Register, backends: Backends, settings: Settings
) -> None:
    """Two processes' stores (each with spares of its own) claim 200 runs of a template capped
    at 64, in 40 concurrent claims, every run popped by two of them: no more than 64 start,
    and once both give their spares back, the gate holds exactly the started runs' places."""
    cap = gates_module.SPARE_MIN_CAP
    template = await register("capped", maxRunning=cap)
    runs = await new_runs(store, template, 200)
    other = MongoStore(backends.store.client, settings.db)
    stores = [store, other]
    batches = [runs[i::20] for i in range(20)] * 2
    outcomes = await asyncio.gather(
        *(
            stores[i % 2].transitions.claim_limited(
                list(map(limited, b)), f"w{i}", 30, store.clock.now()
            )
            for i, b in enumerate(batches)
        )
    )
    claimed = [run.id for leased, _ in outcomes for run, _ in leased]
    assert len(claimed) == len(set(claimed)) <= cap
    assert await store.gates.admitted("capped") <= cap
    for s in stores:
        await s.gates.give_back_spares(everything=True)
    assert await store.gates.admitted("capped") == len(claimed)
    statuses = [await status(store, r.id) for r in runs]
    assert statuses.count(RunStatus.RUNNING) == len(claimed)
    await other.trail.flush()


async def test_no_grant_goes_past_the_cap_of_a_spare_in_the_list(
    store: MongoStore, register: Register, spare_clock: Monotonic
) -> None:
    """A version capped at 64 keeps spares; a later version raised the cap to 1000. While
    places of the low cap are in the list, the raised version's claims stop at 64 places, so
    a run of the first version started in a spare still finds fewer than its own cap started.
    Once they are all back, the raised cap applies."""
    low = await register("capped", maxRunning=64)
    [first, second] = await new_runs(store, low, 2)
    [(_, lease)], _ = await store.transitions.claim_limited(
        [limited(first)], "w1", 30, store.clock.now()
    )
    assert await store.gates.admitted("capped") == 32, "spares while under half of 64"
    high = await register("capped", maxRunning=1000)
    many = await new_runs(store, high, 40)
    other = MongoStore(store.client, store.db.name)
    claimed, held = await other.transitions.claim_limited(
        list(map(limited, many)), "w2", 30, store.clock.now()
    )
    assert await store.gates.admitted("capped") == 64
    assert len(claimed) == 64 - 32 and len(held) == 40 - len(claimed)
    [(run, later)], _ = await store.transitions.claim_limited(
        [limited(second)], "w1", 30, store.clock.now()
    )
    assert run.id == second.id
    for done in (lease, later):
        assert isinstance(await store.transitions.complete(done, 0, "only", 1, 1), Moved)
    await store.gates.give_back_spares(everything=True)
    assert await store.gates.admitted("capped") == len(claimed)
    more = [r for r in many if r.id in held] + await new_runs(store, high, 40)
    rest, _ = await other.transitions.claim_limited(
        list(map(limited, more)), "w2", 30, store.clock.now()
    )
    assert len(rest) == len(more), "no place of the low cap left: the raised cap applies"
    assert await store.gates.admitted("capped") > 64
    await other.gates.give_back_spares(everything=True)
    await other.trail.flush()
