"""An OTLP/HTTP receiver for tests: a server on 127.0.0.1 that keeps every span the processes
export to `<endpoint>/v1/traces`, as a Collector would receive them."""

import gzip
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.trace import SpanKind


@dataclass(frozen=True)
class Span:
    resource: dict[str, Any]
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    kind: SpanKind
    attributes: dict[str, Any]
    # (trace id, span id) of each span linked to.
    links: tuple[tuple[str, str], ...]

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name"))


class Receiver:
    """The spans received so far, from every process exporting to `endpoint`."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def keep(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        found = [
            _span(_attributes(resource.resource.attributes), span)
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]
        with self._lock:
            self._spans.extend(found)


@contextmanager
def receiving() -> Iterator[Receiver]:
    """A receiver until the block ends. It serves from a thread of its own: a process's last
    export, as it exits, still needs an answer while the test's event loop is blocked waiting
    for that process to exit."""
    server = _Server()
    thread = threading.Thread(target=server.serve_forever, name="otlp", daemon=True)
    thread.start()
    try:
        yield server.receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class _Server(ThreadingHTTPServer):
    def __init__(self) -> None:
        # Port 0: the kernel's choice, bound as it is chosen, so no other process gets it first.
        super().__init__(("127.0.0.1", 0), _Handler)
        self.receiver = Receiver(f"http://127.0.0.1:{self.server_address[1]}")


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        assert isinstance(self.server, _Server)
        if self.path != "/v1/traces":
            self.send_error(404)
            return
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        # As an inherited OTEL_EXPORTER_OTLP_COMPRESSION may ask of the exporters.
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        self.server.receiver.keep(body)
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: pytest shows the test's own output, not a line per export."""


def _span(resource: dict[str, Any], span: trace_pb2.Span) -> Span:
    return Span(
        resource=resource,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_id=span.parent_span_id.hex() or None,
        name=span.name,
        # OTLP counts from an UNSPECIFIED kind that the API's enumeration lacks.
        kind=SpanKind(span.kind - 1),
        attributes=_attributes(span.attributes),
        links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
    )


def _attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return None if which is None else getattr(value, which)
