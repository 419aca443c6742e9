"""Prometheus metrics.

Counters and histograms live in the process that does what they count (whoever creates a run
counts it, a worker counts its claims, the scheduler its reaps and fires), in
prometheus_client's default registry. The API serves its process's at `/metrics`; a worker or
scheduler serves its own on `JOBPLANE_METRICS_PORT`; `jobplane dev`, one process, serves all.

Figures about shared state (queue depth, the oldest ready run, live workers, the scheduler
lock) are counted nowhere: the API reads them from Redis and MongoDB when it is scraped
(`read_state`), so every API process reports the same truth and a restart loses nothing.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from prometheus_client import (
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from pymongo.errors import PyMongoError

from jobplane.model import TERMINAL, QueueState, Run
from jobplane.queue.connect import REDIS_DOWN
from jobplane.queue.redis import Offer, RedisQueue
from jobplane.settings import Settings
from jobplane.store import Lost, Moved, Store

# A `_created` timestamp beside every counter and histogram series doubles the series, and
# nothing needs them: rates work from the counters alone.
disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated upstream

RUNS_CREATED = Counter(
    "jobplane_runs_created",
    "Runs created (a repeated idempotency key returns the first run and is not counted)",
    ["template"],
)
RUNS_CLAIMED = Counter(
    "jobplane_runs_claimed", "Claims of runs by inline workers, one per attempt", ["template"]
)
RUNS_FINISHED = Counter(
    "jobplane_runs_finished", "Runs that reached a terminal status", ["template", "status"]
)
RUN_RETRIES = Counter(
    "jobplane_run_retries",
    "Failed attempts queued again with backoff (by a worker; the reaper's are reaper actions)",
    ["template"],
)
LEASE_EXPIRIES = Counter(
    "jobplane_lease_expiries",
    "Runs whose lease expired (their worker died or stalled) and that the reaper recovered",
    ["template"],
)
STALE_WRITES = Counter(
    "jobplane_stale_writes_rejected",
    "Worker writes refused because a newer lease holds the run (a zombie fenced off)",
)
REAPER_ACTIONS = Counter(
    "jobplane_reaper_actions",
    "Runs the reaper moved, by transition: deadline_expire, cancel_timeout, reap_requeue, "
    "reap_expire, reap_cancel",
    ["action"],
)
SCHEDULE_FIRES = Counter(
    "jobplane_schedule_fires",
    "Fire times the scheduler acted on: created, duplicate (another scheduler fired it), "
    "overlap or template_disabled (skipped)",
    ["outcome"],
)
SCHEDULE_MISFIRES = Counter(
    "jobplane_schedule_misfires",
    "Fire times reached later than the misfire grace (the scheduler was down), by the "
    "schedule's misfirePolicy",
    ["policy"],
)
RUNS_HELD = Counter(
    "jobplane_runs_held",
    "Runs a claim held back because their template had maxRunning runs started; each goes "
    "back to its lane as one of those ends",
    ["template"],
)
RATE_LIMIT_DELAYS = Counter(
    "jobplane_rate_limit_delays",
    "Starts a rateLimit window refused: the run went back to wait for the window",
    ["template"],
)
RATE_LIMIT_DELAY = Histogram(
    "jobplane_rate_limit_delay_seconds",
    "How long a run a rateLimit window refused was told to wait",
    ["template"],
    buckets=(0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600),
)
LOCK_WAITS = Counter(
    "jobplane_lock_waits",
    "Runs handed back because a lock their step needs was held by another run, by lock name",
    ["lock"],
)
START_DELAY = Histogram(
    "jobplane_run_start_delay_seconds",
    "Claim-to-start latency: from when a new run could start (created, or its notBefore) "
    "to the claim that started it",
    ["queue"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600),
)
RUN_DURATION = Histogram(
    "jobplane_run_duration_seconds",
    "From a run's first start to its terminal status (runs that never started are left out)",
    ["template", "status"],
    buckets=(0.05, 0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600),
)
SCHEDULER_LAST_TICK = Gauge(
    "jobplane_scheduler_last_tick_timestamp_seconds",
    "When this process's scheduler last completed a maintenance tick (0: never)",
)


def run_claimed(run: Run) -> None:
    """Count a claim; a run's first claim also gives its start delay."""
    RUNS_CLAIMED.labels(run.template_type).inc()
    # A claim sets `heartbeatAt` to its time and `startedAt` only when unset: the two are equal
    # on the first claim alone. A later attempt has no due time on record to measure from.
    if run.started_at is not None and run.started_at == run.heartbeat_at:
        due = max(run.create_at, run.not_before or run.create_at)
        START_DELAY.labels(run.queue).observe(_seconds(run.started_at, due))


