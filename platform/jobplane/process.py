"""Running a jobplane process: signals, logging, the HTTP server in the same event loop."""

import asyncio
import gc
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Coroutine, Generator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Literal, TypeVar

import uvicorn
from opentelemetry import trace

LogFormat = Literal["json", "text"]
T = TypeVar("T")

log = logging.getLogger("jobplane")

# How long a cancelled task is waited for: one whose cancel a driver absorbs is left behind.
CANCEL_SECONDS = 1.0
# What a stopping process may take beyond its drain and its two close budgets (see
# `stop_on_signals`): cancelled tasks unwinding, the event loop closing, the interpreter exiting.
EXIT_SLACK_SECONDS = 5.0

# What a log line says about the work it comes from, when the code that logs knows it.
LOG_FIELDS = ("run_id", "step", "worker_id", "lease_token")
# A lease token is a credential for the run's writes: lines carry only enough to tell leases apart.
LEASE_PREFIX = 8

_context: ContextVar[Mapping[str, str]] = ContextVar(
    "jobplane_log_context", default=MappingProxyType({})
)


def tune_collector() -> None:
    """Set Python's collector for a process that moves many runs; call it after start-up.

    Everything alive by then (modules, pydantic's and PyMongo's tables: ~100,000 objects)
    lives as long as the process. Frozen, full collections stop walking it: they took about a
    tenth of a busy worker's CPU. A young generation of 10,000 objects instead of 700 lets most
    of a run's objects die before a collection looks at them."""
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run a process's main coroutine, on uvloop where it is installed (a dependency wherever
    uvloop builds): its event loop costs less CPU per network call than asyncio's own."""
    tune_collector()
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def stop_on_signals(stop: asyncio.Event, within: float | None = None) -> None:
    """SIGTERM or SIGINT asks for a graceful stop; a second one exits at once.

    With `within`, a process still running that many seconds (plus EXIT_SLACK_SECONDS) after
    the first signal exits then, with code 1. Its own bounds should have ended it long before;
    this one also holds when something unforeseen waits (a step's thread that never returns
    keeps the interpreter from exiting). A timer thread, so it fires even after the loop ended.

    After a hard exit, leases held by a worker simply expire and the reaper recovers them.
    """

    def handle(signum: int) -> None:
        if stop.is_set():
            log.warning("second signal: exiting now")
            os._exit(128 + signum)
        stop.set()
        if within is not None:
            timer = threading.Timer(within + EXIT_SLACK_SECONDS, _overdue, (within,))
            timer.daemon = True
            timer.start()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, handle, signum)


def _overdue(within: float) -> None:
    log.error("still stopping %.0f s after the signal: exiting now", within + EXIT_SLACK_SECONDS)
    logging.shutdown()  # the line above is the last word: make sure it is written
    os._exit(1)


class Stopped(Exception):
    """The process was asked to stop before it had started."""


async def unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> T:
    """`work`'s result, or `Stopped` once `stop` is set first (`work` is then cancelled).

    Start-up waits for an engine that does not answer yet (PyMongo's server selection, 30 s);
    a signal must not have to wait for it too.
    """
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
    if not task.done():
        await asyncio.wait([task], timeout=CANCEL_SECONDS)
        raise Stopped
    return task.result()


async def finish_within(task: asyncio.Future[Any], seconds: float, what: str) -> bool:
    """Give `task` up to `seconds` to end by itself, then cancel it: True if it ended by itself.

    For the last steps of a stop, whose engine may not answer. The cancel is waited for only
    briefly: one landing inside a driver's network call can be absorbed there, and the
    process must not wait on it.
    """
    done, _ = await asyncio.wait([task], timeout=max(0.0, seconds))
    if done:
        return True
    log.warning("%s did not end within %.1f s: cancelled", what, seconds)
    task.cancel()
    await asyncio.wait([task], timeout=CANCEL_SECONDS)
    return False


@contextmanager
def log_context(**fields: str | None) -> Generator[None, None, None]:
    """Within the block, every log line carries `fields` (one of LOG_FIELDS; None drops one).

    The fields live in a context variable, so they follow the block's task into the tasks it
    creates and the threads it starts with a copy of its context (as sync handlers are), and
    never leak into another run's lines.
    """
    merged = {**_context.get(), **fields}
    token = _context.set(MappingProxyType({k: v for k, v in merged.items() if v is not None}))
    try:
        yield
    finally:
        _context.reset(token)


def _fields(record: logging.LogRecord) -> dict[str, str]:
    """The record's context fields: its own (`extra=`, a LoggerAdapter) over its task's."""
    found = dict(_context.get())
    found.update(
        (name, str(value))
        for name in LOG_FIELDS
        if (value := getattr(record, name, None)) is not None
    )
    if token := found.pop("lease_token", None):
        found["lease"] = token[:LEASE_PREFIX]
    # Written inside a span (a step's, say): the line names it, to be found from the trace.
    span = trace.get_current_span().get_span_context()
    if span.is_valid:
        found["trace_id"] = trace.format_trace_id(span.trace_id)
        found["span_id"] = trace.format_span_id(span.span_id)
    return found


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the context fields, and the
    traceback as `exception` when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        # ASCII escapes keep a line writable whatever a message holds (lone surrogates too).
        return json.dumps(line)


class TextFormatter(logging.Formatter):
    """For a person at a terminal: the message, then the context fields in brackets."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = " ".join(f"{name}={value}" for name, value in _fields(record).items())
        return f"{line} [{fields}]" if fields else line


def configure_logging(log_format: LogFormat | None = None, level: str = "INFO") -> None:
    """Send every log line to stderr in `log_format`, replacing any handler set up before;
    unset, text for a terminal and JSON for anything else (a file, a pipe, a log collector)."""
    if log_format is None:
        log_format = "text" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler()
    handler.setFormatter(JSONFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)


class HTTPServer(uvicorn.Server):
    """uvicorn without its own signal handling: our `stop` event governs every part.

    Its log lines go through jobplane's handler (JSON or text) rather than the handlers
    uvicorn installs for itself, so a process writes one format.
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        for name in ("uvicorn", "uvicorn.access"):
            logger = logging.getLogger(name)
            logger.handlers.clear()
            logger.propagate = True

    @contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def serve_http(server: HTTPServer, stop: asyncio.Event) -> None:
    """Serve until `stop`; uvicorn then waits for requests in flight up to the config's
    `timeout_graceful_shutdown` (its default waits for ever) and cancels the rest."""
    task = asyncio.create_task(server.serve())
    await asyncio.wait([task, asyncio.create_task(stop.wait())], return_when="FIRST_COMPLETED")
    server.should_exit = True
    await task
