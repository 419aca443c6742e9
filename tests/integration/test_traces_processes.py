"""Traces across real processes: `jobplane api`, two `jobplane worker`s and a `jobplane
scheduler`, each exporting its spans over OTLP/HTTP, as the standard OTEL_* variables ask, to a
receiver in the test standing in for a Collector.

A run created with a caller's `traceparent` is one trace from the caller's span to its handler's
own HTTP call; a run whose worker is SIGKILLed mid-step is reaped by the scheduler and retried
by the other worker in the trace its creation began.
"""

import asyncio
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from opentelemetry.trace import SpanKind

from jobplane.backends import Backends
from jobplane.devstack import free_port
from jobplane.model import Run, RunStatus
from jobplane.settings import Settings
from tests.integration.conftest import Register
from tests.integration.otlp import Receiver, Span, receiving
from tests.integration.processes import spawn, terminate
from tests.integration.test_api_keys import ready
from tests.integration.test_chaos_worker import stepping

HANDLERS = "tests.integration.traced_handlers"
# A caller's own trace, as its `traceparent` header carries it.
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
SERVICES = {"jobplane-api", "jobplane-worker", "jobplane-scheduler"}
# Bounds for what takes a second or two on a laptop: a loaded 2-core machine may need many
# times that to start four Python processes and expire a lease.
WITHIN = 60.0
POLL = 0.05


def quick(settings: Settings) -> Settings:
    """Short leases, so that the scheduler's reaper takes back a killed worker's run within
    seconds."""
    return settings.model_copy(
        update={"lease_seconds": 2, "heartbeat_seconds": 0.3, "reconcile_seconds": 0.5}
    )


def exporting(receiver: Receiver, instance: str) -> dict[str, str]:
    """The variables that have a process export its spans to `receiver`, under the service
    name it picks itself; `service.instance.id` tells the two workers' spans apart."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        # Milliseconds: a span reaches the receiver within a poll or two, not the SDK's 5 s.
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_RESOURCE_ATTRIBUTES": f"service.instance.id={instance}",
    }


class Fleet:
    """The test's processes by name, and waits that fail the test, with every process's log,
    as soon as one it did not kill exits."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.killed: set[str] = set()

    def start(self, settings: Settings, name: str, command: str, *args: str, **env: str) -> None:
        self.procs[name] = spawn(settings, command, self.logs / f"{name}.log", *args, **env)

    def kill(self, name: str) -> None:
        self.killed.add(name)
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            terminate(proc)

    def check(self) -> None:
        for name, proc in self.procs.items():
            if name not in self.killed and proc.poll() is not None:
                pytest.fail(f"{name} exited with {proc.returncode}:\n{self.output()}")

    def output(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(self.logs.glob("*.log")))

    async def until(
        self, holds: Callable[[], Awaitable[bool]], what: Callable[[], str] | str
    ) -> None:
        try:
            async with asyncio.timeout(WITHIN):
                while not await holds():
                    self.check()
                    await asyncio.sleep(POLL)
        except TimeoutError:
            said = what if isinstance(what, str) else what()
            pytest.fail(f"not within {WITHIN} s: {said}\n{self.output()}")

    async def run(self, backends: Backends, run_id: str, ok: Callable[[Run], bool]) -> Run:
        found: Run | None = None

        async def holds() -> bool:
            nonlocal found
            found = await backends.store.runs.get(run_id)
            return found is not None and ok(found)

        await self.until(holds, f"run {run_id} as asked")
        assert found is not None
        return found

    async def spans(self, receiver: Receiver, holds: Callable[[list[Span]], bool]) -> list[Span]:
        async def arrived() -> bool:
            return holds(receiver.spans)

        await self.until(arrived, lambda: f"spans as asked, received: {names(receiver.spans)}")
        return receiver.spans


def names(spans: list[Span]) -> list[tuple[str, str, str]]:
    return sorted((s.service, s.trace_id, s.name) for s in spans)


def one(spans: list[Span], name: str, attempt: int | None = None) -> Span:
    """The one span called `name` (of the run's attempt `attempt`, if given)."""
    found = [
        s
        for s in spans
        if s.name == name
        and (attempt is None or s.attributes.get("jobplane.run.attempt") == attempt)
    ]
    assert len(found) == 1, f"{len(found)} spans {name} (attempt {attempt}): {names(spans)}"
    return found[0]


def of_run(spans: list[Span], run_id: str) -> list[Span]:
    return [s for s in spans if s.attributes.get("messaging.message.id") == run_id]


def succeeded(run: Run) -> bool:
    return run.status == RunStatus.SUCCEEDED


