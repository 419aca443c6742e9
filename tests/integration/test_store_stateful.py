"""The store's transitions driven in random orders and interleavings against the real MongoDB.

A hypothesis state machine creates runs and plays several workers, external workers, users,
the reaper and the retention pass against one `MongoStore` on a manual clock. Each step is one
store call, or two on the same run at once (`race`). The machine keeps a model of every run
(what the store must have written) and of each worker's view of its lease: the outcome of each
call must be the one the model predicts, and for a race the one of either serial order, since
MongoDB serializes the writes. After every step each run is read back and checked against
docs/contract.md's table (see `StoreMachine.read_back`).
"""

import asyncio
import copy
import os
import typing
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypeVar

from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from pymongo import AsyncMongoClient

from jobplane.clock import ManualClock
from jobplane.model import (
    ALLOWED,
    CLAIMABLE,
    LEASED,
    TERMINAL,
    TRANSITIONS,
    Run,
    RunError,
    RunStatus,
    StepStatus,
    Template,
)
from jobplane.store import DuplicateRun, KeyHeld, Lease, Lost, MongoStore, Moved, NewRun
from tests.integration.conftest import template_spec
from tests.integration.db import raw
from tests.integration.runs import reap

Doc = dict[str, Any]
R = TypeVar("R")
S = RunStatus

T0 = datetime(2026, 3, 1, tzinfo=UTC)
LEASE = 10.0
# Retention in the archive pass: runs last written longer ago than this move.
RETAIN = 10.0
WORKERS = ("w0", "w1")
EXTERNAL_WORKERS = ("x0", "x1")
EXTERNAL = "ext"
KEYS = ("k1", "k2")
ACTOR = "user:u1"
# Clock moves that cross a lease (LEASE), a cancel grace (15 s) and a run's deadline (40 s).
ADVANCES = (1.0, 6.0, 11.0, 16.0, 41.0)
Move = Literal["start", "progress", "finish"]
MOVES: tuple[Move, ...] = typing.get_args(Move)
# What a worker does with its lease.
Action = Literal[
    "finish", "start", "progress", "retry", "fail", "acknowledge", "release", "hand_over", "overdue"
]
ACTIONS: tuple[Action, ...] = typing.get_args(Action)
# Weighted by repetition: a worker mostly finishes steps, and ends its lease now and then.
WEIGHTS: dict[Action, int] = {"finish": 6, "start": 2, "acknowledge": 2}
ACTION = st.sampled_from([a for a in ACTIONS for _ in range(WEIGHTS.get(a, 1))])
# Who acts in a step, weighted by repetition: workers write most, as they do.
PARTIES = (
    *["write"] * 4,
    *["claim"] * 2,
    *["race"] * 2,
    "zombie",
    "create",
    "enqueue",
    "cancel",
    "heartbeat",
    *["advance"] * 2,
    *["maintain"] * 2,
)
# Runs not yet ended, at most: the other calls keep meeting the same few runs.
MAX_ACTIVE = 6
# Which run or lease a rule acts on, by index among those made so far.
RUN = st.integers(0, 15)
LEASE_AT = st.integers(0, 31)
PICK = st.integers(0, 63)
# How long the second call of a race waits: a few milliseconds may land it between the first
# call's read and its write; "between" races a reaper pass and puts the call right there.
LAGS: tuple[float | str, ...] = (0.0, 0.001, 0.003, "between")

SETTINGS = settings(
    # 10-15 s on a quiet 2-core machine, 30 s on a busy one. JOBPLANE_STATEFUL_EXAMPLES=1000
    # searches deeper (the reaper's races need that many to turn up by chance).
    max_examples=int(os.environ.get("JOBPLANE_STATEFUL_EXAMPLES", "50")),
    stateful_step_count=50,
    # The same examples on every run, and nothing kept between runs: CI sees what a laptop sees.
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=False,
)


@dataclass(frozen=True)
class Kind:
    """A template the machine creates runs of."""

    type: str
    steps: int
    max_attempts: int
    timeout: float | None = None
    grace: float = 15
    repeatable: bool = True
    external: int | None = None  # the step an external worker does

    def step_id(self, index: int) -> str:
        return f"s{index}"


KINDS = (
    Kind("single", steps=1, max_attempts=1),
    Kind("three", steps=3, max_attempts=3, timeout=40, external=1),
    Kind("once", steps=2, max_attempts=2, grace=0, repeatable=False),
)


# -- the model ---------------------------------------------------------------------------------


@dataclass
class RunModel:
    """What the store must hold for one run."""

    id: str
    kind: Kind
    update_at: datetime
    status: RunStatus = S.PENDING
    version: int = 1
    attempt: int = 0
    locked_by: str | None = None
    token: str | None = None
    locked_until: datetime | None = None
    deadline: datetime | None = None
    cancel_deadline: datetime | None = None
    not_before: datetime | None = None
    dedupe_key: str | None = None
    dedupe_wait: str | None = None
    idempotency_key: str | None = None
    external: bool = False
    archived: bool = False
    steps: list[StepStatus] = field(default_factory=list)
    attempt_started_at: datetime | None = None
    # The attempts that ended in an error: (attempt, its start, its end).
    attempts: list[tuple[int, datetime | None, datetime]] = field(default_factory=list)
    error: int | None = None  # the attempt whose error the run ended with

    def expected(self) -> Doc:
        """The fields `observed` reads from the stored run."""
        return {
            "status": self.status,
            "version": self.version,
            "attempt": self.attempt,
            "lockedBy": self.locked_by,
            "leaseToken": self.token,
            "lockedUntil": self.locked_until,
            "deadline": self.deadline,
            "cancelDeadline": self.cancel_deadline,
            "notBefore": self.not_before,
            "dedupeKey": self.dedupe_key,
            "dedupeWait": self.dedupe_wait,
            "idempotencyKey": self.idempotency_key,
            "external": self.external,
            "updateAt": self.update_at,
            "steps": self.steps,
            "archived": self.archived,
            "attemptStartedAt": self.attempt_started_at,
            "attempts": self.attempts,
            "error": self.error,
        }

    def held_by(self, lease: Lease) -> bool:
        return (self.locked_by, self.token) == (lease.worker_id, lease.token)

    def first_undone(self) -> int:
        return next(
            (i for i, s in enumerate(self.steps) if s != StepStatus.SUCCEEDED), len(self.steps)
        )


