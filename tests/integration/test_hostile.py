"""Hostile inputs against the real API (issue 6): deep nesting, huge bodies, bytes that are not
UTF-8, MongoDB operators where data belongs, NUL bytes and control characters, and numbers and
times out of range.

Every refusal must be a 4xx in the error shape of docs/contract.md, never a 500 or a hang, and
must leave nothing half-written.
"""

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from bson import ObjectId

from jobplane.backends import Backends
from jobplane.settings import Settings
from tests.integration.api_client import error_of, pointers
from tests.integration.conftest import Client
from tests.integration.db import raw
from tests.integration.workers import running, settled

# A hostile input that hangs the server fails its case instead of stalling the session.
pytestmark = pytest.mark.timeout(60)

JSON = "application/json"
YAML = "application/yaml"
RUN = {"templateType": "t_noop", "scope": "user", "scopeId": "u1"}


def case(name: str, *values: Any) -> Any:
    """A table row, named."""
    return pytest.param(*values, id=name)


def noop(type_: str = "t_noop", **fields: Any) -> dict[str, Any]:
    return {"type": type_, "steps": [{"id": "only", "handler": "builtin.noop"}], **fields}


def as_json(value: Any) -> bytes:
    # Python's json writes NaN, Infinity and lone surrogates, which httpx's `json=` refuses.
    return json.dumps(value).encode()


