"""The producer API, `jobplane.Client` and `jobplane.SyncClient`, over HTTP (a served API) and
directly (MongoDB and Redis): the same calls must give the same answers and the same errors."""

import asyncio
import threading
from typing import Any

import httpx
import pytest

from jobplane import Client, CreateRequest, SyncClient
from jobplane.backends import Backends
from jobplane.client import ServerError
from jobplane.client.http import error_of as _error_of
from jobplane.devstack import free_port
from jobplane.errors import (
    ConcurrencyConflict,
    Forbidden,
    JobplaneError,
    NotFound,
    PayloadTooLarge,
    ResourceInvalidState,
    TemplateDisabled,
    Unauthorized,
    Unavailable,
    ValidationFailed,
)
from jobplane.model import CLAIMABLE, Run, RunStatus
from jobplane.queue.entry import QueueEntry
from jobplane.settings import Settings
from tests.conftest import REDIS_TOPOLOGIES
from tests.integration.conftest import Register, options
from tests.integration.db import raw
from tests.integration.workers import running

TYPED = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
}


async def assert_durable(backends: Backends, runs: list[Run]) -> None:
    """Each run is in MongoDB and in Redis; its `queued` mark may still be on its way."""
    entries = []
    for run in runs:
        stored = await backends.store.runs.get(run.id)
        assert stored is not None and stored.status in CLAIMABLE, stored
        entries.append(QueueEntry.of(stored))
    assert await backends.queue.missing(entries) == []


async def test_create_repeat_and_get(
    client: Client, mode: str, backends: Backends, register: Register
) -> None:
    await register(payload_schema=TYPED, priority=3)
    run = await client.create(
        "t_noop", scope="user", scope_id="u1", payload={"n": 1}, idempotency_key="k"
    )
    assert (run.template_type, run.scope, run.scope_id, run.payload) == (
        "t_noop",
        "user",
        "u1",
        {"n": 1},
    )
    assert run.priority == 3 and run.template_version == 1
    await assert_durable(backends, [run])
    again = await client.create(
        "t_noop", scope="user", scope_id="u1", payload={"n": 1}, idempotency_key="k"
    )
    assert again.id == run.id
    got = await client.get(run.id)
    assert got.id == run.id and got.status in CLAIMABLE
    assert await raw(backends.store).runs.count_documents({}) == 1
    await backends.store.trail.flush()
    [created] = [e for e in await backends.store.trail.events_of(run.id) if e.type == "created"]
    assert created.actor == ("user:admin" if mode == "http" else "client:test")


async def test_cancel_and_wait_until_a_worker_finishes(
    client: Client, backends: Backends, settings: Settings, register: Register
) -> None:
    await register()
    later = await client.create("t_noop", scope="user", scope_id="u1", delay_seconds=3600)
    with pytest.raises(TimeoutError):
        await client.wait(later.id, timeout=0.2)
    cancelled = await client.cancel(later.id, reason="not needed")
    assert cancelled.status == RunStatus.CANCELLED and cancelled.cancel_reason == "not needed"
    assert (await client.wait(later.id, timeout=1)).status == RunStatus.CANCELLED
    with pytest.raises(ResourceInvalidState):
        await client.cancel(later.id)

    run = await client.create("t_noop", scope="user", scope_id="u1")
    async with running(backends, settings):
        done = await client.wait(run.id, timeout=30)
    assert done.status == RunStatus.SUCCEEDED and done.completed_at is not None


async def test_errors_are_the_services_in_both_modes(
    client: Client, register: Register, settings: Settings
) -> None:
    await register(payload_schema=TYPED)
    await register("t_off", enabled=False)
    await register("t_single", concurrency_policy="reject_same_scope")

    def create(type_: str = "t_noop", **fields: Any) -> Any:
        fields = {"scope": "user", "scope_id": "u1", "payload": {"n": 1}, **fields}
        return client.create(type_, **fields)

    with pytest.raises(NotFound):
        await create("t_nowhere")
    with pytest.raises(NotFound):
        await client.get("6b0000000000000000000000")
    with pytest.raises(TemplateDisabled):
        await create("t_off")
    with pytest.raises(ValidationFailed) as invalid:
        await create(payload={"n": "one"})
    assert [e["pointer"] for e in invalid.value.details["errors"]] == ["/payload/n"]
    # Refused by the API's body model, in direct mode too.
    with pytest.raises(ValidationFailed) as malformed:
        await create(scope_id="has space", priority=1000)
    assert {e["pointer"] for e in malformed.value.details["errors"]} == {"/scopeId", "/priority"}
    with pytest.raises(PayloadTooLarge):
        await create(payload={"n": 1, "pad": "x" * settings.max_payload_bytes})
    first = await create("t_single")
    with pytest.raises(ConcurrencyConflict) as conflict:
        await create("t_single")
    assert conflict.value.active_run_id == first.id
    assert conflict.value.details == {"activeRunId": first.id}
    with pytest.raises(ResourceInvalidState) as reused:
        await create(payload={"n": 1}, idempotency_key="same")
        await create(payload={"n": 2}, idempotency_key="same")
    assert set(reused.value.details) == {"runId"}


