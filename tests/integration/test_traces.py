"""Traces from a run's creation to each step, recorded in memory: each span's name, kind,
parent or link, and attributes, on one event loop with a real MongoDB and Redis."""

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from jobplane import Client, tracing
from jobplane.backends import Backends
from jobplane.model import RunStatus
from jobplane.runs import RunRequest, RunService
from jobplane.schedules.service import ScheduleService
from jobplane.settings import Settings
from jobplane.worker import StepContext, registry
from tests.integration.conftest import Register, options
from tests.integration.test_external import external
from tests.integration.workers import running, settled
from tests.tracing import named, recorded

# A caller's own trace, as its `traceparent` header carries it.
CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"


def handlers() -> trace.Tracer:
    # Not one made at import: a tracer keeps the provider it first found, and each test here
    # installs its own.
    return trace.get_tracer("tests.handlers")


# Which of a run's attempts failed already, for the handler that fails each run's first.
failed_once: set[str] = set()


@registry.register("test.traced_async")
async def traced_async(ctx: StepContext) -> str:
    with handlers().start_as_current_span("handler async"):
        await asyncio.sleep(0)
    return "async"


@registry.register("test.traced_sync")
def traced_sync(ctx: StepContext) -> str:
    assert threading.current_thread() is not threading.main_thread()
    with handlers().start_as_current_span("handler sync"):
        return "sync"


@registry.register("test.fails_first")
def fails_first(ctx: StepContext) -> None:
    if ctx.run.id not in failed_once:
        failed_once.add(ctx.run.id)
        raise RuntimeError("the first attempt fails")


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    with recorded() as exporter:
        yield exporter


def hex_of(span: ReadableSpan) -> tuple[str, str]:
    """The span's trace id and span id, as hex."""
    assert span.context is not None
    return trace.format_trace_id(span.context.trace_id), trace.format_span_id(span.context.span_id)


def parent_of(span: ReadableSpan) -> str | None:
    return trace.format_span_id(span.parent.span_id) if span.parent else None


def run_attributes(span: ReadableSpan, run_id: str, type_: str, attempt: int) -> None:
    """The attributes every span of a run carries."""
    assert span.attributes is not None
    assert {k: span.attributes.get(k) for k in RUN_KEYS} == {
        "messaging.system": "jobplane",
        "messaging.destination.name": "default",
        "messaging.message.id": run_id,
        "jobplane.template.type": type_,
        "jobplane.template.version": 1,
        "jobplane.run.scope": "user",
        "jobplane.run.scopeId": "u1",
        "jobplane.run.attempt": attempt,
    }


# The first word of the names of a run's spans, and of its handlers' spans here.
RUN_SPANS = ("send", "process", "step", "handler")
RUN_KEYS = (
    "messaging.system",
    "messaging.destination.name",
    "messaging.message.id",
    "jobplane.template.type",
    "jobplane.template.version",
    "jobplane.run.scope",
    "jobplane.run.scopeId",
    "jobplane.run.attempt",
)


