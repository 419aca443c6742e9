"""Log lines: one JSON object per line with the work's context, or text for a person."""

import asyncio
import contextvars
import io
import json
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from jobplane.process import (
    JSONFormatter,
    LogFormat,
    TextFormatter,
    configure_logging,
    log_context,
)

TOKEN = "0123456789abcdef01234567"  # the shape of a lease token: 24 hex digits
BASE = {"time", "level", "logger", "message"}


@pytest.fixture
def buffer() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger of its own writing JSON lines into a buffer."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JSONFormatter())
    logger = logging.getLogger("jobplane.test_logs")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, out
    logger.removeHandler(handler)


def lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_json_line_has_the_fields_and_only_a_prefix_of_the_lease_token(
    buffer: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = buffer
    with log_context(run_id="r1", worker_id="w1", lease_token=TOKEN), log_context(step="s1"):
        logger.warning("step %s slow", "s1")
    logger.info("outside")
    inside, outside = lines(out)
    assert set(inside) == BASE | {"run_id", "step", "worker_id", "lease"}
    assert inside["level"] == "WARNING" and inside["logger"] == "jobplane.test_logs"
    assert inside["message"] == "step s1 slow"
    assert (inside["run_id"], inside["step"], inside["worker_id"]) == ("r1", "s1", "w1")
    assert inside["lease"] == TOKEN[:8]
    assert TOKEN not in out.getvalue()
    assert inside["time"].endswith("+00:00")
    assert set(outside) == BASE  # nothing left behind


def test_a_record_s_own_fields_win_and_tracebacks_stay_on_one_line(
    buffer: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = buffer
    step_log = logging.LoggerAdapter(logger, {"run_id": "r2", "step": "fetch"})
    with log_context(run_id="r1", worker_id="w1"):
        step_log.info("from a handler")
        try:
            raise ValueError("bad\nnews")
        except ValueError:
            logger.exception("step failed", extra={"lease_token": TOKEN})
    assert len(out.getvalue().splitlines()) == 2
    adapted, failed = lines(out)
    assert (adapted["run_id"], adapted["step"], adapted["worker_id"]) == ("r2", "fetch", "w1")
    assert failed["lease"] == TOKEN[:8] and TOKEN not in out.getvalue()
    assert "Traceback" in failed["exception"] and "ValueError: bad\nnews" in failed["exception"]


async def test_each_task_and_thread_logs_its_own_run(
    buffer: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = buffer
    both = asyncio.Barrier(2)

    async def run(run_id: str) -> None:
        with log_context(run_id=run_id):
            await both.wait()  # the two runs' contexts are set at the same time
            logger.info("async")
            # As the worker runs a sync handler: in a thread, with a copy of the context.
            call = contextvars.copy_context().run
            thread = threading.Thread(target=call, args=(logger.info, "thread"))
            thread.start()
            await asyncio.to_thread(thread.join)

    await asyncio.gather(run("a"), run("b"))
    seen = sorted((line["run_id"], line["message"]) for line in lines(out))
    assert seen == [("a", "async"), ("a", "thread"), ("b", "async"), ("b", "thread")]


def test_text_lines_put_the_fields_after_the_message() -> None:
    record = logging.LogRecord(
        "jobplane.worker", logging.INFO, __file__, 1, "run %s done", ("r1",), None
    )
    with log_context(run_id="r1", step="s1", worker_id="w1", lease_token=TOKEN):
        line = TextFormatter().format(record)
    assert line.endswith(
        " INFO jobplane.worker run r1 done [run_id=r1 step=s1 worker_id=w1 lease=01234567]"
    )
    assert TOKEN not in line
    plain = TextFormatter().format(record)
    assert plain.endswith("run r1 done")


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


@pytest.mark.usefixtures("restore_root")
@pytest.mark.parametrize("log_format", ["json", "text"])
def test_configure_logging_switches_the_format(
    log_format: LogFormat, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging(log_format, "INFO")
    with log_context(run_id="r1"):
        logging.getLogger("jobplane.scheduler").info("tick")
        logging.getLogger("jobplane.scheduler").debug("below the level")
    [line] = capsys.readouterr().err.splitlines()
    if log_format == "json":
        assert json.loads(line)["message"] == "tick" and json.loads(line)["run_id"] == "r1"
    else:
        assert line.endswith("INFO jobplane.scheduler tick [run_id=r1]")


@pytest.mark.usefixtures("restore_root")
@pytest.mark.parametrize("terminal", [True, False])
def test_an_unset_format_follows_the_terminal(
    terminal: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Text for a person at a terminal, JSON for a file, a pipe or a log collector."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    configure_logging(None, "INFO")
    logging.getLogger("jobplane.worker").info("started")
    [line] = capsys.readouterr().err.splitlines()
    if terminal:
        assert line.endswith("INFO jobplane.worker started")
    else:
        assert json.loads(line)["message"] == "started"
