"""One scheduler is active at a time, through the owner-checked Redis lock.

Each tick fires due schedules, reaps expired leases, reconciles Redis with MongoDB (pending runs
are queued, queued runs missing from Redis after a flush or failover are pushed again, and
delayed runs whose `notBefore` has come are promoted), copies the events a dead process never
copied from the runs' trails to `job_events`, and archives terminal runs past retention.

Redis sorted sets ignore a second add of the same id, and MongoDB decides every claim, so a
redundant push costs a wasted pop, never a second execution.
"""

import asyncio
import contextlib
import logging
import os
from datetime import timedelta

from jobplane import metrics
from jobplane.clock import Clock, SystemClock
from jobplane.model import RunStatus
from jobplane.process import finish_within
from jobplane.queue.entry import QueueEntry
from jobplane.queue.redis import RedisQueue
from jobplane.runs.admission.pause import Pauses
from jobplane.runs.lifecycle import Lifecycle
from jobplane.schedules import ScheduleService
from jobplane.settings import Settings
from jobplane.store import Moved, Store

log = logging.getLogger("jobplane.scheduler")

# How often a tick sweeps the trails for events a dead process never copied. Each sweep looks
# back over the writers' clock skew too (30 s), so at every tick (5 s) it read each run's events
# seven times over: at 250 runs/s that was most of MongoDB's work.
SWEEP_SECONDS = 60.0
# How long an ended parent's own process has to cancel its children before the tick does.
ORPHANED_AFTER = timedelta(seconds=30)