async def test_a_run_continues_its_callers_trace_from_send_to_each_steps_own_spans(
    api: httpx.AsyncClient,
    backends: Backends,
    settings: Settings,
    register: Register,
    spans: InMemorySpanExporter,
) -> None:
    await register(
        "traced",
        steps=[
            {"id": "first", "handler": "test.traced_async"},
            {"id": "second", "handler": "test.traced_sync"},
        ],
    )
    body = {"templateType": "traced", "scope": "user", "scopeId": "u1"}
    created = await api.post("/v1/runs", json=body, headers={"traceparent": TRACEPARENT})
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]
    async with running(backends, settings):
        [done] = await settled(backends.store, [run_id])
    assert done.status == RunStatus.SUCCEEDED

    ended = spans.get_finished_spans()
    answered = (await api.get(f"/v1/runs/{run_id}")).json()
    assert answered["traceId"] == CALLER_TRACE
    send = named(ended, "send default")
    process = named(ended, "process default")
    first, second = named(ended, "step first"), named(ended, "step second")
    own_async, own_sync = named(ended, "handler async"), named(ended, "handler sync")
    assert {hex_of(s)[0] for s in ended} == {CALLER_TRACE}, "one trace, the caller's"
    stored = answered["traceContext"]["traceparent"]
    assert stored.startswith(f"00-{CALLER_TRACE}-{hex_of(send)[1]}-"), "the send span's context"

    server = named(ended, "POST /v1/runs")  # FastAPI's, in the caller's trace
    assert (server.kind, parent_of(server)) == (SpanKind.SERVER, CALLER_SPAN)
    assert (send.kind, parent_of(send)) == (SpanKind.PRODUCER, hex_of(server)[1])
    assert (process.kind, parent_of(process)) == (SpanKind.CONSUMER, hex_of(send)[1])
    for step in (first, second):
        assert (step.kind, parent_of(step)) == (SpanKind.INTERNAL, hex_of(process)[1])
        assert step.status.status_code == StatusCode.UNSET
    assert parent_of(own_async) == hex_of(first)[1]
    assert parent_of(own_sync) == hex_of(second)[1], "a sync handler's thread nests too"

    run_attributes(send, run_id, "traced", 0)
    run_attributes(process, run_id, "traced", 1)
    run_attributes(first, run_id, "traced", 1)
    assert send.attributes and send.attributes["messaging.operation.type"] == "send"
    assert process.attributes and process.attributes["messaging.operation.type"] == "process"


async def test_a_failed_step_records_its_exception_and_the_retry_stays_in_the_trace(
    backends: Backends, settings: Settings, register: Register, spans: InMemorySpanExporter
) -> None:
    await register(
        "flaky",
        steps=[{"id": "flaky", "handler": "test.fails_first"}],
        retryPolicy={"maxAttempts": 2, "backoffSeconds": [0]},
    )
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("flaky", "user", "u1"), "user:t")
    async with running(backends, settings):
        [done] = await settled(backends.store, [run.id])
    assert (done.status, done.attempt) == (RunStatus.SUCCEEDED, 2)

    ended = spans.get_finished_spans()
    send = named(ended, "send default")
    assert parent_of(send) is None, "created outside any trace: the run's starts one"
    processes = sorted(
        (s for s in ended if s.name == "process default"), key=lambda s: s.start_time or 0
    )
    steps = sorted((s for s in ended if s.name == "step flaky"), key=lambda s: s.start_time or 0)
    assert len(processes) == len(steps) == 2
    assert {hex_of(s)[0] for s in ended} == {hex_of(send)[0]}
    for attempt, (process, step) in enumerate(zip(processes, steps, strict=True), start=1):
        assert parent_of(process) == hex_of(send)[1], "each attempt is the run's consumer"
        assert parent_of(step) == hex_of(process)[1]
        run_attributes(process, run.id, "flaky", attempt)
    failed, retried = steps
    assert failed.status.status_code == StatusCode.ERROR
    assert processes[0].status.status_code == StatusCode.ERROR
    [exception] = [e for e in failed.events if e.name == "exception"]
    assert exception.attributes and exception.attributes["exception.type"] == "RuntimeError"
    assert exception.attributes["exception.message"] == "the first attempt fails"
    assert retried.status.status_code == StatusCode.UNSET


async def test_a_cancel_is_an_event_on_the_step_it_stopped(
    backends: Backends, settings: Settings, register: Register, spans: InMemorySpanExporter
) -> None:
    await register("sleepy", steps=[{"id": "nap", "handler": "builtin.sleep"}])
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("sleepy", "user", "u1", {"sleepSeconds": 30}), "u:t")
    async with running(backends, settings):
        async with asyncio.timeout(20):
            while (await service.get(run.id)).status != RunStatus.RUNNING:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        await service.cancel(run.id, "user:t", "enough")
        [done] = await settled(backends.store, [run.id])
    assert done.status == RunStatus.CANCELLED
    step = named(spans.get_finished_spans(), "step nap")
    assert [e.name for e in step.events] == ["cancel requested"]
    assert step.status.status_code == StatusCode.UNSET


