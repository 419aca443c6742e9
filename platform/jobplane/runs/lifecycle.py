"""Run transitions with what follows them: the Redis hint, the next run admitted, the metrics.

MongoDB decides and Redis hints. A write that queues a run (a retry, a release, a reap, an
admission) is followed here by its push to Redis; one that ends a run, by the admission of the
next run waiting for its dedupe key; every write, by its metrics. Workers, external steps, the
scheduler and the API make their run writes through `Lifecycle`, so none of them follows a
transition up by itself. A follow-up that fails does not undo its write: MongoDB holds the
truth, and the scheduler's reconciler pushes and admits whatever was left undone.
"""

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jobplane import metrics
from jobplane.clock import Clock
from jobplane.model import TERMINAL, LockWait, Run, RunError, RunStatus, Template
from jobplane.queue.connect import REDIS_DOWN
from jobplane.queue.entry import QueueEntry
from jobplane.queue.redis import RedisQueue
from jobplane.runs import children
from jobplane.runs.admission.starts import Starts
from jobplane.runs.policy import cancel_grace, cancel_of, lease_expired, retry_at
from jobplane.store import KeyHeld, Lease, Lost, Moved, StepEnd, Store

log = logging.getLogger("jobplane.runs")


@dataclass(frozen=True)
class StepStart:
    """When a step began, and which of its tries that is (`progress.steps[i].attempt`)."""

    at: datetime
    attempt: int


def _unwritten(start: StepStart | None) -> dict[str, Any]:
    """A step's start that goes with the write ending it, as the store's writes take it."""
    return {"started_at": start.at, "attempt": start.attempt} if start else {}


@dataclass(frozen=True)
class HeldStep:
    """Step `index` of `run`, which `lease` holds: what its holder's writes are about.
    `done`: how many of the run's steps had ended when it began, for the run's percentage."""

    run: Run
    lease: Lease
    template: Template
    index: int
    done: int

    @property
    def id(self) -> str:
        return self.template.steps[self.index].id

    def percentage(self, step_percentage: float = 100) -> float:
        """The run's percentage with this step `step_percentage` done."""
        return 100 * (self.done + step_percentage / 100) / len(self.template.steps)