def observed(doc: Doc, archived: bool) -> Doc:
    return {
        "status": RunStatus(doc["status"]),
        "version": doc["version"],
        "attempt": doc["attempt"],
        "lockedBy": doc.get("lockedBy"),
        "leaseToken": doc.get("leaseToken"),
        "lockedUntil": doc.get("lockedUntil"),
        "deadline": doc.get("deadline"),
        "cancelDeadline": doc.get("cancelDeadline"),
        "notBefore": doc.get("notBefore"),
        "dedupeKey": doc.get("dedupeKey"),
        "dedupeWait": doc.get("dedupeWait"),
        "idempotencyKey": doc.get("idempotencyKey"),
        "external": "externalType" in doc,
        "updateAt": doc["updateAt"],
        "steps": [StepStatus(s["status"]) for s in doc["progress"]["steps"]],
        "archived": archived,
        "attemptStartedAt": doc.get("attemptStartedAt"),
        "attempts": [(a["attempt"], a["startedAt"], a["endedAt"]) for a in doc.get("attempts", [])],
        "error": doc["error"]["attempt"] if doc.get("error") else None,
    }


@dataclass
class Holder:
    """A simulated worker's view of a lease it was granted, as a real worker keeps it."""

    worker: str
    attempt: int  # the run's attempt as the claim returned it
    step: int  # the step it is on (the number of steps once it completed the run)
    started: bool = False  # whether it wrote that step's start


@dataclass
class World:
    now: datetime
    runs: dict[str, RunModel] = field(default_factory=dict)
    # Every lease ever granted, by (run id, token): one claim batch shares a token.
    holders: dict[tuple[str, str], Holder] = field(default_factory=dict)

    def live(self) -> list[RunModel]:
        """Runs in `job_runs` (not archived), oldest first."""
        return sorted((r for r in self.runs.values() if not r.archived), key=lambda r: r.id)


def expect(world: World, run_id: str, name: str, lease: Lease | None, ok: bool = True) -> Any:
    """The outcome of transition `name` on the run as the model has it (`ok`: its extra
    guards hold), as `_transition` and `_lost` report it."""
    r = world.runs[run_id]
    if r.archived:
        return Lost(run_id, "missing")
    t = TRANSITIONS[name]
    held = lease is not None and r.held_by(lease)
    if r.status in t.sources and ok and (held or not t.fenced):
        return Moved(run_id, r.status, t.target)
    if lease is not None and not held:
        return Lost(run_id, "lease", r.status)
    return Lost(run_id, "status", r.status)


def expect_fenced(world: World, lease: Lease) -> Lost | None:
    """The outcome of a worker write that changes no status (step start, progress, step end)."""
    r = world.runs[lease.run_id]
    if r.archived:
        return Lost(r.id, "missing")
    if not r.held_by(lease):
        return Lost(r.id, "lease", r.status)
    return None if r.status in LEASED else Lost(r.id, "status", r.status)


def wrote(world: World, r: RunModel, status: RunStatus | None = None) -> None:
    """Every write bumps the version and `updateAt`."""
    r.version += 1
    r.update_at = world.now
    if status is not None:
        r.status = status


def restep(r: RunModel, changes: dict[StepStatus, StepStatus]) -> None:
    """What an update's array filters do to the steps."""
    r.steps = [changes.get(s, s) for s in r.steps]


def let_go(r: RunModel, keep_key: bool = True) -> None:
    """The lease ends with the write that moved `r`; an ended run keeps its last worker."""
    r.token = r.locked_until = None
    if r.status not in TERMINAL:
        r.locked_by = None
    if not keep_key:
        r.dedupe_key = None


def attempt_failed(world: World, r: RunModel) -> None:
    """The attempt in progress ended in an error: it joins `attempts`; the error is the run's
    own if the run ended with it, and otherwise the next claim starts a new attempt."""
    r.attempts.append((r.attempt, r.attempt_started_at, world.now))
    if r.status in TERMINAL:
        r.error = r.attempt
    else:
        r.attempt_started_at = None


UNDONE_SKIPPED = {StepStatus.PENDING: StepStatus.SKIPPED, StepStatus.FAILED: StepStatus.SKIPPED}


def agree(got: object, want: object, what: str) -> None:
    assert got == want, f"{what}: the store said {got!r}, the model {want!r}"


# -- operations: one store call each, with what the model says it returns and changes ----------


class Op:
    """One store call. `check` asserts that `got` is what the model predicts and moves the
    model (it must be given a copy to try an order of a race)."""

    async def perform(self, store: MongoStore) -> Any:
        raise NotImplementedError

    def check(self, world: World, got: Any) -> None:
        raise NotImplementedError


@dataclass
class Create(Op):
    template: Template = field(repr=False)
    kind: Kind
    key: str | None
    wait: bool  # wait for the key (`queue_same_scope`) instead of holding it
    idempotency_key: str | None
    delay: float | None
    now: datetime

    def new_run(self) -> NewRun:
        return NewRun(
            self.template,
            "user",
            "u1",
            not_before=None if self.delay is None else self.now + timedelta(seconds=self.delay),
            dedupe_key=None if self.wait else self.key,
            dedupe_wait=self.key if self.wait else None,
            idempotency_key=self.idempotency_key,
        )

    async def perform(self, store: MongoStore) -> Run | KeyHeld | DuplicateRun:
        try:
            return await store.runs.insert(self.new_run(), ACTOR)
        except (KeyHeld, DuplicateRun) as refused:
            return refused

    def check(self, world: World, got: Any) -> None:
        live = world.live()
        same = [
            r for r in live if self.idempotency_key and r.idempotency_key == self.idempotency_key
        ]
        holders = [r for r in live if self.key and not self.wait and r.dedupe_key == self.key]
        if same:  # a repeated idempotency key wins over a dedupe collision
            assert isinstance(got, DuplicateRun) and got.run.id == same[0].id, got
        elif holders:
            assert isinstance(got, KeyHeld), got
            assert got.holder is not None and got.holder.id == holders[0].id, got
        else:
            assert isinstance(got, Run), got
            new = self.new_run()
            world.runs[got.id] = RunModel(
                got.id,
                self.kind,
                world.now,
                status=S.PENDING if new.dedupe_wait else S.QUEUED,
                not_before=new.not_before,
                dedupe_key=new.dedupe_key,
                dedupe_wait=new.dedupe_wait,
                idempotency_key=new.idempotency_key,
                steps=[StepStatus.PENDING] * self.kind.steps,
            )


