"""Runs over HTTP: lists and cursors, cancel and rerun, limits, dedupe and concurrency policies,
and the audit query, against real MongoDB and Redis."""

import asyncio
import random
from datetime import datetime
from itertools import pairwise
from typing import Any

import httpx
import pytest

from jobplane.api import create_app
from jobplane.backends import Backends
from jobplane.model import ALLOWED, RunStatus
from jobplane.queue.entry import QueueEntry
from jobplane.settings import Settings
from jobplane.store import EventQuery
from tests.integration.api_client import error_of, pointers
from tests.integration.conftest import Client
from tests.integration.db import raw
from tests.integration.workers import running, settled


def noop(type_: str = "t_noop", **fields: Any) -> dict[str, Any]:
    return {"type": type_, "steps": [{"id": "only", "handler": "builtin.noop"}], **fields}


def run_body(type_: str = "t_noop", scope_id: str = "u1", **fields: Any) -> dict[str, Any]:
    return {"templateType": type_, "scope": "user", "scopeId": scope_id, **fields}


async def register(api: httpx.AsyncClient, template: dict[str, Any]) -> None:
    response = await api.post("/v1/templates", json=template)
    assert response.status_code in (200, 201), response.text


async def create(api: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    response = await api.post("/v1/runs", json=run_body(**fields))
    assert response.status_code == 201, response.text
    run: dict[str, Any] = response.json()
    return run


async def pages(api: httpx.AsyncClient, url: str) -> list[list[str]]:
    out, cursor = [], None
    while True:
        sep = "&" if "?" in url else "?"
        page = (await api.get(url + (f"{sep}cursor={cursor}" if cursor else ""))).json()
        out.append([item["id"] for item in page["items"]])
        cursor = page["nextCursor"]
        if cursor is None:
            return out


async def test_list_pages_newest_first_and_stays_stable_under_inserts(
    api: httpx.AsyncClient,
) -> None:
    await register(api, noop())
    ids = [(await create(api))["id"] for _ in range(7)]
    newest_first = ids[::-1]
    assert await pages(api, "/v1/runs?limit=3") == [
        newest_first[0:3],
        newest_first[3:6],
        newest_first[6:],
    ]

    first = (await api.get("/v1/runs?limit=3")).json()
    newer = [(await create(api))["id"] for _ in range(5)]
    rest = await pages(api, f"/v1/runs?limit=3&cursor={first['nextCursor']}")
    seen = [i["id"] for i in first["items"]] + [i for page in rest for i in page]
    assert seen == ids[::-1], "runs inserted meanwhile neither repeat nor hide older ones"
    assert not set(newer) & set(seen)


async def test_list_filters(api: httpx.AsyncClient, backends: Backends) -> None:
    await register(api, noop())
    await register(api, noop("t_other"))
    a = await create(api)
    b = await create(api, type_="t_other", scope_id="u2")
    await api.post(f"/v1/runs/{a['id']}/cancel")

    async def ids(query: str) -> list[str]:
        return [r["id"] for r in (await api.get(f"/v1/runs?{query}")).json()["items"]]

    assert await ids("status=cancelled") == [a["id"]]
    assert await ids("status=queued") == [b["id"]]
    assert await ids("templateType=t_other") == [b["id"]]
    assert await ids("scope=user&scopeId=u1") == [a["id"]]
    assert await ids("scheduleId=nothing") == []


@pytest.mark.parametrize(
    ("query", "pointer"),
    [
        ("limit=0", "/limit"),
        ("limit=501", "/limit"),
        ("limit=*/5", "/limit"),
        ("status=bogus", "/status"),
        ("cursor=not-a-cursor", "/cursor"),
        ("scope=galaxy", "/scope"),
    ],
)
async def test_bad_list_queries(api: httpx.AsyncClient, query: str, pointer: str) -> None:
    error = error_of(await api.get(f"/v1/runs?{query}"), 422, "ValidationFailed")
    assert any(p.endswith(pointer) for p in pointers(error))


async def test_cancel_follows_rule_4(api: httpx.AsyncClient, backends: Backends) -> None:
    await register(api, noop())
    queued = await create(api)
    cancelled = await api.post(f"/v1/runs/{queued['id']}/cancel", json={"reason": "not needed"})
    assert cancelled.status_code == 200
    assert cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["cancelRequestedBy"] == "user:admin"
    error_of(await api.post(f"/v1/runs/{queued['id']}/cancel"), 409, "ResourceInvalidState")

    running_run = await create(api)
    [(_, lease)] = await backends.store.transitions.claim([running_run["id"]], "w", 30)
    pubsub = backends.queue.redis.pubsub()
    await pubsub.subscribe(backends.queue.keys.cancel_channel)
    try:
        requested = await api.post(f"/v1/runs/{running_run['id']}/cancel", json={})
        assert requested.json()["status"] == "cancel_requested"
        async with asyncio.timeout(5):
            while (
                msg := await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
            ) is None:
                pass
        assert msg["data"].decode() == running_run["id"]
    finally:
        await pubsub.aclose()
    again = await api.post(f"/v1/runs/{running_run['id']}/cancel")
    assert again.json()["status"] == "cancel_requested", "a second cancel changes nothing"
    await backends.store.transitions.acknowledge_cancel(lease, interrupted=True)
    final = (await api.get(f"/v1/runs/{running_run['id']}")).json()
    assert final["status"] == "cancelled"


async def test_rerun_pins_the_version_and_payload(api: httpx.AsyncClient) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    await register(api, noop(payloadSchema=schema))
    first = await create(api, payload={"n": 1}, priority=5)
    error_of(await api.post(f"/v1/runs/{first['id']}/rerun"), 409, "ResourceInvalidState")
    await api.post(f"/v1/runs/{first['id']}/cancel")
    await register(api, noop(payloadSchema=schema, description="v2"))
    again = await api.post(f"/v1/runs/{first['id']}/rerun")
    assert again.status_code == 201, again.text
    rerun = again.json()
    assert rerun["rerunOf"] == first["id"] and rerun["id"] != first["id"]
    assert (rerun["templateVersion"], rerun["payload"], rerun["priority"]) == (1, {"n": 1}, 5)
    error_of(await api.post("/v1/runs/0123456789abcdef01234567/rerun"), 404, "NotFound")


async def test_a_disabled_template_refuses_runs_and_lets_existing_ones_finish(
    api: httpx.AsyncClient, backends: Backends, settings: Settings
) -> None:
    await register(api, noop())
    existing = await create(api)
    disabled = await api.post("/v1/templates/t_noop/disable")
    assert disabled.json()["enabled"] is False
    error_of(await api.post("/v1/runs", json=run_body()), 409, "TemplateDisabled")
    error_of(await api.post(f"/v1/runs/{existing['id']}/rerun"), 409, "ResourceInvalidState")
    async with running(backends, settings):
        [done] = await settled(backends.store, [existing["id"]], within=20)
    assert done.status == RunStatus.SUCCEEDED
    error_of(await api.post(f"/v1/runs/{existing['id']}/rerun"), 409, "TemplateDisabled")
    assert (await api.post("/v1/templates/t_noop/enable")).json()["enabled"] is True
    assert (await api.post(f"/v1/runs/{existing['id']}/rerun")).status_code == 201
    error_of(await api.post("/v1/templates/nope/disable"), 404, "NotFound")


async def test_payload_and_body_size_limits(
    client_for: Client, backends: Backends, settings: Settings
) -> None:
    small = settings.model_copy(update={"max_payload_bytes": 1000})
    transport = httpx.ASGITransport(app=create_app(small, backends))
    headers = {"authorization": f"Bearer {settings.admin_key}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=headers) as api:
        await register(api, noop())
        fits = await api.post("/v1/runs", json=run_body(payload={"x": "a" * 900}))
        assert fits.status_code == 201
        over = await api.post("/v1/runs", json=run_body(payload={"x": "a" * 1000}))
        error = error_of(over, 413, "PayloadTooLarge")
        assert error["details"]["limit"] == 1000
        huge = await api.post("/v1/runs", json=run_body(payload={"x": "a" * (3 << 20)}))
        error_of(huge, 413, "PayloadTooLarge")
    assert await raw(backends.store).runs.count_documents({}) == 1


async def test_delay_and_not_before(api: httpx.AsyncClient) -> None:
    await register(api, noop())
    delayed = await create(api, delaySeconds=60)
    assert delayed["notBefore"] is not None
    at = await create(api, notBefore="2031-01-01T09:00:00+08:00")
    assert at["notBefore"].startswith("2031-01-01T01:00:00")
    error_of(await api.post("/v1/runs", json=run_body(notBefore="soon")), 422, "ValidationFailed")
    naive = await api.post("/v1/runs", json=run_body(notBefore="2031-01-01T09:00:00"))
    assert "/notBefore" in pointers(error_of(naive, 422, "ValidationFailed"))


async def test_reject_same_scope_lets_one_of_50_concurrent_creates_win(
    api: httpx.AsyncClient, backends: Backends
) -> None:
    await register(
        api, noop(concurrencyPolicy="reject_same_scope", dedupeKeys=["scopeId", "payload.target"])
    )
    body = run_body(payload={"target": "db-1"})
    responses = await asyncio.gather(*(api.post("/v1/runs", json=body) for _ in range(50)))
    winners = [r.json()["id"] for r in responses if r.status_code == 201]
    assert len(winners) == 1
    for r in responses:
        if r.status_code != 201:
            assert error_of(r, 409, "ConcurrencyConflict")["details"]["activeRunId"] == winners[0]
    assert await raw(backends.store).runs.count_documents({}) == 1
    # Another target is another key; the same target in another scope too.
    await create(api, payload={"target": "db-2"})
    await create(api, scope_id="u2", payload={"target": "db-1"})
    # Once the active run ends, the key is free again.
    await api.post(f"/v1/runs/{winners[0]}/cancel")
    await create(api, payload={"target": "db-1"})


async def test_queue_same_scope_runs_the_waiting_run_after_the_active_one(
    api: httpx.AsyncClient, backends: Backends, settings: Settings
) -> None:
    await register(api, noop(concurrencyPolicy="queue_same_scope"))
    first = await create(api)
    second = await create(api)
    third = await create(api)
    # The first holds the key and is queued; the others wait for it, `pending`.
    assert (first["status"], second["status"], third["status"]) == ("queued", "pending", "pending")
    assert second["dedupeWait"] is not None and second["dedupeKey"] is None
    assert second["waitingFor"] == {"reason": "concurrency", "detail": second["dedupeWait"]}
    # The waiting runs are not in Redis: nothing can claim them early.
    waiting = [QueueEntry(r["id"], "default", 0, None, r["handler"]) for r in (second, third)]
    assert await backends.queue.missing(waiting) == waiting

    async with running(backends, settings, scheduler=True):
        done = await settled(backends.store, [first["id"], second["id"], third["id"]], within=30)
    assert [r.status for r in done] == [RunStatus.SUCCEEDED] * 3
    # One at a time, in creation order.
    assert done[0].completed_at <= done[1].started_at  # type: ignore[operator]
    assert done[1].completed_at <= done[2].started_at  # type: ignore[operator]


async def test_a_waiting_run_that_is_cancelled_frees_its_place(
    api: httpx.AsyncClient, backends: Backends
) -> None:
    await register(api, noop(concurrencyPolicy="queue_same_scope"))
    first = await create(api)
    second = await create(api)
    third = await create(api)
    assert (await api.post(f"/v1/runs/{second['id']}/cancel")).json()["status"] == "cancelled"
    await api.post(f"/v1/runs/{first['id']}/cancel")
    admitted = (await api.get(f"/v1/runs/{third['id']}")).json()
    assert admitted["status"] == "queued" and admitted["dedupeKey"] is not None


async def test_a_non_repeatable_template_runs_once_per_key(
    api: httpx.AsyncClient, backends: Backends, settings: Settings
) -> None:
    await register(api, noop(repeatable=False, dedupeKeys=["payload.order"]))
    failed_first = await create(api, payload={"order": 1})
    await api.post(f"/v1/runs/{failed_first['id']}/cancel")
    # A run that did not succeed leaves the key free.
    first = await create(api, payload={"order": 1})
    error_of(
        await api.post("/v1/runs", json=run_body(payload={"order": 1})), 409, "ConcurrencyConflict"
    )
    async with running(backends, settings):
        await settled(backends.store, [first["id"]], within=20)
    refused = await api.post("/v1/runs", json=run_body(payload={"order": 1}))
    error = error_of(refused, 409, "ResourceInvalidState")
    assert error["details"]["succeededRunId"] == first["id"]
    error_of(await api.post(f"/v1/runs/{first['id']}/rerun"), 409, "ResourceInvalidState")
    await create(api, payload={"order": 2})
    # Keys are per scope: another scope's run for the same order is its own.
    await create(api, scope_id="u9", payload={"order": 1})


async def test_a_cancel_racing_a_claim_ends_in_one_consistent_state(
    api: httpx.AsyncClient, backends: Backends, settings: Settings
) -> None:
    await register(api, {"type": "t_nap", "steps": [{"id": "nap", "handler": "builtin.sleep"}]})
    ids = []
    async with running(backends, settings, workers=2):
        for _ in range(40):
            run = await create(api, type_="t_nap", payload={"sleepSeconds": 0.2})
            ids.append(run["id"])
            await asyncio.sleep(random.uniform(0, 0.01))
            response = await api.post(f"/v1/runs/{run['id']}/cancel", json={"reason": "race"})
            assert response.status_code in (200, 409), response.text
        runs = await settled(backends.store, ids, within=30)
    outcomes = set()
    for run in runs:
        trail = [
            e for e in await backends.store.trail.events_of(run.id) if e.type == "status_changed"
        ]
        moves = [(e.from_, e.to) for e in trail]
        assert all(prev[1] == nxt[0] for prev, nxt in pairwise(moves)), moves
        assert all(to in ALLOWED[from_] for from_, to in moves if from_), moves
        assert [to for _, to in moves].count(RunStatus.CANCELLED) <= 1
        if run.status == RunStatus.CANCELLED:
            claimed = RunStatus.RUNNING in [to for _, to in moves]
            # Either it never ran (cancelled while queued), or the worker acknowledged a
            # cancel request.
            assert moves[-1][0] in ({RunStatus.CANCEL_REQUESTED} if claimed else {RunStatus.QUEUED})
            outcomes.add("acknowledged" if claimed else "before it ran")
        else:
            assert run.status == RunStatus.SUCCEEDED  # the cancel came after the end: a 409
            outcomes.add("finished first")
    assert "before it ran" in outcomes or "acknowledged" in outcomes


async def test_the_audit_query_filters_and_pages(
    api: httpx.AsyncClient, backends: Backends
) -> None:
    await register(api, noop())
    runs = [await create(api, scope_id=f"u{i % 2}") for i in range(4)]
    await api.post(f"/v1/runs/{runs[0]['id']}/cancel", json={"reason": "audit me"})
    await backends.store.trail.flush()

    async def items(query: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = (await api.get(f"/v1/events?{query}")).json()["items"]
        return found

    assert {e["jobId"] for e in await items(f"jobId={runs[0]['id']}")} == {runs[0]["id"]}
    assert len(await items("type=created")) == 4
    assert {e["scopeId"] for e in await items("scope=user&scopeId=u1")} == {"u1"}
    assert len(await items("actor=user:admin")) == len(await items(""))
    mine = await items("type=status_changed&actor=user:admin&scope=user&scopeId=u0")
    assert mine[-1]["to"] == "cancelled" and mine[-1]["message"] == "audit me"
    everything = await items("limit=500")
    times = [datetime.fromisoformat(e["createAt"]) for e in everything]
    assert times == sorted(times)
    middle = times[len(times) // 2]
    at = middle.isoformat().replace("+", "%2B")
    since = await items(f"from={at}")
    assert [e["id"] for e in since] == [
        e["id"] for e, t in zip(everything, times, strict=True) if t >= middle
    ]
    until = await items(f"to={at}")
    assert [e["id"] for e in until] == [
        e["id"] for e, t in zip(everything, times, strict=True) if t < middle
    ]
    paged = await pages(api, "/v1/events?limit=3")
    assert [i for page in paged for i in page] == [e["id"] for e in everything]
    error_of(await api.get("/v1/events?from=yesterday"), 422, "ValidationFailed")
    error_of(await api.get("/v1/events?from=2026-01-01T00:00:00"), 422, "ValidationFailed")
    error_of(await api.get("/v1/events?cursor=abc"), 422, "ValidationFailed")
    # Milliseconds past 13 digits (the year 2286) are no time of ours.
    error_of(await api.get(f"/v1/events?cursor={10**14}-{'0' * 24}"), 422, "ValidationFailed")
    assert (await api.get(f"/v1/events?cursor={10**12}-{'0' * 24}")).status_code == 200


@pytest.mark.parametrize(
    "query",
    [
        EventQuery(),
        EventQuery(job_id="0123456789abcdef01234567"),
        EventQuery(type="created"),
        EventQuery(scope="user", scope_id="u1"),
        EventQuery(actor="user:admin"),
        EventQuery(type="created", actor="reaper", scope="user", scope_id="u1"),
    ],
    ids=str,
)
@pytest.mark.parametrize("timed", [False, True])
@pytest.mark.parametrize("within", [None, [("user", "u1"), ("account", "acme")]])
async def test_the_audit_query_never_scans_the_collection(
    api: httpx.AsyncClient,
    backends: Backends,
    query: EventQuery,
    timed: bool,
    within: list[tuple[str, str]] | None,
) -> None:
    await register(api, noop())
    await create(api)
    await backends.store.trail.flush()
    store = backends.store
    if timed:
        now = store.clock.now()
        query = EventQuery(
            **{**query.__dict__, "since": now, "until": now, "after": (now, "0" * 24)}
        )
    find = store.trail.audit_filter(query, within)
    plan = (
        await raw(store).events.find(find).sort([("createAt", 1), ("_id", 1)]).limit(10).explain()
    )
    assert "COLLSCAN" not in str(plan["queryPlanner"]["winningPlan"])


async def test_openapi_lists_every_route_with_models_and_errors(api: httpx.AsyncClient) -> None:
    doc = (await api.get("/openapi.json")).json()
    expected = {
        ("post", "/v1/api-keys"),
        ("get", "/v1/api-keys"),
        ("delete", "/v1/api-keys/{key_id}"),
        ("post", "/v1/templates"),
        ("get", "/v1/templates"),
        ("get", "/v1/templates/{type_}"),
        ("get", "/v1/templates/{type_}/versions/{version}"),
        ("post", "/v1/templates/{type_}/enable"),
        ("post", "/v1/templates/{type_}/disable"),
        ("post", "/v1/runs"),
        ("get", "/v1/runs"),
        ("get", "/v1/runs/{run_id}"),
        ("post", "/v1/runs/{run_id}/cancel"),
        ("post", "/v1/runs/{run_id}/rerun"),
        ("get", "/v1/runs/{run_id}/events"),
        ("get", "/v1/events"),
    }
    listed = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert expected <= listed
    for method, path in expected:
        op = doc["paths"][path][method]
        success = next(c for c in op["responses"] if c.startswith("2"))
        assert "schema" in op["responses"][success]["content"]["application/json"], (method, path)
        assert {"401", "403", "404", "409", "413", "422"} <= set(op["responses"]), (method, path)
        if method == "post" and path not in {"/v1/runs/{run_id}/rerun"} and "able" not in path:
            assert "requestBody" in op, (method, path)
    error = doc["components"]["schemas"]["ErrorResponse"]
    assert error["properties"]["error"]["$ref"].endswith("ErrorBody")
