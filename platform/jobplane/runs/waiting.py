"""Why a run that could start does not: what a run's `waitingFor` says, from the rules that
hold it back (`runs/admission/`), in the order a run meets them.

A paused queue starts nothing (`queue_paused`); a run may wait for a place of its dedupe key
or among its map step's active children (`concurrency`), for a worker that offers its current
step's handler (`handler`: workers claim only the lanes of the handlers they offer,
`queue/keys.py`, so nothing fails or spins meanwhile), for a lock its step needs (`lock`), for
a started run of its template to end (`max_running`), or for its rate window (`rate_limit`). A
run whose steps left are map steps waits for its children (`children`), counted as it is
answered. The pauses (MongoDB) and the worker registry (Redis) are read at most once per
`max_age` per process, so answering runs adds no round trip for them; whether a run is held
back or sent back by its limits is one pipelined Redis read per answer that holds such runs. A
fact that cannot be read leaves its reason out, never failing the answer.
"""

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from jobplane.errors import JobplaneError
from jobplane.model import CLAIMABLE, Run, WaitingFor
from jobplane.queue.entry import QueueEntry
from jobplane.queue.redis import RedisQueue
from jobplane.runs import children
from jobplane.runs.admission import concurrency, locks, pause, starts
from jobplane.runs.admission.pause import Pauses
from jobplane.store import Store

log = logging.getLogger("jobplane.runs")

Lane = tuple[str, str]


class Waiting:
    def __init__(self, store: Store, queue: RedisQueue, max_age: float = 1.0) -> None:
        self.store = store
        self.queue = queue
        self.max_age = max_age
        self.pauses = Pauses(store, queue, max_age)
        self._offered: frozenset[Lane] | None = None
        self._read_at = -math.inf

    async def offered(self) -> frozenset[Lane] | None:
        """The (queue, handler) lanes live workers offer; None while Redis does not answer.

        A failed read is remembered for `max_age` too: a Redis that does not answer costs one
        bounded wait a second, not one per request."""
        if time.monotonic() - self._read_at > self.max_age:
            try:
                live = await self.queue.live_workers()
                lanes = {(q, h) for o in live.values() for q in o.queues for h in o.handlers}
                self._offered = frozenset(lanes)
            except Exception as exc:
                # Only an explanation: it must never fail the answer it is part of. Beyond
                # `REDIS_DOWN`, redis-py's cluster client was seen to raise AttributeError and
                # RuntimeError from a connection torn down under it while a node restarted.
                log.warning("worker registry unreadable: %s", exc or type(exc).__name__)
                self._offered = None
            self._read_at = time.monotonic()
        return self._offered

    async def explain(self, runs: Sequence[Run]) -> list[Run]:
        """The runs, each with its `waiting_for` said."""
        waiting = [r for r in runs if r.status in CLAIMABLE]
        facts = _Facts(None, frozenset(), set(), {})
        if any(r.handler is not None for r in waiting):
            facts.offered = await self.offered()
        if waiting:
            try:
                facts.paused = await self.pauses.paused()
            except Exception as exc:
                log.warning("queue pauses unreadable: %s", exc or type(exc).__name__)
        capped = [QueueEntry.of(r) for r in waiting if r.max_running is not None]
        rated = [r for r in waiting if r.rate is not None]
        try:
            if capped:
                facts.holding = await self.queue.limits.holding(capped)
            if rated:
                due = await self.queue.delayed_until([QueueEntry.of(r) for r in rated])
                facts.due = {r.id: d for r, d in zip(rated, due, strict=True) if d is not None}
        except Exception as exc:
            log.warning("runs held back unreadable: %s", exc or type(exc).__name__)
        explained = [r.model_copy(update={"waiting_for": _reason(r, facts)}) for r in runs]
        return [await self._counted(r) for r in explained]

    async def _counted(self, run: Run) -> Run:
        """A run with map steps that made children, with their counts read."""
        if not any(s.map for s in run.progress.steps):
            return run
        try:
            return children.counted(run, await self.store.children.counts(run))
        except Exception as exc:
            log.warning("children of run %s uncounted: %s", run.id, exc or type(exc).__name__)
            return run

    async def explain_created(
        self, outcomes: Sequence[tuple[Run, bool] | JobplaneError]
    ) -> list[tuple[Run, bool] | JobplaneError]:
        """What `RunService.create_many` answered, each run in it explained."""
        runs = iter(await self.explain([o[0] for o in outcomes if isinstance(o, tuple)]))
        return [(next(runs), o[1]) if isinstance(o, tuple) else o for o in outcomes]


@dataclass
class _Facts:
    """What the explanations are read from: the lanes live workers offer (None: unknown), the
    paused queues, the runs held back by `maxRunning`, and when runs a rate window sent back
    fall due."""

    offered: frozenset[Lane] | None
    paused: frozenset[str]
    holding: set[str]
    due: dict[str, datetime]


def _reason(run: Run, facts: _Facts) -> WaitingFor | None:
    if run.status not in CLAIMABLE:
        return None
    return (
        pause.waiting_for(run, facts.paused)
        or concurrency.waiting_for(run)
        or children.place_wait(run)
        or _handler(run, facts.offered)
        or locks.waiting_for(run)
        or starts.held_back(run, facts.holding)
        or starts.rate_delayed(run, facts.due.get(run.id))
    )


def _handler(run: Run, offered: frozenset[Lane] | None) -> WaitingFor | None:
    if run.handler is None or offered is None or (run.queue, run.handler) in offered:
        return None
    return WaitingFor(reason="handler", detail=run.handler)