@dataclass
class Enqueue(Op):
    run_id: str

    async def perform(self, store: MongoStore) -> Moved | Lost:
        return await store.transitions.enqueue(self.run_id, ACTOR)

    def check(self, world: World, got: Any) -> None:
        waits = world.runs[self.run_id].dedupe_wait is not None
        want = expect(world, self.run_id, "enqueue", None, ok=not waits)
        agree(got, want, "enqueue")
        if isinstance(want, Moved):
            wrote(world, world.runs[self.run_id], want.to)


@dataclass
class Claim(Op):
    worker: str
    run_ids: list[str]

    async def perform(self, store: MongoStore) -> list[tuple[Run, Lease]]:
        return await store.transitions.claim(self.run_ids, self.worker, LEASE)

    def check(self, world: World, got: Any) -> None:
        def claimable(r: RunModel) -> bool:
            due = r.not_before is None or r.not_before <= world.now
            return not r.archived and r.status in CLAIMABLE and r.dedupe_wait is None and due

        want = sorted(i for i in self.run_ids if claimable(world.runs[i]))
        agree(sorted(run.id for run, _ in got), want, f"claim by {self.worker}")
        for run, lease in got:
            r = world.runs[run.id]
            assert lease.worker_id == self.worker and run.lease_token == lease.token
            wrote(world, r, S.RUNNING)
            r.attempt += 1
            if r.attempt_started_at is None:  # else it goes on with an attempt handed back
                r.attempt_started_at = world.now
            r.locked_by, r.token = self.worker, lease.token
            r.locked_until = world.now + timedelta(seconds=LEASE)
            if r.deadline is None and r.kind.timeout is not None:
                r.deadline = world.now + timedelta(seconds=r.kind.timeout)
            world.holders[run.id, lease.token] = Holder(self.worker, r.attempt, r.first_undone())


@dataclass
class ClaimExternal(Op):
    worker: str

    async def perform(self, store: MongoStore) -> tuple[Run, Lease] | None:
        return await store.transitions.resume(EXTERNAL, self.worker, LEASE)

    def check(self, world: World, got: Any) -> None:
        waiting = [r for r in world.live() if r.status == S.WAITING_WORKER and r.external]
        if not waiting:
            agree(got, None, f"external claim by {self.worker}")
            return
        assert got is not None, f"external claim by {self.worker} missed {waiting[0].id}"
        run, lease = got
        r = waiting[0]  # the oldest waiting run
        agree(run.id, r.id, f"external claim by {self.worker}")
        wrote(world, r, S.RUNNING)
        r.locked_by, r.token, r.external = self.worker, lease.token, False
        r.locked_until = world.now + timedelta(seconds=LEASE)
        step = r.first_undone()
        started = step < len(r.steps) and r.steps[step] == StepStatus.RUNNING
        world.holders[r.id, lease.token] = Holder(self.worker, r.attempt, step, started)


@dataclass
class Work(Op):
    """The worker's next write on its step: its start, progress, or its end (the run's end
    after the last step)."""

    lease: Lease
    move: Move
    kind: Kind
    step: int
    started: bool
    now: datetime

    @property
    def completes(self) -> bool:
        return self.move == "finish" and self.step == self.kind.steps - 1

    async def perform(self, store: MongoStore) -> Moved | Lost | None:
        i, step_id, n = self.step, self.kind.step_id(self.step), self.kind.steps
        began = None if self.started else self.now
        if self.completes:
            spend = not self.kind.repeatable
            return await store.transitions.complete(
                self.lease, i, step_id, i, i, began, spend_key=spend
            )
        if self.move == "finish":
            return await store.leases.finish_step(
                self.lease, i, step_id, i, 100 * (i + 1) / n, began, next_handler=None
            )
        if self.move == "start" and not self.started:
            return await store.leases.start_step(self.lease, i, step_id, self.now)
        return await store.leases.report_progress(self.lease, i, 50, 100 * (i + 0.5) / n, "half")

    def check(self, world: World, got: Any) -> None:
        r, holder = (
            world.runs[self.lease.run_id],
            world.holders[self.lease.run_id, self.lease.token],
        )
        if self.completes:
            want = expect(world, r.id, "complete", self.lease)
            agree(got, want, "complete")
            if isinstance(want, Moved):
                wrote(world, r, want.to)
                r.steps[self.step] = StepStatus.SUCCEEDED
                let_go(r, keep_key=not self.kind.repeatable)
                holder.step = self.kind.steps
            return
        fenced = expect_fenced(world, self.lease)
        agree(got, fenced, self.move)
        if fenced is not None:
            return
        wrote(world, r)
        if self.move == "finish":
            r.steps[self.step] = StepStatus.SUCCEEDED
            holder.step, holder.started = self.step + 1, False
        elif self.move == "start" and not self.started:
            r.steps[self.step] = StepStatus.RUNNING
            holder.started = True


@dataclass
class Fail(Op):
    """The worker's step raised: retried while attempts are left (and it is retryable)."""

    lease: Lease
    retryable: bool
    backoff: float
    holder: Holder
    kind: Kind
    now: datetime

    @property
    def retries(self) -> bool:
        return self.retryable and self.holder.attempt < self.kind.max_attempts

    @property
    def step(self) -> int:
        return min(self.holder.step, self.kind.steps - 1)

    async def perform(self, store: MongoStore) -> Moved | Lost:
        step_id = self.kind.step_id(self.step)
        error = RunError(code="boom", message="boom", step=step_id, attempt=self.holder.attempt)
        began = None if self.holder.started else self.now
        if self.retries:
            later = self.now + timedelta(seconds=self.backoff)
            return await store.transitions.retry(self.lease, self.step, error, later, began)
        return await store.transitions.fail(self.lease, self.step, error, began)

    def check(self, world: World, got: Any) -> None:
        r = world.runs[self.lease.run_id]
        want = expect(world, r.id, "retry" if self.retries else "fail", self.lease)
        agree(got, want, "retry" if self.retries else "fail")
        if isinstance(want, Moved):
            wrote(world, r, want.to)
            attempt_failed(world, r)
            r.steps[self.step] = StepStatus.FAILED
            if self.retries:
                let_go(r)
                r.not_before = self.now + timedelta(seconds=self.backoff)
            else:
                let_go(r, keep_key=False)