@pytest.fixture
async def api(client_for: Client, settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """An admin client, with the schedulable template `t_noop` registered."""
    assert settings.admin_key is not None
    admin = client_for(settings.admin_key)
    response = await admin.post("/v1/templates", json=noop(schedulable=True))
    assert response.status_code == 201, response.text
    yield admin


async def written(backends: Backends) -> tuple[int, int, int]:
    """Runs, templates and schedules in MongoDB: a refused request must not change them."""
    store = backends.store
    return (
        await raw(store).runs.count_documents({}),
        await raw(store).templates.count_documents({}),
        await raw(store).schedules.count_documents({}),
    )


async def create_run(api: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    response = await api.post("/v1/runs", json={**RUN, **fields})
    assert response.status_code == 201, response.text
    run: dict[str, Any] = response.json()
    return run


def refused(response: httpx.Response, pointer: str) -> None:
    """A 422 in the contract's error shape naming `pointer` (or a field inside it)."""
    error = error_of(response, 422, "ValidationFailed")
    assert any(p.startswith(pointer) for p in pointers(error)), error


def deep_bodies() -> list[Any]:
    """A run payload and a template's payloadSchema nested deep, as JSON and as YAML (flow style
    takes the same bytes): 300 levels get past the parsers but not MongoDB (180 levels) or
    pydantic, 10,000 levels get past nothing."""
    rows = []
    for depth, kind in [(300, "list"), (300, "object"), (10_000, "list"), (10_000, "object")]:
        if kind == "list":
            nest = b"[" * depth + b"]" * depth
        else:
            nest = b'{"a":' * depth + b"1" + b"}" * depth
        run = as_json(RUN)[:-1] + b', "payload": {"x": ' + nest + b"}}"
        template = as_json(noop("t_deep"))[:-1] + b', "payloadSchema": {"x": ' + nest + b"}}"
        rows += [
            case(f"run-{kind}-{depth}", "/v1/runs", JSON, run),
            case(f"json-{kind}-{depth}", "/v1/templates", JSON, template),
            case(f"yaml-{kind}-{depth}", "/v1/templates", YAML, template),
        ]
    return rows


STEPS_YAML = b"steps: [{id: a, handler: builtin.noop}]\n"


@pytest.mark.parametrize(
    ("path", "content_type", "body"),
    [
        *deep_bodies(),
        # Bytes that are not UTF-8 (nor UTF-16 with a BOM, which JSON and YAML both detect).
        case("run-garbage", "/v1/runs", JSON, b"\xff\xfe\x00garbage"),
        case(
            "run-invalid-utf8-in-a-string",
            "/v1/runs",
            JSON,
            b'{"templateType": "t_noop", "scope": "user", "scopeId": "\xff"}',
        ),
        case("json-garbage", "/v1/templates", JSON, b"\xff\xfe\x00garbage"),
        case("yaml-garbage", "/v1/templates", YAML, b"\xff\xfe\x00garbage"),
        case(
            "json-latin1", "/v1/templates", JSON, as_json(noop("t_x"))[:-1] + b', "name": "\xe9"}'
        ),
        case("yaml-latin1", "/v1/templates", YAML, b"type: t_x\nname: caf\xe9\n" + STEPS_YAML),
        # Escapes of lone surrogates: valid JSON and YAML, but no UTF-8 string.
        case(
            "run-lone-surrogate",
            "/v1/runs",
            JSON,
            as_json({**RUN, "payload": {"s": "\ud800"}}),
        ),
        case(
            "json-lone-surrogate",
            "/v1/templates",
            JSON,
            as_json(noop("t_x", description="\ud800")),
        ),
        case(
            "yaml-lone-surrogate",
            "/v1/templates",
            YAML,
            b'type: t_x\ndescription: "\\ud800"\n' + STEPS_YAML,
        ),
    ],
)
async def test_hostile_bodies_are_refused(
    api: httpx.AsyncClient, backends: Backends, path: str, content_type: str, body: bytes
) -> None:
    before = await written(backends)
    response = await api.post(path, content=body, headers={"content-type": content_type})
    error_of(response, 422, "ValidationFailed")
    assert await written(backends) == before


async def ten_megabytes(sent: list[int]) -> AsyncIterator[bytes]:
    for _ in range(10):
        sent.append(1)
        yield b"x" * (1 << 20)


@pytest.mark.parametrize("path", ["/v1/runs", "/v1/templates"])
@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
async def test_a_10_mb_body_is_refused_with_413(
    api: httpx.AsyncClient, backends: Backends, path: str, declared: bool
) -> None:
    before = await written(backends)
    sent: list[int] = []
    body = b"x" * (10 << 20) if declared else ten_megabytes(sent)
    response = await api.post(path, content=body, headers={"content-type": JSON})
    error_of(response, 413, "PayloadTooLarge")
    # Without a declared length the body is cut off once past the limit (1 MiB), unread.
    assert len(sent) <= 2
    assert await written(backends) == before


@pytest.mark.parametrize(
    ("fields", "pointer"),
    [
        case("type-nul", {"type": "t\0x"}, "/type"),
        case("schema-key-nul", {"payloadSchema": {"a\0": {}}}, "/payloadSchema"),
        case("timeout-negative", {"timeoutSeconds": -1}, "/timeoutSeconds"),
        case("timeout-huge", {"timeoutSeconds": 1e30}, "/timeoutSeconds"),
        case("timeout-inf", {"timeoutSeconds": float("inf")}, "/timeoutSeconds"),
        case("priority-huge", {"priority": 10**30}, "/priority"),
        case("attempts-huge", {"retryPolicy": {"maxAttempts": 10**30}}, "/retryPolicy"),
        case(
            "backoff-inf",
            {"retryPolicy": {"maxSeconds": float("inf")}},
            "/retryPolicy",
        ),
        case("grace-huge", {"cancelPolicy": {"graceSeconds": 1e300}}, "/cancelPolicy"),
        # JSON types the document does not allow: a boolean is no number, nor a number a
        # boolean.
        case("priority-false", {"priority": False}, "/priority"),
        case("schedulable-0", {"schedulable": 0}, "/schedulable"),
        case("enabled-text", {"enabled": "true"}, "/enabled"),
        case("attempts-true", {"retryPolicy": {"maxAttempts": True}}, "/retryPolicy/maxAttempts"),
    ],
)
async def test_hostile_template_fields_are_refused(
    api: httpx.AsyncClient, backends: Backends, fields: dict[str, Any], pointer: str
) -> None:
    before = await written(backends)
    body = as_json(noop("t_x", **fields))
    refused(await api.post("/v1/templates", content=body, headers={"content-type": JSON}), pointer)
    assert await written(backends) == before


async def test_an_infinite_number_in_a_yaml_template_is_refused(
    api: httpx.AsyncClient, backends: Backends
) -> None:
    body = b"type: t_x\ntimeoutSeconds: .inf\n" + STEPS_YAML
    response = await api.post("/v1/templates", content=body, headers={"content-type": YAML})
    refused(response, "/timeoutSeconds")
    assert await raw(backends.store).templates.count_documents({"type": "t_x"}) == 0


@pytest.mark.parametrize(
    ("change", "pointer"),
    [
        # MongoDB operators where a value belongs.
        case("scope-id-op", {"scopeId": {"$gt": ""}}, "/scopeId"),
        case("scope-op", {"scope": {"$in": ["user"]}}, "/scope"),
        case("type-op", {"templateType": {"$ne": None}}, "/templateType"),
        case("type-lone-surrogate", {"templateType": "t_noop\ud800"}, "/templateType"),
        case("version-op", {"templateVersion": {"$gt": 0}}, "/templateVersion"),
        case("idempotency-key-op", {"idempotencyKey": {"$ne": None}}, "/idempotencyKey"),
        # NUL bytes.
        case("scope-id-nul", {"scopeId": "u1\0"}, "/scopeId"),
        case("scope-id-newline", {"scopeId": "u1\n"}, "/scopeId"),
        case("scope-id-space", {"scopeId": "u 1"}, "/scopeId"),
        case("scope-id-lone-surrogate", {"scopeId": "u\ud800"}, "/scopeId"),
        case("scope-id-empty", {"scopeId": ""}, "/scopeId"),
        case("payload-key-nul", {"payload": {"a\0b": 1}}, "/payload"),
        # Numbers out of range.
        case("priority-low", {"priority": -101}, "/priority"),
        case("priority-huge", {"priority": 10**30}, "/priority"),
        case("priority-tiny", {"priority": -(10**30)}, "/priority"),
        case("priority-float", {"priority": 1.5}, "/priority"),
        # JSON types the document does not allow.
        case("priority-false", {"priority": False}, "/priority"),
        case("priority-true", {"priority": True}, "/priority"),
        case("priority-text", {"priority": "5"}, "/priority"),
        case("version-true", {"templateVersion": True}, "/templateVersion"),
        case("delay-true", {"delaySeconds": True}, "/delaySeconds"),
        case("delay-negative", {"delaySeconds": -1}, "/delaySeconds"),
        case("delay-huge", {"delaySeconds": 10**30}, "/delaySeconds"),
        case("delay-nan", {"delaySeconds": float("nan")}, "/delaySeconds"),
        case("delay-inf", {"delaySeconds": float("inf")}, "/delaySeconds"),
        case("version-0", {"templateVersion": 0}, "/templateVersion"),
        case("version-2**63", {"templateVersion": 2**63}, "/templateVersion"),
        case("payload-huge-int", {"payload": {"n": 10**30}}, "/payload"),
        case("payload-under-int64", {"payload": {"n": -(2**63) - 1}}, "/payload"),
        case("payload-nan", {"payload": {"n": float("nan")}}, "/payload"),
        case("payload-inf", {"payload": {"n": float("inf")}}, "/payload"),
        # Times whose UTC reading is before year 1 or after year 9999.
        case("year-0", {"notBefore": "0001-01-01T00:00:00+01:00"}, "/notBefore"),
        case("year-10000", {"notBefore": "9999-12-31T23:59:59-01:00"}, "/notBefore"),
        # Pydantic reads numbers as seconds since 1970; the API speaks ISO 8601.
        case("time-number", {"notBefore": 1_900_000_000}, "/notBefore"),
        case("time-digits", {"notBefore": "1900000000"}, "/notBefore"),
    ],
)
async def test_hostile_run_fields_are_refused(
    api: httpx.AsyncClient, backends: Backends, change: dict[str, Any], pointer: str
) -> None:
    body = as_json({**RUN, **change})
    refused(await api.post("/v1/runs", content=body, headers={"content-type": JSON}), pointer)
    assert await raw(backends.store).runs.count_documents({}) == 0


async def test_an_integer_may_be_written_with_a_zero_fraction(api: httpx.AsyncClient) -> None:
    """JSON Schema counts 5.0 as an integer; the API reads what its document allows."""
    run = await create_run(api, priority=5.0, templateVersion=1.0)
    assert (run["priority"], run["templateVersion"]) == (5, 1)
    response = await api.post("/v1/schedules", json={**SCHEDULE, "catchUpLimit": 3.0})
    assert response.status_code == 201, response.text
    assert response.json()["catchUpLimit"] == 3


async def test_a_template_type_with_a_nul_is_not_found(
    api: httpx.AsyncClient, backends: Backends
) -> None:
    response = await api.post("/v1/runs", json={**RUN, "templateType": "t_noop\0"})
    error_of(response, 404, "NotFound")
    assert await raw(backends.store).runs.count_documents({}) == 0


async def test_a_method_the_path_does_not_have_is_405_naming_those_it_has(
    api: httpx.AsyncClient, backends: Backends
) -> None:
    error_of(await api.put("/v1/runs", json=RUN), 405, "MethodNotAllowed")
    answer = await api.delete("/v1/templates")
    error_of(answer, 405, "MethodNotAllowed")
    assert set(answer.headers["allow"].replace(" ", "").split(",")) == {"GET", "POST"}
    # A path written out is no id of the templated path beside it: no run named "batch".
    for method, path, allow in [
        ("GET", "/v1/runs/batch", "POST"),
        ("DELETE", "/v1/api-keys/me", "GET"),
    ]:
        answer = await api.request(method, path)
        error_of(answer, 405, "MethodNotAllowed")
        assert answer.headers["allow"] == allow
    assert await raw(backends.store).runs.count_documents({}) == 0


# `$` and `.` in keys, operators as values, a NUL inside a string: all data to the platform.
ODD_PAYLOAD = {
    "x": {"$gt": ""},
    "$where": "sleep(1000)",
    "$set": {"status": "succeeded"},
    "a.b": {"$ne": 1},
    "$": 1,
    ".": 2,
    "": 3,
    "list": [{"$in": []}, "a\0b"],
}


async def test_operators_and_dots_in_a_payload_are_stored_as_data(
    api: httpx.AsyncClient, backends: Backends, settings: Settings
) -> None:
    """The API takes such payloads (MongoDB 5+ stores `$` and `.` in field names of an inserted
    document) and gives them back exactly: from the API, from MongoDB, and through a worker
    (`builtin.echo` returns the payload, which the worker writes as the result)."""
    echo = {"type": "t_echo", "steps": [{"id": "only", "handler": "builtin.echo"}]}
    assert (await api.post("/v1/templates", json=echo)).status_code == 201
    run = await create_run(api, templateType="t_echo", payload=ODD_PAYLOAD)
    assert run["payload"] == ODD_PAYLOAD
    assert (await api.get(f"/v1/runs/{run['id']}")).json()["payload"] == ODD_PAYLOAD
    doc = await raw(backends.store).runs.find_one({"_id": ObjectId(run["id"])})
    assert doc is not None and doc["payload"] == ODD_PAYLOAD
    async with running(backends, settings):
        [done] = await settled(backends.store, [run["id"]], within=20)
    assert (done.status, done.result) == ("succeeded", ODD_PAYLOAD)


async def test_an_operator_in_a_dedupe_value_is_compared_as_data(api: httpx.AsyncClient) -> None:
    once = noop("t_once", concurrencyPolicy="reject_same_scope", dedupeKeys=["payload.target"])
    assert (await api.post("/v1/templates", json=once)).status_code == 201
    first = await create_run(api, templateType="t_once", payload={"target": {"$gt": ""}})
    # `{"$gt": ""}` is a value like any other: it does not match every target.
    await create_run(api, templateType="t_once", payload={"target": "b"})
    again = await api.post(
        "/v1/runs", json={**RUN, "templateType": "t_once", "payload": {"target": {"$gt": ""}}}
    )
    assert error_of(again, 409, "ConcurrencyConflict")["details"]["activeRunId"] == first["id"]


OPERATOR = '{"$gt":""}'
LEASE = {"workerId": "w", "leaseToken": "t"}


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", f"/v1/runs/{OPERATOR}", None),
        ("GET", f"/v1/runs/{OPERATOR}/events", None),
        ("POST", f"/v1/runs/{OPERATOR}/cancel", {"reason": "x"}),
        ("POST", f"/v1/runs/{OPERATOR}/rerun", None),
        ("POST", f"/v1/runs/{OPERATOR}/steps/only/heartbeat", LEASE),
        ("POST", f"/v1/runs/{OPERATOR}/steps/only/complete", LEASE),
        ("GET", "/v1/runs/%24where", None),
        ("GET", f"/v1/schedules/{OPERATOR}", None),
        ("DELETE", f"/v1/schedules/{OPERATOR}", None),
        ("POST", f"/v1/schedules/{OPERATOR}/trigger", None),
        ("GET", f"/v1/templates/{OPERATOR}", None),
        ("GET", f"/v1/templates/{OPERATOR}/versions/1", None),
        ("POST", f"/v1/templates/{OPERATOR}/disable", None),
        ("DELETE", f"/v1/api-keys/{OPERATOR}", None),
    ],
)
async def test_an_operator_as_an_id_is_not_found(
    api: httpx.AsyncClient, backends: Backends, method: str, path: str, body: Any
) -> None:
    """Ids are looked up as strings: an operator matches nothing, least of all everything."""
    run = await create_run(api)
    schedule = await api.post("/v1/schedules", json={**RUN, "cron": "@daily"})
    assert schedule.status_code == 201, schedule.text
    before = await written(backends)
    error_of(await api.request(method, path, json=body), 404, "NotFound")
    assert await written(backends) == before
    assert (await api.get(f"/v1/runs/{run['id']}")).json()["status"] == "queued"
    assert (await api.get("/v1/templates/t_noop")).json()["enabled"] is True