async def test_with_tracing_off_a_run_keeps_its_callers_context_and_no_span_is_made(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register("plain", steps=[{"id": "only", "handler": "builtin.noop"}])
    body = {"templateType": "plain", "scope": "user", "scopeId": "u1"}
    carried = await api.post("/v1/runs", json=body, headers={"traceparent": TRACEPARENT})
    plain = await api.post("/v1/runs", json=body)
    # A malformed header is no trace context at all, as the W3C specification says.
    garbled = await api.post("/v1/runs", json=body, headers={"traceparent": "00-nonsense-01"})
    assert garbled.status_code == 201 and garbled.json()["traceContext"] is None
    assert carried.json()["traceContext"] == {"traceparent": TRACEPARENT}
    assert carried.json()["traceId"] == CALLER_TRACE
    assert plain.json()["traceContext"] is None and plain.json()["traceId"] is None
    stored = await backends.store.runs.get(plain.json()["id"])
    assert stored is not None and stored.trace_context is None
    async with running(backends, settings):
        done = await settled(backends.store, [r.json()["id"] for r in (carried, plain, garbled)])
    assert {r.status for r in done} == {RunStatus.SUCCEEDED}
    assert tracing.tracer() is None


async def test_a_map_steps_children_are_sent_from_its_span(
    backends: Backends, settings: Settings, register: Register, spans: InMemorySpanExporter
) -> None:
    await register("child", steps=[{"id": "work", "handler": "builtin.echo"}])
    await register(
        "parent",
        steps=[
            {
                "id": "fan",
                "workerType": "map",
                "map": {"template": "child", "items": "payload.items"},
            }
        ],
    )
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(
        RunRequest("parent", "user", "u1", {"items": [{"n": 1}, {"n": 2}]}), "u:t"
    )
    async with running(backends, settings):
        [done] = await settled(backends.store, [run.id])
    assert done.status == RunStatus.SUCCEEDED, done.error
    ended = spans.get_finished_spans()
    fans = [s for s in ended if s.name == "step fan"]
    sends = [s for s in ended if s.name == "send default"]
    children = [
        s for s in sends if s.attributes and s.attributes["jobplane.template.type"] == "child"
    ]
    assert len(children) == 2
    assert {parent_of(c) for c in children} <= {hex_of(f)[1] for f in fans}
    assert {hex_of(s)[0] for s in ended} == {hex_of(fans[0])[0]}, "the family is one trace"
    child_processes = [
        s
        for s in ended
        if s.name == "process default"
        and s.attributes
        and s.attributes["jobplane.template.type"] == "child"
    ]
    assert {parent_of(p) for p in child_processes} == {hex_of(c)[1] for c in children}


async def test_a_fire_starts_a_trace_of_its_own_linked_to_the_schedules(
    api: httpx.AsyncClient, backends: Backends, register: Register, spans: InMemorySpanExporter
) -> None:
    await register("nightly", steps=[{"id": "only", "handler": "builtin.noop"}], schedulable=True)
    body = {"templateType": "nightly", "cron": "* * * * *", "scope": "user", "scopeId": "u1"}
    made = await api.post("/v1/schedules", json=body, headers={"traceparent": TRACEPARENT})
    assert made.status_code == 201, made.text
    schedule = await ScheduleService(backends.store, backends.queue).get(made.json()["id"])
    assert schedule.next_run_at is not None
    fired = await ScheduleService(backends.store, backends.queue).fire_due(
        schedule.next_run_at, 10, 60
    )
    assert fired == 1
    ended = spans.get_finished_spans()
    fire, send = named(ended, "fire"), named(ended, "send default")
    assert parent_of(fire) is None and hex_of(fire)[0] != CALLER_TRACE
    [link] = fire.links
    assert trace.format_trace_id(link.context.trace_id) == CALLER_TRACE
    created = named(ended, "POST /v1/schedules")
    assert trace.format_span_id(link.context.span_id) == hex_of(created)[1]
    assert fire.attributes and fire.attributes["jobplane.schedule.id"] == schedule.id
    assert parent_of(send) == hex_of(fire)[1] and hex_of(send)[0] == hex_of(fire)[0]


async def test_an_external_worker_continues_the_trace_of_the_step_it_leased(
    api: httpx.AsyncClient,
    backends: Backends,
    settings: Settings,
    register: Register,
    spans: InMemorySpanExporter,
) -> None:
    await register(
        "outside",
        steps=[{"id": "render", "handler": "test.traced_async", "workerType": "external"}],
    )
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("outside", "user", "u1"), "user:t")
    async with running(backends, settings), external(api):
        [done] = await settled(backends.store, [run.id])
    assert done.status == RunStatus.SUCCEEDED
    # The external worker's own calls to the API are FastAPI's spans, in traces of their own.
    ended = tuple(s for s in spans.get_finished_spans() if s.name.split()[0] in RUN_SPANS)
    send = named(ended, "send default")
    step = named(ended, "step render")
    consumers = [s for s in ended if s.name == "process default"]
    assert {hex_of(s)[0] for s in ended} == {hex_of(send)[0]}
    assert parent_of(step) in {hex_of(p)[1] for p in consumers}
    assert all(parent_of(p) == hex_of(send)[1] for p in consumers)
    assert parent_of(named(ended, "handler async")) == hex_of(step)[1]


