"""What the OpenTelemetry SDK itself costs per span, as jobplane makes its spans: the floor
under tracing's price per run.

Each span is made as `worker/spans.py` makes a `process` span (`start_as_current_span` with
the nine attributes every span of a run carries, ended at once), in one process, through the
SDK's `BatchSpanProcessor` with its defaults, to an exporter that

    dropping   does nothing: the span's making alone
    encoding   encodes the batch for OTLP and serializes it, as the HTTP exporter does before
               it sends (the request itself, and the receiver, not counted)

CPU is `time.process_time()`, so the batch processor's thread counts; each figure is the
CPU µs per span of `--spans` spans, after a warm-up, three times. A run with one step makes
three spans (`send`, `process`, `step`). docs/benchmarks.md ("Issue 30") has the figures.

    .venv/bin/python bench/span_floor.py [--spans N]
"""

import argparse
import time
from collections.abc import Sequence

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind

from jobplane import tracing


class Dropping(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class Encoding(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        encode_spans(spans).SerializePartialToString()
        return SpanExportResult.SUCCESS


ATTRIBUTES = {
    **tracing.attributes("default", "bench_noop", 1, "user", "u1", 1, "6b0b6cfe2b329c3ee509a575"),
    "messaging.operation.type": "process",
}


def per_span(exporter: SpanExporter, spans: int) -> float:
    """CPU µs per span, the batch processor's thread included."""
    provider = TracerProvider()
    # A queue as long as the run, so that no span is dropped while the thread catches up.
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=spans + 2_000))
    tracer = provider.get_tracer("jobplane")

    def make(n: int) -> None:
        for _ in range(n):
            with tracer.start_as_current_span(
                "process default",
                kind=SpanKind.CONSUMER,
                attributes=ATTRIBUTES,
                record_exception=False,
                set_status_on_exception=False,
            ):
                pass

    make(2_000)
    provider.force_flush()
    began = time.process_time()
    make(spans)
    provider.force_flush()
    took = time.process_time() - began
    provider.shutdown()
    return took / spans * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spans", type=int, default=30_000)
    args = parser.parse_args()
    for name, exporter in (("dropping", Dropping()), ("encoding", Encoding())):
        figures = [per_span(exporter, args.spans) for _ in range(3)]
        each = " / ".join(f"{f:.1f}" for f in figures)
        print(f"{name:9} {each} CPU µs per span (nine attributes)")


if __name__ == "__main__":
    main()
