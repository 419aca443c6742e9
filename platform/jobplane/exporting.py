"""A process's spans exported: the OpenTelemetry SDK's tracer provider, with a batch processor
per exporter the standard OTEL_* variables name (`tracing.configure` reads them). Needs the
`jobplane[otel]` extra; nothing else imports the SDK."""

import logging
import os
from functools import cached_property

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

log = logging.getLogger("jobplane.tracing")


class KeptResource(Resource):
    """A resource whose hash is computed once. The OTLP exporter groups every span it sends by
    its resource, and the SDK's hash dumps the attributes to JSON each time: a sixth of the
    cost of encoding a span. A resource never changes."""

    @cached_property
    def _hash(self) -> int:
        return super().__hash__()

    def __hash__(self) -> int:
        return self._hash


def provider(service: str, exporters: list[str]) -> TracerProvider:
    """A tracer provider exporting through `exporters` (`otlp`, `console`), its service named
    `service` unless the variables name one."""
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service}))
    made = TracerProvider(resource=KeptResource(resource.attributes, resource.schema_url))
    for name in exporters:
        if (exporter := _exporter(name)) is not None:
            made.add_span_processor(BatchSpanProcessor(exporter))
    return made


def _exporter(name: str) -> SpanExporter | None:
    if name == "console":
        return ConsoleSpanExporter()
    if name != "otlp":
        log.warning("OTEL_TRACES_EXPORTER %r is not one jobplane knows (otlp, console)", name)
        return None
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if protocol != "http/protobuf":
        log.warning("OTLP protocol %r is not supported: exporting over http/protobuf", protocol)
    return OTLPSpanExporter()
