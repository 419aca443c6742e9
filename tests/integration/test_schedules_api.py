"""Schedules over HTTP: everything a fire needs is checked when a schedule is written."""

from typing import Any

import httpx
import pytest

from jobplane.backends import Backends
from jobplane.settings import Settings
from tests.integration.api_client import error_of, pointers
from tests.integration.conftest import Client
from tests.integration.db import raw

REPORT = {
    "type": "t_report",
    "schedulable": True,
    "payloadSchema": {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date-time"}, "who": {"type": "string"}},
        "required": ["day"],
        "additionalProperties": False,
    },
    "steps": [{"id": "only", "handler": "builtin.noop"}],
}
BODY = {
    "templateType": "t_report",
    "scope": "account",
    "scopeId": "acme",
    "cron": "30 2 * * *",
    "timezone": "America/New_York",
    "payloadTemplate": {"day": "{{scheduledFor}}", "who": "{{scopeId}}/{{scheduleId}}"},
}


@pytest.fixture
async def api(client_for: Client, settings: Settings) -> httpx.AsyncClient:
    assert settings.admin_key is not None
    client = client_for(settings.admin_key)
    assert (await client.post("/v1/templates", json=REPORT)).status_code == 201
    return client


async def created(api: httpx.AsyncClient, **changes: Any) -> dict[str, Any]:
    response = await api.post("/v1/schedules", json={**BODY, **changes})
    assert response.status_code == 201, response.text
    schedule: dict[str, Any] = response.json()
    return schedule


async def test_create_read_change_pause_delete(api: httpx.AsyncClient, backends: Backends) -> None:
    schedule = await created(api)
    assert schedule["enabled"] and schedule["misfirePolicy"] == "run_once"
    assert schedule["overlapPolicy"] == "allow" and schedule["nextRunAt"] is not None
    sid = schedule["id"]
    assert (await api.get(f"/v1/schedules/{sid}")).json() == schedule
    assert [s["id"] for s in (await api.get("/v1/schedules")).json()["items"]] == [sid]

    changed = await api.patch(
        f"/v1/schedules/{sid}", json={"cron": "0 9 * * *", "timezone": "Asia/Taipei"}
    )
    assert changed.status_code == 200, changed.text
    assert changed.json()["nextRunAt"].endswith("T01:00:00Z") and changed.json()["version"] == 2
    paused = (await api.post(f"/v1/schedules/{sid}/pause")).json()
    assert paused["enabled"] is False
    assert (await api.post(f"/v1/schedules/{sid}/resume")).json()["enabled"] is True
    assert (await api.get("/v1/schedules?enabled=false")).json()["items"] == []

    assert (await api.delete(f"/v1/schedules/{sid}")).status_code == 204
    error_of(await api.get(f"/v1/schedules/{sid}"), 404, "NotFound")
    error_of(await api.delete(f"/v1/schedules/{sid}"), 404, "NotFound")
    assert await raw(backends.store).schedules.count_documents({}) == 0


async def test_preview_in_utc_and_in_the_zone_across_spring_forward(api: httpx.AsyncClient) -> None:
    sid = (await created(api))["id"]
    response = await api.get(f"/v1/schedules/{sid}/preview?count=3&after=2026-03-07T00:00:00Z")
    preview = response.json()
    assert preview["timezone"] == "America/New_York"
    assert [t["utc"] for t in preview["times"]] == [
        "2026-03-07T07:30:00Z",
        "2026-03-08T07:00:00Z",  # 02:30 does not exist that day: the jump to 03:00 EDT
        "2026-03-09T06:30:00Z",
    ]
    assert [t["local"] for t in preview["times"]] == [
        "2026-03-07T02:30:00-05:00",
        "2026-03-08T03:00:00-04:00",
        "2026-03-09T02:30:00-04:00",
    ]
    error_of(await api.get(f"/v1/schedules/{sid}/preview?count=0"), 422, "ValidationFailed")
    error_of(
        await api.get(f"/v1/schedules/{sid}/preview?after=2026-03-07T00:00:00"),
        422,
        "ValidationFailed",
    )


async def test_trigger_creates_a_run_with_the_rendered_payload(api: httpx.AsyncClient) -> None:
    schedule = await created(api)
    sid = schedule["id"]
    assert schedule["lastRunAt"] is None and schedule["lastRunId"] is None
    response = await api.post(f"/v1/schedules/{sid}/trigger")
    assert response.status_code == 201, response.text
    run = response.json()
    assert run["scheduleId"] == sid and run["scheduledFor"] is not None
    assert run["payload"]["who"] == f"acme/{sid}"
    assert run["payload"]["day"].startswith(run["scheduledFor"][:16])
    listed = (await api.get(f"/v1/runs?scheduleId={sid}")).json()["items"]
    assert [r["id"] for r in listed] == [run["id"]]
    # The schedule's last run from then on; when it fires next is not changed.
    after = (await api.get(f"/v1/schedules/{sid}")).json()
    assert (after["lastRunAt"], after["lastRunId"]) == (run["scheduledFor"], run["id"])
    assert after["nextRunAt"] == schedule["nextRunAt"]
    again = (await api.post(f"/v1/schedules/{sid}/trigger")).json()
    assert (await api.get(f"/v1/schedules/{sid}")).json()["lastRunId"] == again["id"]
    await api.post("/v1/templates/t_report/disable")
    error_of(await api.post(f"/v1/schedules/{sid}/trigger"), 409, "TemplateDisabled")