@pytest.mark.parametrize(
    ("path", "body", "pointer"),
    [
        ("/v1/runs/{run}/cancel", {"reason": {"$set": {"status": "cancelled"}}}, "/reason"),
        (
            "/v1/runs/{run}/steps/only/heartbeat",
            {**LEASE, "leaseToken": {"$ne": None}},
            "/leaseToken",
        ),
        ("/v1/runs/{run}/steps/only/complete", {**LEASE, "workerId": {"$ne": ""}}, "/workerId"),
        ("/v1/external/inline/claim", {"workerId": {"$gt": ""}, "waitSeconds": 0}, "/workerId"),
        ("/v1/api-keys", {"name": {"$gt": ""}, "role": "admin"}, "/name"),
        ("/v1/api-keys", {"name": "k", "role": {"$ne": "user"}}, "/role"),
    ],
)
async def test_an_operator_in_another_body_is_refused(
    api: httpx.AsyncClient, backends: Backends, path: str, body: Any, pointer: str
) -> None:
    """The fencing fields of a worker's call above all: `{"$ne": null}` must not pass for
    any lease token."""
    run = await create_run(api)
    refused(await api.post(path.replace("{run}", run["id"]), json=body), pointer)
    assert (await api.get(f"/v1/runs/{run['id']}")).json()["status"] == "queued"
    assert await raw(backends.store).api_keys.count_documents({}) == 0