async def test_http_errors_of_keys_scopes_and_servers(
    url: str, settings: Settings, register: Register
) -> None:
    await register()
    async with Client(url, api_key="jp_nope_nope") as stranger:
        with pytest.raises(Unauthorized):
            await stranger.create("t_noop", scope="user", scope_id="u1")
    headers = {"authorization": f"Bearer {settings.admin_key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers) as http:
        body = {"name": "shop", "role": "user", "scopes": ["user:u1"]}
        key = (await http.post("/v1/api-keys", json=body)).json()["key"]
    async with Client(url, api_key=settings.admin_key) as admin:
        hidden = await admin.create("t_noop", scope="user", scope_id="u2")
    async with Client(url, api_key=key) as user:
        assert (await user.create("t_noop", scope="user", scope_id="u1")).scope_id == "u1"
        with pytest.raises(Forbidden):
            await user.create("t_noop", scope="user", scope_id="u2")
        with pytest.raises(NotFound):
            await user.get(hidden.id)
    async with Client(f"http://127.0.0.1:{free_port()}", timeout=5) as nobody:
        with pytest.raises(Unavailable, match="cannot reach"):
            await nobody.get(hidden.id)
    # What a proxy in front of the API might answer.
    request = httpx.Request("GET", f"{url}/v1/runs/x")
    proxy = _error_of(httpx.Response(502, text="<html>Bad Gateway</html>", request=request))
    assert isinstance(proxy, ServerError) and "502" in proxy.message
    crashed = httpx.Response(
        500,
        json={"error": {"code": "Internal", "message": "it was logged", "details": {}}},
        request=request,
    )
    assert isinstance(failed := _error_of(crashed), ServerError) and failed.status == 500


async def test_create_many_answers_each_item_in_order(
    client: Client, backends: Backends, register: Register
) -> None:
    await register(payload_schema=TYPED)
    bad: dict[int, tuple[type[JobplaneError], list[str]]] = {
        5: (ValidationFailed, ["/payload/n"]),
        999: (NotFound, []),
        1000: (ValidationFailed, ["/scope"]),  # malformed: the API refuses its whole chunk
        1001: (ValidationFailed, ["/priority"]),
        1150: (ValidationFailed, ["/payload/n"]),
    }
    requests: list[CreateRequest | dict[str, Any]] = []
    for i in range(1200):
        fields: dict[str, Any] = {"scope": "user", "scope_id": "u1", "payload": {"n": i}}
        if i in (5, 1150):
            fields["payload"] = {"n": "many"}
        if i == 999:
            fields["template_type"] = "t_nowhere"
        if i == 1000:
            fields["scope"] = "planet"
        if i == 1001:
            fields["priority"] = 101
        if i % 2:  # a mapping of `create`'s arguments works as well as a CreateRequest
            requests.append({"template_type": "t_noop", **fields})
        else:
            requests.append(CreateRequest(**{"template_type": "t_noop", **fields}))
    requests.append(CreateRequest("t_noop", "user", "u1", {"n": 7}, idempotency_key="k"))
    requests.append(CreateRequest("t_noop", "user", "u1", {"n": 7}, idempotency_key="k"))

    results = await client.create_many(requests)
    assert len(results) == len(requests)
    for i, result in enumerate(results[:1200]):
        if i in bad:
            kind, where = bad[i]
            assert isinstance(result, kind), (i, result)
            assert [e["pointer"] for e in result.details.get("errors", [])] == where
        else:
            assert isinstance(result, Run), (i, result)
            assert result.payload == {"n": i}
    repeat = results[1200:]
    assert all(isinstance(r, Run) for r in repeat)
    assert len({r.id for r in repeat if isinstance(r, Run)}) == 1
    created = [r for r in results if isinstance(r, Run)]
    await assert_durable(backends, created)
    assert await raw(backends.store).runs.count_documents({}) == len({r.id for r in created})


async def test_sync_client_from_plain_threads(
    mode: str, url: str, settings: Settings, backends: Backends, register: Register
) -> None:
    await register()
    made: list[Run] = []

    def produce(sync: SyncClient) -> None:
        for _ in range(10):
            made.append(sync.create("t_noop", scope="user", scope_id="u1"))

    def work() -> None:
        # The test's event loop serves the API meanwhile: this runs in a thread of its own.
        with SyncClient(**options(mode, url, settings)) as sync:
            threads = [threading.Thread(target=produce, args=(sync,)) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert sync.get(made[0].id).id == made[0].id
            assert sync.cancel(made[1].id).status == RunStatus.CANCELLED
            assert sync.wait(made[1].id, timeout=5).status == RunStatus.CANCELLED
            [one, refused] = sync.create_many(
                [
                    {"template_type": "t_noop", "scope": "user", "scope_id": "u1"},
                    {"template_type": "t_nowhere", "scope": "user", "scope_id": "u1"},
                ]
            )
            assert isinstance(one, Run) and isinstance(refused, NotFound)
            made.append(one)
            with pytest.raises(NotFound):
                sync.get("6b0000000000000000000000")
        with pytest.raises(RuntimeError, match="closed"):
            sync.get(made[0].id)
        sync.close()  # again: nothing happens

    await asyncio.to_thread(work)
    assert len({r.id for r in made}) == 41
    await assert_durable(backends, [r for r in made if r.id != made[1].id])


def test_creating_a_client_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="either url"):
        Client("http://127.0.0.1:8000", mongodb_url="mongodb://127.0.0.1")
    with pytest.raises(ValueError, match="either url"):
        Client(mongodb_url="mongodb://127.0.0.1")
    with pytest.raises(ValueError) as refused:
        Client(mongodb_url="mongodb://127.0.0.1", redis_url="redis+cluster://u:pw@h1")
    assert str(refused.value) == (
        "JOBPLANE_REDIS_URL 'redis+cluster://u:***@h1': 'h1' is not host:port "
        "(each node needs its port)"
    )


@REDIS_TOPOLOGIES
async def test_direct_mode_on_every_redis_topology(
    redis_url: str, backends: Backends, settings: Settings, register: Register
) -> None:
    await register()
    async with Client(**options("direct", "", settings)) as client:
        run = await client.create("t_noop", scope="user", scope_id="u1")
        async with running(backends, settings):
            done = await client.wait(run.id, timeout=30)
    assert done.status == RunStatus.SUCCEEDED
