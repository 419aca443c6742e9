"""The overview: what the dashboard's first page shows, in one read.

Runs by status, the last hour by the minute and the failing templates come from MongoDB
(`store/overview.py`), limited to the caller's scopes like `GET /v1/runs`. Queue depth, the
oldest ready run, live workers and the scheduler lock are the figures `/metrics` reads from
Redis at scrape time (`metrics.read_state`), which name queues and workers, never runs or
scopes; a backend that does not answer is reported in `backends` and its figures left out.
"""

from datetime import datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from jobplane.api.auth import PERMISSIONS, Caller, Permission, authenticate
from jobplane.api.deps import SettingsDep, StoreDep
from jobplane.api.errors import ERROR_RESPONSES
from jobplane.metrics import Gauges, read_state
from jobplane.metrics import gauges as read_gauges
from jobplane.model import RunStatus
from jobplane.model.answers import ResponseBody
from jobplane.model.documents import Role
from jobplane.queue.connect import REDIS_DOWN
from jobplane.queue.redis import RedisQueue
from jobplane.settings import Settings
from jobplane.store import overview
from jobplane.store.overview import HeldRun

router = APIRouter(prefix="/v1/overview", tags=["overview"], responses=ERROR_RESPONSES)

AnyCaller = Annotated[Caller, Depends(authenticate)]


class Identity(ResponseBody):
    """The key's name, role, scopes and what its role may do (`templates:read`, ...)."""

    name: str
    role: Role
    scopes: list[str]
    permissions: list[str]


class StatusCount(ResponseBody):
    status: RunStatus
    count: int


class Minute(ResponseBody):
    """Runs created, and runs that ended by how, in the minute starting `at`."""

    at: datetime
    created: int
    succeeded: int
    failed: int
    cancelled: int
    expired: int


class ErrorCount(ResponseBody):
    code: str
    count: int
    message: str | None
    last_at: datetime


class FailingTemplate(ResponseBody):
    template_type: str
    failed: int
    expired: int
    last_at: datetime
    errors: list[ErrorCount]


class RunFigures(ResponseBody):
    """`active`: every run in an active status. `finishedLastHour` and `perMinute`: runs
    that ended (or were created) in the last 60 minutes, this minute included.
    `failingTemplates`: templates with runs that ended `failed` or `expired` in the last 24
    hours, the most first (at most 10)."""

    active: list[StatusCount]
    finished_last_hour: list[StatusCount]
    per_minute: list[Minute]
    failing_templates: list[FailingTemplate]


class HandlerWait(ResponseBody):
    """Runs of the queue whose current step's handler no live worker offers on it."""

    handler: str
    runs: int


class QueueFigures(ResponseBody):
    name: str
    ready: int
    delayed: int
    oldest_ready_age_seconds: float
    waiting_for_handlers: list[HandlerWait]


class HeldRunPublic(ResponseBody):
    id: str
    template_type: str
    status: RunStatus
    phase: str | None
    percentage: float
    locked_until: datetime | None


class WorkerFigures(ResponseBody):
    """A worker holding leases, and whether it is among the live workers (None: Redis did not
    answer). A held run whose worker is not alive is recovered when its lease runs out."""

    worker_id: str
    alive: bool | None
    runs: list[HeldRunPublic]


class Workers(ResponseBody):
    """`alive` and `runsHeld` count every live worker (idle ones too); `holding` lists the
    workers that hold runs this key may see. None: Redis did not answer."""

    alive: int | None
    runs_held: int | None
    holding: list[WorkerFigures]


class SchedulerFigures(ResponseBody):
    """The scheduler holding the singleton lock (None: no one), its lock's time left, and when
    it last ticked: the active scheduler renews the lock as each tick begins (at least every
    third of its TTL), so that is the lock's TTL (`JOBPLANE_SCHEDULER_LOCK_SECONDS`, which all
    processes share) less the time left. None while no scheduler holds the lock."""

    leader: str | None
    lock_ttl_seconds: float | None
    last_tick_at: datetime | None


class Backends(ResponseBody):
    mongodb: bool
    redis: bool


class Overview(ResponseBody):
    generated_at: datetime
    caller: Identity
    # None when the key's role may not read runs (an author's).
    runs: RunFigures | None
    queues: list[QueueFigures]
    workers: Workers
    scheduler: SchedulerFigures
    backends: Backends
    # The dashboard links a run's trace id here, `{traceId}` replaced (JOBPLANE_TRACE_URL);
    # None when unset.
    trace_url: str | None


