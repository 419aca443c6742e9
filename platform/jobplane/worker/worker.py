"""The worker: claims runs, keeps their leases alive, and has its runner run their steps.

One claim loop fills free slots (a batch per Redis call), one heartbeat loop renews every
lease this worker holds, and one listener turns Redis cancel signals into flags. Each run
claimed gets a task of its own, in which `worker/runner.py` runs its steps in order. A run
whose lease is lost has its handler interrupted at once and writes nothing more.
"""

import asyncio
import contextlib
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from jobplane import metrics
from jobplane.clock import Clock, SystemClock
from jobplane.model import RunStatus
from jobplane.process import CANCEL_SECONDS, finish_within, log_context
from jobplane.queue.pop import Popped
from jobplane.queue.redis import RedisQueue
from jobplane.runs.admission.locks import Locks, holder
from jobplane.runs.admission.pause import Pauses
from jobplane.runs.lifecycle import Lifecycle
from jobplane.runs.service import RunService
from jobplane.settings import Settings
from jobplane.store import Store
from jobplane.store.types import lease_token, step_of
from jobplane.worker import spans
from jobplane.worker.handlers import HandlerRegistry, registry
from jobplane.worker.held import Held
from jobplane.worker.lending import Lending
from jobplane.worker.runner import Runner

log = logging.getLogger("jobplane.worker")

# A run whose only running steps are lent holds no slot (it runs no handler here, and held
# slots would let two workers fill up with runs each waiting for a step only the other can
# take); this caps how many runs a worker holds in all, as a multiple of its concurrency.
HELD_MOST = 4

# With runs waiting and few slots free, how long the claim loop may wait for more slots to
# free up, so that it claims them together. 5 ms halved the claims' batches once the Redis
# lock mirror's round trip no longer paced the loop: docs/benchmarks.md, "Issue 21".
CLAIM_GATHER = 0.01


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"