class Scheduler:
    def __init__(
        self,
        store: Store,
        queue: RedisQueue,
        settings: Settings,
        clock: Clock | None = None,
        owner: str | None = None,
    ) -> None:
        self.store = store
        self.queue = queue
        self.settings = settings
        self.clock = clock or SystemClock()
        self.lifecycle = Lifecycle(store, queue, self.clock)
        self.owner = owner or f"scheduler-{os.getpid()}-{os.urandom(4).hex()}"
        self._swept = -SWEEP_SECONDS

    async def run(self, stop: asyncio.Event) -> None:
        """Hold the singleton lock and tick until `stop`: a tick in flight then gets
        `settings.close_seconds` to finish, and so does letting go of the lock.

        A tick cut short is safe: each of its writes is a whole transition, and the next active
        scheduler does the rest. A lock not let go expires after its TTL."""
        log.info("scheduler %s started", self.owner)
        ticking = asyncio.create_task(self._tick_loop(stop))
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait([ticking, stopping], return_when=asyncio.FIRST_COMPLETED)
            await finish_within(ticking, self.settings.close_seconds, "the scheduler's tick")
        finally:
            stopping.cancel()
            if not ticking.done():
                ticking.cancel()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.settings.close_seconds):
                    await self.queue.locks.release_singleton("scheduler", self.owner)

    async def _tick_loop(self, stop: asyncio.Event) -> None:
        """Schedules fire the moment they are due (the loop sleeps until the earliest
        `nextRunAt`), the rest of the tick runs every interval."""
        ttl = self.settings.scheduler_lock_seconds
        interval = min(self.settings.reconcile_seconds, ttl / 3)
        loop = asyncio.get_running_loop()
        maintained = -interval
        active = False
        while not stop.is_set():
            wait = interval
            try:
                holds = await self.queue.locks.take_singleton("scheduler", self.owner, ttl)
                if holds != active:  # say when this one takes over or is taken over from
                    active = holds
                    log.info("scheduler %s %s", self.owner, "active" if holds else "stands by")
                if holds:
                    if loop.time() - maintained >= interval:
                        maintained = loop.time()
                        await self.tick()
                    else:
                        await self.fire()
                    wait = min(interval - (loop.time() - maintained), ttl / 3)
                    if (due := await self.store.schedules.next_fire_time()) is not None:
                        wait = min(wait, (due - self.clock.now()).total_seconds())
            except Exception:
                log.exception("scheduler tick failed; retrying")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, wait))

    async def fire(self) -> int:
        """Fire the schedules that are due; returns how many runs were created."""
        schedules = ScheduleService(self.store, self.queue)
        batch, grace = self.settings.reap_batch, self.settings.misfire_grace_seconds
        return await schedules.fire_due(self.clock.now(), batch, grace)

    async def tick(self) -> None:
        fired = await self.fire()
        reaped = await self.reap()
        queued = await self.reconcile()
        swept = 0
        loop = asyncio.get_running_loop()
        if loop.time() - self._swept >= SWEEP_SECONDS:
            self._swept = loop.time()
            # Writers copy their own events within milliseconds; a tick later, nobody will.
            settled = self.clock.now() - timedelta(seconds=self.settings.reconcile_seconds)
            swept = await self.store.trail.sweep(settled)
        retained = timedelta(days=self.settings.run_retention_days)
        archived = await self.store.maintenance.archive(
            self.clock.now() - retained, self.settings.reap_batch
        )
        metrics.SCHEDULER_LAST_TICK.set_to_current_time()
        if fired or reaped or queued or swept or archived:
            log.info(
                "tick: fired %d, reaped %d, queued %d, swept %d events, archived %d",
                fired,
                reaped,
                queued,
                swept,
                archived,
            )

    async def reap(self) -> int:
        """End runs past their deadline or cancel grace, and recover runs whose lease expired
        (requeued runs go back to Redis). Returns how many runs moved."""
        batch = self.settings.reap_batch
        late, slow = await self.store.maintenance.overdue(batch)
        outcomes = [
            *[await self.lifecycle.overdue(run) for run in late],
            *[await self.lifecycle.cancel_timeout(run) for run in slow],
            *[
                await self.lifecycle.reap(run)
                for run in await self.store.maintenance.expired_leases(batch)
            ],
        ]
        return sum(isinstance(o, Moved) for o in outcomes)

    async def mend_families(self) -> None:
        """Carry out what a process that died left undone between map steps and their
        children: a parent whose children ended is queued, a free place goes to a waiting
        child, and the children of an ended parent are cancelled."""
        batch, actor = self.settings.reap_batch, "scheduler"
        since = self.clock.now() - timedelta(seconds=self.settings.reconcile_seconds)
        try:
            for parent in await self.store.children.waiting_parents(batch):
                if parent.update_at < since:  # a younger one is looked at by its own writer
                    await self.lifecycle.wake(parent.id, actor)
            for child in await self.store.children.waiting_children(batch):
                await self.lifecycle.admit_children(child, actor)
            # A parent's own end carries its cancel to its children; the tick steps in only
            # once that has had time to, or it would race it (and name itself the canceller).
            ended = self.clock.now() - ORPHANED_AFTER
            for parent in await self.store.children.orphaned(batch, ended):
                reason = f"parent run {parent.id} ended {parent.status.value}"
                await self.lifecycle.cancel_children(parent, actor, reason)
        except Exception:  # the rest of the tick goes on; the next tick tries again
            log.exception("mending map steps' families failed")

    async def reconcile(self) -> int:
        """Queue pending runs, re-push queued runs that Redis lost, and admit runs waiting for
        a dedupe key that is free (the process that freed it may have died before it could).
        The queues' pauses are copied to Redis first, so that a run pushed back after a Redis
        loss finds its queue's pause there."""
        await Pauses(self.store, self.queue).mirror()
        # Runs `maxRunning` held back whose hand-over was lost (the process that ended a run
        # of their template died first, or Redis lost the hand-over).
        await self.lifecycle.starts.release_all_room()
        for key in await self.store.maintenance.waited_keys(self.settings.reap_batch):
            try:
                await self.lifecycle.admit_next(key, "scheduler")
            except Exception:  # one key's trouble must not hold up the rest of the tick
                log.exception("admitting the next run for key %s failed", key)
        await self.mend_families()
        # Workers promote delayed runs as they pop; this covers queues no worker is polling, so
        # their ready sets (and what they show) stay true.
        await self.queue.promote(await self.store.templates.queues(), self.clock.now())
        pushed = 0
        after: str | None = None
        # A run created within the last tick is most likely still on its way into Redis.
        idle_since = self.clock.now() - timedelta(seconds=self.settings.reconcile_seconds)
        while True:
            runs = await self.store.maintenance.to_reconcile(
                after, self.settings.reap_batch, idle_since
            )
            if not runs:
                return pushed
            after = runs[-1].id
            # Runs are created `queued`. A pending one here took its dedupe key in a process
            # that died before queueing it, or was created by an earlier version.
            for run in runs:
                if run.status == RunStatus.PENDING:
                    if isinstance(await self.lifecycle.enqueue(run, "scheduler"), Moved):
                        pushed += 1
            entries = [QueueEntry.of(r) for r in runs if r.status != RunStatus.PENDING]
            missing = await self.queue.missing(entries)
            await self.queue.push(missing, self.clock.now())
            pushed += len(missing)