@dataclass
class Release(Op):
    """Shutdown: the worker hands the run back without spending the attempt."""

    lease: Lease

    async def perform(self, store: MongoStore) -> Moved | Lost:
        return await store.transitions.release(self.lease)

    def check(self, world: World, got: Any) -> None:
        r = world.runs[self.lease.run_id]
        want = expect(world, r.id, "release", self.lease)
        agree(got, want, "release")
        if isinstance(want, Moved):
            wrote(world, r, want.to)
            restep(r, {StepStatus.RUNNING: StepStatus.PENDING})
            let_go(r)
            r.attempt -= 1


@dataclass
class Acknowledge(Op):
    lease: Lease
    interrupted: bool

    async def perform(self, store: MongoStore) -> Moved | Lost:
        return await store.transitions.acknowledge_cancel(self.lease, self.interrupted)

    def check(self, world: World, got: Any) -> None:
        r = world.runs[self.lease.run_id]
        want = expect(world, r.id, "acknowledge_cancel", self.lease)
        agree(got, want, "acknowledge_cancel")
        if isinstance(want, Moved):
            wrote(world, r, want.to)
            stopped = StepStatus.CANCELLED if self.interrupted else StepStatus.SKIPPED
            restep(r, {StepStatus.RUNNING: stopped, **UNDONE_SKIPPED})
            let_go(r, keep_key=False)


@dataclass
class HandOver(Op):
    """The worker hands its step to an external worker (`wait_worker`)."""

    lease: Lease
    kind: Kind
    step: int

    async def perform(self, store: MongoStore) -> Moved | Lost:
        return await store.transitions.wait_worker(
            self.lease, self.step, self.kind.step_id(self.step), EXTERNAL
        )

    def check(self, world: World, got: Any) -> None:
        r = world.runs[self.lease.run_id]
        want = expect(world, r.id, "wait_worker", self.lease)
        agree(got, want, "wait_worker")
        if isinstance(want, Moved):
            wrote(world, r, want.to)
            r.steps[self.step] = StepStatus.RUNNING
            r.external = True
            let_go(r)


@dataclass
class Heartbeat(Op):
    worker: str
    leases: list[Lease]
    lease: Lease | None = None  # the one lease a heartbeat in a race renews
    # What a heartbeat answers is read after its write, so in a race it may see the other
    # write; only its effect is checked then.
    exact: bool = True

    async def perform(self, store: MongoStore) -> tuple[set[str], set[str]]:
        return await store.leases.heartbeat(self.worker, self.leases, LEASE)

    def check(self, world: World, got: Any) -> None:
        held = {
            le.run_id
            for le in self.leases
            if not world.runs[le.run_id].archived
            and world.runs[le.run_id].held_by(le)
            and world.runs[le.run_id].status in LEASED
        }
        cancel = {i for i in held if world.runs[i].status == S.CANCEL_REQUESTED}
        if self.exact:
            agree(got, (held, cancel), f"heartbeat of {self.worker}")
        for run_id in held:
            # A heartbeat counts as a write (`version`) but leaves `updateAt` alone: it carries
            # no events for the trail sweep, which reads runs by `updateAt`, to look for.
            world.runs[run_id].version += 1
            world.runs[run_id].locked_until = world.now + timedelta(seconds=LEASE)


@dataclass
class Overdue(Op):
    """The worker finds its run past the deadline and ends it (not fenced: the reaper may
    have got there first)."""

    lease: Lease
    run: Run  # as the worker's claim returned it

    async def perform(self, store: MongoStore) -> Moved | Lost:
        return await store.transitions.deadline_expire(self.run, self.lease.actor)

    def check(self, world: World, got: Any) -> None:
        r = world.runs[self.lease.run_id]
        late = r.deadline is not None and r.deadline <= world.now
        want = expect(world, r.id, "deadline_expire", None, ok=late)
        agree(got, want, "expire_deadline")
        if isinstance(want, Moved):
            expire_deadline(world, r)


def expire_deadline(world: World, r: RunModel) -> None:
    wrote(world, r, S.EXPIRED)
    attempt_failed(world, r)
    restep(r, {StepStatus.RUNNING: StepStatus.FAILED, **UNDONE_SKIPPED})
    let_go(r, keep_key=False)


@dataclass
class Cancel(Op):
    """A user's cancel: `cancel` ends a run no worker holds, `request_cancel` asks its worker
    (with the grace RunService gives: none for a run waiting for an external worker)."""

    run_id: str
    ask: bool
    grace: float

    async def perform(self, store: MongoStore) -> Moved | Lost:
        if self.ask:
            return await store.transitions.request_cancel(self.run_id, ACTOR, "stop", self.grace)
        return await store.transitions.cancel(self.run_id, ACTOR, "stop")

    def check(self, world: World, got: Any) -> None:
        r = world.runs[self.run_id]
        want = expect(world, r.id, "request_cancel" if self.ask else "cancel", None)
        agree(got, want, "request_cancel" if self.ask else "cancel")
        if not isinstance(want, Moved):
            return
        wrote(world, r, want.to)
        if self.ask:
            r.cancel_deadline = world.now + timedelta(seconds=self.grace)
        else:
            restep(r, UNDONE_SKIPPED)
            r.dedupe_key = r.dedupe_wait = None


