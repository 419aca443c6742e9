"""What the store's callers hand it and get back: leases, write outcomes, new runs, list
filters, and the refusals a create can meet."""

import secrets
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from bson import ObjectId

from jobplane.model import Run, RunError, RunStatus, StepStatus, Template


def worker_actor(worker_id: str) -> str:
    """How events name a worker as their actor."""
    return f"worker:{worker_id}"


@dataclass(frozen=True)
class Admission:
    """A place among a template's started runs under `maxRunning`: its entry in the template's
    gate (`store/gates.py`), by its token, and the run in it (None: a place no run took)."""

    template_type: str
    run_id: ObjectId | None
    token: str


@dataclass
class Known:
    """What a writer knows of a run from its own last write.

    With it, the next write can be a conditional update on that status and version with no
    read first: if it matches, the writer knew the run's state exactly; if another writer got
    in between, it misses, and the writer reads the state and tries again.
    """

    status: RunStatus
    version: int
    scope: str
    scope_id: str
    # The attempt in progress, for a write that ends it in an error (`AttemptChange.FAIL`).
    attempt: int = 0
    attempt_started_at: datetime | None = None
    # The place the run holds while started under its template's `maxRunning`.
    admission: Admission | None = None


@dataclass(frozen=True)
class StepEnd:
    """A step that ended without a result, the run going on or about to end: skipped (its
    `when` was false, or a step it needs failed for good), failed for good (`onFailure:
    continue`), or cancelled (a step beside it failed the run)."""

    index: int
    step_id: str
    status: StepStatus
    # Its start, when that was not written yet, and which of its tries that was.
    started_at: datetime | None = None
    attempt: int = 0
    error: RunError | None = None
    # Why a skipped step was skipped.
    reason: str | None = None
    # A failed step that is not run again (`onFailure: continue`).
    final: bool = False


@dataclass
class Lease:
    """Proof of ownership that every worker write carries."""

    run_id: str
    worker_id: str
    token: str
    # Kept up to date by the store after each write made with this lease.
    known: Known | None = field(default=None, compare=False, repr=False)
    # A step lease: the worker holds step `step` of the run, lent to it, not the run; its
    # writes are fenced by the step's lease (`progress.steps[step].lease`).
    step: int | None = None

    @property
    def actor(self) -> str:
        return worker_actor(self.worker_id)

    @property
    def key(self) -> str:
        """What the lease holds: the run's id, or a lent step's queue entry id."""
        return self.run_id if self.step is None else step_key(self.run_id, self.step)


def lease_token() -> str:
    """A new lease's token: random, so that an earlier holder of the run, or of the step,
    cannot pass for the new one."""
    return secrets.token_hex(12)


# What separates a run's id from a lent step's index in the step's queue entry id.
STEP_MARK = "#"


def step_key(run_id: str, index: int) -> str:
    """A lent step's queue entry id: its run's id and its index."""
    return f"{run_id}{STEP_MARK}{index}"


def step_of(key: str) -> tuple[str, int] | None:
    """The run id and step index of a lent step's queue entry id; None for a run's."""
    run_id, mark, index = key.partition(STEP_MARK)
    return (run_id, int(index)) if mark else None


@dataclass(frozen=True)
class Moved:
    """A transition that took place."""

    run_id: str
    from_: RunStatus
    to: RunStatus


@dataclass(frozen=True)
class Lost:
    """A write whose filter matched nothing: the caller lost a race.

    `reason` is "missing" (no such run), "lease" (another claim superseded the caller's lease;
    a `stale_write_rejected` event was recorded) or "status" (the run is in `status`, from which
    the write is not allowed, or a guard of the transition no longer holds).
    """

    run_id: str
    reason: Literal["missing", "lease", "status"]
    status: RunStatus | None = None


@dataclass(frozen=True)
class NewRun:
    template: Template
    scope: Literal["user", "account", "system"]
    scope_id: str
    payload: dict[str, Any] = field(default_factory=dict)
    priority: int | None = None
    not_before: datetime | None = None
    # The key the run holds while active, or the one it waits for (`queue_same_scope`,
    # `cancel_previous`); `key_places` of it may be active at once.
    dedupe_key: str | None = None
    dedupe_wait: str | None = None
    key_places: int = 1
    # Which place of the key the run takes: chosen by the store, the first one free.
    dedupe_slot: int = 0
    # The window the run's starts count in (its template's `rateLimit`).
    rate_key: str | None = None
    # The locks its first steps take (`keys.start_locks`).
    start_locks: list[str] = field(default_factory=list)
    idempotency_key: str | None = None
    schedule_id: str | None = None
    scheduled_for: datetime | None = None
    rerun_of: str | None = None
    child: "ChildOf | None" = None
    # The context of its `send` span, or of its creator's trace (`jobplane/tracing.py`).
    trace_context: dict[str, str] | None = None

    @property
    def waits(self) -> bool:
        """It is written `pending`: it waits for its dedupe key or for a place among its
        map's children."""
        return self.dedupe_wait is not None or (self.child is not None and self.child.waits)


@dataclass(frozen=True)
class ChildOf:
    """A map step's child run: its parent run and step, its family's first run, which item it
    is, and its place among the step's active children when `maxConcurrency` (`limit`) caps
    them: None waits for one."""

    parent_run_id: str
    parent_step_id: str
    root_run_id: str
    index: int
    limit: int | None = None
    place: int | None = None

    @property
    def waits(self) -> bool:
        return self.limit is not None and self.place is None


@dataclass(frozen=True)
class RunQuery:
    """Filters of the run list; `before` is the id the previous page ended at."""

    status: RunStatus | None = None
    template_type: str | None = None
    scope: str | None = None
    scope_id: str | None = None
    schedule_id: str | None = None
    parent_run_id: str | None = None
    before: str | None = None


@dataclass(frozen=True)
class ScheduleQuery:
    """Filters of the schedule list; `before` is the id the previous page ended at."""

    template_type: str | None = None
    scope: str | None = None
    scope_id: str | None = None
    enabled: bool | None = None
    before: str | None = None


# A reader of a change stream (`RunStore.watch`, `TrailStore.watch_audit`) that waits for a
# change also looks, this often, at whether it should stop or watch something else.
WATCH_WAIT_MS = 100


@dataclass(frozen=True)
class EventQuery:
    """Filters of the audit query; `after` is the (createAt, id) the previous page ended at."""

    job_id: str | None = None
    type: str | None = None
    scope: str | None = None
    scope_id: str | None = None
    actor: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    after: tuple[datetime, str] | None = None


class KeyHeld(Exception):
    """Another run holds the dedupe key: an active run, or (non-repeatable templates) the run
    that succeeded for it. `holder` is None if it let go before it could be read."""

    def __init__(self, key: str, holder: Run | None) -> None:
        super().__init__(f"dedupe key {key} is held by {holder.id if holder else 'a run'}")
        self.key = key
        self.holder = holder

    @property
    def spent(self) -> bool:
        """The holder succeeded (its template is not repeatable): the key is never free again,
        so a run waiting for it can never start."""
        return self.holder is not None and self.holder.status == RunStatus.SUCCEEDED


class DuplicateRun(Exception):
    """A run with this idempotency key (or schedule fire time) already exists."""

    def __init__(self, run: Run) -> None:
        super().__init__(f"run {run.id} already exists")
        self.run = run


class NotSharded(Exception):
    """Sharding was asked of a server that is not a sharded cluster's mongos."""