@pytest.mark.parametrize(
    "scope",
    [
        "user:u1\0",
        "user:\0",
        "user:u\n",
        "user:u 1",
        "user:\ud800",
        "user:",
        "team:u1",
        "user:" + "x" * 201,
    ],
)
async def test_hostile_key_scopes_are_refused(
    api: httpx.AsyncClient, backends: Backends, scope: str
) -> None:
    """A key's scopes take the scope ids runs and schedules take: printable, no whitespace."""
    body = as_json({"name": "k", "role": "user", "scopes": [scope]})
    response = await api.post("/v1/api-keys", content=body, headers={"content-type": JSON})
    refused(response, "/scopes/0")
    assert await raw(backends.store).api_keys.count_documents({}) == 0


@pytest.mark.parametrize(
    "output",
    [
        {"a\0b": 1},
        {"n": 10**30},
        {"n": float("nan")},
        float("inf"),
        "\ud800",
        {"deep": json.loads("[" * 100 + "]" * 100)},
    ],
    ids=["key-nul", "huge-int", "nan", "inf", "lone-surrogate", "deep"],
)
async def test_a_hostile_step_output_is_refused(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, output: Any
) -> None:
    """An external worker's output goes into the run as sent, so it must be storable as sent;
    a refused one leaves the run with the worker, to report again."""
    steps = [{"id": "far", "handler": "x", "workerType": "external"}]
    assert (
        await api.post("/v1/templates", json={"type": "t_far", "steps": steps})
    ).status_code == 201
    run = await create_run(api, templateType="t_far")
    async with running(backends, settings):  # an inline worker hands the step over
        claim = {"workerId": "w", "waitSeconds": 20}
        claimed = await api.post("/v1/external/external/claim", json=claim)
    assert claimed.status_code == 200, claimed.text
    body = as_json({"workerId": "w", "leaseToken": claimed.json()["leaseToken"], "output": output})
    url = f"/v1/runs/{run['id']}/steps/far/complete"
    refused(await api.post(url, content=body, headers={"content-type": JSON}), "/output")
    after = (await api.get(f"/v1/runs/{run['id']}")).json()
    assert (after["status"], after["lockedBy"], after["outputs"]) == ("running", "w", {})