@dataclass
class Reap(Op):
    """One reaper pass as the scheduler makes it: deadlines, cancel graces, expired leases.
    Its answer is the runs it moved; a run it found but lost to another write is left out.
    In a race, the `contested` run may be one it lost: it decided on a read that the other
    write made stale, and leaves the run to the next pass. `meanwhile` runs between its read
    of the expired leases and its writes."""

    contested: str | None = None
    meanwhile: Callable[[], Awaitable[None]] | None = field(default=None, repr=False)

    async def perform(self, store: MongoStore) -> dict[str, tuple[RunStatus, RunStatus]]:
        late, slow = await store.maintenance.overdue(100)
        outcomes = [
            *[await store.transitions.deadline_expire(run, "reaper") for run in late],
            *[await store.transitions.cancel_timeout(run, "reaper") for run in slow],
        ]
        expired = await store.maintenance.expired_leases(100)
        if self.meanwhile is not None:
            await self.meanwhile()
        outcomes += [await reap(store, run) for run in expired]
        return {m.run_id: (m.from_, m.to) for m in outcomes if isinstance(m, Moved)}

    def check(self, world: World, got: Any) -> None:
        moved: dict[str, tuple[RunStatus, RunStatus]] = {}
        live = [r for r in world.live() if r.id != self.contested or r.id in got]
        late = [r for r in live if r.status in LEASED and r.deadline and r.deadline < world.now]
        slow = [
            r
            for r in live
            if r.status == S.CANCEL_REQUESTED
            and r.cancel_deadline
            and r.cancel_deadline < world.now
        ]
        for r in late:
            moved[r.id] = (r.status, S.EXPIRED)
            expire_deadline(world, r)
        for r in slow:
            if r.id not in moved:
                moved[r.id] = (r.status, S.CANCELLED)
                wrote(world, r, S.CANCELLED)
                restep(r, {StepStatus.RUNNING: StepStatus.CANCELLED, **UNDONE_SKIPPED})
                let_go(r, keep_key=False)
        for r in live:
            if r.status not in LEASED or r.locked_until is None or r.locked_until >= world.now:
                continue
            if r.status == S.CANCEL_REQUESTED:
                to, step, keep_key = S.CANCELLED, StepStatus.CANCELLED, False
            elif r.attempt < r.kind.max_attempts:
                to, step, keep_key = S.QUEUED, StepStatus.PENDING, True
            else:
                to, step, keep_key = S.EXPIRED, StepStatus.FAILED, False
            moved[r.id] = (r.status, to)
            wrote(world, r, to)
            if to != S.CANCELLED:  # the lost lease ended the attempt
                attempt_failed(world, r)
            restep(r, {StepStatus.RUNNING: step})
            let_go(r, keep_key=keep_key)
        agree(got, moved, "reaper pass")


@dataclass
class Admit(Op):
    """A freed key goes to the oldest run waiting for it (Lifecycle.admit_next's store part)."""

    key: str

    async def perform(self, store: MongoStore) -> Moved | Lost | str | None:
        waiting = await store.runs.next_waiting(self.key)
        if waiting is None:
            return None
        try:
            return await store.runs.take_key(waiting, "scheduler")
        except KeyHeld as held:
            return f"held by {held.holder.id if held.holder else None}"

    def check(self, world: World, got: Any) -> None:
        live = world.live()
        waiting = [r for r in live if r.status == S.PENDING and r.dedupe_wait == self.key]
        holders = [r for r in live if r.dedupe_key == self.key]
        if not waiting:
            agree(got, None, f"admit {self.key}")
        elif holders:
            agree(got, f"held by {holders[0].id}", f"admit {self.key}")
        else:
            r = waiting[0]
            agree(got, Moved(r.id, S.PENDING, S.PENDING), f"admit {self.key}")
            wrote(world, r)
            r.dedupe_key, r.dedupe_wait = self.key, None


class Archive(Op):
    """The retention pass."""

    async def perform(self, store: MongoStore) -> int:
        return await store.maintenance.archive(store.clock.now() - timedelta(seconds=RETAIN), 100)

    def check(self, world: World, got: Any) -> None:
        before = world.now - timedelta(seconds=RETAIN)
        old = [
            r
            for r in world.live()
            if r.status in TERMINAL and r.dedupe_key is None and r.update_at < before
        ]
        agree(got, len(old), "archived")
        for r in old:
            r.archived = True


# -- the machine -------------------------------------------------------------------------------