class Lifecycle:
    """Every process's run writes, each followed by the push, admission and metrics it entails."""

    def __init__(self, store: Store, queue: RedisQueue, clock: Clock | None = None) -> None:
        self.store = store
        self.queue = queue
        self.clock = clock or store.clock
        self.starts = Starts(store, queue, self.clock)
        self._with_maps: dict[tuple[str, int], bool] = {}

    # -- the lease holder's writes: an inline worker's, or an external one's through the API --

    async def start_step(self, step: HeldStep, start: StepStart) -> Lost | None:
        started = await self.store.leases.start_step(
            step.lease, step.index, step.id, start.at, start.attempt
        )
        self.observe(step.run, started)
        return started

    async def report_progress(
        self, step: HeldStep, percentage: float, message: str | None
    ) -> Lost | None:
        """A step's own progress, and the run's: the steps ended done, this one `percentage`."""
        written = await self.store.leases.report_progress(
            step.lease, step.index, percentage, step.percentage(percentage), message
        )
        self.observe(step.run, written)
        return written

    async def locks_taken(self, step: HeldStep, lock_ids: Sequence[str]) -> Lost | None:
        """The run took the locks of the step it waited for: it waits for none now, and is
        among their waiters no more (a wake-up goes to a run still waiting)."""
        taken = await self.store.leases.locks_taken(step.lease)
        self.observe(step.run, taken)
        with contextlib.suppress(*REDIS_DOWN):  # a stale waiter costs one wasted wake-up
            await self.queue.locks.stop_waiting(lock_ids, QueueEntry.of(step.run))
        return taken

    async def finish_step(
        self,
        step: HeldStep,
        output: Any,
        start: StepStart | None = None,
        *,
        next_handler: str | None,
    ) -> Lost | None:
        """Record a step's success, without ending the run: it goes on with the step whose
        handler is `next_handler` (or, the last step's success refused for a cancel, it keeps
        the step's output)."""
        finished = await self.store.leases.finish_step(
            step.lease,
            step.index,
            step.id,
            output,
            step.percentage(),
            next_handler=next_handler,
            **_unwritten(start),
        )
        self.observe(step.run, finished)
        return finished

    async def end_steps(self, step: HeldStep, ends: Sequence[StepEnd]) -> Lost | None:
        """Record steps that ended without a result (skipped, failed with `onFailure:
        continue`, or cancelled), the run going on; `step.done` counts the steps ended before
        them."""
        done = 100 * min(1.0, (step.done + len(ends)) / len(step.template.steps))
        written = await self.store.leases.end_steps(step.lease, ends, done)
        self.observe(step.run, written)
        return written

    async def complete(
        self, step: HeldStep, output: Any, start: StepStart | None = None, *, result: Any
    ) -> Moved | Lost:
        """Every step is done: `step` succeeded last, with `output`. A template that is not
        `repeatable` spends the run's dedupe key: it stays the run's, so no later run of the
        key may start."""
        spend = not step.template.repeatable
        completed = await self.store.transitions.complete(
            step.lease,
            step.index,
            step.id,
            output,
            result,
            spend_key=spend,
            **_unwritten(start),
        )
        return await self._ended(step.run, completed, step.lease.actor)

    async def complete_ended(
        self, run: Run, lease: Lease, template: Template, result: Any
    ) -> Moved | Lost:
        """Every step is done, the last to end having been skipped or failed with `onFailure:
        continue` (written already)."""
        completed = await self.store.transitions.complete(
            lease, None, None, None, result, spend_key=not template.repeatable
        )
        return await self._ended(run, completed, lease.actor)

    async def wait_worker(self, step: HeldStep) -> Moved | Lost:
        """Hand the step to an external worker; the run's holder lets go of it."""
        worker_type = step.template.steps[step.index].worker_type
        waiting = await self.store.transitions.wait_worker(
            step.lease, step.index, step.id, worker_type
        )
        self.observe(step.run, waiting)
        return waiting

    async def wait_step(self, step: HeldStep, start: StepStart, total: int) -> Lost | None:
        """A map step made its `total` children and waits for them."""
        waiting = await self.store.leases.wait_step(
            step.lease, step.index, step.id, total, start.at, start.attempt
        )
        self.observe(step.run, waiting)
        return waiting

    async def wait_children(self, run: Run, lease: Lease) -> Moved | Lost:
        """Only map steps are left: the holder lets go while their children run. Children that
        ended before this write could not wake the run, so it looks once more after it."""
        waiting = await self.store.transitions.wait_children(lease)
        self.observe(run, waiting)
        if isinstance(waiting, Moved):
            await self._freed(run)
            await self.wake(run.id, lease.actor)
        return waiting

    async def wake(self, run_id: str, actor: str) -> None:
        """Queue a run waiting for its children if a waiting map step of it can go on."""
        run = await self.store.runs.get(run_id)
        if run is None or run.status != RunStatus.WAITING_CHILDREN:
            return
        template = await self.store.templates.cached(run.template_type, run.template_version)
        counts = await self.store.children.counts(run)
        if template is None or not children.resumes(run, template, counts):
            return
        done = await self.store.transitions.children_done(run, actor, children.detail(run, counts))
        if isinstance(done, Moved):
            await self.push([run])
        self.observe(run, done)

    async def admit_children(self, child: Run, actor: str) -> None:
        """Give every free place of `child`'s map step to a waiting sibling, and queue it."""
        while (admitted := await self.store.children.admit_next(child, actor)) is not None:
            await self.enqueue(admitted, actor)

    async def cancel_children(
        self, parent: Run, actor: str, reason: str, step_id: str | None = None
    ) -> None:
        """Cancel the active children of `parent` (of its map step `step_id`), each naming the
        parent. A child admitted to a place meanwhile moves on from what was read, so the
        ones left are read again."""
        for _ in range(3):
            active = await self.store.children.active(parent, step_id)
            if not active:
                return
            for batch in range(0, len(active), _CANCEL_BATCH):
                await asyncio.gather(
                    *(
                        self.cancel(child, actor, reason, parent=parent.id)
                        for child in active[batch : batch + _CANCEL_BATCH]
                    ),
                    return_exceptions=True,
                )

    async def attempt_failed(
        self, step: HeldStep, error: RunError, retryable: bool, start: StepStart | None = None
    ) -> Moved | Lost:
        """Fail the run, or queue it again after the step's backoff, as its policy says."""
        run, lease = step.run, step.lease
        not_before = retry_at(run, step.template, step.id, retryable, self.clock.now())
        if not_before is None:
            return await self.fail(run, lease, step.index, error, start)
        retried = await self.store.transitions.retry(
            lease, step.index, error, not_before, **_unwritten(start)
        )
        if isinstance(retried, Moved):
            metrics.RUN_RETRIES.labels(run.template_type).inc()
            await self.push([run.model_copy(update={"not_before": not_before})])
            await self._freed(run)
        self.observe(run, retried)
        return retried

    async def fail(
        self, run: Run, lease: Lease, index: int, error: RunError, start: StepStart | None = None
    ) -> Moved | Lost:
        failed = await self.store.transitions.fail(lease, index, error, **_unwritten(start))
        return await self._ended(run, failed, lease.actor)

    async def release(self, run: Run, lease: Lease, handler: str | None = None) -> Moved | Lost:
        """Hand the run back to the queue without spending its attempt: to the lane of `handler`
        when given (a handler its holder lacks), else to the run's own. It is ready at once:
        having been claimed, it is past its `notBefore`."""
        released = await self.store.transitions.release(lease, handler)
        if isinstance(released, Moved):
            ready = {"handler": handler or run.handler, "not_before": None}
            await self.push([run.model_copy(update=ready)])
            await self._freed(run)
        self.observe(run, released)
        return released

    async def wait_for_lock(
        self, run: Run, lease: Lease, wait: LockWait, until: datetime
    ) -> Moved | Lost:
        """Hand the run back to wait for the lock its step found held: in its lane's delayed
        set until `until` (MongoDB's `notBefore` stays, so an early wake-up may claim it), and
        among the lock's waiters, the first of whom goes back at once when it is let go."""
        released = await self.store.transitions.release(lease, lock_wait=wait)
        if isinstance(released, Moved):
            metrics.LOCK_WAITS.labels(wait.lock.split(":", 1)[0]).inc()
            await self.push([run.model_copy(update={"not_before": until})])
            try:
                await self.queue.locks.wait(wait.lock, QueueEntry.of(run), self.clock.now())
            except REDIS_DOWN as exc:
                log.warning("run %s waits for lock %s until its back-off: %s", run.id, wait, exc)
            await self._freed(run)
        self.observe(run, released)
        return released

    async def acknowledge_cancel(self, run: Run, lease: Lease, interrupted: bool) -> Moved | Lost:
        acked = await self.store.transitions.acknowledge_cancel(lease, interrupted)
        return await self._ended(run, acked, lease.actor)

    async def deadline_expire(self, run: Run, actor: str) -> Moved | Lost:
        """End a run past its deadline, as its worker found it or the reaper did."""
        expired = await self.store.transitions.deadline_expire(run, actor)
        return await self._ended(run, expired, actor)

    # -- the reaper's: each move counted by its transition ------------------------------------

    async def overdue(self, run: Run) -> Moved | Lost:
        """End a run the reaper found past its deadline."""
        expired = await self.deadline_expire(run, "reaper")
        return _reaped(run, "deadline_expire", expired)

    async def cancel_timeout(self, run: Run) -> Moved | Lost:
        cancelled = await self.store.transitions.cancel_timeout(run, "reaper")
        return _reaped(run, "cancel_timeout", await self._ended(run, cancelled, "reaper"))

    async def reap(self, run: Run) -> Moved | Lost:
        """Recover a run whose lease expired, by the transition the policy picks: queued again
        (and pushed), cancelled or expired."""
        rows = self.store.transitions
        reaping = {
            "reap_cancel": rows.reap_cancel,
            "reap_requeue": rows.reap_requeue,
            "reap_expire": rows.reap_expire,
        }
        # Cached: a version never changes. Only a template whose steps have retry policies of
        # their own tells more than the run's own count.
        template = await self.store.templates.cached(run.template_type, run.template_version)
        transition = lease_expired(run, template)
        reaped = await reaping[transition](run, "reaper")
        if isinstance(reaped, Moved) and reaped.to == RunStatus.QUEUED:
            await self.push([run])
            await self._freed(run)
            self.observe(run, reaped)
            return _reaped(run, transition, reaped)
        return _reaped(run, transition, await self._ended(run, reaped, "reaper"))

    # -- the API's ----------------------------------------------------------------------------

    async def cancel(
        self,
        run: Run,
        actor: str,
        reason: str | None,
        displaced_by: str | None = None,
        parent: str | None = None,
    ) -> Moved | Lost | None:
        """Cancel `run` as the policy says: a run no worker holds ends at once and leaves the
        queue; a held one is asked to stop, and its worker signalled. None: it was asked already.
        `displaced_by` (a newer run of a `cancel_previous` key) or `parent` (whose cancel or
        failure this is) goes in the events. A run with children has them cancelled too.
        """
        way = cancel_of(run)
        if way is None:
            return None
        scope = _scope(run)
        metadata: dict[str, str] = {}
        if displaced_by:
            metadata["displacedBy"] = displaced_by
        if parent:
            metadata["parentRunId"] = parent
        if way == "request_cancel":
            grace = cancel_grace(run)
            asked = await self.store.transitions.request_cancel(
                run.id, actor, reason, grace, scope, metadata
            )
            if isinstance(asked, Moved):
                # Heartbeats bring the cancel from MongoDB too, should the signal be lost.
                with contextlib.suppress(*REDIS_DOWN):
                    await self.queue.signal_cancel(run.id)
            await self._family(run, asked, actor, as_child=parent is None)
            return asked
        cancelled = await self.store.transitions.cancel(run.id, actor, reason, scope, metadata)
        if isinstance(cancelled, Moved):
            with contextlib.suppress(*REDIS_DOWN):  # a popped id is skipped
                await self.queue.remove(QueueEntry.of(run))
                if run.lock_wait is not None:
                    await self.queue.locks.stop_waiting([run.lock_wait.lock], QueueEntry.of(run))
            # The run may have taken the key it waited for since it was read.
            if key := run.dedupe_key or run.dedupe_wait:
                await self._admit_after_end(key, actor)
        self.observe(run, cancelled)
        await self._family(run, cancelled, actor, as_child=parent is None)
        return cancelled

    # -- the scheduler's ----------------------------------------------------------------------

    async def enqueue(self, run: Run, actor: str) -> Moved | Lost:
        """pending → queued, and into Redis: a run that took the dedupe key it waited for, or
        one the reconciler found `pending` (its process died before it could queue it)."""
        queued = await self.store.transitions.enqueue(run.id, actor, _scope(run))
        if isinstance(queued, Moved):
            await self.push([run])
        self.observe(run, queued)
        return queued

    # -- what follows -------------------------------------------------------------------------

    async def admit_next(self, key: str, actor: str) -> None:
        """Hand a free dedupe key to the oldest run waiting for it, and queue that run.

        Follows the end of a run that held the key; the scheduler calls it too, as a backstop
        (the process that freed the key may have died). If the key is spent, the waiting runs
        can never run: they are cancelled, saying why.
        """
        while (waiting := await self.store.runs.next_waiting(key)) is not None:
            try:
                taken = await self.store.runs.take_key(waiting, actor)
            except KeyHeld as held:
                if not held.spent:
                    return  # an active run has it; its end admits the next
                assert held.holder is not None
                reason = f"run {held.holder.id} already succeeded for this key"
                cancelled = await self.store.transitions.cancel(
                    waiting.id, actor, reason, _scope(waiting)
                )
                self.observe(waiting, cancelled)
                continue
            if isinstance(taken, Lost):
                continue  # cancelled meanwhile; look at the next
            if isinstance(await self.enqueue(waiting, actor), Lost):
                continue  # cancelled since it took the key; the cancel admits the next
            return

    async def push(self, runs: Sequence[Run]) -> None:
        """Put `queued` runs in Redis. MongoDB has them already, so a push Redis refused is
        left to the reconciler, which pushes the queued runs Redis is missing."""
        if not runs:
            return
        try:
            await self.queue.push([QueueEntry.of(r) for r in runs], self.clock.now())
        except REDIS_DOWN as exc:
            log.warning(
                "%d queued runs wait for the reconciler, Redis push failed: %s", len(runs), exc
            )

    def observe(self, run: Run, outcome: Moved | Lost | None) -> None:
        """Count what a write did to `run`."""
        metrics.observe(run, outcome, self.clock.now())

    async def _ended(self, run: Run, outcome: Moved | Lost, actor: str) -> Moved | Lost:
        """A run that ended let go of its dedupe key (unless it spent it): a run waiting for the
        key may start; and of its place among its template's started runs."""
        self.observe(run, outcome)
        if isinstance(outcome, Moved):
            if run.dedupe_key is not None:
                await self._admit_after_end(run.dedupe_key, actor)
            await self._freed(run)
        await self._family(run, outcome, actor)
        return outcome

    async def _family(
        self, run: Run, outcome: Moved | Lost | None, actor: str, as_child: bool = True
    ) -> None:
        """What a run's end means for its family: an ended child lets the next waiting sibling
        have its place and may let its parent go on (unless its parent is what ended it: a
        child cancelled for its parent's sake wakes nobody); an ended parent's children are
        cancelled, and a parent asked to stop asks its children. Should this fail, the
        scheduler's tick repairs it."""
        if not isinstance(outcome, Moved):
            return
        try:
            if as_child and run.parent_run_id is not None and outcome.to in TERMINAL:
                if run.map_limit is not None:
                    await self.admit_children(run, actor)
                if outcome.to != RunStatus.SUCCEEDED or not await self.store.children.any_left(run):
                    await self.wake(run.parent_run_id, actor)
            if outcome.to in TERMINAL or outcome.to == RunStatus.CANCEL_REQUESTED:
                if await self._maps(run):
                    reason = f"parent run {run.id} was {_ending(outcome.to)}"
                    await self.cancel_children(run, actor, reason)
        except Exception:
            log.exception("run %s: its family's follow-up failed; the scheduler will", run.id)

    async def _freed(self, run: Run) -> None:
        """A started run ended or went back to its queue: a run its template's `maxRunning`
        held back may take its place. Should Redis fail here, the scheduler's tick lets it go."""
        try:
            await self.starts.freed(run)
        except REDIS_DOWN as exc:
            log.warning("run %s ended; a held run waits for the scheduler: %s", run.id, exc)

    async def _maps(self, run: Run) -> bool:
        """Whether `run`'s template version has map steps. A version never changes, so each is
        read once per process: every run's end asks, and a cache that expires would have many
        ends read it again at once."""
        key = (run.template_type, run.template_version)
        if key not in self._with_maps:
            template = await self.store.templates.get(*key)
            self._with_maps[key] = template is not None and template.maps
        return self._with_maps[key]

    async def _admit_after_end(self, key: str, actor: str) -> None:
        """Admit the next run for a key a run's end freed. The end is written whatever happens
        here: should the admission fail, the scheduler's reconciler admits the run."""
        try:
            await self.admit_next(key, actor)
        except Exception:
            log.exception("admitting the next run for key %s failed; the scheduler will", key)


def _reaped(run: Run, transition: str, outcome: Moved | Lost) -> Moved | Lost:
    """Count a reaper's move by its transition."""
    if isinstance(outcome, Moved):
        metrics.reaped(run, transition)
    return outcome


# How many children a cancel of their parent cancels at once.
_CANCEL_BATCH = 50


def _ending(status: RunStatus) -> str:
    return "asked to cancel" if status == RunStatus.CANCEL_REQUESTED else status.value


def _scope(run: Run) -> tuple[str, str]:
    """The run's scope, which its writes carry so that they go to its shard alone."""
    return run.scope, run.scope_id
