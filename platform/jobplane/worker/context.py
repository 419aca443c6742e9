"""What a step handler sees (its payload, earlier outputs, progress, heartbeat and cancel), and
the errors it raises."""

import asyncio
import contextlib
import logging
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from jobplane.model import Run, RunError, StepSpec, Template

# A failed step's error keeps this much of its traceback: the innermost frames.
TRACEBACK_FRAMES = 5
TRACEBACK_CHARS = 4000


class StepError(Exception):
    """Base of the errors a handler raises on purpose."""

    code = "step_error"


class RetryableError(StepError):
    """The step may succeed if the run is tried again (after backoff)."""

    code = "retryable"


class FatalError(StepError):
    """Trying again cannot help: the run fails at once."""

    code = "fatal"


class StepInterrupted(Exception):
    """Raised by `checkpoint()` in a step the worker stopped; the handler should just return."""


class StepTimeout(StepError):
    """The step ran past its `timeoutSeconds`; retryable, like any transient failure."""

    code = "step_timeout"


class LockTimeout(RetryableError):
    """`ctx.lock` did not get its lock within its `wait_seconds`: another run held it."""

    code = "lock_timeout"


class CancelRequested(Exception):
    """Raised by `StepContext.checkpoint()` once a cancel was requested.

    `interrupted` is False when the worker stops between steps, so no step was cut short.
    """

    def __init__(self, run_id: str, interrupted: bool = True) -> None:
        super().__init__(run_id)
        self.interrupted = interrupted


def step_failure(exc: Exception, step_id: str) -> RunError:
    """The error of a step that raised `exc`: its code (a `StepError`'s own), its one-line
    summary, and the innermost frames of its traceback."""
    summary = "".join(traceback.format_exception_only(exc)).strip()
    frames = "".join(traceback.format_exception(exc, limit=-TRACEBACK_FRAMES))
    return RunError(
        code=exc.code if isinstance(exc, StepError) else "step_error",
        message=summary,
        step=step_id,
        traceback=frames[-TRACEBACK_CHARS:],
    )


# Takes a lock (`<name>` and its key's values) for the step, waiting up to some seconds:
# the lock's id, its fencing token, and whether it was taken now (False: the step held it).
TakeLock = Callable[[str, list[Any], float], Awaitable[tuple[str, int, bool]]]
M = TypeVar("M", bound=BaseModel)
# Lets go of a lock the step took.
ReleaseLock = Callable[[str], Awaitable[None]]


