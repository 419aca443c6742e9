"""The store's interfaces: what services may ask of it, one small interface per aggregate.

Services, the scheduler, the worker and the API type against these, never against the MongoDB
classes that implement them (`MongoStore` composes one of each). A write that loses a race
answers `Lost`; only a refusal the caller must tell apart (`KeyHeld`, `DuplicateRun`) raises.
"""

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

from pymongo.asynchronous.change_stream import AsyncChangeStream
from pymongo.asynchronous.cursor import AsyncCursor

from jobplane.clock import Clock
from jobplane.model import (
    ApiKey,
    ApiKeyPublic,
    Event,
    LockWait,
    MapProgress,
    QueueState,
    Run,
    RunError,
    Schedule,
    StartLimits,
    StepOutcome,
    StepProgress,
    Template,
    TemplateSpec,
)
from jobplane.model.webhooks import Delivery, SignedWebhook, Webhook
from jobplane.store.children import ChildEnd
from jobplane.store.feed import FedRun, Position
from jobplane.store.overview import RunFigures
from jobplane.store.types import (
    EventQuery,
    Lease,
    Lost,
    Moved,
    NewRun,
    RunQuery,
    ScheduleQuery,
    StepEnd,
)
from jobplane.store.webhooks import Claimed


class TemplateStore(Protocol):
    async def register(self, spec: TemplateSpec) -> tuple[Template, bool]: ...
    async def get(self, type_: str, version: int | None = None) -> Template | None: ...
    async def cached(self, type_: str, version: int | None = None) -> Template | None: ...
    async def latest(self) -> list[Template]: ...
    async def queues(self) -> list[str]: ...
    async def set_enabled(self, type_: str, enabled: bool) -> Template | None: ...


class ScheduleStore(Protocol):
    async def insert(self, schedule: Schedule) -> None: ...
    async def get(self, schedule_id: str) -> Schedule | None: ...
    async def page(
        self, query: ScheduleQuery, within: Sequence[tuple[str, str]] | None, limit: int
    ) -> list[Schedule]: ...
    async def replace(self, schedule: Schedule) -> Schedule | None: ...
    async def due(self, now: datetime, limit: int) -> list[Schedule]: ...
    async def next_fire_time(self) -> datetime | None: ...
    async def advance(
        self, schedule: Schedule, next_run_at: datetime, fired: tuple[datetime, str] | None
    ) -> bool: ...
    async def note_run(self, schedule_id: str, at: datetime, run_id: str) -> None: ...
    async def delete(self, schedule_id: str) -> bool: ...


class KeyStore(Protocol):
    async def insert(self, key: ApiKey) -> bool: ...
    async def get(self, key_id: str) -> ApiKey | None: ...
    async def page(self, before: str | None, limit: int) -> list[ApiKeyPublic]: ...
    async def revoke(self, key_id: str, actor: str) -> ApiKeyPublic | None: ...


class LockStore(Protocol):
    """The blocks of fencing tokens Redis hands out for locks."""

    async def token_block(self) -> tuple[int, int]: ...


class QueueStore(Protocol):
    """Queues' pauses, each with its audit event."""

    async def states(self) -> list[QueueState]: ...
    async def set_paused(
        self, queue: str, paused: bool, actor: str, reason: str | None
    ) -> tuple[QueueState, bool]: ...


class RunStore(Protocol):
    """Creating runs (with their dedupe and idempotency keys) and reading them."""

    async def watch(
        self, run_ids: Sequence[str], after: Any
    ) -> AsyncChangeStream[dict[str, Any]]: ...
    async def insert(self, new: NewRun, actor: str) -> Run: ...
    async def insert_many(self, news: Sequence[NewRun], actor: str) -> list[Run | Exception]: ...
    async def get(self, run_id: str) -> Run | None: ...
    async def page(
        self, query: RunQuery, within: Sequence[tuple[str, str]] | None, limit: int
    ) -> list[Run]: ...
    async def active_of(self, schedule: Schedule) -> Run | None: ...
    async def limited(self, run_ids: Sequence[str]) -> list[Run]: ...
    async def next_waiting(self, key: str) -> Run | None: ...
    async def holders(self, key: str, scope: str, scope_id: str) -> list[Run]: ...
    async def with_key(self, key: str, scope: str, scope_id: str) -> list[Run]: ...
    async def take_key(self, run: Run, actor: str) -> Moved | Lost: ...


