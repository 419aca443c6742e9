"""Running the runs a worker holds: their steps in order, each handler under its timeouts.

Every outcome is written through the lifecycle (`runs/lifecycle.py`); how a run stops is
settled in one place, `Runner.run`: a cancel asked is acknowledged, a passed deadline expires
the run, a step this worker cannot run is handed on, a lost lease writes nothing more, and a
shutdown hands the run back.
"""

import asyncio
import contextvars
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from jobplane.clock import Clock
from jobplane.model import TERMINAL, Run, RunError, StepStatus, Template
from jobplane.process import log_context
from jobplane.queue.locks import Blocked
from jobplane.runs.admission.keys import lock_id, lock_named
from jobplane.runs.admission.locks import Locks, holder
from jobplane.runs.lifecycle import HeldStep, Lifecycle
from jobplane.runs.policy import cancel_asked
from jobplane.store import Lease, Lost, Moved, Store
from jobplane.worker.context import (
    CancelRequested,
    FatalError,
    LockTimeout,
    StepContext,
    StepTimeout,
    step_failure,
)
from jobplane.worker.handlers import HandlerRegistry

log = logging.getLogger("jobplane.worker")

# A step still running after this long gets its start written on its own; a quicker one has
# its start written together with its end, saving a MongoDB write per step.
START_WRITE_AFTER = 0.05


# Why a run's handler was interrupted: its lease was lost, the worker shuts down, or a lock
# its step held was lost.
Stop = Literal["lost", "shutdown", "lock"]


@dataclass
class Held:
    """A run this worker holds, with what it needs to stop it."""

    run: Run
    lease: Lease
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    # The running handler. Stopping a run interrupts only this, never the worker's own writes,
    # so a transition and its events are never cut in half.
    handler: asyncio.Future[Any] | None = None
    stop: Stop | None = None
    # The locks its step holds (the step's and its handler's), each with its fencing token:
    # the heartbeat renews them.
    locks: dict[str, int] = field(default_factory=dict)
    # When the current step began, while its start is not yet written (see START_WRITE_AFTER).
    unwritten_start: datetime | None = None
    # When MongoDB last confirmed the lease (monotonic seconds); past the lease length the
    # worker assumes the reaper may have given the run away and stops its handler itself.
    renewed: float = field(default_factory=time.monotonic)

    @property
    def log_fields(self) -> dict[str, str]:
        """For lines about the run logged outside its own task (whose context has them)."""
        return {"run_id": self.run.id, "lease_token": self.lease.token}

    def interrupt(self, reason: Stop) -> None:
        self.stop = reason
        if self.handler is not None:
            self.handler.cancel()


class _Overdue(Exception):
    """The run's deadline passed: it ends `expired`, whatever its step was doing."""


class _HandOff(Exception):
    """The run's next step needs a handler this worker does not offer."""

    def __init__(self, handler: str) -> None:
        super().__init__(handler)
        self.handler = handler


class _LockHeld(Exception):
    """A lock the next step needs is held by another run."""

    def __init__(self, blocked: Blocked) -> None:
        super().__init__(blocked.lock_id)
        self.blocked = blocked


