"""Schemathesis against the OpenAPI document the API serves: every operation, with an admin key
and with a user key, and afterwards a look at MongoDB and Redis for anything half-written.

Every answer must hold to docs/contract.md and to the document, under every check Schemathesis
has: no 5xx, every 4xx in the contract's error shape, status, content type, headers and body as
the document states them, a request the document calls invalid refused and one it calls valid
accepted (but for rules no JSON Schema can state, `BEYOND_THE_DOCUMENT`), a method a path does
not have refused with 405 and `Allow`. Cases come from Schemathesis's coverage phase (each
field at its bounds and just past them, each method a path lacks) and from Hypothesis.

The server runs on the test's event loop (with the backends opened there); Hypothesis drives
blocking `requests` calls from a worker thread, which leaves the loop free to answer them.
Generation is derandomized, so a run is repeatable.
"""

import asyncio
import re
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import Case, CheckContext, GenerationMode, Response
from schemathesis.core.failures import Failure
from schemathesis.errors import FailureGroup
from schemathesis.specs.openapi import checks

from jobplane.backends import Backends
from jobplane.model import LEASED, ApiKey, Event, Run, RunStatus, Schedule, Template
from jobplane.model.webhooks import SignedWebhook
from jobplane.queue.entry import QueueEntry
from jobplane.schedules.cron import Cron
from jobplane.settings import Settings
from tests.integration.conftest import Client
from tests.integration.db import raw

pytestmark = pytest.mark.timeout(300)

# Cases per operation and kind of run (valid with each key, invalid with the admin key's):
# about 80 runs of 30 cases, and some 2,000 coverage cases; some 70 s on a quiet machine (2 CPUs).
EXAMPLES = 30
# Chains the stateful phase may try per operation (it tries some 100 in all, ~10 s).
SCENARIOS = 200
# Rules no JSON Schema can state, by operation, with the pointers of the fields they are about:
# a request the document allows may still break one, and be refused with 422 naming them.
# A template's steps form a graph and hold CEL expressions (and as YAML it is any text); a cron
# expression has a grammar of its own and must fire; a scheduled template must exist and be
# schedulable; a payload must fit its template's `payloadSchema`; a payload or a step's output
# must be storable (integers within int64, nesting within 64 levels); a URL must parse; a
# schedule's scope cannot change.
BEYOND_THE_DOCUMENT = {
    "POST /v1/templates": ("",),
    "POST /v1/schedules": ("/cron", "/timezone", "/templateType", "/payloadTemplate"),
    "PATCH /v1/schedules/{schedule_id}": (
        "/cron",
        "/timezone",
        "/templateType",
        "/payloadTemplate",
        "/scope",
    ),
    "POST /v1/runs": ("/payload",),
    "POST /v1/runs/{run_id}/steps/{step_id}/complete": ("/output",),
    "POST /v1/webhooks": ("/url",),
    "PATCH /v1/webhooks/{webhook_id}": ("/url",),
}
# Values that reach the seeded objects, for path parameters and body fields of these names;
# generated ids almost never name anything.
Seeds = dict[str, list[Any]]


def error_shape(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """docs/contract.md: every error is `{"error": {"code", "message", "details"}}`."""
    if not 400 <= response.status_code < 500:
        return None
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"code", "message", "details"}, error
    assert isinstance(error["code"], str) and isinstance(error["message"], str), error
    assert isinstance(error["details"], dict), error
    return True