@router.get(
    "", summary="The dashboard's overview", response_model=Overview, response_model_by_alias=True
)
async def read_overview(
    request: Request, store: StoreDep, settings: SettingsDep, caller: AnyCaller
) -> Overview:
    """The dashboard's overview, for any key. Run figures are limited to the key's scopes,
    and left out (`runs: null`) for a role that may not read runs."""
    now = store.clock.now()
    queue: RedisQueue = request.app.state.queue
    reads_runs = Permission.RUNS_READ in PERMISSIONS[caller.role]
    figures = await store.overview.run_figures(caller.within, now) if reads_runs else None
    gauges = read_gauges(await read_state(store, queue, settings.queues))
    # The scheduler lock's TTL was read just now, not at `now`: the run figures' queries before
    # it may have taken a while, and its last tick is counted back from the TTL.
    read_at = store.clock.now()
    redis_up = gauges.get(("jobplane_backend_up", ("redis",))) == 1
    held = figures.held if figures else []
    leader: str | None = None
    alive: dict[str, bool] = {}
    if redis_up:
        try:
            leader, alive = await _leader(queue), await _alive(queue, held)
        except REDIS_DOWN:
            redis_up = False
    return Overview(
        generated_at=now,
        caller=Identity(
            name=caller.name,
            role=caller.role,
            scopes=[f"{s}:{i}" for s, i in sorted(caller.scopes)],
            permissions=sorted(p.value for p in PERMISSIONS[caller.role]),
        ),
        runs=_runs(figures) if figures else None,
        queues=_queues(gauges) if redis_up else [],
        workers=Workers(
            alive=_int(gauges.get(("jobplane_workers_alive", ()))) if redis_up else None,
            runs_held=_int(gauges.get(("jobplane_worker_runs_held", ()))) if redis_up else None,
            holding=_holding(held, alive if redis_up else None),
        ),
        scheduler=_scheduler(leader, gauges, settings, read_at) if redis_up else _NO_SCHEDULER,
        backends=Backends(
            mongodb=gauges.get(("jobplane_backend_up", ("mongodb",))) == 1, redis=redis_up
        ),
        trace_url=settings.trace_url,
    )


_NO_SCHEDULER = SchedulerFigures(leader=None, lock_ttl_seconds=None, last_tick_at=None)


def _scheduler(
    leader: str | None, gauges: Gauges, settings: Settings, now: datetime
) -> SchedulerFigures:
    left = gauges.get(("jobplane_scheduler_lock_ttl_seconds", ()), 0.0)
    if leader is None or left <= 0:
        return SchedulerFigures(leader=None, lock_ttl_seconds=0.0, last_tick_at=None)
    renewed = now - timedelta(seconds=max(0.0, settings.scheduler_lock_seconds - left))
    return SchedulerFigures(leader=leader, lock_ttl_seconds=left, last_tick_at=renewed)


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


async def _leader(queue: RedisQueue) -> str | None:
    """The scheduler lock's value: the owner id of the active scheduler."""
    owner, _ = await queue.locks.singleton_holder("scheduler")
    return owner


async def _alive(queue: RedisQueue, held: list[HeldRun]) -> dict[str, bool]:
    """Whether each worker holding a run is still in the live workers' registry."""
    workers = {h.locked_by for h in held if h.locked_by}
    if not workers:
        return {}
    alive = await queue.live_workers()
    return {w: w in alive for w in sorted(workers)}


def _runs(figures: overview.RunFigures) -> RunFigures:
    return RunFigures(
        active=[StatusCount(status=s, count=n) for s, n in figures.active.items()],
        finished_last_hour=[StatusCount(status=s, count=n) for s, n in figures.finished.items()],
        per_minute=[
            Minute(
                at=m.at,
                created=m.created,
                succeeded=m.finished.get(RunStatus.SUCCEEDED, 0),
                failed=m.finished.get(RunStatus.FAILED, 0),
                cancelled=m.finished.get(RunStatus.CANCELLED, 0),
                expired=m.finished.get(RunStatus.EXPIRED, 0),
            )
            for m in figures.minutes
        ],
        failing_templates=[
            FailingTemplate(
                template_type=f.template_type,
                failed=f.by_status.get(RunStatus.FAILED, 0),
                expired=f.by_status.get(RunStatus.EXPIRED, 0),
                last_at=f.last_at,
                errors=[
                    ErrorCount(code=e.code, count=e.count, message=e.message, last_at=e.last_at)
                    for e in f.errors
                ],
            )
            for f in figures.failing
        ],
    )


def _queues(gauges: Gauges) -> list[QueueFigures]:
    names = sorted({labels[0] for name, labels in gauges if name == "jobplane_queue_depth"})
    oldest = "jobplane_queue_oldest_ready_age_seconds"
    waits = [
        (labels, int(n)) for (name, labels), n in gauges.items() if name == _WAITING_FOR_HANDLER
    ]
    return [
        QueueFigures(
            name=q,
            ready=int(gauges.get(("jobplane_queue_depth", (q, "ready")), 0)),
            delayed=int(gauges.get(("jobplane_queue_depth", (q, "delayed")), 0)),
            oldest_ready_age_seconds=gauges.get((oldest, (q,)), 0),
            waiting_for_handlers=[
                HandlerWait(handler=h, runs=n) for (wq, h), n in sorted(waits) if wq == q
            ],
        )
        for q in names
    ]


_WAITING_FOR_HANDLER = "jobplane_runs_waiting_for_handler"


def _holding(held: list[HeldRun], alive: dict[str, bool] | None) -> list[WorkerFigures]:
    workers: dict[str, list[HeldRunPublic]] = {}
    for h in held:
        workers.setdefault(h.locked_by, []).append(
            HeldRunPublic(
                id=h.id,
                template_type=h.template_type,
                status=h.status,
                phase=h.phase,
                percentage=h.percentage,
                locked_until=h.locked_until,
            )
        )
    return [
        WorkerFigures(worker_id=w, alive=None if alive is None else alive.get(w, False), runs=runs)
        for w, runs in workers.items()
    ]