class StepContext:
    """Passed to every handler. Its methods are plain calls, safe from async and sync handlers,
    but `lock`, which async handlers use as `async with ctx.lock(...)`.

    `progress()` is throttled to a few writes a second per run; the latest value is always
    written in the end. `checkpoint()` raises `CancelRequested` when the run's cancel was
    requested and the step is cancelable.
    """

    PROGRESS_INTERVAL = 0.25

    def __init__(
        self,
        run: Run,
        template: Template,
        index: int,
        outputs: dict[str, Any],
        cancel: asyncio.Event,
        write_progress: Callable[[float, str | None], Awaitable[None]],
        renew: Callable[[], Coroutine[Any, Any, None]],
        step_locks: dict[str, int] | None = None,
        take_lock: TakeLock | None = None,
        release_lock: ReleaseLock | None = None,
    ) -> None:
        self.run = run
        self.template = template
        self.index = index
        self.step: StepSpec = template.steps[index]
        self.payload = run.payload
        self.outputs = outputs
        self.attempt = run.attempt
        self.log = logging.LoggerAdapter(
            logging.getLogger("jobplane.step"), {"run_id": run.id, "step": self.step.id}
        )
        self._cancel = cancel
        self._write_progress = write_progress
        self._renew = renew
        self._loop = asyncio.get_running_loop()
        self._latest: tuple[float, str | None] | None = None
        self._last_write = 0.0
        self._writer: asyncio.Task[None] | None = None
        self._writing = False
        self._closed = False
        self._interrupted = False
        # A step beside it failed the run: it is asked to stop, as a cancel of the run would.
        self.cancel_asked = False
        self._background: set[asyncio.Task[None]] = set()
        # The locks the step holds, in the order taken: its `locks`, then the handler's.
        self._locks: list[tuple[str, int]] = list((step_locks or {}).items())
        self._take_lock = take_lock
        self._release_lock = release_lock

    def payload_as(self, model: type[M]) -> M:
        """The payload parsed into `model` (a pydantic model, as the template's `payload`).
        A payload it refuses fails the run at once: trying again would read the same one."""
        try:
            return model.model_validate(self.payload)
        except ValidationError as exc:
            said = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise FatalError(f"the payload is not a {model.__name__}: {said}") from exc

    @property
    def lock_token(self) -> int | None:
        """The fencing token of the lock the step took last and still holds (a handler's
        `ctx.lock`, else its own `locks`): greater than the token of every earlier grant of
        any lock, so a downstream system that keeps the largest it has seen can refuse a
        stale holder's writes. None while the step holds no lock."""
        return self._locks[-1][1] if self._locks else None

    @property
    def lock_tokens(self) -> dict[str, int]:
        """Every lock the step holds (`<name>:<key values>`) and its fencing token."""
        return dict(self._locks)

    @contextlib.asynccontextmanager
    async def lock(
        self, name: str, key: Any = None, wait_seconds: float = 0.0
    ) -> AsyncIterator[int]:
        """Hold the lock `name` (with `key`'s values: one value, or a list) for the block,
        as a step's `locks` would: owner-checked, renewed with the heartbeat, let go when the
        block ends. Yields its fencing token (`lock_token` says it too). Another run holding
        it is waited for up to `wait_seconds`, then `LockTimeout` (retryable) is raised. A
        lock the step holds already is held on, not taken twice."""
        if self._take_lock is None or self._release_lock is None:
            raise RuntimeError("this step context takes no locks")
        values = [] if key is None else list(key) if isinstance(key, list | tuple) else [key]
        lock_id, token, fresh = await self._take_lock(name, values, wait_seconds)
        self._locks.append((lock_id, token))
        try:
            yield token
        finally:
            self._locks.remove((lock_id, token))
            if fresh:
                await self._release_lock(lock_id)

    @property
    def cancelled(self) -> bool:
        asked = self._cancel.is_set() or self.cancel_asked
        return self._interrupted or (asked and self.step.cancelable)

    def checkpoint(self) -> None:
        if self._interrupted:
            raise StepInterrupted(self.run.id)
        if self.cancelled:
            raise CancelRequested(self.run.id)

    def interrupt(self) -> None:
        """The worker stopped this step (timeout, lost lease, shutdown).

        An async handler was cancelled already; a sync one learns it at its next checkpoint.
        """
        self._interrupted = True

    def progress(self, percentage: float, message: str | None = None) -> None:
        self._loop.call_soon_threadsafe(
            self._set_progress, max(0.0, min(100.0, percentage)), message
        )

    def heartbeat(self) -> None:
        self._loop.call_soon_threadsafe(self._spawn, self._renew())

    async def close(self, write_latest: bool) -> None:
        """Settle progress when the step ends: no write may land after the step's own.

        A write in flight is awaited; a throttled one is written only if asked (a succeeded
        step's final write supersedes it).
        """
        self._closed = True
        if self._writer is not None:
            if not self._writing:
                self._writer.cancel()
            await asyncio.wait([self._writer])
        if write_latest:
            await self._write_latest()

    def _set_progress(self, percentage: float, message: str | None) -> None:
        if self._closed:  # a call that was still on its way when the step ended
            return
        self._latest = (percentage, message)
        if self._writer is None:
            self._writer = self._loop.create_task(self._write_throttled())

    async def _write_throttled(self) -> None:
        try:
            while self._latest is not None:
                delay = self._last_write + self.PROGRESS_INTERVAL - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                self._writing = True
                try:
                    await self._write_latest()
                except Exception as exc:  # progress is best effort; the step goes on
                    self.log.warning("progress not written: %s", exc)
                finally:
                    self._writing = False
        finally:
            self._writer = None

    async def _write_latest(self) -> None:
        if self._latest is None:
            return
        percentage, message = self._latest
        self._latest = None
        self._last_write = time.monotonic()
        await self._write_progress(percentage, message)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = self._loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.warning("heartbeat from the handler failed: %s", task.exception())
