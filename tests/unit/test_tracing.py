"""A process's tracing set up from the standard OTEL_* variables, and its log lines naming the
span they were written in."""

import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace import StatusCode

from jobplane import tracing
from jobplane.model import Run, RunStatus
from jobplane.process import JSONFormatter
from jobplane.worker import spans as spans_of
from jobplane.worker.context import CancelRequested
from jobplane.worker.held import Stopped
from tests.tracing import install, recorded

VARIABLES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_TRACES_EXPORTER",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_SDK_DISABLED",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
)


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    install(None)
    yield
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()
    install(None)


def installed() -> TracerProvider:
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    return provider


def exporters(provider: TracerProvider) -> list[object]:
    processors = provider._active_span_processor._span_processors
    return [p._batch_processor._exporter for p in processors if isinstance(p, BatchSpanProcessor)]


def test_without_a_variable_nothing_is_installed_and_no_span_is_made() -> None:
    tracing.configure("jobplane-worker")
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert tracing.tracer() is None
    assert tracing.send("default", "t", 1, "user", "u") == (None, None)


def test_an_endpoint_turns_on_otlp_export_under_the_process_s_own_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    tracing.configure("jobplane-worker")
    provider = installed()
    assert provider.resource.attributes["service.name"] == "jobplane-worker"
    [exporter] = exporters(provider)
    assert isinstance(exporter, OTLPSpanExporter)
    assert tracing.tracer() is not None


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("OTEL_SERVICE_NAME", "billing-worker"),
        ("OTEL_RESOURCE_ATTRIBUTES", "service.name=billing-worker"),
    ],
)
def test_a_service_name_set_by_the_variables_wins(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv(variable, value)
    tracing.configure("jobplane-worker")
    provider = installed()
    assert provider.resource.attributes["service.name"] == "billing-worker"
    [exporter] = exporters(provider)
    assert isinstance(exporter, ConsoleSpanExporter)


@pytest.mark.parametrize(
    "variables",
    [
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_SDK_DISABLED": "true"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_TRACES_EXPORTER": "none"},
    ],
)
def test_disabled_or_no_exporter_installs_nothing(
    monkeypatch: pytest.MonkeyPatch, variables: dict[str, str]
) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    tracing.configure("jobplane-api")
    assert tracing.tracer() is None


def test_an_applications_own_provider_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    mine = TracerProvider()
    install(mine)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    tracing.configure("jobplane-api")
    assert trace.get_tracer_provider() is mine
    assert exporters(mine) == []


def test_an_unsupported_protocol_is_said_and_http_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with caplog.at_level(logging.WARNING, "jobplane.tracing"):
        tracing.configure("jobplane-api")
    assert "'grpc' is not supported" in caplog.text
    assert len(exporters(installed())) == 1


def test_a_log_line_written_in_a_span_names_it() -> None:
    record = logging.LogRecord("jobplane.worker", logging.INFO, __file__, 1, "hello", None, None)
    outside = json.loads(JSONFormatter().format(record))
    assert "trace_id" not in outside and "span_id" not in outside
    with recorded(), trace.get_tracer("t").start_as_current_span("work") as span:
        inside = json.loads(JSONFormatter().format(record))
    context = span.get_span_context()
    assert inside["trace_id"] == trace.format_trace_id(context.trace_id)
    assert inside["span_id"] == trace.format_span_id(context.span_id)


def test_a_send_span_s_context_is_what_the_run_stores() -> None:
    with recorded() as spans:
        span, stored = tracing.send("default", "t", 3, "account", "acme")
        tracing.sent(span, "run-1")
    [ended] = spans.get_finished_spans()
    assert ended.context is not None and stored is not None
    trace_id = trace.format_trace_id(ended.context.trace_id)
    span_id = trace.format_span_id(ended.context.span_id)
    assert list(stored) == ["traceparent"]
    assert stored["traceparent"].startswith(f"00-{trace_id}-{span_id}-")
    assert ended.attributes is not None and ended.attributes["messaging.message.id"] == "run-1"


@pytest.mark.parametrize(
    ("stop", "event"),
    [
        (Stopped("lost"), "lease lost"),
        (Stopped("shutdown"), "stopped: shutdown"),
        (CancelRequested("r1"), "cancel requested"),
    ],
)
def test_what_stops_a_step_without_failing_it_is_an_event(stop: Exception, event: str) -> None:
    run = Run(
        id="r1",
        template_type="t",
        template_version=1,
        scope="user",
        scope_id="u",
        status=RunStatus.RUNNING,
        create_at=datetime.now(UTC),
        update_at=datetime.now(UTC),
    )
    with recorded() as spans, pytest.raises(type(stop)), spans_of.step(run, "s1"):
        raise stop
    [ended] = spans.get_finished_spans()
    assert [e.name for e in ended.events] == [event]
    assert ended.status.status_code == StatusCode.UNSET