class StoreMachine(RuleBasedStateMachine):
    """Runs and leases are picked by index among those made so far (wrapping around), not
    from bundles: a race's winner varies from one execution to the next, and every draw must
    have the same shape when hypothesis replays a case."""

    def __init__(
        self,
        runner: asyncio.Runner,
        client: AsyncMongoClient[Doc],
        db: str,
        templates: dict[str, Template],
    ) -> None:
        super().__init__()
        self.runner = runner
        self.clock = ManualClock(T0)
        self.store = MongoStore(client, db, clock=self.clock)
        self.templates = templates
        self.world = World(T0)
        # Each lease granted, and the Run its claim returned (the worker's `held.run`).
        self.granted: dict[tuple[str, str], Lease] = {}
        self.claimed: dict[tuple[str, str], Run] = {}
        self.docs: dict[str, Doc] = {}  # each run as last read back
        self.final: dict[str, Doc] = {}  # each terminal run as first read back terminal
        self.stale: Counter[str] = Counter()  # stale_write_rejected events per run

    def call(self, work: Coroutine[Any, Any, R]) -> R:
        return self.runner.run(work)

    def do(self, op: Op) -> Any:
        note(repr(op))
        got = self.call(op.perform(self.store))
        op.check(self.world, got)
        if isinstance(got, Lost):
            # A refused write changes nothing (the model keeps the version, and `read_back`
            # fails a run that changed at the same version); a superseded lease's is recorded.
            recorded = self.call(self.count_stale(got.run_id))
            agree(recorded - self.stale[got.run_id], int(got.reason == "lease"), "stale events")
        return got

    def run_at(self, index: int) -> str | None:
        ids = list(self.world.runs)
        return ids[index % len(ids)] if ids else None

    def lease_at(self, index: int, stale: bool) -> Lease | None:
        """A lease that still holds its run, or (`stale`) one that no longer does."""
        leases = [
            lease
            for lease in self.granted.values()
            if (self.world.runs[lease.run_id].token == lease.token) != stale
        ]
        return leases[index % len(leases)] if leases else None

    def holder(self, lease: Lease) -> Holder:
        return self.world.holders[lease.run_id, lease.token]

    def kind_of(self, run_id: str) -> Kind:
        return self.world.runs[run_id].kind

    def keep(self, op: Claim | ClaimExternal, got: Any) -> None:
        """Remember the leases a claim granted."""
        for run, lease in got if isinstance(op, Claim) else [got] if got else []:
            self.granted[run.id, lease.token] = lease
            self.claimed[run.id, lease.token] = run

    def worker_op(self, lease: Lease, action: Action) -> Op:
        """The call a worker holding (or once holding) `lease` makes for `action`, from what
        it knows: the step it is on and whether it wrote that step's start."""
        holder, kind = self.holder(lease), self.kind_of(lease.run_id)
        step = min(holder.step, kind.steps - 1)
        if step == kind.external and lease.worker_id in WORKERS and action in MOVES:
            action = "hand_over"  # an inline worker hands an external step over
        match action:
            case "start" | "progress" | "finish":
                return Work(lease, action, kind, step, holder.started, self.world.now)
            case "retry" | "fail":
                retryable = action == "retry"
                return Fail(lease, retryable, 5.0, copy.copy(holder), kind, self.world.now)
            case "acknowledge":
                # A cancel seen at a checkpoint interrupts the step; one seen between steps not.
                return Acknowledge(lease, interrupted=holder.started)
            case "release":
                return Release(lease)
            case "hand_over":
                return HandOver(lease, kind, step)
            case "overdue":
                return Overdue(lease, self.claimed[lease.run_id, lease.token])

    # -- the parties, one call each ---------------------------------------------------------------

    @initialize(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3))
    def start(self, kinds: list[Kind]) -> None:
        """A few plain runs to work on from the first step."""
        for kind in kinds:
            template = self.templates[kind.type]
            self.do(Create(template, kind, None, False, None, None, self.world.now))

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One call by one party, chosen by weight. A rule per party would do, but hypothesis
        turns most rules off in each example (swarm testing), and in the few examples a CI
        run affords, claims, worker writes and cancels must meet on the same runs."""
        party = data.draw(st.sampled_from(PARTIES), label="party")
        getattr(self, party)(data)

    def create(self, data: st.DataObject) -> None:
        kind = data.draw(st.sampled_from(KINDS), label="kind")
        key = data.draw(st.sampled_from([None, *KEYS]), label="dedupe key")
        wait = data.draw(st.booleans(), label="waits for the key")
        idempotency_key = data.draw(st.sampled_from([None, "i1"]), label="idempotency key")
        delay = data.draw(st.sampled_from([None, 5.0]), label="delay")
        if sum(r.status not in TERMINAL for r in self.world.runs.values()) < MAX_ACTIVE:
            template = self.templates[kind.type]
            self.do(Create(template, kind, key, wait, idempotency_key, delay, self.world.now))

    def enqueue(self, data: st.DataObject) -> None:
        if (run_id := self.run_at(data.draw(RUN, label="run"))) is not None:
            self.do(Enqueue(run_id))

    def claim(self, data: st.DataObject) -> None:
        """An inline worker claims runs it popped from Redis; an external worker claims the
        oldest run waiting for one."""
        worker = data.draw(st.sampled_from(WORKERS + EXTERNAL_WORKERS), label="worker")
        picked = data.draw(st.lists(RUN, min_size=1, max_size=3), label="runs")
        op: Claim | ClaimExternal = ClaimExternal(worker)
        if worker in WORKERS:
            op = Claim(worker, sorted({i for i in map(self.run_at, picked) if i is not None}))
        self.keep(op, self.do(op))

    def write(self, data: st.DataObject) -> None:
        """A worker's writes on a lease it holds, one after the other as a worker makes them."""
        lease = data.draw(LEASE_AT, label="lease")
        actions = data.draw(st.lists(ACTION, min_size=1, max_size=4), label="actions")
        if (held := self.lease_at(lease, stale=False)) is None:
            return
        for n, action in enumerate(actions):
            if n:
                self.read_back()
            got = self.do(self.worker_op(held, action))
            if isinstance(got, Lost) and got.status == S.CANCEL_REQUESTED:
                # As the worker does when its write is refused for a cancel: it acknowledges.
                self.read_back()
                self.do(self.worker_op(held, "acknowledge"))
                return

    def zombie(self, data: st.DataObject) -> None:
        """A write from a worker whose lease another claim (or the reaper) superseded."""
        lease = data.draw(LEASE_AT, label="lease")
        action = data.draw(ACTION, label="action")
        if (held := self.lease_at(lease, stale=True)) is not None:
            self.do(self.worker_op(held, action))

    def heartbeat(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from(WORKERS + EXTERNAL_WORKERS), label="worker")
        # A worker renews every lease it was ever granted: the stale ones must not renew.
        mine = [self.granted[g] for g, h in self.world.holders.items() if h.worker == worker]
        self.do(Heartbeat(worker, mine))

    def cancel(self, data: st.DataObject) -> None:
        """A user's cancel: mostly the call RunService makes for the run's status, now and then
        the other one."""
        run = data.draw(RUN, label="run")
        how = data.draw(st.sampled_from(["service", "service", "cancel", "ask"]), label="how")
        if (run_id := self.run_at(run)) is not None:
            held = self.world.runs[run_id].status in {S.RUNNING, S.WAITING_WORKER}
            self.do(self.cancel_op(run_id, ask=how == "ask" or (how == "service" and held)))

    def cancel_op(self, run_id: str, ask: bool) -> Cancel:
        r = self.world.runs[run_id]
        return Cancel(run_id, ask, 0 if r.status == S.WAITING_WORKER else r.kind.grace)

    def advance(self, data: st.DataObject) -> None:
        """Time passes; leases, cancel graces and deadlines run out."""
        self.pass_time(data.draw(st.sampled_from(ADVANCES), label="seconds"))

    def pass_time(self, seconds: float) -> None:
        note(f"advance {seconds}s")
        self.clock.advance(seconds)
        self.world.now = self.clock.now()

    def maintain(self, data: st.DataObject) -> None:
        """The scheduler's tick, some time later: one of its passes."""
        seconds = data.draw(st.sampled_from([0.0, *ADVANCES]), label="seconds")
        job = data.draw(st.sampled_from(["reap", "reap", *KEYS, "archive"]), label="pass")
        self.pass_time(seconds)
        self.do(Reap() if job == "reap" else Archive() if job == "archive" else Admit(job))

    def race(self, data: st.DataObject) -> None:
        """Two writers on one run at once: the outcome must be that of one of the two orders."""
        run = data.draw(RUN, label="run")
        first, second = data.draw(st.tuples(PICK, PICK), label="ops")
        lag = data.draw(st.sampled_from(LAGS), label="lag")
        if (run_id := self.run_at(run)) is None:
            return
        lapsed = [
            r.id
            for r in self.world.live()
            if r.status in LEASED and r.locked_until and r.locked_until < self.world.now
        ]
        if lag == "between" and lapsed:
            run_id = lapsed[run % len(lapsed)]  # a run the reaper is about to take
        ops = self.ops_on(run_id)
        a = Reap(run_id) if lag == "between" else ops[first % len(ops)]
        partners = [op for op in ops if can_race(a, op)]
        b = partners[second % len(partners)]
        note(f"race {a!r} ‖ {b!r} ({lag})")
        got = [loose(outcome) for outcome in self.call(both(self.store, a, b, lag))]
        tried = []
        for order in ((a, got[0]), (b, got[1])), ((b, got[1]), (a, got[0])):
            world = copy.deepcopy(self.world)
            try:
                for op, outcome in order:
                    op.check(world, outcome)
                self.call(self.compare(world))
            except AssertionError as mismatch:
                tried.append(str(mismatch))
                continue
            self.world = world
            for op, outcome in order:
                if isinstance(op, Claim | ClaimExternal):
                    self.keep(op, outcome)
            return
        raise AssertionError(f"no serial order explains {a} ‖ {b} → {got}: {tried}")

    def ops_on(self, run_id: str) -> list[Op]:
        """Every call that can touch the run, by each party that can make it."""
        ops: list[Op] = [
            Claim(WORKERS[0], [run_id]),
            Claim(WORKERS[1], [run_id]),
            Enqueue(run_id),
            self.cancel_op(run_id, ask=False),
            self.cancel_op(run_id, ask=True),
            Reap(run_id),
        ]
        if self.world.runs[run_id].status == S.WAITING_WORKER:
            ops += [ClaimExternal(w) for w in EXTERNAL_WORKERS]
        for (owned, token), holder in self.world.holders.items():
            if owned == run_id:
                lease = self.granted[run_id, token]
                ops += [self.worker_op(lease, action) for action in ACTIONS]
                ops.append(Heartbeat(holder.worker, [lease], lease, exact=False))
        return ops

    # -- reading back ---------------------------------------------------------------------------

    async def count_stale(self, run_id: str) -> int:
        query = {"jobId": run_id, "type": "stale_write_rejected"}
        return await raw(self.store).events.count_documents(query)

    async def read_all(self) -> dict[str, tuple[Doc, bool]]:
        live = {str(d["_id"]): (d, False) async for d in raw(self.store).runs.find({})}
        archived = {str(d["_id"]): (d, True) async for d in raw(self.store).archive.find({})}
        assert not live.keys() & archived.keys(), "a run is both live and archived"
        return live | archived

    async def compare(self, world: World) -> dict[str, tuple[Doc, bool]]:
        """The stored runs are the model's runs, field for field; returns them."""
        stored = await self.read_all()
        agree(set(stored), set(world.runs), "run ids")
        for run_id, (doc, archived) in stored.items():
            agree(observed(doc, archived), world.runs[run_id].expected(), f"run {run_id}")
        return stored

    @invariant()
    def read_back(self) -> None:
        """Every run as stored: the model's fields, a valid path through the table, steps in
        order, one live lease at most, an error only as the outcome, dedupe keys held once,
        versions that only go up, and terminal runs that never change again."""
        stored = self.call(self.compare(self.world))
        stale = self.call(raw(self.store).events.find({"type": "stale_write_rejected"}).to_list())
        self.stale = Counter(e["jobId"] for e in stale)
        for run_id, (doc, _) in stored.items():
            r = self.world.runs[run_id]
            check_path(doc)
            check_steps(doc, r.kind)
            check_lease(doc)
            check_outcome(doc)
            if "leaseToken" in doc:
                # One live lease at most: the one granted last; every earlier one is dead.
                grants = [token for (i, token) in self.world.holders if i == run_id]
                agree(doc["leaseToken"], grants[-1], f"{run_id}: the live lease")
            previous = self.docs.get(run_id)
            if previous is not None and doc != previous:
                assert doc["version"] > previous["version"], f"{run_id}: changed, same version"
            if run_id in self.final:
                assert doc == self.final[run_id], f"{run_id}: a terminal run changed"
            elif doc["status"] in TERMINAL:
                self.final[run_id] = doc
            self.docs[run_id] = doc
        check_keys([d for d, archived in stored.values() if not archived], self.world)
        for event in stale:
            # A rejected write came from a lease once granted for that run and since superseded.
            run_id, worker, prefix = (
                event["jobId"],
                event["metadata"]["worker"],
                event["metadata"]["lease"],
            )
            granted = [
                t for (i, t), h in self.world.holders.items() if i == run_id and h.worker == worker
            ]
            assert any(t.startswith(prefix) for t in granted), f"{run_id}: stale event {event}"
            live = self.world.runs[run_id].token
            assert live is None or not live.startswith(prefix), (
                f"{run_id}: {event} for the live lease"
            )

    def teardown(self) -> None:
        self.call(self.reset())

    async def reset(self) -> None:
        # The next example starts from empty collections (indexes and templates stay).
        await self.store.trail.flush()
        db = raw(self.store)
        for collection in (db.runs, db.archive, db.events):
            await collection.delete_many({})