async def test_operators_in_filters_do_not_widen_a_list(
    api: httpx.AsyncClient, backends: Backends, client_for: Client
) -> None:
    mine = {(await create_run(api))["id"] for _ in range(2)}
    await create_run(api, scopeId="u2")
    await create_run(api, scope="account", scopeId="acme")
    assert (await api.post("/v1/schedules", json={**RUN, "cron": "@daily"})).status_code == 201
    key = {"name": "u1", "role": "user", "scopes": ["user:u1"]}
    user = client_for((await api.post("/v1/api-keys", json=key)).json()["key"])
    await backends.store.trail.flush()

    # A user key sees its own scope whatever the query string says; a bracketed operator is
    # an unknown parameter (ignored), one in a value is a plain string.
    for url in [
        "/v1/runs?scopeId[$ne]=u1",
        "/v1/runs?scope[$ne]=user&scopeId[$ne]=u1",
        '/v1/runs?scopeId={"$ne":"u1"}',
        '/v1/runs?scope=user&scopeId={"$ne":"u1"}',
        "/v1/runs?$where=1&$or[0][scopeId]=u2",
        "/v1/events?jobId[$ne]=x&scopeId[$ne]=u1",
        '/v1/events?scope=user&scopeId={"$gt":""}',
        "/v1/schedules?scopeId[$ne]=u1",
    ]:
        response = await user.get(url)
        if response.status_code != 200:
            error_of(response, 403, "Forbidden")
            continue
        items = response.json()["items"]
        assert {(i["scope"], i["scopeId"]) for i in items} <= {("user", "u1")}, url
    listed = (await user.get("/v1/runs?scopeId[$ne]=u1")).json()["items"]
    assert {run["id"] for run in listed} == mine

    # For an admin an operator in a value matches no run, rather than every run.
    for url in [
        '/v1/runs?scopeId={"$ne":"u1"}',
        '/v1/runs?templateType={"$gt":""}',
        '/v1/runs?scheduleId={"$ne":null}',
        "/v1/runs?scopeId=%00",
        '/v1/events?jobId={"$gt":""}',
        '/v1/events?actor={"$regex":"."}',
        '/v1/schedules?scopeId={"$ne":""}',
    ]:
        response = await api.get(url)
        assert response.status_code == 200, response.text
        assert response.json()["items"] == [], url
    everything = (await api.get("/v1/runs")).json()["items"]
    assert (await api.get("/v1/runs?status[$ne]=x")).json()["items"] == everything


