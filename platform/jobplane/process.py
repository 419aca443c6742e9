"""Running a jobplane process: signals, logging, the HTTP server in the same event loop."""

import asyncio
import gc
import json
import logging
import os
import signal
from collections.abc import Coroutine, Generator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Literal, TypeVar

import uvicorn

LogFormat = Literal["json", "text"]
T = TypeVar("T")

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


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM or SIGINT asks for a graceful stop; a second one exits at once.

    After a hard exit, leases held by a worker simply expire and the reaper recovers them.
    """

    def handle(signum: int) -> None:
        if stop.is_set():
            logging.getLogger("jobplane").warning("second signal: exiting now")
            os._exit(128 + signum)
        stop.set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, handle, signum)


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


def configure_logging(log_format: LogFormat = "json", level: str = "INFO") -> None:
    """Send every log line to stderr in `log_format`, replacing any handler set up before."""
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
    task = asyncio.create_task(server.serve())
    await asyncio.wait([task, asyncio.create_task(stop.wait())], return_when="FIRST_COMPLETED")
    server.should_exit = True
    await task
