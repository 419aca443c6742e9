"""Spans recorded in memory: the process's tracer provider, installed for one test."""

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import TracerProvider as AnyProvider
from opentelemetry.util._once import Once


def install(provider: AnyProvider | None) -> None:
    """Make `provider` the process's (None: none, as before anything installs one). The API
    lets a process install one provider for its life; a test installs its own and removes it."""
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = provider


@contextmanager
def recorded() -> Iterator[InMemorySpanExporter]:
    """Within the block, every span this process ends is kept in the exporter given."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    install(provider)
    try:
        yield exporter
    finally:
        install(None)
        provider.shutdown()


def named(spans: Iterator[ReadableSpan] | tuple[ReadableSpan, ...], name: str) -> ReadableSpan:
    """The one span called `name`."""
    [span] = [s for s in spans if s.name == name]
    return span