SCHEDULE = {**RUN, "cron": "* * * * *", "timezone": "UTC"}


@pytest.mark.parametrize(
    ("change", "pointer"),
    [
        case("cron-100kb", {"cron": "* " * 50_000}, "/cron"),
        case("cron-nul-after", {"cron": "* * * * *\0"}, "/cron"),
        case("cron-nul-inside", {"cron": "*\0 * * * *"}, "/cron"),
        case("cron-never-fires", {"cron": "0 0 30 2 *"}, "/cron"),
        case("tz-unknown", {"timezone": "Mars/Olympus"}, "/timezone"),
        case("tz-relative-path", {"timezone": "../../etc/passwd"}, "/timezone"),
        case("tz-absolute-path", {"timezone": "/etc/localtime"}, "/timezone"),
        case("tz-nul", {"timezone": "UTC\0"}, "/timezone"),
        case("tz-100kb", {"timezone": "x" * 100_000}, "/timezone"),
        case("tz-folder", {"timezone": "America"}, "/timezone"),
        # Names the tz database ships that are no place: the machine's own zone, the rules
        # for POSIX TZ strings, a zone not yet set; and the `posix/` and `right/` copies.
        case("tz-localtime", {"timezone": "localtime"}, "/timezone"),
        case("tz-posixrules", {"timezone": "posixrules"}, "/timezone"),
        case("tz-factory", {"timezone": "Factory"}, "/timezone"),
        case("tz-posix-copy", {"timezone": "posix/Asia/Taipei"}, "/timezone"),
        case("tz-leap-seconds", {"timezone": "right/UTC"}, "/timezone"),
        case("scope-id-op", {"scopeId": {"$ne": ""}}, "/scopeId"),
        case("scope-id-nul", {"scopeId": "u1\0"}, "/scopeId"),
        case("scope-id-tab", {"scopeId": "u1\t"}, "/scopeId"),
        case("update-operator", {"$set": {"enabled": False}}, "/$set"),
        case("catch-up-huge", {"catchUpLimit": 10**30}, "/catchUpLimit"),
        # JSON types the document does not allow.
        case("enabled-0", {"enabled": 0}, "/enabled"),
        case("enabled-text", {"enabled": "false"}, "/enabled"),
        case("catch-up-true", {"catchUpLimit": True}, "/catchUpLimit"),
        case("catch-up-text", {"catchUpLimit": "3"}, "/catchUpLimit"),
        case("payload-key-nul", {"payloadTemplate": {"a\0": 1}}, "/payloadTemplate"),
        case("payload-huge-int", {"payloadTemplate": {"n": 10**30}}, "/payloadTemplate"),
    ],
)
async def test_hostile_schedules_are_refused(
    api: httpx.AsyncClient, backends: Backends, change: dict[str, Any], pointer: str
) -> None:
    """At create, and as a change to a schedule that exists (which stays as it was)."""
    schedule = (await api.post("/v1/schedules", json=SCHEDULE)).json()
    before = await written(backends)
    headers = {"content-type": JSON}
    body = as_json({**SCHEDULE, **change})
    refused(await api.post("/v1/schedules", content=body, headers=headers), pointer)
    url = f"/v1/schedules/{schedule['id']}"
    refused(await api.patch(url, content=as_json(change), headers=headers), pointer)
    assert await written(backends) == before
    assert (await api.get(url)).json() == schedule