@pytest.mark.parametrize(
    ("changes", "pointer"),
    [
        ({"cron": "61 * * * *"}, "/cron"),
        ({"cron": "* * * * * * *"}, "/cron"),
        ({"timezone": "Mars/Olympus_Mons"}, "/timezone"),
        ({"payloadTemplate": {"day": 5}}, "/payloadTemplate/day"),
        ({"payloadTemplate": {"who": "x"}}, "/payloadTemplate"),
        ({"payloadTemplate": {"day": "{{tomorrow}}"}}, "/payloadTemplate"),
        ({"misfirePolicy": "sometimes"}, "/misfirePolicy"),
        ({"catchUpLimit": "*/5"}, "/catchUpLimit"),
        ({"extra": 1}, "/extra"),
    ],
)
async def test_bad_schedules_are_refused_and_nothing_is_written(
    api: httpx.AsyncClient, backends: Backends, changes: dict[str, Any], pointer: str
) -> None:
    error = error_of(
        await api.post("/v1/schedules", json={**BODY, **changes}), 422, "ValidationFailed"
    )
    assert any(p.startswith(pointer) for p in pointers(error)), pointers(error)
    assert await raw(backends.store).schedules.count_documents({}) == 0


async def test_a_template_that_is_not_schedulable_is_refused(api: httpx.AsyncClient) -> None:
    await api.post("/v1/templates", json={**REPORT, "type": "t_plain", "schedulable": False})
    refused = await api.post("/v1/schedules", json={**BODY, "templateType": "t_plain"})
    assert "/templateType" in pointers(error_of(refused, 422, "ValidationFailed"))


async def test_an_unknown_template_is_not_found_as_when_creating_a_run(
    api: httpx.AsyncClient, backends: Backends
) -> None:
    body = {**BODY, "templateType": "nope"}
    scheduled = error_of(await api.post("/v1/schedules", json=body), 404, "NotFound")
    run = {"templateType": "nope", "scope": BODY["scope"], "scopeId": BODY["scopeId"]}
    created = error_of(await api.post("/v1/runs", json=run), 404, "NotFound")
    assert scheduled["message"] == created["message"] == "template 'nope' not found"
    assert await raw(backends.store).schedules.count_documents({}) == 0


async def test_bad_changes_leave_the_schedule_as_it_was(api: httpx.AsyncClient) -> None:
    schedule = await created(api)
    sid = schedule["id"]
    for changes in (
        {"cron": "nope"},
        {"timezone": "Nowhere/Land"},
        {"payloadTemplate": {"day": 1}},
    ):
        error_of(await api.patch(f"/v1/schedules/{sid}", json=changes), 422, "ValidationFailed")
    assert (await api.get(f"/v1/schedules/{sid}")).json() == schedule


async def test_a_schedule_keeps_its_scope(api: httpx.AsyncClient) -> None:
    """One run per fire time is kept by a unique index within the runs' scope (the shard key),
    so a schedule's scope never changes: even an admin's change of it is refused."""
    schedule = await created(api)
    sid = schedule["id"]
    for changes, moved in (
        ({"scopeId": "globex"}, ["/scopeId"]),
        ({"scope": "user", "scopeId": "u1"}, ["/scope", "/scopeId"]),
    ):
        response = await api.patch(f"/v1/schedules/{sid}", json=changes)
        assert pointers(error_of(response, 422, "ValidationFailed")) == moved
    assert (await api.get(f"/v1/schedules/{sid}")).json() == schedule
    same = await api.patch(f"/v1/schedules/{sid}", json={"scope": "account", "scopeId": "acme"})
    assert same.status_code == 200, same.text


async def test_scopes_apply_to_schedules(
    api: httpx.AsyncClient, client_for: Client, backends: Backends
) -> None:
    theirs = await created(api, scopeId="globex")
    made = await api.post(
        "/v1/api-keys", json={"name": "acme-user", "role": "user", "scopes": ["account:acme"]}
    )
    user = client_for(made.json()["key"])
    mine = (await user.post("/v1/schedules", json=BODY)).json()
    assert mine["createdBy"] == "user:acme-user"
    error_of(await user.post("/v1/schedules", json={**BODY, "scopeId": "globex"}), 403, "Forbidden")
    assert [s["id"] for s in (await user.get("/v1/schedules")).json()["items"]] == [mine["id"]]
    for method, path in (
        ("GET", ""),
        ("PATCH", ""),
        ("DELETE", ""),
        ("POST", "/pause"),
        ("POST", "/trigger"),
        ("GET", "/preview"),
    ):
        body = {"enabled": False} if method == "PATCH" else None
        response = await user.request(method, f"/v1/schedules/{theirs['id']}{path}", json=body)
        error_of(response, 404, "NotFound")
    moved = await user.patch(f"/v1/schedules/{mine['id']}", json={"scopeId": "globex"})
    error_of(moved, 403, "Forbidden")
    made = await api.post("/v1/api-keys", json={"name": "aud", "role": "auditor"})
    auditor = client_for(made.json()["key"])
    assert len((await auditor.get("/v1/schedules")).json()["items"]) == 2
    error_of(await auditor.post(f"/v1/schedules/{mine['id']}/pause"), 403, "Forbidden")
    assert await raw(backends.store).runs.count_documents({}) == 0
