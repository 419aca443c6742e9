"""Live streams over a real HTTP server: a run's changes until it ends, the trail as it grows
and resumed with Last-Event-ID, scope isolation, keep-alives, and the end at shutdown."""

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from jobplane.api import create_app, live
from jobplane.backends import Backends
from jobplane.devstack import free_port
from jobplane.model import TERMINAL
from jobplane.process import HTTPServer, serve_http
from jobplane.settings import Settings
from tests.integration.api_client import error_of
from tests.integration.conftest import Register
from tests.integration.db import raw
from tests.integration.workers import running

ADMIN = {"authorization": "Bearer test-admin-key"}
RUN = {"templateType": "t_noop", "scope": "user", "scopeId": "u1"}


@dataclass(frozen=True)
class Message:
    event: str | None
    id: str | None
    data: Any
    comment: bool = False


async def messages(response: httpx.Response) -> AsyncIterator[Message]:
    """The SSE messages of `response`, comments (keep-alives) included."""
    fields: dict[str, str] = {}
    async for line in response.aiter_lines():
        if line.startswith(":"):
            yield Message(None, None, None, comment=True)
        elif line == "":
            if "data" in fields:
                yield Message(fields.get("event"), fields.get("id"), json.loads(fields["data"]))
            fields = {}
        else:
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")


async def collect(
    client: httpx.AsyncClient, path: str, count: int | None = None, **kwargs: Any
) -> list[Message]:
    """Read `path`'s stream until it ends (or `count` messages came)."""
    got: list[Message] = []
    async with client.stream("GET", path, **kwargs) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        async for message in messages(response):
            if not message.comment:
                got.append(message)
            if count is not None and len(got) == count:
                break
    return got


async def test_a_run_s_stream_sends_each_change_and_ends_after_a_terminal_status(
    url: str, backends: Backends, settings: Settings, register: Register
) -> None:
    steps = [{"id": "nap", "handler": "builtin.sleep"}, {"id": "after", "handler": "builtin.echo"}]
    await register(steps=steps)
    async with httpx.AsyncClient(base_url=url, headers=ADMIN, timeout=30) as client:
        run = (await client.post("/v1/runs", json=RUN | {"payload": {"sleepSeconds": 0.6}})).json()
        reading = asyncio.create_task(collect(client, f"/v1/runs/{run['id']}/stream"))
        await asyncio.sleep(0.3)  # the stream is open before anything happens
        async with running(backends, settings):
            got = await asyncio.wait_for(reading, 30)
        final = (await client.get(f"/v1/runs/{run['id']}")).json()
    runs = [m.data for m in got]
    assert {m.event for m in got} == {"run"}
    assert runs[0]["status"] == "queued" and runs[-1] == final, "the last is GET's run"
    assert runs[-1]["status"] == "succeeded"
    versions = [int(m.id or 0) for m in got]
    assert versions == sorted(set(versions)), "each change once, in order"
    percentages = [r["progress"]["percentage"] for r in runs]
    assert any(0 < p < 100 for p in percentages), "progress reached the stream"
    assert percentages == sorted(percentages)
    assert "running" in [r["status"] for r in runs]


async def test_a_stream_of_an_ended_run_sends_it_once_and_another_scope_s_is_not_found(
    url: str, backends: Backends, settings: Settings, register: Register
) -> None:
    await register("t_noop")
    made = await _user_key(url, "user:u1")
    async with httpx.AsyncClient(base_url=url, headers=ADMIN, timeout=30) as client:
        run = (await client.post("/v1/runs", json=RUN)).json()
        theirs = (await client.post("/v1/runs", json=RUN | {"scopeId": "u2"})).json()
        async with running(backends, settings):
            for _ in range(200):
                if (await client.get(f"/v1/runs/{run['id']}")).json()["status"] in TERMINAL:
                    break
                await asyncio.sleep(0.05)
        [ended] = await collect(client, f"/v1/runs/{run['id']}/stream")
        assert ended.data["status"] == "succeeded"
    async with httpx.AsyncClient(base_url=url, headers=made, timeout=30) as alice:
        error_of(await alice.get(f"/v1/runs/{theirs['id']}/stream"), 404, "NotFound")
        error_of(await alice.get(f"/v1/runs/{'f' * 24}/stream"), 404, "NotFound")


async def _user_key(url: str, scope: str) -> dict[str, str]:
    async with httpx.AsyncClient(base_url=url, headers=ADMIN) as client:
        made = await client.post(
            "/v1/api-keys", json={"name": f"k{free_port()}", "role": "user", "scopes": [scope]}
        )
    return {"authorization": f"Bearer {made.json()['key']}"}