class TransitionStore(Protocol):
    """One method per row of `model.status.TRANSITIONS`, named as the row."""

    async def enqueue(
        self, run_id: str, actor: str, scope: tuple[str, str] | None = None
    ) -> Moved | Lost: ...
    async def claim(
        self,
        run_ids: Sequence[str],
        worker_id: str,
        lease_seconds: float,
        token: str | None = None,
    ) -> list[tuple[Run, Lease]]: ...
    async def claim_limited(
        self,
        runs: Sequence[tuple[str, StartLimits]],
        worker_id: str,
        lease_seconds: float,
        at: datetime,
    ) -> tuple[list[tuple[Run, Lease]], list[str]]: ...
    async def wait_worker(
        self, lease: Lease, index: int, step_id: str, worker_type: str
    ) -> Moved | Lost: ...
    async def wait_children(self, lease: Lease) -> Moved | Lost: ...
    async def children_done(self, run: Run, actor: str, detail: str) -> Moved | Lost: ...
    async def resume(
        self, worker_type: str, worker_id: str, lease_seconds: float
    ) -> tuple[Run, Lease] | None: ...
    async def complete(
        self,
        lease: Lease,
        index: int | None,
        step_id: str | None,
        output: Any,
        result: Any,
        started_at: datetime | None = None,
        spend_key: bool = False,
        attempt: int = 0,
    ) -> Moved | Lost: ...
    async def fail(
        self,
        lease: Lease,
        index: int,
        error: RunError,
        started_at: datetime | None = None,
        attempt: int = 0,
    ) -> Moved | Lost: ...
    async def retry(
        self,
        lease: Lease,
        index: int,
        error: RunError,
        not_before: datetime,
        started_at: datetime | None = None,
        attempt: int = 0,
    ) -> Moved | Lost: ...
    async def release(
        self, lease: Lease, handler: str | None = None, lock_wait: LockWait | None = None
    ) -> Moved | Lost: ...
    async def cancel(
        self,
        run_id: str,
        actor: str,
        reason: str | None,
        scope: tuple[str, str] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Moved | Lost: ...
    async def request_cancel(
        self,
        run_id: str,
        actor: str,
        reason: str | None,
        grace_seconds: float = 30,
        scope: tuple[str, str] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Moved | Lost: ...
    async def acknowledge_cancel(self, lease: Lease, interrupted: bool) -> Moved | Lost: ...
    async def reap_requeue(self, run: Run, actor: str) -> Moved | Lost: ...
    async def reap_expire(self, run: Run, actor: str) -> Moved | Lost: ...
    async def reap_cancel(self, run: Run, actor: str) -> Moved | Lost: ...
    async def cancel_timeout(self, run: Run, actor: str) -> Moved | Lost: ...
    async def deadline_expire(self, run: Run, actor: str) -> Moved | Lost: ...


class LeaseStore(Protocol):
    """A lease holder's writes that change no status."""

    async def heartbeat(
        self, worker_id: str, leases: Sequence[Lease], lease_seconds: float
    ) -> tuple[set[str], set[str]]: ...
    async def start_step(
        self, lease: Lease, index: int, step_id: str, at: datetime | None = None, attempt: int = 0
    ) -> Lost | None: ...
    async def wait_step(
        self, lease: Lease, index: int, step_id: str, total: int, at: datetime, attempt: int
    ) -> Lost | None: ...
    async def finish_step(
        self,
        lease: Lease,
        index: int,
        step_id: str,
        output: Any,
        percentage: float,
        started_at: datetime | None = None,
        *,
        next_handler: str | None,
        attempt: int = 0,
    ) -> Lost | None: ...
    async def end_steps(
        self, lease: Lease, ends: Sequence[StepEnd], percentage: float
    ) -> Lost | None: ...
    async def report_progress(
        self,
        lease: Lease,
        index: int,
        step_percentage: float,
        percentage: float,
        message: str | None,
    ) -> Lost | None: ...
    async def lease_lost(self, lease: Lease, what: str) -> Lost: ...
    async def locks_taken(self, lease: Lease) -> Lost | None: ...


class LendingStore(Protocol):
    """Lent steps: the holder's lend, take-back and stop; a borrower's claim, renewal,
    give-back and report (`model/status.py`, `STEP_MOVES`)."""

    async def lend(
        self, lease: Lease, index: int, step_id: str, handler: str, attempt: int
    ) -> Lost | None: ...
    async def claim(
        self, steps: Sequence[tuple[str, int]], worker_id: str, lease_seconds: float
    ) -> list[tuple[Run, Lease]]: ...
    async def give_back(self, lease: Lease, step_id: str) -> Lost | None: ...
    async def report(self, lease: Lease, outcome: StepOutcome) -> Lost | None: ...
    async def take_back(
        self, lease: Lease, index: int, step_id: str, token: str | None, reason: str
    ) -> Lost | None: ...
    async def ask_stop(self, lease: Lease, index: int) -> Lost | None: ...
    async def step(self, lease: Lease, index: int) -> StepProgress | None: ...
    async def heartbeat(
        self, leases: Sequence[Lease], lease_seconds: float
    ) -> tuple[set[str], set[str]]: ...


class ChildStore(Protocol):
    """A map step's children, as their parent sees them."""

    async def counts(self, parent: Run) -> dict[str, MapProgress]: ...
    async def ends(self, parent: Run, step_id: str) -> list[ChildEnd]: ...
    async def active(self, parent: Run, step_id: str | None = None) -> list[Run]: ...
    async def any_left(self, child: Run) -> bool: ...
    async def admit_next(self, child: Run, actor: str) -> Run | None: ...
    async def waiting_parents(self, limit: int) -> list[Run]: ...
    async def waiting_children(self, limit: int) -> list[Run]: ...
    async def orphaned(self, limit: int, ended_before: datetime) -> list[Run]: ...


class TrailStore(Protocol):
    async def events_of(self, run_id: str) -> list[Event]: ...
    def audit_filter(
        self, query: EventQuery, within: Sequence[tuple[str, str]] | None
    ) -> dict[str, Any]: ...
    async def page(
        self, query: EventQuery, within: Sequence[tuple[str, str]] | None, limit: int
    ) -> list[Event]: ...
    async def schedule_event(
        self, schedule: Schedule, kind: str, message: str, metadata: dict[str, Any], actor: str
    ) -> None: ...
    async def sweep(self, settled: datetime) -> int: ...
    async def flush(self) -> None: ...
    def since(self, at: datetime, types: Sequence[str]) -> AsyncCursor[dict[str, Any]]: ...
    async def watch_audit(
        self, query: EventQuery, within: Sequence[tuple[str, str]] | None, after: Any
    ) -> AsyncChangeStream[dict[str, Any]]: ...
    def event_of(self, doc: dict[str, Any]) -> Event: ...


class WebhookStore(Protocol):
    """Webhooks (each change audited), and their deliveries: stored by the fan-out, claimed for
    each try by the sender (`store/webhooks.py`)."""

    async def insert(self, webhook: SignedWebhook) -> None: ...
    async def get(self, webhook_id: str) -> SignedWebhook | None: ...
    async def page(
        self, within: Sequence[tuple[str, str]] | None, before: str | None, limit: int
    ) -> list[Webhook]: ...
    async def enabled(self) -> list[SignedWebhook]: ...
    async def change(
        self,
        webhook_id: str,
        fields: dict[str, Any],
        kind: str,
        actor: str,
        message: str,
        only_if: dict[str, Any],
    ) -> Webhook | None: ...
    async def delete(self, webhook_id: str, actor: str) -> Webhook | None: ...
    async def add(self, deliveries: Sequence[dict[str, Any]]) -> None: ...
    async def stored(self, pairs: Sequence[tuple[str, str]]) -> set[tuple[str, str]]: ...
    async def claim(
        self, now: datetime, webhook_ids: Sequence[str], until: datetime, limit: int
    ) -> list[Claimed]: ...
    async def tried(self, claimed: Claimed, outcome: dict[str, Any]) -> None: ...
    async def page_deliveries(
        self, webhook_id: str, before: str | None, limit: int
    ) -> list[Delivery]: ...
    async def redeliver(self, webhook_id: str, delivery_id: str) -> Delivery | None: ...
    async def note_failing(self, webhook_id: str, since: datetime) -> datetime | None: ...
    async def note_healthy(self, webhook_id: str) -> None: ...


class FeedStore(Protocol):
    """What the notifier fans out, and where it is in it (`store/feed.py`)."""

    async def watch(
        self, after: Any, types: Sequence[str]
    ) -> AsyncChangeStream[dict[str, Any]]: ...
    def news(self, change: dict[str, Any]) -> dict[str, Any]: ...
    async def runs_of(self, run_ids: Sequence[str]) -> dict[str, FedRun]: ...
    async def position(self) -> Position: ...
    async def save_position(self, token: Any, at: datetime | None) -> None: ...
    async def go_idle(self, since: datetime) -> None: ...


class MaintenanceStore(Protocol):
    """The scheduler's scans (each followed by transitions on what it read) and retention."""

    async def expired_leases(self, limit: int) -> list[Run]: ...
    async def overdue(self, limit: int) -> tuple[list[Run], list[Run]]: ...
    async def to_reconcile(
        self, after: str | None, limit: int, idle_since: datetime
    ) -> list[Run]: ...
    async def waited_keys(self, limit: int) -> list[str]: ...
    async def archive(self, before: datetime, limit: int) -> int: ...


class GateStore(Protocol):
    """Admissions under `maxRunning`; the claim's own are the transition store's."""

    async def admitted(self, template_type: str) -> int: ...
    async def sweep(self, template_type: str) -> int: ...
    async def give_back_spares(self, everything: bool = False) -> dict[str, int]: ...


class OverviewStore(Protocol):
    async def held_back(self) -> dict[tuple[str, str], int]: ...
    async def started_by_queue(self) -> dict[str, int]: ...
    async def run_figures(
        self, within: Sequence[tuple[str, str]] | None, now: datetime
    ) -> RunFigures: ...


class Store(Protocol):
    """The store as services see it: its clock and its aggregate stores."""

    clock: Clock
    templates: TemplateStore
    schedules: ScheduleStore
    keys: KeyStore
    locks: LockStore
    queues: QueueStore
    runs: RunStore
    children: ChildStore
    transitions: TransitionStore
    leases: LeaseStore
    lending: LendingStore
    trail: TrailStore
    gates: GateStore
    maintenance: MaintenanceStore
    overview: OverviewStore
    webhooks: WebhookStore
    feed: FeedStore

    async def ping(self) -> None: ...