class Worker:
    def __init__(
        self,
        store: Store,
        queue: RedisQueue,
        settings: Settings,
        handlers: HandlerRegistry = registry,
        worker_id: str | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.store = store
        self.queue = queue
        self.settings = settings
        self.handlers = handlers
        self.id = worker_id or settings.worker_id or default_worker_id()
        self.clock = clock or SystemClock()
        self.lifecycle = Lifecycle(store, queue, self.clock)
        self.pauses = Pauses(store, queue)
        self.held: dict[str, Held] = {}
        # The handlers this worker claims runs for: the lanes it pops, which its heartbeat
        # advertises. A run whose step needs another is handed on, never failed.
        self.offered = handlers.offered()
        self._slot_free = asyncio.Event()
        self._closing = asyncio.Event()
        # Sync handlers get a thread each, up to the concurrency: none waits for a free thread.
        self._threads = ThreadPoolExecutor(settings.worker_concurrency, "jobplane-step")
        self.locks = Locks(store, queue, settings.lease_seconds)
        # The steps lent to this worker that it runs now, by queue entry id (`Lease.key`).
        self.borrowed: dict[str, Held] = {}
        self.runner = Runner(
            store,
            self.lifecycle,
            handlers,
            self.offered,
            self.clock,
            self._threads,
            self._renew,
            self.locks,
            RunService(store, queue, self.lifecycle),
            Lending(store, queue, self.clock, settings.lease_seconds),
            self._slot_free.set,
        )

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, drain_seconds: float = 30) -> None:
        """Work until `stop` is set, then drain: running steps get `drain_seconds` to finish,
        and runs still unfinished are released back to `queued` without spending an attempt.

        The releases and the loops' ends get `settings.close_seconds` after the drain: past
        that, whatever waits on an engine that does not answer is cancelled. Those runs' leases
        expire and the reaper recovers them, as after a crash."""
        log.info(
            "worker %s started: queues %s, concurrency %d, handlers %s",
            self.id,
            ", ".join(self.settings.queues),
            self.settings.worker_concurrency,
            ", ".join(self.offered),
        )
        # Tasks copy the context as they are created: the loops', and so the runs', log lines
        # name this worker.
        with log_context(worker_id=self.id):
            loops = [
                asyncio.create_task(self._claim_loop(stop)),
                asyncio.create_task(self._heartbeat_loop()),
                asyncio.create_task(self._cancel_listener()),
            ]
        try:
            await stop.wait()
            await self._drain(loops[0], drain_seconds)
        finally:
            # The loops end on `_closing`. Cancellation is only a backstop: a cancel that lands
            # inside a driver's network call can be absorbed there and never reach the loop.
            self._closing.set()
            for held in self._holding():
                held.interrupt("shutdown")  # each run then releases itself, each step gives back
            ending = [*self._tasks(), *loops]
            _, late = await asyncio.wait(ending, timeout=self.settings.close_seconds)
            if late:
                log.warning("%d tasks did not end within the close budget: cancelled", len(late))
                for task in late:
                    task.cancel()
                await asyncio.wait(late, timeout=CANCEL_SECONDS)
            self._threads.shutdown(wait=False)
            # No claim uses them any more: others may, now rather than at their fence.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CANCEL_SECONDS):
                    await self.lifecycle.starts.give_back_spares(everything=True)
            # Gone at once from the live workers, rather than when its time runs out; a
            # courtesy, so a Redis that does not answer gets a second for it.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CANCEL_SECONDS):
                    await self.queue.withdraw(self.id)
        log.info("worker %s stopped", self.id)

    async def _drain(self, claiming: asyncio.Task[None], seconds: float) -> None:
        """Let the claim loop end and running steps finish, within `seconds`."""
        loop = asyncio.get_running_loop()
        drained = loop.time() + seconds
        self._slot_free.set()  # a claim loop waiting for a free slot sees the stop
        # A pop in flight may block for `poll_seconds`, and is let finish (the ids it took
        # would otherwise wait for the reconciler). A claim MongoDB does not answer is cut
        # short: a lease it may have granted expires.
        await finish_within(claiming, max(seconds, self.settings.poll_seconds), "the claim loop")
        if self._tasks():
            await asyncio.wait(self._tasks(), timeout=max(0.0, drained - loop.time()))

    def _free(self) -> int:
        """Slots free for claims: those no run's handler (its own or one lent here) takes,
        within the cap on runs held in all."""
        concurrency = self.settings.worker_concurrency
        busy = sum(1 for h in self.held.values() if not h.watching) + len(self.borrowed)
        held = len(self.held) + len(self.borrowed)
        return min(concurrency - busy, HELD_MOST * concurrency - held)

    def _holding(self) -> list[Held]:
        """The runs this worker holds and the steps lent to it."""
        return [*self.held.values(), *self.borrowed.values()]

    def _tasks(self) -> list[asyncio.Task[None]]:
        return [h.task for h in self._holding() if h.task]

    # -- claiming ------------------------------------------------------------------------------

    async def _claim_loop(self, stop: asyncio.Event) -> None:
        queues = self.settings.queues
        concurrency = self.settings.worker_concurrency
        # The last pop filled every free slot: runs are waiting. Then slots are let to free up
        # a little before the next claim, so one claim takes many runs rather than each run
        # that ends paying for a claim of its own.
        backlog = False
        gathered = 0.0
        # Until when a pop may block: the earliest delayed run's due time, which only a pop
        # promotes. Unknown at first, so the first pop does not block.
        due = self.clock.now()
        # The queues paused at the last pop, whose lanes a blocking pop does not wait on.
        paused: frozenset[str] = frozenset()
        while not stop.is_set():
            free = self._free()
            if free <= 0 or (backlog and free < concurrency // 4 and gathered < CLAIM_GATHER):
                self._slot_free.clear()
                waited = time.monotonic()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._slot_free.wait(), CLAIM_GATHER if free else None)
                gathered += time.monotonic() - waited
                continue
            gathered = 0.0
            try:
                now = self.clock.now()
                # Under a backlog a blocking pop would take its first run lane by lane, not
                # by priority; and it would not wait anyway.
                block = (
                    0 if backlog else min(self.settings.poll_seconds, (due - now).total_seconds())
                )
                popped = await self.queue.pop(queues, free, now, block, self.offered, paused)
                if not popped.mirrored:
                    log.info("Redis holds no copy of the queues' pauses: loading it from MongoDB")
                    await self.pauses.mirror()
                    continue
                paused = popped.paused
                due = popped.next_due or now + timedelta(seconds=self.settings.poll_seconds)
                backlog = len(popped.run_ids) == free
                runs, lent = [], []
                for key in popped.run_ids:
                    if (step := step_of(key)) is None:
                        runs.append(key)
                    else:
                        lent.append(step)
                if lent:
                    await self.borrow(lent)
                for limits, due in popped.refused:
                    metrics.rate_delayed(limits.template_type, (due - now).total_seconds())
                if runs:
                    await self.claim(runs, popped)
            except Exception:
                # MongoDB or Redis unreachable: back off, the runs wait safely where they are.
                log.exception("claim failed; retrying")
                await asyncio.sleep(self.settings.poll_seconds)

    async def claim(self, run_ids: list[str], popped: Popped | None = None) -> None:
        """Take the leases MongoDB grants among `run_ids` (`popped`, the pop that took them:
        the limits of the runs that have some to pass as they start) and start their runs.

        The locks of the first steps of runs claimed plainly are taken beside their claim,
        under the lease token it grants them: a run's step then starts without a round trip to
        Redis after MongoDB's. Those of runs the claim did not lease under that token are let
        go after it."""
        limits = popped.limits if popped else {}
        seconds = self.settings.lease_seconds
        token = lease_token()
        ahead = {i: sl.locks for i, sl in limits.items() if sl.locks and not sl.gated}
        asked = time.monotonic()
        taking = asyncio.ensure_future(self.locks.take_ahead(ahead, token)) if ahead else None
        adopted: set[str] = set()
        try:
            async for claimed in self.lifecycle.starts.claim(
                run_ids, self.id, seconds, popped, token
            ):
                for run, lease in claimed:
                    metrics.run_claimed(run)
                    held = Held(run, lease)
                    if run.id in ahead and lease.token == token:
                        held.ahead = taking
                        held.answered(asked)
                        adopted.add(run.id)
                    if run.status == RunStatus.CANCEL_REQUESTED:  # asked between claim and read
                        held.cancel.set()
                    self.held[run.id] = held
                    # The task copies the context as it is created: its log lines carry the run.
                    with log_context(run_id=run.id, lease_token=lease.token):
                        held.task = asyncio.create_task(self._execute(held))
        finally:
            if taking is not None:
                unused = {i: t for i, t in (await taking).items() if i not in adopted}
                if unused:
                    await self.locks.give_back(unused, token, self.clock.now())

    async def borrow(self, steps: list[tuple[str, int]]) -> None:
        """Claim those of the popped lent `steps` (run id, step index) that are lent still,
        and run them."""
        seconds = self.settings.lease_seconds
        for run, lease in await self.store.lending.claim(steps, self.id, seconds):
            held = Held(run, lease)
            self.borrowed[lease.key] = held
            with log_context(run_id=run.id, lease_token=lease.token):
                held.task = asyncio.create_task(self._execute_lent(held))

    # -- executing -----------------------------------------------------------------------------

    async def _execute(self, held: Held) -> None:
        try:
            with spans.process(held.run):
                await self.runner.run(held)
        finally:
            self.held.pop(held.run.id, None)
            self._slot_free.set()

    async def _execute_lent(self, held: Held) -> None:
        try:
            with spans.process(held.run):
                await self.runner.run_lent(held)
        finally:
            self.borrowed.pop(held.lease.key, None)
            self._slot_free.set()

    # -- leases and signals --------------------------------------------------------------------

    async def _closed_within(self, seconds: float) -> bool:
        """Wait up to `seconds`; True once the worker is closing."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closing.wait(), seconds)
        return self._closing.is_set()

    async def _heartbeat_loop(self) -> None:
        # The first beat comes at once: the worker counts as alive from its start. Beats keep
        # to a fixed clock, so a slow renewal does not push every later one back.
        interval = self.settings.heartbeat_seconds
        beat = time.monotonic()
        while True:
            try:
                await self._renew(self._holding())
                await self.queue.mark_alive(
                    self.id,
                    3 * self.settings.heartbeat_seconds,
                    len(self.held) + len(self.borrowed),
                    self.settings.queues,
                    self.offered,
                )
                await self.lifecycle.starts.give_back_spares()
            except Exception:
                log.exception("heartbeat failed; retrying at the next beat")
            # Unrenewed past the lease length (MongoDB unreachable, the process stalled): the
            # reaper may have given the run to another worker, so stop working on it.
            deadline = time.monotonic() - self.settings.lease_seconds
            for held in self._holding():
                if held.renewed < deadline and held.busy and held.stop is None:
                    log.warning(
                        "run %s: lease not renewed in time; stopping",
                        held.run.id,
                        extra=held.log_fields,
                    )
                    held.interrupt("lost")
            # A beat that took longer than the interval is not made up for: the next one is due.
            beat = max(beat + interval, time.monotonic())
            if await self._closed_within(beat - time.monotonic()):
                return

    async def _renew(self, helds: list[Held]) -> None:
        """Renew leases in MongoDB, which alone says who holds a run, and the locks their
        steps hold in Redis."""
        if not helds:
            return
        ttl = self.settings.lease_seconds
        asked = time.monotonic()
        runs = [h.lease for h in helds if h.lease.step is None]
        steps = [h.lease for h in helds if h.lease.step is not None]
        kept, cancel = await self.store.leases.heartbeat(self.id, runs, ttl)
        if steps:
            kept_steps, stop_steps = await self.store.lending.heartbeat(steps, ttl)
            kept, cancel = kept | kept_steps, cancel | stop_steps
        await self._renew_locks([h for h in helds if h.lease.key in kept and h.locks])
        for held in helds:
            if held.lease.key in kept:
                held.renewed = asked
                if held.lease.key in cancel:
                    held.cancel.set()
            else:
                # Not renewed means lost only while a handler runs: then no write of the worker's
                # own can have ended the lease. Outside a handler the run may have just finished,
                # and the worker's next write, fenced by MongoDB, finds a real loss by itself.
                # Once stopped, a sync handler's thread may run on: the loss is recorded once.
                if held.busy and held.stop is None:
                    log.warning(
                        "run %s: lease lost; stopping its handler",
                        held.run.id,
                        extra=held.log_fields,
                    )
                    held.interrupt("lost")
                    lost = await self.store.leases.lease_lost(held.lease, "heartbeat")
                    self.lifecycle.observe(held.run, lost)

    async def _renew_locks(self, helds: list[Held]) -> None:
        """Extend the locks the runs' steps hold, every run's at once: they share one round
        trip, so a beat's renewals come as close together as they can. A step whose lock was
        lost (it expired, or Redis was wiped) no longer excludes anyone: its handler is stopped
        and the run handed back, to take the lock again."""
        await asyncio.gather(*map(self._renew_run_locks, helds))

    async def _renew_run_locks(self, held: Held) -> None:
        owner = holder(held.run.id, held.lease.token)
        asked, renewing = time.monotonic(), list(held.locks)
        lost = await self.locks.renew(renewing, owner)
        if not lost:
            if held.locks.keys() <= set(renewing):  # none taken meanwhile
                held.locks_answered = asked
        elif held.busy and held.stop is None:
            log.warning(
                "run %s: locks %s lost; stopping its step",
                held.run.id,
                sorted(lost),
                extra=held.log_fields,
            )
            held.interrupt("lock")

    async def _cancel_listener(self) -> None:
        while not self._closing.is_set():
            try:
                async for signal, key in self.queue.signals(until=self._closing):
                    if signal == "reported":  # a step this worker lent, perhaps
                        self.runner.lending.reported(key)
                        continue
                    # A run's id (its holder, and the steps of it lent here), or a lent
                    # step's key (its holder asks it to stop).
                    if key in self.held:
                        self.held[key].cancel.set()
                    for lent in self.borrowed.values():
                        if key in (lent.run.id, lent.lease.key):
                            lent.cancel.set()
            except Exception:
                # Heartbeats carry cancels from MongoDB, and holders read their lent steps,
                # so a gap here only adds latency.
                log.warning("signal listener lost Redis; reconnecting")
                await self._closed_within(1)
