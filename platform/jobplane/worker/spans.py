"""The spans of a worker's work, in the trace each run's creation began (`jobplane/tracing.py`):
`process <queue>` for each attempt it runs (or step lent or leased to it), whose parent is
the run's `traceContext`, and within it `step <stepId>` for each step it works, current while
the step's handler runs so that the handler's own spans nest under it.

By the messaging conventions a single message's `process` span is a child of its creation
context; a worker's claim takes many runs at once, but runs each on its own, so no span of the
claim links them.
"""

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from jobplane import tracing
from jobplane.model import Run
from jobplane.worker.context import CancelRequested, StepInterrupted, StepTimeout
from jobplane.worker.fanout import ChildrenActive
from jobplane.worker.held import Overdue, Stopped
from jobplane.worker.lending import TakenBack


@contextmanager
def process(run: Run) -> Iterator[None]:
    """An attempt at `run` (its holder's, or a borrower's or an external worker's step)."""
    if (tracer := tracing.tracer()) is None:
        yield
        return
    with tracer.start_as_current_span(
        f"process {run.queue}",
        context=tracing.context_of(run.trace_context),
        kind=SpanKind.CONSUMER,
        attributes={**_attributes(run), "messaging.operation.type": "process"},
        record_exception=False,
        set_status_on_exception=False,
    ):
        yield


@contextmanager
def step(run: Run, step_id: str) -> Iterator[None]:
    """A step worked, in the current `process` span: what failed it is recorded and ends it
    with status ERROR; what stopped it otherwise (a cancel, a lost lease) is an event."""
    if (tracer := tracing.tracer()) is None:
        yield
        return
    with tracer.start_as_current_span(
        f"step {step_id}",
        attributes=_attributes(run),
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield
        except BaseException as exc:
            _ended(span, exc)
            raise


def failed(message: str) -> None:
    """The current `process` span's attempt failed."""
    trace.get_current_span().set_status(Status(StatusCode.ERROR, message))


def _ended(span: Span, exc: BaseException) -> None:
    if isinstance(exc, CancelRequested):
        span.add_event("cancel requested")
    elif isinstance(exc, Stopped):
        span.add_event("lease lost" if exc.reason == "lost" else f"stopped: {exc.reason}")
    elif isinstance(exc, StepInterrupted | asyncio.CancelledError):
        span.add_event("interrupted")
    elif isinstance(exc, ChildrenActive):
        span.add_event("waiting for children")
    elif isinstance(exc, TakenBack):
        span.add_event("taken back")
    elif isinstance(exc, Overdue):
        span.add_event("deadline passed")
        span.set_status(Status(StatusCode.ERROR, "the run's deadline passed"))
    else:
        if isinstance(exc, StepTimeout):
            span.add_event("timeout")
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, str(exc) or type(exc).__name__))


def _attributes(run: Run) -> dict[str, Any]:
    return tracing.attributes(
        run.queue,
        run.template_type,
        run.template_version,
        run.scope,
        run.scope_id,
        run.attempt,
        run.id,
    )