@dataclass(frozen=True)
class AnyLost:
    """Stands for a `Lost` from a race: `_lost` reads the run again after the refused write,
    so the reason and status it gives may already show the other writer's change."""

    run_id: str

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Lost | AnyLost) and other.run_id == self.run_id


def loose(outcome: Any) -> Any:
    return AnyLost(outcome.run_id) if isinstance(outcome, Lost) else outcome


async def both(store: MongoStore, a: Op, b: Op, lag: float | str) -> tuple[Any, Any]:
    """`a` and `b` at once, `b` starting `lag` seconds later; or, with `lag` "between", `b`
    between the reaper pass `a`'s read and its writes (the reaper decides on what it read)."""
    if isinstance(a, Reap) and lag == "between":
        done: list[Any] = []

        async def meanwhile() -> None:
            done.append(await b.perform(store))

        return await Reap(a.contested, meanwhile).perform(store), done[0]

    async def later() -> Any:
        await asyncio.sleep(lag if isinstance(lag, float) else 0)
        return await b.perform(store)

    return await asyncio.gather(a.perform(store), later())


def can_race(a: Op, b: Op) -> bool:
    """Whether two calls may overlap. A worker overlaps only its heartbeat with its other
    writes, and one scheduler at a time reaps. A claim reads back the runs it won by its token
    after its write: a deadline expiry in between takes the run away and the claim (rightly)
    does not report it, so that pair has no serial order to compare with."""
    pair = {type(a), type(b)}
    if pair == {Reap}:
        return False
    lease = getattr(a, "lease", None)  # the lease a worker's call carries
    if lease is not None and lease == getattr(b, "lease", None) and Heartbeat not in pair:
        return False
    return not (Claim in pair and pair & {Reap, Overdue})