async def test_a_schedule_stored_before_scope_ids_were_checked_still_loads(
    api: httpx.AsyncClient, backends: Backends
) -> None:
    """A scope id with a space was taken before: such a schedule still lists and fires, and a
    change to it must fix it."""
    schedule = (await api.post("/v1/schedules", json=SCHEDULE)).json()
    stored = {"_id": ObjectId(schedule["id"])}
    await raw(backends.store).schedules.update_one(stored, {"$set": {"scopeId": "u 1"}})
    assert [s["scopeId"] for s in (await api.get("/v1/schedules")).json()["items"]] == ["u 1"]
    url = f"/v1/schedules/{schedule['id']}"
    assert (await api.post(f"{url}/trigger")).json()["scopeId"] == "u 1"
    refused(await api.patch(url, json={"enabled": False}), "/scopeId")
    assert (await api.patch(url, json={"scopeId": "u1"})).status_code == 200


HUGE = str(10**30)
PREVIEW = "/v1/schedules/{schedule}/preview"


@pytest.mark.parametrize(
    ("url", "pointer"),
    [
        case("runs-limit-negative", "/v1/runs?limit=-1", "/limit"),
        case("runs-limit-0", "/v1/runs?limit=0", "/limit"),
        case("runs-limit-huge", "/v1/runs?limit=" + HUGE, "/limit"),
        case("runs-limit-float", "/v1/runs?limit=1e3", "/limit"),
        case("events-limit-negative", "/v1/events?limit=-1", "/limit"),
        case("events-limit-huge", "/v1/events?limit=" + HUGE, "/limit"),
        case("schedules-limit-huge", "/v1/schedules?limit=" + HUGE, "/limit"),
        case("status-op", '/v1/runs?status={"$ne":"x"}', "/status"),
        case("scope-op", '/v1/runs?scope={"$ne":""}', "/scope"),
        case("runs-cursor-op", '/v1/runs?cursor={"$gt":""}', "/cursor"),
        case("events-cursor-op", '/v1/events?cursor={"$gt":""}', "/cursor"),
        case("cursor-long", "/v1/runs?cursor=" + "A" * 300, "/cursor"),
        # Not base64: the decoder takes ASCII only.
        case("runs-cursor-non-ascii", "/v1/runs?cursor=%C3%A9", "/cursor"),
        case("events-cursor-non-ascii", "/v1/events?cursor=%C3%A9", "/cursor"),
        case("schedules-cursor-non-ascii", "/v1/schedules?cursor=%C3%A9", "/cursor"),
        case("preview-count-negative", PREVIEW + "?count=-1", "/count"),
        case("preview-count-huge", PREVIEW + "?count=" + HUGE, "/count"),
        case("version-huge", "/v1/templates/t_noop/versions/" + HUGE, "/version"),
        # `+` is a space in a query string: %2B.
        case("from-year-0", "/v1/events?from=0001-01-01T00:00:00%2B01:00", "/from"),
        case("to-year-10000", "/v1/events?to=9999-12-31T23:59:59-01:00", "/to"),
        case("to-digits", "/v1/events?to=3081", "/to"),
        case("preview-year-0", PREVIEW + "?after=0001-01-01T00:00:00%2B01:00", "/after"),
        case("preview-no-offset", PREVIEW + "?after=2030-01-01T00:00:00", "/after"),
    ],
)
async def test_hostile_query_values_are_refused(
    api: httpx.AsyncClient, url: str, pointer: str
) -> None:
    schedule = (await api.post("/v1/schedules", json=SCHEDULE)).json()
    refused(await api.get(url.replace("{schedule}", schedule["id"])), pointer)


