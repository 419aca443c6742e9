"""A run's holder lending steps to other workers (docs/architecture.md, "Lent steps").

A holder that cannot run a ready step (its handler is offered by other workers) while other
steps of the run run here lends it: the step's own lease waits in its handler's lane, a
worker offering the handler claims it (`Runner.run_lent`), runs it and reports how it ended.
The holder watches for that report and writes the step's end as it would its own. It takes
the step back when the borrower's lease runs out (the step's try failed, as a reaped run's
does), or when nobody claimed it and the holder has nothing else of the run to do (the run is
then handed on whole, as before lending).
"""

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from jobplane.clock import Clock
from jobplane.model import RunError, StepOutcome, StepStatus
from jobplane.queue.connect import REDIS_DOWN
from jobplane.queue.entry import QueueEntry
from jobplane.queue.redis import RedisQueue
from jobplane.runs.lifecycle import HeldStep
from jobplane.store import Lease, Lost, Store
from jobplane.store.types import step_key

log = logging.getLogger("jobplane.worker")

# How often the holder reads a lent step, from the first look to the slowest. The borrower's
# report wakes it at once (a Redis signal): the reads are for a signal lost, and for the
# borrower's lease running out. Reads from 20 ms on cost 8.6 queries and 17 ms of worker CPU
# a run in bench/flows.py's "lent" workload, as every holder polled its steps.
WATCH_FIRST = 0.25
WATCH_MOST = 5.0
# How often an unclaimed step's queue entry is pushed again, should Redis have lost it.
PUSH_AGAIN = 5.0


class LentFailed(Exception):
    """A lent step's try failed: as its borrower reported, or its borrower's lease ran out."""

    def __init__(self, error: RunError, retryable: bool) -> None:
        super().__init__(error.message)
        self.error = error
        self.retryable = retryable


class TakenBack(Exception):
    """Nobody claimed the lent step while the holder had nothing else of the run to do."""


class HolderLost(Exception):
    """The holder's lease no longer holds the run: someone else decides its fate now."""


@dataclass
class Lending:
    store: Store
    queue: RedisQueue
    clock: Clock
    lease_seconds: float
    # The lent steps watched here, by queue entry id: set when their borrower reports.
    _reports: dict[str, asyncio.Event] = field(default_factory=dict, init=False)

    def reported(self, key: str) -> None:
        """A borrower reported the end of lent step `key`: its watch, if here, reads it now."""
        if (event := self._reports.get(key)) is not None:
            event.set()

    async def report(self, lease: Lease, outcome: StepOutcome) -> Lost | None:
        """The borrower's report of its step's end, and the signal that wakes the holder."""
        written = await self.store.lending.report(lease, outcome)
        if written is None:
            with contextlib.suppress(*REDIS_DOWN):  # the holder's next look finds it
                await self.queue.signal_reported(lease.key)
        return written

    async def lend(self, at: HeldStep, handler: str, attempt: int) -> Lost | None:
        """Lend step `at` (its `attempt`-th try) to a worker offering `handler`."""
        lent = await self.store.lending.lend(at.lease, at.index, at.id, handler, attempt)
        if lent is None:
            await self._push(at, handler)
        return lent

    async def give_back(self, at: HeldStep, handler: str) -> Lost | None:
        """A borrower shutting down lends the step again, to another worker."""
        given = await self.store.lending.give_back(at.lease, at.id)
        if given is None:
            await self._push(at, handler)
        return given

    async def watch(
        self,
        at: HeldStep,
        handler: str,
        check: Callable[[], None],
        asked: Callable[[], bool],
        idle: Callable[[], bool],
    ) -> StepOutcome:
        """Wait for lent step `at` to end: its borrower's report. `check` raises what stops
        the holder; `asked` says the holder wants the step stopped (its borrower is told; a
        step not claimed yet is taken back, and reported cancelled with no start to write);
        `idle` that the holder has nothing else of the run to do."""
        key = step_key(at.run.id, at.index)
        woken = self._reports[key] = asyncio.Event()
        try:
            return await self._watch(at, handler, check, asked, idle, woken)
        finally:
            self._reports.pop(key, None)

    async def _watch(
        self,
        at: HeldStep,
        handler: str,
        check: Callable[[], None],
        asked: Callable[[], bool],
        idle: Callable[[], bool],
        woken: asyncio.Event,
    ) -> StepOutcome:
        loop = asyncio.get_running_loop()
        pause = WATCH_FIRST
        unclaimed = pushed = loop.time()
        stop_asked = False
        while True:
            check()
            step = await self.store.lending.step(at.lease, at.index)
            if step is None:
                raise HolderLost(at.run.id)
            lent = step.lease
            if lent is None:  # taken back by an earlier holder of the run, which lost it since
                raise HolderLost(at.run.id)
            if lent.outcome is not None:
                return lent.outcome
            if asked() and lent.worker_id is None:
                # Not claimed yet: nobody is to stop, and nobody may start it now.
                reason = "its run stops"
                if await self.store.lending.take_back(at.lease, at.index, at.id, None, reason):
                    continue  # claimed meanwhile, or the holder lost the run: read again
                stopped = StepStatus.CANCELLED
                return StepOutcome(status=stopped, started_at=self.clock.now(), start_written=True)
            if asked() and not stop_asked:
                stop_asked = True
                await self.store.lending.ask_stop(at.lease, at.index)
                with contextlib.suppress(*REDIS_DOWN):  # its heartbeat hears it anyway
                    await self.queue.signal_cancel(step_key(at.run.id, at.index))
            now = loop.time()
            if lent.token is not None:
                unclaimed = now
                if lent.until is not None and lent.until < self.clock.now():
                    reason = f"the step lease of {lent.worker_id} ran out"
                    took = await self.store.lending.take_back(
                        at.lease, at.index, at.id, lent.token, reason
                    )
                    if took is None:
                        error = RunError(code="lease_expired", message=reason, step=at.id)
                        raise LentFailed(error, retryable=True)
            elif now - unclaimed >= self.lease_seconds and idle():
                reason = f"no worker offering {handler!r} claimed it"
                if await self.store.lending.take_back(at.lease, at.index, at.id, None, reason):
                    continue  # claimed meanwhile, or the holder lost the run: read again
                raise TakenBack(at.id)
            elif now - pushed >= PUSH_AGAIN:
                pushed = now
                await self._push(at, handler)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), pause)
            woken.clear()
            pause = min(2 * pause, WATCH_MOST)

    async def _push(self, at: HeldStep, handler: str) -> None:
        """Put the lent step in its handler's lane; one Redis lost is pushed again."""
        try:
            await self.queue.push([QueueEntry.lent(at.run, at.index, handler)], self.clock.now())
        except REDIS_DOWN as exc:
            log.warning("run %s: lent step %s not pushed yet: %s", at.run.id, at.id, exc)