def rate_delayed(template_type: str, seconds: float) -> None:
    """Count a start a rate window refused, and how long its run waits."""
    RATE_LIMIT_DELAYS.labels(template_type).inc()
    RATE_LIMIT_DELAY.labels(template_type).observe(max(0.0, seconds))


def observe(run: Run, outcome: Moved | Lost | None, now: datetime) -> None:
    """Count what a write did to `run`: a terminal status reached, or a stale lease refused."""
    if isinstance(outcome, Lost):
        if outcome.reason == "lease":
            STALE_WRITES.inc()
        return
    if outcome is None or outcome.to not in TERMINAL:
        return
    RUNS_FINISHED.labels(run.template_type, outcome.to.value).inc()
    if run.started_at is not None:
        RUN_DURATION.labels(run.template_type, outcome.to.value).observe(
            _seconds(now, run.started_at)
        )


def reaped(run: Run, transition: str) -> None:
    """Count a reaper move by its transition; a `reap_*` one recovered an expired lease."""
    if transition.startswith("reap_"):
        LEASE_EXPIRIES.labels(run.template_type).inc()
    REAPER_ACTIONS.labels(transition).inc()


def serve_metrics(settings: Settings) -> None:
    """A worker's or scheduler's own metrics on `host:metrics_port` (none when the port is 0);
    a thread of prometheus_client's serves them."""
    if settings.metrics_port:
        start_http_server(settings.metrics_port, settings.host)


# -- state read at scrape time --------------------------------------------------------------


@dataclass(frozen=True)
class _Read:
    """Metric families read already, in the shape `generate_latest` collects."""

    families: list[Metric]

    def collect(self) -> Iterable[Metric]:
        return self.families


async def read_state(store: Store, queue: RedisQueue, queues: Sequence[str]) -> list[Metric]:
    """The platform's state as gauges, read now. Redis is asked for counts and the head of
    each priority, never whole sets, and MongoDB only for the queues templates name (a small
    collection the scheduler reads every tick too). Live workers are one read of the registry.

    A backend that does not answer is reported by `jobplane_backend_up`, and the figures read
    from it are left out rather than shown as zeros.
    """
    now = store.clock.now()
    up = GaugeMetricFamily(
        "jobplane_backend_up", "1 if this scrape could read MongoDB / Redis", labels=["backend"]
    )
    held = GaugeMetricFamily(
        "jobplane_runs_held_back",
        "Runs that could start but for a limit: concurrency (waiting for a place of their "
        "dedupe key), lock (handed back for a lock their step needs), max_running (held back "
        "until a started run of their template ends)",
        labels=["template", "reason"],
    )
    families: list[Metric] = [up, held]
    try:
        # Every queue a template names, an operator paused, or this process was told of.
        states = await store.queues.states()
        queues = sorted({*queues, *await store.templates.queues(), *(s.queue for s in states)})
        families += _started_state(queues, await store.overview.started_by_queue(), states)
        for (template, reason), count in sorted((await store.overview.held_back()).items()):
            held.add_metric([template, reason], count)
        up.add_metric(["mongodb"], 1)
    except PyMongoError:
        up.add_metric(["mongodb"], 0)
    try:
        live = await queue.live_workers()
        families += [
            *await _queues_state(queue, queues, now, live),
            *_workers_state(live),
            *await _scheduler_state(queue),
        ]
        for template, count in (await queue.limits.held_counts()).items():
            held.add_metric([template, "max_running"], count)
        up.add_metric(["redis"], 1)
    except REDIS_DOWN:
        up.add_metric(["redis"], 0)
    return families


Gauges = dict[tuple[str, tuple[str, ...]], float]


