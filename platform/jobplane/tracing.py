"""Traces: the trace context a run carries, the spans of its creation and of a schedule's fire,
and whether a process exports them (how: `exporting.py`).

Spans follow OpenTelemetry's messaging conventions (`docs/operations.md`, "Traces"): a run's
creation is a PRODUCER span, `send <queue>`, whose W3C context the run stores as
`traceContext`; every attempt and step a worker runs continues it (`worker/spans.py`), so
retries, reaped runs and map children stay in the trace that created them.

Tracing is on in a process when a tracer provider is installed, by the application or by
`configure` from the standard OTEL_* variables. Off, nothing here makes a span: a run only
keeps the context its creator was in already (a caller's `traceparent`, say).
"""

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as contexts
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("jobplane.tracing")

# W3C trace context only, whatever propagators the process configured: it is what the run's
# `traceContext` holds and what an incoming `traceparent` header carries.
W3C = TraceContextTextMapPropagator()
# The providers that make no spans: the API's placeholders until something installs one.
_PLACEHOLDERS = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)

Carrier = dict[str, str]


# jobplane's tracer from the provider it was made by: an application may install its provider
# after jobplane is imported, and a test installs one per test.
_made: tuple[object, Tracer | None] = (None, None)


def tracer() -> Tracer | None:
    """jobplane's tracer, or None while this process records no spans (no tracer provider is
    installed)."""
    global _made
    provider = trace.get_tracer_provider()
    if provider is not _made[0]:
        made = None if isinstance(provider, _PLACEHOLDERS) else provider.get_tracer("jobplane")
        _made = provider, made
    return _made[1]


def carrier(span: Span | None = None) -> Carrier | None:
    """The W3C context (`traceparent`, `tracestate`) of `span`, or of the current context
    without one; None outside a trace."""
    if span is None:
        span = trace.get_current_span()
    if not span.get_span_context().is_valid:
        return None
    found: Carrier = {}
    W3C.inject(found, trace.set_span_in_context(span))
    return found


def context_of(stored: Mapping[str, str] | None) -> contexts.Context:
    """The context a stored or received carrier names: a fresh one, a new trace's root,
    without one (never the current context, which belongs to someone else's work)."""
    return W3C.extract(stored) if stored else contexts.Context()


@contextmanager
def continued(headers: Mapping[str, str]) -> Iterator[None]:
    """Within the block, the current context is the one `headers` (`traceparent`,
    `tracestate`) carry, unless a span is current already (an application's instrumentation
    read the headers first)."""
    if "traceparent" not in headers or trace.get_current_span().get_span_context().is_valid:
        yield
        return
    token = contexts.attach(W3C.extract(headers))
    try:
        yield
    finally:
        contexts.detach(token)


def attributes(
    queue: str,
    template_type: str,
    template_version: int,
    scope: str,
    scope_id: str,
    attempt: int,
    run_id: str | None = None,
) -> dict[str, Any]:
    """The attributes every span of a run carries (`messaging.message.id` once it has an id)."""
    found: dict[str, Any] = {
        "messaging.system": "jobplane",
        "messaging.destination.name": queue,
        "jobplane.template.type": template_type,
        "jobplane.template.version": template_version,
        "jobplane.run.scope": scope,
        "jobplane.run.scopeId": scope_id,
        "jobplane.run.attempt": attempt,
    }
    if run_id is not None:
        found["messaging.message.id"] = run_id
    return found


def send(
    queue: str, template_type: str, template_version: int, scope: str, scope_id: str
) -> tuple[Span | None, Carrier | None]:
    """A run's creation begins: its `send` span (None when off), child of the current
    context, and the context the run stores."""
    if (traced := tracer()) is None:
        return None, carrier()
    span = traced.start_span(
        f"send {queue}",
        kind=SpanKind.PRODUCER,
        attributes={
            **attributes(queue, template_type, template_version, scope, scope_id, 0),
            "messaging.operation.type": "send",
        },
    )
    return span, carrier(span)


def sent(span: Span | None, run_id: str | None, error: BaseException | None = None) -> None:
    """A run's creation ended: with the run it made (or found, for a repeated idempotency
    key), or with the error that refused it."""
    if span is None:
        return
    if run_id is not None:
        span.set_attribute("messaging.message.id", run_id)
    if error is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end()


@contextmanager
def fire(schedule_id: str, stored: Mapping[str, str] | None, at: str) -> Iterator[None]:
    """A schedule's fire: a new trace, linked to the one that created the schedule, so each
    fire's runs start a trace of their own rather than one growing for the schedule's life."""
    if (traced := tracer()) is None:
        yield
        return
    linked = trace.get_current_span(context_of(stored)).get_span_context()
    with traced.start_as_current_span(
        "fire",
        context=contexts.Context(),
        kind=SpanKind.INTERNAL,
        links=[Link(linked)] if linked.is_valid else None,
        attributes={"jobplane.schedule.id": schedule_id, "jobplane.schedule.scheduledFor": at},
    ):
        yield


def configure(service: str) -> None:
    """Export this process's spans as the standard OTEL_* variables ask, under the service
    name `service` unless OTEL_SERVICE_NAME (or OTEL_RESOURCE_ATTRIBUTES) names one.

    Nothing is installed when the application installed a tracer provider of its own, when
    OTEL_SDK_DISABLED is true, or when neither OTEL_TRACES_EXPORTER nor an OTLP endpoint is
    set. The SDK and its exporter are the `jobplane[otel]` extra (`exporting.py`)."""
    env = os.environ
    if tracer() is not None or env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return
    named = env.get("OTEL_TRACES_EXPORTER")
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if named is None and not endpoint:
        return
    exporters = [e for e in (n.strip() for n in (named or "otlp").split(",")) if e != "none"]
    if not exporters:
        return
    try:
        from jobplane.exporting import provider
    except ImportError:
        log.warning(
            "OTEL_* variables ask for traces, but the OpenTelemetry SDK is not installed: "
            "pip install 'jobplane[otel]'"
        )
        return
    trace.set_tracer_provider(provider(service, exporters))