async def test_every_operation_holds_to_the_document(
    url: str, settings: Settings, backends: Backends
) -> None:
    assert settings.admin_key is not None
    headers = {"authorization": f"Bearer {settings.admin_key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers) as admin:
        user_key, seeds = await seed(admin)
    keys = {"admin": settings.admin_key, "user": user_key}
    failures = await asyncio.to_thread(fuzz, url, keys, seeds)
    assert not failures, "\n\n".join(failures)
    await backends.store.trail.flush()
    assert await half_written(backends) == []


async def test_chains_of_operations_hold_to_the_document(
    url: str, settings: Settings, backends: Backends, tmp_path: Path
) -> None:
    """Schemathesis's stateful phase: operations chained by the links it infers from the
    document (a created run's id to its read, its cancel, its rerun; a schedule's to its change
    and its delete), so that the checks that need a chain run too: what was made can be read
    (`ensure_resource_availability`), what was deleted is gone (`use_after_free`), another's
    object is not served (`object_level_authorization`). Schemathesis's own runner drives it,
    in a process of its own: a chain replayed against a server whose state moved on makes
    other calls, which Hypothesis's state machines, run here, take for a flaky test.
    `positive_data_acceptance` is left to the test above, which knows the rules beyond the
    document."""
    assert settings.admin_key is not None
    headers = {"authorization": f"Bearer {settings.admin_key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers) as admin:
        await seed(admin)
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "schemathesis"),
        "run",
        f"{url}/openapi.json",
        "--phases=stateful",
        "--checks=all",
        "--exclude-checks=positive_data_acceptance",
        f"--header=Authorization: Bearer {settings.admin_key}",
        "--exclude-path-regex=/stream$",
        f"--max-examples={SCENARIOS}",
        "--seed=1",
        "--workers=1",
        "--no-color",
        cwd=tmp_path,  # where it keeps its cache (`.schemathesis/`)
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(240):
        said, _ = await proc.communicate()
    report = said.decode()
    assert proc.returncode == 0, report
    # It ran chains, not nothing: some links of the document were followed.
    covered = re.search(r"API Links:\s+(\d+) covered", report)
    assert covered is not None and int(covered[1]) > 0, report
    await backends.store.trail.flush()
    assert await half_written(backends) == []


async def test_every_reference_in_the_document_resolves(client_for: Client) -> None:
    """A `$ref` to nothing hides its part of the document from clients and from the run
    above (Schemathesis drops a body it cannot resolve)."""
    document = (await client_for("").get("/openapi.json")).json()
    refs = set(references(document))
    assert "#/components/schemas/Run" in refs
    for ref in refs:
        assert ref.startswith("#/"), ref
        node = document
        for token in ref.removeprefix("#/").split("/"):
            token = token.replace("~1", "/").replace("~0", "~")
            assert isinstance(node, dict) and token in node, f"{ref} names nothing"
            node = node[token]


def references(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from references(value)
    elif isinstance(node, list):
        for value in node:
            yield from references(value)


async def seed(admin: httpx.AsyncClient) -> tuple[str, Seeds]:
    """Templates, runs and schedules, in the scope of a user key and outside it; returns the
    user key (scope `user:u1`) and the values that reach them."""
    noop = {"steps": [{"id": "only", "handler": "builtin.noop"}], "schedulable": True}
    far = {"steps": [{"id": "only", "handler": "x", "workerType": "external"}]}
    for template in [
        {"type": "t_seed", **noop},
        {"type": "t_seed", **noop, "description": "version 2"},
        {"type": "t_far", **far},
    ]:
        response = await admin.post("/v1/templates", json=template)
        assert response.status_code == 201, response.text
    runs = []
    for scope, scope_id in [("user", "u1"), ("user", "u1"), ("account", "acme")]:
        body = {"templateType": "t_seed", "scope": scope, "scopeId": scope_id}
        response = await admin.post("/v1/runs", json=body)
        assert response.status_code == 201, response.text
        runs.append(response.json()["id"])
    # A finished run, to rerun.
    assert (await admin.post(f"/v1/runs/{runs[1]}/cancel", json={})).status_code == 200
    schedules = []
    for scope_id in ["u1", "u2"]:
        body = {"templateType": "t_seed", "scope": "user", "scopeId": scope_id, "cron": "@daily"}
        response = await admin.post("/v1/schedules", json=body)
        assert response.status_code == 201, response.text
        schedules.append(response.json()["id"])
    hooks = []
    for scope_id in ["u1", "u2"]:
        body = {
            "url": "https://hooks.example.com/jobplane",
            "events": ["*"],
            "scope": "user",
            "scopeId": scope_id,
        }
        response = await admin.post("/v1/webhooks", json=body)
        assert response.status_code == 201, response.text
        hooks.append(response.json()["id"])
    keys = []
    for key in [
        {"name": "fuzz-user", "role": "user", "scopes": ["user:u1"]},
        {"name": "fuzz-spare", "role": "auditor"},  # for the revoke to find
    ]:
        response = await admin.post("/v1/api-keys", json=key)
        assert response.status_code == 201, response.text
        keys.append(response.json())
    seeds: Seeds = {
        "type_": ["t_seed", "t_far"],
        "version": [1, 2],
        "run_id": runs,
        "schedule_id": schedules,
        "step_id": ["only"],
        "worker_type": ["external", "inline"],
        "templateType": ["t_seed", "t_far"],
        "scope": ["user"],
        "scopeId": ["u1"],
        "cron": ["@daily", "0 9 * * 1-5"],
        "timezone": ["UTC", "Asia/Taipei"],
        "key_id": [keys[1]["id"]],
        "webhook_id": hooks,
        "url": ["https://hooks.example.com/jobplane"],
        "events": [["*"], ["run.succeeded", "run.failed"]],
    }
    return keys[0]["key"], seeds


def fuzz(url: str, keys: dict[str, str], seeds: Seeds) -> list[str]:
    """Valid requests to every operation with each key, invalid ones with the admin key (a
    user key's would mostly stop at its permissions); the failures, one per run."""
    runs = [
        ("admin", GenerationMode.POSITIVE),
        ("admin", GenerationMode.NEGATIVE),
        ("user", GenerationMode.POSITIVE),
    ]
    failures = []
    # The operations that refused a request without the key and with a wrong one.
    enforced: set[str] = set()
    with requests.Session() as session:
        for operation in operations(url):
            for who, mode in runs:
                if mode == GenerationMode.NEGATIVE and not negatable(operation):
                    continue
                try:
                    exercise(operation, mode, session, url, keys[who], seeds, enforced)
                except (Exception, FailureGroup) as exc:
                    failures.append(f"{operation.label} as {who} ({mode.value}): {exc}")
            failures.extend(cover(operation, session, url, keys["admin"], enforced))
    return failures


def operations(url: str) -> list[Any]:
    """Every operation of the served document; those that delete or disable a seeded object
    last, so the others find the seeds as they were."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    found = [result.ok() for result in schema.get_all_operations()]
    # A live stream answers as long as its client reads: a case would wait for its end for
    # ever. Their refusals are checked in test_streams.py.
    found = [op for op in found if not op.path.endswith("/stream")]
    return sorted(found, key=lambda op: op.method == "delete" or op.path.endswith("/disable"))


def negatable(operation: Any) -> bool:
    """Whether the document rules out any request: it has a body, or a parameter that takes
    less than any string (Hypothesis would spend seconds looking for an invalid one)."""
    raw = operation.definition.raw
    return "requestBody" in raw or any(
        set(p["schema"]) - {"title"} != {"type"} or p["schema"]["type"] != "string"
        for p in raw.get("parameters", [])
    )


def exercise(
    operation: Any,
    mode: GenerationMode,
    session: requests.Session,
    url: str,
    key: str,
    seeds: Seeds,
    enforced: set[str],
) -> None:
    """EXAMPLES cases of one operation sent with `key`; raises at the first failed check."""
    headers = {"Authorization": f"Bearer {key}"}
    # Schemathesis picks one media type for a body; a template is sent as JSON and as YAML.
    media_types = list(operation.definition.raw.get("requestBody", {}).get("content", {}))
    # The key is given, not generated: an invalid case is invalid in what it asks, not in
    # whether it may ask (`ignored_auth` tries it without the key).
    strategy = partial(operation.as_strategy, generation_mode=mode, headers=headers)
    cases = [strategy(media_type=m) for m in media_types]

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        # The report shows the failing case; shrinking it would take many more requests.
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=st.one_of(cases or [strategy()]), data=st.data())
    def run(case: Case, data: st.DataObject) -> None:
        if mode == GenerationMode.POSITIVE:  # aimed, an invalid case could turn valid
            aim(case, seeds, data.draw)
        response = case.call(base_url=url, session=session, headers=headers)
        check(case, response, headers, enforced)

    run()


def cover(
    operation: Any, session: requests.Session, url: str, key: str, enforced: set[str]
) -> list[str]:
    """Schemathesis's coverage cases of one operation (each field at its bounds and just
    beyond them, and the methods the path does not take), sent with `key`; the first failure."""
    headers = {"Authorization": f"Bearer {key}"}
    schema = operation.schema
    generation = schema.config.generation_for(operation=operation, phase="coverage")
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    for case in schema.iter_coverage_cases(
        operation, generation_modes=modes, generation_config=generation
    ):
        positive = case.meta is not None and case.meta.generation.mode.is_positive
        if positive and isinstance(case.body, dict) and case.operation.path.endswith("/claim"):
            case.body["waitSeconds"] = 0  # see `aim`
        try:
            response = case.call(base_url=url, session=session, headers=headers)
            check(case, response, headers, enforced)
        except (Exception, FailureGroup) as exc:
            return [f"{operation.label} (coverage): {exc}"]
    return []


def check(
    case: Case,
    response: requests.Response | Response,
    headers: dict[str, str],
    enforced: set[str],
    recorder: Any = None,
) -> None:
    """Every check Schemathesis has (no `checks` given), `positive_data_acceptance` as
    `valid_data_acceptance` has it and `ignored_auth` once per operation, and the error
    shape."""

    def ignored_auth(ctx: CheckContext, response: Response, case: Case) -> bool | None:
        # As Schemathesis's own runner: once an operation refused a request without the key
        # and with a wrong one, it is not asked again (`enforced`).
        ctx.auth_enforced_operations = enforced
        return checks.ignored_auth(ctx, response, case)

    case.validate_response(
        response,
        excluded_checks=[checks.positive_data_acceptance, checks.ignored_auth],
        additional_checks=[valid_data_acceptance, ignored_auth, error_shape],
        headers=headers,
        # A chain's record, which its checks look back on (what was made, what was deleted).
        recorder=recorder,
    )


def valid_data_acceptance(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """Schemathesis's `positive_data_acceptance`, but for a 422 that names only fields with
    rules beyond the document (`BEYOND_THE_DOCUMENT`)."""
    try:
        return checks.positive_data_acceptance(ctx, response, case)
    except Failure:
        beyond = BEYOND_THE_DOCUMENT.get(case.operation.label)
        if beyond is None or response.status_code != 422:
            raise
        problems = response.json()["error"]["details"].get("errors", [])
        if not problems or not all(p["pointer"].startswith(beyond) for p in problems):
            raise
        return None


def aim(case: Case, seeds: Seeds, draw: Callable[[st.SearchStrategy[Any]], Any]) -> None:
    """Point some of a case's path parameters and body fields at the seeded objects."""
    for name in list(case.path_parameters or {}):
        if name in seeds and draw(st.booleans()):
            case.path_parameters[name] = draw(st.sampled_from(seeds[name]))
    if not isinstance(case.body, dict):
        return
    if draw(st.booleans()):
        for name in case.body.keys() & seeds.keys():
            case.body[name] = draw(st.sampled_from(seeds[name]))
    if case.operation.path.endswith("/claim"):
        # A claim waits up to `waitSeconds` (20 by default) for a step to come.
        case.body["waitSeconds"] = 0


async def half_written(backends: Backends) -> list[str]:
    """What a reader of MongoDB could not use: a document its model cannot read, a run without
    its `created` event, its template version or its place in Redis, a schedule that cannot
    fire, an API key whose events do not tell its life."""
    store = backends.store
    problems = []
    templates = {}
    async for doc in raw(store).templates.find():
        template = Template.model_validate(doc)
        templates[template.type, template.version] = template
    for type_ in {t for t, _ in templates}:
        versions = sorted(v for t, v in templates if t == type_)
        if versions != list(range(1, len(versions) + 1)):
            problems.append(f"template {type_}: versions {versions}")
    queued = []
    async for doc in raw(store).runs.find():
        run = Run.model_validate({**doc, "id": str(doc["_id"])})
        trail = [Event.model_validate({**e, "id": str(e["_id"])}) for e in doc["trail"]]
        created = await raw(store).events.count_documents({"jobId": run.id, "type": "created"})
        if not trail or trail[0].type != "created" or created != 1:
            problems.append(f"run {run.id}: no `created` event (trail {trail}, copied {created})")
        template = templates.get((run.template_type, run.template_version))
        if template is None:
            problems.append(f"run {run.id}: no template {run.template_type} {run.template_version}")
        elif [s.id for s in run.progress.steps] != [s.id for s in template.steps]:
            problems.append(f"run {run.id}: steps {run.progress.steps}")
        if (run.status in LEASED) != (run.lease_token is not None):
            problems.append(f"run {run.id}: {run.status} with lease {run.lease_token}")
        if run.status == RunStatus.QUEUED:
            queued.append(QueueEntry.of(run))
    for entry in await backends.queue.missing(queued):
        problems.append(f"run {entry.run_id}: queued in MongoDB, not in Redis")
    async for doc in raw(store).schedules.find():
        schedule = Schedule.model_validate({**doc, "id": str(doc["_id"])})
        if not any(t == schedule.template_type for t, _ in templates):
            problems.append(f"schedule {schedule.id}: no template {schedule.template_type}")
        Cron.parse(schedule.cron, schedule.timezone)  # raises if it could never fire
        if schedule.enabled and schedule.next_run_at is None:
            problems.append(f"schedule {schedule.id}: enabled, with no nextRunAt")
    async for doc in raw(store).api_keys.find():
        key = ApiKey.model_validate({**doc, "id": str(doc["_id"])})
        kinds = await raw(store).events.distinct("type", {"jobId": key.id})
        expected = ["api_key_created"] + (["api_key_revoked"] if key.revoked_at else [])
        if sorted(kinds) != expected:
            problems.append(f"API key {key.id}: events {kinds}")
    async for doc in raw(store).webhooks.find():
        hook = SignedWebhook.model_validate({**doc, "id": str(doc["_id"])})
        kinds = await raw(store).events.distinct("type", {"jobId": hook.id})
        if "webhook_created" not in kinds or not hook.secrets:
            problems.append(f"webhook {hook.id}: events {kinds}, {len(hook.secrets)} secrets")
    async for doc in raw(store).events.find():
        Event.model_validate({**doc, "id": str(doc["_id"])})
    return problems