def gauges(state: list[Metric]) -> Gauges:
    """Each sample of `read_state`'s families by (name, label values)."""
    return {
        (sample.name, tuple(sample.labels.values())): sample.value
        for family in state
        for sample in family.samples
    }


def render(state: list[Metric]) -> bytes:
    """This process's counters, then the state figures, in Prometheus's text format."""
    return generate_latest(REGISTRY) + generate_latest(_Read(state))


async def _queues_state(
    queue: RedisQueue, queues: Sequence[str], now: datetime, live: dict[str, Offer]
) -> list[Metric]:
    depth = GaugeMetricFamily(
        "jobplane_queue_depth",
        "Runs in a queue's Redis sets: ready to claim (delayed runs now due included) or "
        "delayed (notBefore still ahead)",
        labels=["queue", "state"],
    )
    oldest = GaugeMetricFamily(
        "jobplane_queue_oldest_ready_age_seconds",
        "Age of the oldest ready run: since its creation (to the second), or since its "
        "notBefore while it waits in the delayed set; 0 when none is ready",
        labels=["queue"],
    )
    waiting = GaugeMetricFamily(
        "jobplane_runs_waiting_for_handler",
        "Runs (ready or delayed) whose current step's handler no live worker offers on their "
        "queue; they start once a worker that offers it does",
        labels=["queue", "handler"],
    )
    for name in queues:
        ready = delayed = 0
        times: list[datetime] = []
        for handler in [None, *await queue.lanes(name)]:
            lane = await queue.lane_depth(name, handler, now)
            ready, delayed = ready + lane.ready + lane.due, delayed + lane.delayed - lane.due
            times += [lane.oldest_at] if lane.oldest_at else []
            served = any(o.serves(name, handler) for o in live.values())
            if handler is not None and not served and lane.ready + lane.delayed:
                waiting.add_metric([name, handler], lane.ready + lane.delayed)
        depth.add_metric([name, "ready"], ready)
        depth.add_metric([name, "delayed"], delayed)
        oldest.add_metric([name], _seconds(now, min(times)) if times else 0.0)
    return [depth, oldest, waiting]


def _started_state(
    queues: Sequence[str], started: dict[str, int], states: Sequence[QueueState]
) -> list[Metric]:
    """Each queue's started runs and whether it is paused, from MongoDB."""
    running = GaugeMetricFamily(
        "jobplane_queue_started",
        "Runs of a queue started and not yet ended (running, waiting for an external worker, "
        "or asked to cancel)",
        labels=["queue"],
    )
    paused = GaugeMetricFamily(
        "jobplane_queue_paused",
        "1 while an operator has the queue paused: its runs wait, none starts",
        labels=["queue"],
    )
    pauses = {s.queue: s.paused for s in states}
    for name in queues:
        running.add_metric([name], started.get(name, 0))
        paused.add_metric([name], int(pauses.get(name, False)))
    return [running, paused]


def _workers_state(live: dict[str, Offer]) -> list[Metric]:
    """Workers that heartbeated within three heartbeats, and the runs they hold."""
    return [
        GaugeMetricFamily(
            "jobplane_workers_alive",
            "Workers that heartbeated within three heartbeats",
            len(live),
        ),
        GaugeMetricFamily(
            "jobplane_worker_runs_held",
            "Runs the live workers hold, as of their last heartbeat",
            sum(o.held for o in live.values()),
        ),
    ]


async def _scheduler_state(queue: RedisQueue) -> list[Metric]:
    """Whether a scheduler holds the singleton lock, and how long until it expires: the
    active one renews it at least every third of its TTL, so a falling TTL is a stalled one."""
    _, left = await queue.locks.singleton_holder("scheduler")
    return [
        GaugeMetricFamily(
            "jobplane_scheduler_leader",
            "1 while a scheduler holds the singleton lock",
            int(left > 0),
        ),
        GaugeMetricFamily(
            "jobplane_scheduler_lock_ttl_seconds",
            "Time left on the scheduler lock; 0 when no scheduler holds it",
            left,
        ),
    ]


def _seconds(later: datetime, earlier: datetime) -> float:
    # Clocks of different processes may disagree a little; a delay is never negative.
    return max(0.0, (later - earlier).total_seconds())