async def test_the_trail_s_stream_resumes_with_last_event_id_missing_nothing(
    url: str, backends: Backends, register: Register
) -> None:
    await register("t_noop")
    async with httpx.AsyncClient(base_url=url, headers=ADMIN, timeout=30) as client:
        reading = asyncio.create_task(
            collect(client, "/v1/events/stream", 3, params={"type": "created"})
        )
        await asyncio.sleep(0.3)
        first = [(await client.post("/v1/runs", json=RUN)).json()["id"] for _ in range(3)]
        seen = await asyncio.wait_for(reading, 30)
        assert [m.data["jobId"] for m in seen] == first, "in the order they happened"
        # Away: these are written while no stream is open.
        away = [(await client.post("/v1/runs", json=RUN)).json()["id"] for _ in range(4)]
        await client.post("/v1/runs", json=RUN | {"scopeId": "u9"})
        resumed = await collect(
            client,
            "/v1/events/stream",
            4,
            params={"type": "created", "scopeId": "u1", "scope": "user"},
            headers={"last-event-id": seen[1].id or ""},
        )
    assert [m.data["jobId"] for m in resumed] == [first[2], *away[:3]]
    ids = [m.id or "" for m in [*seen, *resumed[1:]]]
    assert ids == sorted(ids), "ids order the trail"
    stored = await raw(backends.store).events.find({"type": "created"}).to_list()
    assert {m.data["id"] for m in resumed} <= {str(d["_id"]) for d in stored}


async def test_the_trail_s_stream_keeps_to_the_key_s_scopes(
    url: str, backends: Backends, register: Register
) -> None:
    await register("t_noop")
    alice = await _user_key(url, "user:u1")
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        refused = await client.get(
            "/v1/events/stream", params={"scope": "user", "scopeId": "u2"}, headers=alice
        )
        error_of(refused, 403, "Forbidden")
        bad = await client.get("/v1/events/stream", headers=alice | {"last-event-id": "zz"})
        error_of(bad, 422, "ValidationFailed")
        stale = await client.get("/v1/events/stream", headers=alice | {"last-event-id": "8200"})
        error_of(stale, 409, "ResourceInvalidState")
        reading = asyncio.create_task(
            collect(client, "/v1/events/stream", 2, params={"type": "created"}, headers=alice)
        )
        await asyncio.sleep(0.3)
        for scope_id in ("u2", "u1", "u3", "u1"):
            await client.post("/v1/runs", json=RUN | {"scopeId": scope_id}, headers=ADMIN)
        got = await asyncio.wait_for(reading, 30)
    assert [m.data["scopeId"] for m in got] == ["u1", "u1"]


async def test_streams_keep_alive_and_end_when_the_server_stops(
    backends: Backends, settings: Settings, register: Register, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live, "KEEP_ALIVE_SECONDS", 0.2)
    await register("t_noop")
    async with _served(backends, settings) as (base, stop):
        async with httpx.AsyncClient(base_url=base, headers=ADMIN, timeout=30) as client:
            run = (await client.post("/v1/runs", json=RUN)).json()
            comments = 0
            loop = asyncio.get_running_loop()
            async with client.stream("GET", f"/v1/runs/{run['id']}/stream") as response:
                async for message in messages(response):
                    comments += message.comment
                    if comments == 2 and not stop.is_set():
                        stop.set()
                        stopped_at = loop.time()
            ended_within = loop.time() - stopped_at
    assert comments >= 2, "keep-alive comments while nothing changes"
    assert ended_within < 5, "the stream ended when the server stopped"


@asynccontextmanager
async def _served(
    backends: Backends, settings: Settings
) -> AsyncIterator[tuple[str, asyncio.Event]]:
    port, stop = free_port(), asyncio.Event()
    config = uvicorn.Config(
        create_app(settings, backends, stop),
        host="127.0.0.1",
        port=port,
        log_config=None,
        lifespan="off",
        timeout_graceful_shutdown=10,
    )
    server = HTTPServer(config)
    task = asyncio.create_task(serve_http(server, stop))
    while not server.started:  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", stop
    finally:
        stop.set()
        await task


async def test_a_waiting_run_s_stream_says_when_why_it_waits_changes(
    url: str, backends: Backends, register: Register
) -> None:
    """A paused queue changes no run, yet a queued run's stream says it now waits for it."""
    await register("t_noop", queue="reports")
    async with httpx.AsyncClient(base_url=url, headers=ADMIN, timeout=30) as client:
        run = (await client.post("/v1/runs", json=RUN)).json()
        reading = asyncio.create_task(collect(client, f"/v1/runs/{run['id']}/stream", 2))
        await asyncio.sleep(0.3)
        await client.post("/v1/queues/reports/pause", json={"reason": "maintenance"})
        first, paused = await asyncio.wait_for(reading, 30)
    assert first.data["waitingFor"]["reason"] == "handler", "no worker runs"
    assert paused.data["waitingFor"]["reason"] == "queue_paused"
    assert first.id == paused.id, "the run itself did not change"
