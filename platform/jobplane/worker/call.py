"""A step's handler called: in its context, under its timeout and the run's deadline, on the
event loop (async handlers) or on a thread of the worker's pool (sync ones), with its start
written only if it runs long enough to need it."""

import asyncio
import contextvars
import inspect
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from jobplane.clock import Clock
from jobplane.runs.admission.keys import lock_id
from jobplane.runs.lifecycle import Lifecycle
from jobplane.store import Lost
from jobplane.worker.context import StepContext, StepTimeout
from jobplane.worker.handlers import HandlerRegistry
from jobplane.worker.held import Held, Overdue, RunningStep, Stopped, stop_if_lost, time_left
from jobplane.worker.steplocks import StepLocks

log = logging.getLogger("jobplane.worker")

# A step still running after this long gets its start written on its own; a quicker one has
# its start written together with its end, saving a MongoDB write per step.
START_WRITE_AFTER = 0.05


@dataclass(frozen=True)
class Caller:
    handlers: HandlerRegistry
    lifecycle: Lifecycle
    clock: Clock
    # Where sync handlers run: the worker's pool, a thread a slot.
    threads: ThreadPoolExecutor
    # What a handler's `ctx.heartbeat()` calls: the worker renews the lease at once.
    renew: Callable[[list[Held]], Awaitable[None]]
    step_locks: StepLocks

    async def call(self, held: Held, running: RunningStep, outputs: dict[str, Any]) -> Any:
        """Call the step's handler in its context, within its timeout and the run's deadline;
        its output, or what it raised (`Stopped`, `Overdue`, `StepTimeout`, its own error)."""
        at = running.at
        template, index = at.template, at.index
        step = template.steps[index]
        assert step.handler is not None, "a step with a handler, as checked before it began"
        handler = self.handlers.resolve(step.handler)
        assert handler is not None, "an offered handler, as checked before the step began"
        start: asyncio.Future[Lost | None] | None = None

        # The closures below end up on the step's context, which `running` holds: they must
        # not hold `running` back, or every step would leave a cycle for the collector.
        first = running.start

        async def write_start() -> Lost | None:
            return await self.lifecycle.start_step(at, first)

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

        async def take_lock(name: str, values: list[Any], wait: float) -> tuple[str, int, bool]:
            return await self.step_locks.take_for_handler(held, name, values, wait)

        async def release_lock(lock: str) -> None:
            await self.step_locks.let_go(held, [lock])

        mine = [lock_id(lock, held.run) for lock in step.locks]
        step_locks = {lock: held.locks[lock] for lock in mine if lock in held.locks}
        ctx = running.ctx = StepContext(
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
        if held.stop is not None:
            raise Stopped(held.stop)
        if inspect.iscoroutinefunction(handler):
            work: asyncio.Future[Any] = asyncio.ensure_future(handler(ctx))
            watched = work
        else:
            call = contextvars.copy_context().run
            work = asyncio.wrap_future(self.threads.submit(call, handler, ctx))
            # A thread cannot be cancelled: interrupting cancels this shield, not the thread.
            watched = asyncio.shield(work)
        held.handlers.add(watched)
        left = time_left(held.run, self.clock.now())
        overdue = left is not None and (step.timeout_seconds is None or left < step.timeout_seconds)
        try:
            async with asyncio.timeout(left if overdue else step.timeout_seconds):
                # A step over at once has its start written with its end: one write, not two.
                await asyncio.wait([watched], timeout=START_WRITE_AFTER)
                if not watched.done():
                    stop_if_lost(await started())
                output = await watched
            succeeded = True
            return output
        except (asyncio.CancelledError, TimeoutError) as exc:
            ctx.interrupt()
            if work is not watched:
                # Keep the lease until the thread returns (its checkpoint() now raises), so
                # a retry or a release never runs the step twice at once.
                await asyncio.wait([work])
            if isinstance(exc, TimeoutError) and overdue:
                raise Overdue from exc
            if isinstance(exc, TimeoutError):
                message = f"step {step.id!r} exceeded {step.timeout_seconds}s"
                raise StepTimeout(message) from exc
            current = asyncio.current_task()
            if held.stop is not None and not (current and current.cancelling()):
                raise Stopped(held.stop) from None
            raise
        finally:
            held.handlers.discard(watched)
            await ctx.close(write_latest=not succeeded and held.stop is None)
            if start is not None:
                await asyncio.wait([start])
                if not start.cancelled() and start.exception() is not None:
                    log.warning(
                        "run %s: step start not written: %s", held.run.id, start.exception()
                    )
            running.start_written = start is not None