async def test_the_http_client_sends_its_current_context(
    url: str, settings: Settings, register: Register, spans: InMemorySpanExporter
) -> None:
    await register("plain", steps=[{"id": "only", "handler": "builtin.noop"}])
    async with Client(url, api_key=settings.admin_key) as client:
        with handlers().start_as_current_span("producer") as producer:
            run = await client.create("plain", scope="user", scope_id="u1")
    mine = producer.get_span_context()
    assert run.trace_id == trace.format_trace_id(mine.trace_id)
    ended = spans.get_finished_spans()
    server, send = named(ended, "POST /v1/runs"), named(ended, "send default")
    assert parent_of(server) == trace.format_span_id(mine.span_id)
    assert parent_of(send) == hex_of(server)[1]


async def test_a_direct_client_sends_from_the_applications_current_span(
    url: str, settings: Settings, register: Register, spans: InMemorySpanExporter
) -> None:
    await register("plain", steps=[{"id": "only", "handler": "builtin.noop"}])
    async with Client(**options("direct", url, settings)) as client:
        with handlers().start_as_current_span("producer") as producer:
            run = await client.create("plain", scope="user", scope_id="u1")
    mine = producer.get_span_context()
    assert run.trace_id == trace.format_trace_id(mine.trace_id)
    send = named(spans.get_finished_spans(), "send default")
    assert parent_of(send) == trace.format_span_id(mine.span_id)


async def test_a_step_timeout_is_an_event_and_fails_its_span(
    backends: Backends, settings: Settings, register: Register, spans: InMemorySpanExporter
) -> None:
    await register("slow", steps=[{"id": "nap", "handler": "builtin.sleep", "timeoutSeconds": 0.2}])
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("slow", "user", "u1", {"sleepSeconds": 30}), "u:t")
    async with running(backends, settings):
        [done] = await settled(backends.store, [run.id])
    assert done.status == RunStatus.FAILED and done.error and done.error.code == "step_timeout"
    step = named(spans.get_finished_spans(), "step nap")
    assert [e.name for e in step.events] == ["timeout", "exception"]
    assert step.status.status_code == StatusCode.ERROR