@pytest.mark.parametrize(
    ("timezone", "after", "times"),
    [
        ("UTC", "9999-12-31T23:58:00Z", ["9999-12-31T23:59:00Z"]),
        ("UTC", "9999-12-31T23:59:00Z", []),
        # 23:59 on the last day there is 15:59 in UTC; there is no next minute.
        ("Asia/Taipei", "9999-12-31T15:58:00Z", ["9999-12-31T15:59:00Z"]),
        ("Asia/Taipei", "9999-12-31T16:00:00Z", []),
        # 18:59 there is 23:59 in UTC; 19:00 there would be year 10000 in UTC.
        ("America/New_York", "9999-12-31T23:58:00Z", ["9999-12-31T23:59:00Z"]),
        # Year 0 there, so fire times start with the second day of year 1 in UTC (New York
        # kept local mean time then, 4:56:02 behind).
        (
            "America/New_York",
            "0001-01-01T00:00:00Z",
            ["0001-01-02T00:00:02Z", "0001-01-02T00:01:02Z", "0001-01-02T00:02:02Z"],
        ),
    ],
)
async def test_a_preview_ends_with_the_calendar(
    api: httpx.AsyncClient, timezone: str, after: str, times: list[str]
) -> None:
    """Fire times stop at the end of year 9999, in UTC and in the schedule's zone: a preview
    near it lists fewer than `count`, or none."""
    schedule = (await api.post("/v1/schedules", json={**SCHEDULE, "timezone": timezone})).json()
    url = f"/v1/schedules/{schedule['id']}/preview"
    response = await api.get(url, params={"after": after, "count": 3})
    assert response.status_code == 200, response.text
    assert [t["utc"] for t in response.json()["times"]] == times