@pytest.mark.slow
async def test_a_runs_trace_crosses_the_api_and_worker_processes_and_survives_a_killed_worker(
    backends: Backends,
    settings: Settings,
    register: Register,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The processes inherit this one's variables: only the test's own OTEL_* may reach them.
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    await register("traced_call", steps=[{"id": "call", "handler": "traced.call"}])
    await register(
        "traced_hang",
        steps=[{"id": "hang", "handler": "traced.hang_first"}],
        retryPolicy={"maxAttempts": 2, "backoffSeconds": [0]},
    )
    fast, port = quick(settings), free_port()
    base = f"http://127.0.0.1:{port}"
    fleet = Fleet(tmp_path)
    with receiving() as otlp:
        fleet.start(fast, "api", "api", "--port", str(port), **exporting(otlp, "api"))
        for name in ("w0", "w1"):
            env = exporting(otlp, name) | {"JOBPLANE_HANDLERS": HANDLERS}
            fleet.start(fast, name, "worker", JOBPLANE_WORKER_ID=name, **env)
        fleet.start(fast, "scheduler", "scheduler", **exporting(otlp, "scheduler"))
        try:
            headers = {"authorization": f"Bearer {settings.admin_key}"}
            async with httpx.AsyncClient(base_url=base, headers=headers) as api:
                await fleet.until(lambda: ready(api), "the API is ready")

                # -- a run in its caller's trace, to its handler's own HTTP call -----------
                body = {
                    "templateType": "traced_call",
                    "scope": "user",
                    "scopeId": "u1",
                    "payload": {"url": f"{base}/healthz"},
                }
                created = await api.post(
                    "/v1/runs", json=body, headers={"traceparent": TRACEPARENT}
                )
                assert created.status_code == 201, created.text
                called = created.json()["id"]
                done = await fleet.run(backends, called, succeeded)
                assert done.outputs["call"] == {"status": 200}

                # By name, in whatever trace: a span in the wrong one should fail an assertion
                # below that says so, not time out here.
                def whole(spans: list[Span]) -> bool:
                    ran = {"send default", "process default", "step call"}
                    around = {"POST /v1/runs", "GET", "GET /healthz"}
                    named = {s.name for s in spans}
                    return ran <= {s.name for s in of_run(spans, called)} and around <= named

                await fleet.spans(otlp, whole)

                # -- a run whose worker is killed mid-step, reaped and retried -------------
                body = {"templateType": "traced_hang", "scope": "user", "scopeId": "u1"}
                created = await api.post("/v1/runs", json=body)
                assert created.status_code == 201, created.text
                hung = created.json()["id"]
                held = await fleet.run(
                    backends, hung, lambda r: stepping(r) and r.locked_by in ("w0", "w1")
                )
                assert held.locked_by is not None and held.attempt == 1
                victim = held.locked_by
                [survivor] = {"w0", "w1"} - {victim}
                fleet.kill(victim)
                retried = await fleet.run(backends, hung, succeeded)

                def resent(spans: list[Span]) -> bool:
                    wanted = {("send default", 0), ("process default", 2), ("step hang", 2)}
                    return wanted <= {
                        (s.name, s.attributes.get("jobplane.run.attempt"))
                        for s in of_run(spans, hung)
                    }

                await fleet.spans(otlp, resent)
        finally:
            fleet.stop()
        spans = otlp.spans

    # One trace, the caller's, each span the child of the one before it.
    trace = [s for s in spans if s.trace_id == CALLER_TRACE]
    server = one(trace, "POST /v1/runs")
    send = one(trace, "send default")
    process = one(trace, "process default")
    step = one(trace, "step call")
    client = one(trace, "GET")
    healthz = one(trace, "GET /healthz")
    chain = [
        (server, SpanKind.SERVER, CALLER_SPAN, "jobplane-api"),
        (send, SpanKind.PRODUCER, server.span_id, "jobplane-api"),
        (process, SpanKind.CONSUMER, send.span_id, "jobplane-worker"),
        (step, SpanKind.INTERNAL, process.span_id, "jobplane-worker"),
        (client, SpanKind.CLIENT, step.span_id, "jobplane-worker"),
        (healthz, SpanKind.SERVER, client.span_id, "jobplane-api"),
    ]
    for span, kind, parent, service in chain:
        assert (span.kind, span.parent_id, span.service) == (kind, parent, service), span
    instance = process.resource["service.instance.id"]
    assert {step.resource["service.instance.id"], client.resource["service.instance.id"]} == {
        instance
    }, "the handler's call is made in the worker process that runs the step"
    assert client.attributes.get("url.full", client.attributes.get("http.url")) == (
        f"{base}/healthz"
    )
    assert {s.trace_id for s in of_run(spans, called)} == {CALLER_TRACE}
    for span, attempt in ((send, 0), (process, 1), (step, 1)):
        assert span.attributes["messaging.system"] == "jobplane"
        assert span.attributes["messaging.message.id"] == called
        assert span.attributes["jobplane.run.attempt"] == attempt
    answered = done.trace_context or {}
    assert answered.get("traceparent") == f"00-{CALLER_TRACE}-{send.span_id}-01"

    # The killed attempt's spans ended with its process, unexported; the retry's continue the
    # trace of the run's `send`, begun by the API's server span since no caller's trace was.
    assert retried.attempt == 2
    assert [a.error.code for a in retried.attempts if a.error] == ["lease_expired"], (
        "the scheduler's reaper took the run back from the killed worker"
    )
    hung_spans = of_run(spans, hung)
    sent = one(hung_spans, "send default")
    created_by = one([s for s in spans if s.trace_id == sent.trace_id], "POST /v1/runs")
    assert (created_by.parent_id, sent.parent_id) == (None, created_by.span_id)
    again = one(hung_spans, "process default", attempt=2)
    again_step = one(hung_spans, "step hang", attempt=2)
    assert (again.kind, again.trace_id, again.parent_id) == (
        SpanKind.CONSUMER,
        sent.trace_id,
        sent.span_id,
    )
    assert (again_step.trace_id, again_step.parent_id) == (sent.trace_id, again.span_id)
    assert (again.service, again.resource["service.instance.id"]) == ("jobplane-worker", survivor)
    assert {s.trace_id for s in hung_spans} == {sent.trace_id}
    assert sent.trace_id != CALLER_TRACE

    # The scheduler reaps without a span; it would export only a schedule's `fire`, and none
    # is due here.
    assert {s.service for s in spans} <= SERVICES
    assert {s.name for s in spans if s.service == "jobplane-scheduler"} <= {"fire"}
    workers = {s.resource["service.instance.id"] for s in spans if s.service == "jobplane-worker"}
    assert workers <= {"w0", "w1"}
