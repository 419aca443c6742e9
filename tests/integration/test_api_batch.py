"""POST /v1/runs/batch against real MongoDB and Redis: each item is answered as POST /v1/runs
would answer it alone, a refused item leaves no trace and a created one is durable and queued."""

from typing import Any

import httpx
import pytest

from jobplane.api import create_app
from jobplane.backends import Backends
from jobplane.model import RunStatus
from jobplane.queue.entry import QueueEntry
from jobplane.settings import Settings
from tests.integration.api_client import error_of, pointers
from tests.integration.conftest import Client
from tests.integration.db import raw

TYPED = {
    "type": "t_typed",
    "payloadSchema": {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
    },
    "steps": [{"id": "only", "handler": "builtin.noop"}],
}
ONE_AT_A_TIME = {
    "type": "t_single",
    "concurrencyPolicy": "reject_same_scope",
    "steps": [{"id": "only", "handler": "builtin.noop"}],
}


def item(type_: str = "t_typed", scope_id: str = "u1", **fields: Any) -> dict[str, Any]:
    return {"templateType": type_, "scope": "user", "scopeId": scope_id, **fields}


@pytest.fixture
async def admin(client_for: Client, settings: Settings) -> httpx.AsyncClient:
    assert settings.admin_key is not None
    api = client_for(settings.admin_key)
    for template in (TYPED, ONE_AT_A_TIME, {**TYPED, "type": "t_off"}):
        response = await api.post("/v1/templates", json=template)
        assert response.status_code == 201, response.text
    assert (await api.post("/v1/templates/t_off/disable")).status_code == 200
    return api