def check_path(doc: Doc) -> None:
    """The trail starts with `created` (`pending` for a run waiting for its dedupe key,
    `queued` otherwise) and its status changes form a valid path through the table, from named
    transitions, ending at the run's status; nothing follows a terminal status, so a run
    succeeds at most once."""
    trail = doc["trail"]
    assert trail[0]["type"] == "created" and trail[0]["runVersion"] == 1, trail[0]
    versions = [e["runVersion"] for e in trail]
    assert versions == sorted(versions) and versions[-1] <= doc["version"], versions
    status = S(trail[0]["to"])
    assert status in (S.PENDING, S.QUEUED), trail[0]
    changes = [e for e in trail if e["type"] == "status_changed"]
    for e in changes:
        frm, to = S(e["from"]), S(e["to"])
        t = TRANSITIONS[e["metadata"]["transition"]]
        assert frm == status and to in ALLOWED[frm], (doc["_id"], frm, to)
        assert frm in t.sources and to == t.target, (doc["_id"], t.name, frm, to)
        assert status not in TERMINAL, f"{doc['_id']}: moved on from {status}"
        status = to
    agree(S(doc["status"]), status, f"{doc['_id']}: status after its trail")


def check_steps(doc: Doc, kind: Kind) -> None:
    """Steps ran in order: each started only after the ones before it succeeded, each succeeded
    once, in order; the stored steps are a succeeded prefix, then at most one running step."""
    ids = [kind.step_id(i) for i in range(kind.steps)]
    done = 0
    for e in doc["trail"]:
        step = e["metadata"].get("step")
        if e["type"] == "step_started":
            agree(step, ids[done], f"{doc['_id']}: step started")
        elif e["type"] == "step_finished" and e["metadata"].get("status") != "failed":
            assert done < kind.steps, f"{doc['_id']}: a step succeeded twice"
            agree(step, ids[done], f"{doc['_id']}: step finished")
            done += 1
    statuses = [StepStatus(s["status"]) for s in doc["progress"]["steps"]]
    agree(statuses[:done], [StepStatus.SUCCEEDED] * done, f"{doc['_id']}: steps done")
    rest = statuses[done:]
    assert StepStatus.SUCCEEDED not in rest, (doc["_id"], statuses)
    assert StepStatus.RUNNING not in rest[1:], (doc["_id"], statuses)


def check_lease(doc: Doc) -> None:
    """A lease (token and expiry) exists only while a worker may write, and is whole."""
    status, fields = S(doc["status"]), ("lockedBy", "leaseToken", "lockedUntil")
    has = [f in doc for f in fields]
    if status == S.RUNNING:
        assert all(has), (doc["_id"], status, has)
    elif status == S.CANCEL_REQUESTED:
        assert all(has) or not any(has), (doc["_id"], status, has)
    else:
        assert not has[1] and not has[2], (doc["_id"], status, has)


def check_outcome(doc: Doc) -> None:
    """Only a failed or expired run has an `error`: the one its last attempt ended with."""
    if S(doc["status"]) in (S.FAILED, S.EXPIRED):
        agree(doc.get("error"), doc["attempts"][-1]["error"], f"{doc['_id']}: error")
    else:
        assert doc.get("error") is None, (doc["_id"], doc["status"], doc["error"])


def check_keys(live: list[Doc], world: World) -> None:
    """No dedupe key is held by two runs; a key is held by an active run, or spent by a run of
    a non-repeatable template that succeeded; only pending runs wait for one."""
    held = Counter(d["dedupeKey"] for d in live if "dedupeKey" in d)
    assert all(n == 1 for n in held.values()), held
    for d in live:
        kind = world.runs[str(d["_id"])].kind
        if "dedupeKey" in d:
            spent = d["status"] == S.SUCCEEDED and not kind.repeatable
            assert d["status"] not in TERMINAL or spent, (d["_id"], d["status"])
        if "dedupeWait" in d:
            assert d["status"] == S.PENDING, (d["_id"], d["status"])


# -- the test ----------------------------------------------------------------------------------


async def connect(mongo_url: str, db: str) -> tuple[AsyncMongoClient[Doc], dict[str, Template]]:
    client: AsyncMongoClient[Doc] = AsyncMongoClient(mongo_url, tz_aware=True)
    store = MongoStore(client, db)
    await store.ensure_indexes()
    templates = {}
    for kind in KINDS:
        spec = template_spec(
            kind.type,
            steps=[
                {
                    "id": kind.step_id(i),
                    "handler": "builtin.noop",
                    "workerType": "external" if i == kind.external else "inline",
                }
                for i in range(kind.steps)
            ],
            retryPolicy={"maxAttempts": kind.max_attempts},
            timeoutSeconds=kind.timeout,
            cancelPolicy={"graceSeconds": kind.grace},
            repeatable=kind.repeatable,
        )
        templates[kind.type], _ = await store.templates.register(spec)
    return client, templates


def test_transitions_keep_the_table_in_any_order(mongo_url: str, db_name: str) -> None:
    # The store is async and hypothesis is not: the machine runs each step on a loop of its
    # own (not the session's, which is idle during a sync test and must stay its own).
    with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:
        client, templates = runner.run(connect(mongo_url, db_name))
        try:
            # Any factory will do (hypothesis's documentation); its stub asks for a class.
            run_state_machine_as_test(
                lambda: StoreMachine(runner, client, db_name, templates),  # type: ignore[arg-type]
                settings=SETTINGS,
            )
        finally:
            runner.run(client.close())
