"""The HTTP API on the ASGI app, against real MongoDB and Redis."""

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from jobplane.api import create_app
from jobplane.backends import Backends
from jobplane.settings import Settings
from tests.integration.api_client import error_of, pointers
from tests.integration.db import raw

TEMPLATES = Path(__file__).parents[2] / "templates"
DEMO_YAML = (TEMPLATES / "demo_long_task.yaml").read_text()


@pytest.fixture
async def api(backends: Backends, settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(settings, backends))
    headers = {"authorization": f"Bearer {settings.admin_key}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=headers) as c:
        yield c


async def test_health_and_readiness(api: httpx.AsyncClient) -> None:
    assert (await api.get("/healthz")).json() == {"status": "ok"}
    ready = await api.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ok", "mongodb": "ok", "redis": "ok"}


async def test_missing_or_wrong_key_is_unauthorized(api: httpx.AsyncClient) -> None:
    error_of(await api.get("/v1/templates/x", headers={"authorization": ""}), 401, "Unauthorized")
    wrong = {"authorization": "Bearer nope"}
    error_of(await api.post("/v1/runs", json={}, headers=wrong), 401, "Unauthorized")


async def test_template_versions(api: httpx.AsyncClient, backends: Backends) -> None:
    yaml_type = {"content-type": "application/yaml"}
    first = await api.post("/v1/templates", content=DEMO_YAML, headers=yaml_type)
    assert first.status_code == 201 and first.json()["version"] == 1
    assert first.json()["created"] is True
    again = await api.post("/v1/templates", content=DEMO_YAML, headers=yaml_type)
    assert again.status_code == 200 and again.json() == first.json() | {"created": False}
    changed = DEMO_YAML.replace("graceSeconds: 30", "graceSeconds: 45")
    second = await api.post("/v1/templates", content=changed, headers=yaml_type)
    assert second.status_code == 201 and second.json()["version"] == 2
    as_json = await api.post("/v1/templates", json={**second.json(), "version": 9})
    error_of(as_json, 422, "ValidationFailed")  # `version` is not the author's to set

    latest = await api.get("/v1/templates/demo_long_task")
    assert latest.json()["version"] == 2
    v1 = await api.get("/v1/templates/demo_long_task/versions/1")
    assert v1.json()["cancelPolicy"]["graceSeconds"] == 30
    error_of(await api.get("/v1/templates/nope"), 404, "NotFound")
    error_of(await api.get("/v1/templates/demo_long_task/versions/7"), 404, "NotFound")
    error_of(await api.get("/v1/templates/demo_long_task/versions/x"), 422, "ValidationFailed")
    assert await raw(backends.store).templates.count_documents({}) == 2


@pytest.mark.parametrize(
    ("body", "content_type", "pointer"),
    [
        ("type: [unclosed", "application/yaml", ""),
        ("{not json", "application/json", ""),
        (
            '{"type": "x", "steps": [{"id": "a", "handler": "h"}], "extra": 1}',
            "application/json",
            "/extra",
        ),
        ('{"type": "x", "steps": "no"}', "application/json", "/steps"),
        (
            '{"type": "x", "steps": [{"id": "a", "handler": "h", "timeoutSeconds": "*/5 * *"}]}',
            "application/json",
            "/steps/0/timeoutSeconds",
        ),
    ],
)
async def test_bad_templates_write_nothing(
    api: httpx.AsyncClient, backends: Backends, body: str, content_type: str, pointer: str
) -> None:
    response = await api.post("/v1/templates", content=body, headers={"content-type": content_type})
    assert pointer in pointers(error_of(response, 422, "ValidationFailed"))
    assert await raw(backends.store).templates.count_documents({}) == 0


async def test_create_get_and_follow_a_run(api: httpx.AsyncClient, backends: Backends) -> None:
    await api.post("/v1/templates", content=DEMO_YAML, headers={"content-type": "application/yaml"})
    body = {
        "templateType": "demo_long_task",
        "scope": "user",
        "scopeId": "u1",
        "payload": {"target": "a"},
    }
    created = await api.post("/v1/runs", json=body)
    assert created.status_code == 201, created.text
    run = created.json()
    assert run["status"] == "queued" and run["templateVersion"] == 1 and run["priority"] == 0
    assert [s["id"] for s in run["progress"]["steps"]] == ["prepare", "execute", "finalize"]

    fetched = (await api.get(f"/v1/runs/{run['id']}")).json()
    assert fetched["status"] == "queued" and fetched["id"] == run["id"]
    events = (await api.get(f"/v1/runs/{run['id']}/events")).json()
    assert [(e["type"], e.get("from"), e["to"]) for e in events] == [("created", None, "queued")]
    assert {e["actor"] for e in events} == {"user:admin"}


@pytest.mark.parametrize(
    ("change", "status", "code", "pointer"),
    [
        ({"templateType": "missing"}, 404, "NotFound", None),
        ({"payload": {"target": 5}}, 422, "ValidationFailed", "/payload/target"),
        ({"payload": {"sleepSeconds": -1}}, 422, "ValidationFailed", "/payload/sleepSeconds"),
        ({"payload": {"unknown": 1}}, 422, "ValidationFailed", "/payload"),
        ({"priority": "0 * * * *"}, 422, "ValidationFailed", "/priority"),
        ({"delaySeconds": -3}, 422, "ValidationFailed", "/delaySeconds"),
        ({"scope": "galaxy"}, 422, "ValidationFailed", "/scope"),
        ({"surprise": True}, 422, "ValidationFailed", "/surprise"),
        ({"payload": []}, 422, "ValidationFailed", "/payload"),
    ],
)
async def test_bad_runs_write_nothing(
    api: httpx.AsyncClient,
    backends: Backends,
    change: dict[str, Any],
    status: int,
    code: str,
    pointer: str | None,
) -> None:
    await api.post("/v1/templates", content=DEMO_YAML, headers={"content-type": "application/yaml"})
    body = {"templateType": "demo_long_task", "scope": "user", "scopeId": "u1", **change}
    error = error_of(await api.post("/v1/runs", json=body), status, code)
    if pointer is not None:
        assert pointer in pointers(error)
    assert await raw(backends.store).runs.count_documents({}) == 0
    assert await raw(backends.store).events.count_documents({}) == 0


async def test_malformed_json_body_is_rejected(api: httpx.AsyncClient) -> None:
    response = await api.post(
        "/v1/runs", content=b"{broken", headers={"content-type": "application/json"}
    )
    error_of(response, 422, "ValidationFailed")


@pytest.mark.parametrize("run_id", ["nope", "0123456789abcdef01234567", "%24gt"])
async def test_unknown_run_ids_are_not_found(api: httpx.AsyncClient, run_id: str) -> None:
    error_of(await api.get(f"/v1/runs/{run_id}"), 404, "NotFound")
    error_of(await api.get(f"/v1/runs/{run_id}/events"), 404, "NotFound")


async def test_openapi_lists_routes_and_error_shape(api: httpx.AsyncClient) -> None:
    doc = (await api.get("/openapi.json")).json()
    assert {"/v1/runs", "/v1/runs/{run_id}", "/v1/templates", "/healthz"} <= set(doc["paths"])
    responses = doc["paths"]["/v1/runs"]["post"]["responses"]
    assert {"201", "404", "409", "422"} <= set(responses)


async def test_an_idempotency_key_returns_the_first_run(
    api: httpx.AsyncClient, backends: Backends
) -> None:
    await api.post("/v1/templates", content=DEMO_YAML, headers={"content-type": "application/yaml"})
    body = {"templateType": "demo_long_task", "scope": "user", "scopeId": "u1"}
    first = await api.post("/v1/runs", json={**body, "idempotencyKey": "order-42"})
    again = await api.post("/v1/runs", json={**body, "idempotencyKey": "order-42"})
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    changed = await api.post(
        "/v1/runs", json={**body, "payload": {"target": "b"}, "idempotencyKey": "order-42"}
    )
    assert error_of(changed, 409, "ResourceInvalidState")["details"]["runId"] == first.json()["id"]
    other = await api.post("/v1/runs", json={**body, "scopeId": "u2", "idempotencyKey": "order-42"})
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]
    assert await raw(backends.store).runs.count_documents({}) == 2