class _Stopped(Exception):
    """The run must stop: its lease was lost (write nothing), the worker shuts down, or a lock
    its step held was lost (both hand the run back)."""

    def __init__(self, reason: Stop) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Runner:
    """Runs the steps of the runs a worker holds, one task a run."""

    store: Store
    lifecycle: Lifecycle
    handlers: HandlerRegistry
    # The handlers the worker offers: a step needing another is handed on, never failed.
    offered: list[str]
    clock: Clock
    # Where sync handlers run: the worker's pool, a thread a slot.
    threads: ThreadPoolExecutor
    # What a handler's `ctx.heartbeat()` calls: the worker renews the lease at once.
    renew: Callable[[list[Held]], Awaitable[None]]
    # The locks steps hold and handlers take.
    locks: Locks
    # Versions are immutable, so a template cached never goes stale.
    _templates: dict[tuple[str, int], Template] = field(default_factory=dict, init=False)

    async def run(self, held: Held) -> None:
        """Run `held` from its first step not done until it ends, or until it must stop; what
        stops it is settled here. Raises nothing: an error is logged, and the lease expires."""
        try:
            try:
                await self._run_steps(held)
            except CancelRequested as cancel:
                ack = await self.lifecycle.acknowledge_cancel(
                    held.run, held.lease, cancel.interrupted
                )
                self._check(held.run, ack)
            except _Overdue:
                # Not fenced: if the reaper got there first, the run is expired already.
                moved = await self.lifecycle.deadline_expire(held.run, held.lease.actor)
                self._finished(held.run, moved)
            except _HandOff as handoff:
                log.info("run %s: handed on for handler %r", held.run.id, handoff.handler)
                await self._release(held, handoff.handler)
            except _LockHeld as wait:
                await self._wait_for_lock(held, wait.blocked)
        except _Stopped as stopped:
            if stopped.reason == "lost":
                log.warning("run %s: lease lost, stopped without writing", held.run.id)
            else:
                if stopped.reason == "lock":
                    log.warning("run %s: a lock its step held was lost; handed back", held.run.id)
                try:
                    await self._release(held)
                except Exception:
                    log.exception("run %s: release failed; its lease will expire", held.run.id)
        except Exception:
            log.exception("run %s: worker error", held.run.id)

    async def _wait_for_lock(self, held: Held, blocked: Blocked) -> None:
        """Hand the run back to wait for a lock its step found held, or finish a cancel."""
        wait, until = self.locks.wait(held.run, blocked, self.clock.now())
        log.info("run %s: waits for lock %s until %s at the latest", held.run.id, wait.lock, until)
        released = await self.lifecycle.wait_for_lock(held.run, held.lease, wait, until)
        if cancel_asked(released):
            acked = await self.lifecycle.acknowledge_cancel(held.run, held.lease, interrupted=False)
            self._finished(held.run, acked)

    async def _release(self, held: Held, handler: str | None = None) -> None:
        """Hand the run back to the queue (on shutdown, or to the lane of `handler`, which
        this worker lacks), or finish a cancel that was asked for."""
        released = await self.lifecycle.release(held.run, held.lease, handler)
        if cancel_asked(released):
            acked = await self.lifecycle.acknowledge_cancel(held.run, held.lease, interrupted=True)
            self._finished(held.run, acked)

    async def _run_steps(self, held: Held) -> None:
        """Run the steps from the first one not yet done; raises `CancelRequested` to stop."""
        run, lease = held.run, held.lease
        template = await self._template(run)
        if template is None:
            missing = f"template {run.template_type} v{run.template_version} not found"
            error = RunError(code="fatal", message=missing)
            self._check(run, await self.lifecycle.fail(run, lease, 0, error))
            return
        steps = template.steps
        # Resume, don't restart: steps that succeeded in an earlier attempt keep their outputs.
        done = {s.id for s in run.progress.steps if s.status == StepStatus.SUCCEEDED}
        first = next((i for i, s in enumerate(steps) if s.id not in done), len(steps))
        outputs = dict(run.outputs)
        if first == len(steps):  # every step succeeded before a crash cut the final write short
            last = HeldStep(run, lease, template, first - 1)
            self._check(run, await self.lifecycle.complete(last, outputs.get(last.id)))
            return
        for index in range(first, len(steps)):
            step = steps[index]
            if held.stop is not None:
                raise _Stopped(held.stop)
            if held.cancel.is_set():
                raise CancelRequested(run.id, interrupted=False)
            if self._time_left(run) == 0:
                raise _Overdue
            at = HeldStep(held.run, lease, template, index)
            if step.worker_type == "external":
                # The run waits for an external worker's callback; this worker lets go of it.
                self._check(run, await self.lifecycle.wait_worker(at))
                return
            if step.handler not in self.offered:
                raise _HandOff(step.handler)
            taken = await self._take_locks(held, at)
            try:
                if not await self._step(held, at, outputs):
                    return
            finally:
                # After the step's end is written: its recorded span ends inside the lock's.
                await self._let_go(held, taken)

    async def _step(self, held: Held, at: HeldStep, outputs: dict[str, Any]) -> bool:
        """Run one step and write how it ended; False when that ended the run's attempt."""
        run = held.run
        try:
            with log_context(step=at.id):
                output = await self._call(held, at, outputs)
        except (CancelRequested, _Stopped, _Overdue):
            raise
        except Exception as exc:
            await self._failed(held, at, exc)
            return False
        outputs[at.id] = output
        began = held.unwritten_start
        if at.index + 1 < len(at.template.steps):
            self._check(run, await self.lifecycle.finish_step(at, output, began))
            held.run = held.run.model_copy(update={"handler": at.following})
            return True
        moved = await self.lifecycle.complete(at, output, began)
        if cancel_asked(moved):
            # The step ran to its end (it may be non-cancelable): keep its output, then
            # acknowledge the cancel, which the table requires over success.
            self._check(run, await self.lifecycle.finish_step(at, output, began))
            raise CancelRequested(run.id, interrupted=False)
        self._check(run, moved)
        return True

    async def _take_locks(self, held: Held, at: HeldStep) -> list[str]:
        """Take the step's locks, all or none; `_LockHeld` when another run holds one. A run
        that waited for one says so no more."""
        wanted = [lock_id(lock, held.run) for lock in at.template.steps[at.index].locks]
        if not wanted:
            return []
        taken = await self.locks.take(wanted, holder(held.run.id, held.lease.token))
        if isinstance(taken, Blocked):
            raise _LockHeld(taken)
        held.locks.update(taken.tokens)
        if held.run.lock_wait is not None:
            try:
                self._stop_if_lost(await self.lifecycle.locks_taken(at, wanted))
            except BaseException:
                await self._let_go(held, wanted)  # the step will not run: nobody else waits
                raise
            held.run = held.run.model_copy(update={"lock_wait": None})
        return wanted

    async def _let_go(self, held: Held, lock_ids: list[str]) -> None:
        """Let go of the step's locks (and wake a run waiting for each); a Redis that does not
        answer lets them expire with the lease length instead."""
        if not lock_ids:
            return
        for lock in lock_ids:
            held.locks.pop(lock, None)
        try:
            owner = holder(held.run.id, held.lease.token)
            await self.locks.release(lock_ids, owner, self.clock.now())
        except Exception as exc:
            log.warning("run %s: locks %s not let go, they expire: %s", held.run.id, lock_ids, exc)

    async def _call(self, held: Held, at: HeldStep, outputs: dict[str, Any]) -> Any:
        template, index = at.template, at.index
        step = template.steps[index]
        began = held.unwritten_start = self.clock.now()
        handler = self.handlers.resolve(step.handler)
        assert handler is not None, "an offered handler, as checked before the step began"
        start: asyncio.Future[Lost | None] | None = None

        async def write_start() -> Lost | None:
            return await self.lifecycle.start_step(at, began)

        def started() -> asyncio.Future[Lost | None]:
            # One start write per step, shared: every later write of the step waits for it.
            nonlocal start
            if start is None:
                start = asyncio.ensure_future(write_start())
            return start

        async def write_progress(percentage: float, message: str | None) -> None:
            if isinstance(await started(), Lost):
                held.interrupt("lost")
                return
            outcome = await self.lifecycle.report_progress(at, percentage, message)
            if isinstance(outcome, Lost):  # progress writes are fenced too
                held.interrupt("lost")

        async def renew() -> None:
            await self.renew([held])

        owner = holder(held.run.id, held.lease.token)

        async def take_lock(name: str, values: list[Any], wait: float) -> tuple[str, int, bool]:
            lock = lock_named(name, values)
            if lock in held.locks:
                return lock, held.locks[lock], False
            loop, pause = asyncio.get_running_loop(), 0.05
            until = loop.time() + wait
            while isinstance(taken := await self.locks.take([lock], owner), Blocked):
                if loop.time() >= until:
                    by = taken.holder.split(":", 1)[0]
                    raise LockTimeout(f"lock {lock} is held by run {by}")
                await asyncio.sleep(min(pause, max(0.0, until - loop.time())))
                pause = min(2 * pause, 1.0)
            held.locks.update(taken.tokens)
            return lock, taken.tokens[lock], True

        async def release_lock(lock: str) -> None:
            await self._let_go(held, [lock])

        mine = [lock_id(lock, held.run) for lock in step.locks]
        step_locks = {lock: held.locks[lock] for lock in mine if lock in held.locks}
        ctx = StepContext(
            held.run,
            template,
            index,
            outputs,
            held.cancel,
            write_progress,
            renew,
            step_locks,
            take_lock,
            release_lock,
        )
        succeeded = False
        if inspect.iscoroutinefunction(handler):
            work: asyncio.Future[Any] = asyncio.ensure_future(handler(ctx))
            held.handler = work
        else:
            call = contextvars.copy_context().run
            work = asyncio.wrap_future(self.threads.submit(call, handler, ctx))
            # A thread cannot be cancelled: interrupting cancels this shield, not the thread.
            held.handler = asyncio.shield(work)
        left = self._time_left(held.run)
        overdue = left is not None and (step.timeout_seconds is None or left < step.timeout_seconds)
        try:
            async with asyncio.timeout(left if overdue else step.timeout_seconds):
                # A step over at once has its start written with its end: one write, not two.
                await asyncio.wait([held.handler], timeout=START_WRITE_AFTER)
                if not held.handler.done():
                    self._stop_if_lost(await started())
                output = await held.handler
            succeeded = True
            return output
        except (asyncio.CancelledError, TimeoutError) as exc:
            ctx.interrupt()
            if work is not held.handler:
                # Keep the lease until the thread returns (its checkpoint() now raises), so
                # a retry or a release never runs the step twice at once.
                await asyncio.wait([work])
            if isinstance(exc, TimeoutError) and overdue:
                raise _Overdue from exc
            if isinstance(exc, TimeoutError):
                message = f"step {step.id!r} exceeded {step.timeout_seconds}s"
                raise StepTimeout(message) from exc
            current = asyncio.current_task()
            if held.stop is not None and not (current and current.cancelling()):
                raise _Stopped(held.stop) from None
            raise
        finally:
            held.handler = None
            await ctx.close(write_latest=not succeeded and held.stop is None)
            if start is not None:
                await asyncio.wait([start])
                if not start.cancelled() and start.exception() is not None:
                    log.warning(
                        "run %s: step start not written: %s", held.run.id, start.exception()
                    )
            held.unwritten_start = None if start is not None else began

    async def _failed(self, held: Held, at: HeldStep, exc: Exception) -> None:
        error, retryable = step_failure(exc, at.id), not isinstance(exc, FatalError)
        failed = await self.lifecycle.attempt_failed(at, error, retryable, held.unwritten_start)
        self._check(held.run, failed)

    def _time_left(self, run: Run) -> float | None:
        """Seconds until the run's deadline (0 once passed), or None without one."""
        if run.deadline is None:
            return None
        return max(0.0, (run.deadline - self.clock.now()).total_seconds())

    def _check(self, run: Run, outcome: Moved | Lost | None) -> None:
        """Say so when a write finished `run`, and stop the run when the write was lost."""
        self._finished(run, outcome)
        self._stop_if_lost(outcome)

    def _finished(self, run: Run, outcome: Moved | Lost | None) -> None:
        """Say so when a write finished `run` (the lifecycle counted it)."""
        if isinstance(outcome, Moved) and outcome.to in TERMINAL:
            # From the run's first start, as its duration metric; clocks may disagree a little.
            began = run.started_at or run.create_at
            took = max(0.0, (self.clock.now() - began).total_seconds())
            log.info("run %s (%s) %s in %.1f s", run.id, run.template_type, outcome.to.value, took)

    def _stop_if_lost(self, outcome: Moved | Lost | None) -> None:
        """Stop the run when a write was lost.

        Lost to a cancel request, the worker still holds the lease and must acknowledge it;
        lost any other way, someone else decides the run's fate now.
        """
        if isinstance(outcome, Lost):
            if cancel_asked(outcome):
                raise CancelRequested(outcome.run_id)
            raise _Stopped("lost")

    async def _template(self, run: Run) -> Template | None:
        key = (run.template_type, run.template_version)
        if key not in self._templates:
            template = await self.store.templates.get(*key)
            if template is None:
                return None
            self._templates[key] = template
        return self._templates[key]