async def batch(api: httpx.AsyncClient, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    response = await api.post("/v1/runs/batch", json={"runs": runs})
    assert response.status_code == 200, response.text
    items: list[dict[str, Any]] = response.json()["items"]
    assert len(items) == len(runs)
    return items


async def assert_durable(backends: Backends, items: list[dict[str, Any]]) -> None:
    """Every created item is in MongoDB, queued there and in Redis; nothing else was written."""
    ids = {i["run"]["id"] for i in items if "run" in i}
    entries = []
    for run_id in ids:
        run = await backends.store.runs.get(run_id)
        assert run is not None and run.status == RunStatus.QUEUED, run
        entries.append(QueueEntry.of(run))
    assert await backends.queue.missing(entries) == []
    assert await raw(backends.store).runs.count_documents({}) == len(ids)


async def test_each_item_is_answered_in_order_and_a_bad_one_does_not_stop_the_others(
    admin: httpx.AsyncClient, backends: Backends, settings: Settings
) -> None:
    huge = "x" * (settings.max_payload_bytes + 1)
    items = await batch(
        admin,
        [
            item(payload={"n": 1}),
            item(payload={"n": "one"}),
            item("t_nowhere", payload={"n": 1}),
            item("t_off", payload={"n": 1}),
            item(payload={"n": 2, "pad": huge}),
            item("t_single"),
            item("t_single"),
            item(payload={"n": 3}, priority=7),
        ],
    )
    assert [i["status"] for i in items[:5]] == [201, 422, 404, 409, 413]
    assert [i["error"]["code"] for i in items[1:5]] == [
        "ValidationFailed",
        "NotFound",
        "TemplateDisabled",
        "PayloadTooLarge",
    ]
    for refused in items[1:5]:
        assert set(refused) == {"status", "error"}
        assert set(refused["error"]) == {"code", "message", "details"}
    assert pointers(items[1]["error"]) == ["/runs/1/payload/n"]
    # Two runs for one dedupe key in one batch: one wins, as with two concurrent creates.
    assert sorted(i["status"] for i in items[5:7]) == [201, 409]
    [lost] = [i for i in items[5:7] if i["status"] == 409]
    [won] = [i for i in items[5:7] if i["status"] == 201]
    assert lost["error"]["code"] == "ConcurrencyConflict"
    assert lost["error"]["details"] == {"activeRunId": won["run"]["id"]}
    assert items[0]["run"]["payload"] == {"n": 1}
    assert items[7]["run"]["priority"] == 7
    assert all(i["run"]["templateType"] for i in items if "run" in i)
    await assert_durable(backends, items)


async def test_a_user_key_is_refused_only_the_items_of_other_scopes(
    admin: httpx.AsyncClient, client_for: Client, backends: Backends
) -> None:
    made = await admin.post(
        "/v1/api-keys", json={"name": "shop", "role": "user", "scopes": ["user:u1"]}
    )
    user = client_for(made.json()["key"])
    items = await batch(
        user,
        [
            item(payload={"n": 1}),
            item(scope_id="u2", payload={"n": 2}),
            item(payload={"n": 3}),
        ],
    )
    assert [i["status"] for i in items] == [201, 403, 201]
    assert items[1]["error"]["code"] == "Forbidden"
    assert await raw(backends.store).runs.count_documents({"scopeId": "u2"}) == 0
    events = raw(backends.store).events.find({"actor": "user:shop"})
    await backends.store.trail.flush()
    assert {e["scopeId"] async for e in events} <= {"u1"}
    await assert_durable(backends, items)


async def test_a_repeated_idempotency_key_answers_the_first_run_within_and_across_batches(
    admin: httpx.AsyncClient, backends: Backends
) -> None:
    first = await batch(
        admin,
        [
            item(payload={"n": 1}, idempotencyKey="k1"),
            item(payload={"n": 1}, idempotencyKey="k1"),
            item(payload={"n": 2}, idempotencyKey="k2"),
        ],
    )
    assert sorted(i["status"] for i in first[:2]) == [200, 201]
    assert first[0]["run"]["id"] == first[1]["run"]["id"]
    assert first[2]["status"] == 201
    again = await batch(
        admin,
        [
            item(payload={"n": 2}, idempotencyKey="k2"),
            item(payload={"n": 9}, idempotencyKey="k1"),
            item(payload={"n": 3}, idempotencyKey="k3"),
        ],
    )
    assert [i["status"] for i in again] == [200, 409, 201]
    assert again[0]["run"]["id"] == first[2]["run"]["id"]
    assert again[1]["error"]["code"] == "ResourceInvalidState"
    assert again[1]["error"]["details"] == {"runId": first[0]["run"]["id"]}
    # One single create repeats a batch's key too.
    single = await admin.post("/v1/runs", json=item(payload={"n": 3}, idempotencyKey="k3"))
    assert single.status_code == 200 and single.json()["id"] == again[2]["run"]["id"]
    await assert_durable(backends, first + again)


async def test_a_batch_of_refused_items_only(admin: httpx.AsyncClient, backends: Backends) -> None:
    items = await batch(admin, [item("t_nowhere"), item("t_off", payload={"n": 1})])
    assert [i["status"] for i in items] == [404, 409]
    assert await raw(backends.store).runs.count_documents({}) == 0


async def test_a_malformed_item_refuses_the_whole_batch_naming_its_pointer(
    admin: httpx.AsyncClient, backends: Backends
) -> None:
    runs = [item(payload={"n": 1}), item(payload={"n": 2}), {**item(), "scope": "planet"}]
    runs.append({**item(), "priority": "5", "colour": "red"})
    response = await admin.post("/v1/runs/batch", json={"runs": runs})
    error = error_of(response, 422, "ValidationFailed")
    assert set(pointers(error)) == {"/runs/2/scope", "/runs/3/priority", "/runs/3/colour"}
    assert await raw(backends.store).runs.count_documents({}) == 0


@pytest.mark.parametrize("count", [0, 1001])
async def test_a_batch_holds_1_to_1000_runs(
    admin: httpx.AsyncClient, backends: Backends, count: int
) -> None:
    response = await admin.post("/v1/runs/batch", json={"runs": [item()] * count})
    assert pointers(error_of(response, 422, "ValidationFailed")) == ["/runs"]
    assert await raw(backends.store).runs.count_documents({}) == 0


async def test_a_full_batch_is_created(admin: httpx.AsyncClient, backends: Backends) -> None:
    # About 1.2 MB: more than any other route takes, within the batch's own cap.
    runs = [item(payload={"n": i, "pad": "x" * 1200}) for i in range(1000)]
    items = await batch(admin, runs)
    assert [i["status"] for i in items] == [201] * 1000
    assert [i["run"]["payload"]["n"] for i in items] == list(range(1000))
    await assert_durable(backends, items)


async def test_a_body_over_the_batch_cap_is_413(
    admin: httpx.AsyncClient, backends: Backends, settings: Settings
) -> None:
    small = settings.model_copy(update={"max_batch_bytes": 20_000})
    transport = httpx.ASGITransport(app=create_app(small, backends))
    headers = admin.headers
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=headers) as api:
        runs = [item(payload={"n": i, "pad": "x" * 300}) for i in range(100)]  # 40 kB
        assert (await api.post("/v1/runs/batch", json={"runs": runs[:40]})).status_code == 200
        response = await api.post("/v1/runs/batch", json={"runs": runs})
        error_of(response, 413, "PayloadTooLarge")

        # A body sent without a declared length is counted as it arrives.
        async def chunks() -> Any:
            yield b'{"runs": ['
            for i in range(300):
                yield (b"," if i else b"") + b'{"templateType": "t_typed", "scope": "user", '
                yield b'"scopeId": "u1", "payload": {"n": 1}}'
            yield b"]}"

        response = await api.post(
            "/v1/runs/batch", content=chunks(), headers={"content-type": "application/json"}
        )
        error_of(response, 413, "PayloadTooLarge")
    assert await raw(backends.store).runs.count_documents({}) == 40
