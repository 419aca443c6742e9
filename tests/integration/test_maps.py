"""Map steps: fan-out to child runs and fan-in, run by real worker processes. Children are
ordinary runs in their parent's scope; the parent waits for them holding no lease, and goes on
when they end."""

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest
from bson import ObjectId
from pymongo.errors import OperationFailure

from jobplane.backends import Backends
from jobplane.model import LEASED, Run, RunStatus
from jobplane.runs import RunRequest, RunService
from jobplane.settings import Settings
from jobplane.templates.loader import load_file
from tests.integration.conftest import Client, Register
from tests.integration.db import raw
from tests.integration.flow import sampled, until, workers
from tests.integration.processes import spawn
from tests.integration.workers import settled

ADMIN = "test-admin-key"


def fan(**map_: Any) -> dict[str, Any]:
    return {"id": "fan", "workerType": "map", "map": {"template": "child", **map_}}


async def start(backends: Backends, payload: dict[str, Any]) -> Run:
    service = RunService(backends.store, backends.queue)
    run, _ = await service.create(RunRequest("parent", "account", "acme", payload), "user:t")
    return run


async def children_of(backends: Backends, run_id: str) -> list[dict[str, Any]]:
    cursor = raw(backends.store).runs.find({"parentRunId": run_id}, {"trail": 0})
    return sorted(await cursor.to_list(), key=lambda d: d["mapIndex"])


async def test_a_map_step_fans_out_to_children_and_fans_in_their_results_in_order(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path, client_for: Client
) -> None:
    await register("child", steps=[{"id": "work", "handler": "builtin.echo"}])
    await register(
        "parent",
        steps=[
            {"id": "plan", "handler": "builtin.noop"},
            fan(items="payload.accounts", payload="{'account': item, 'at': index}"),
            {"id": "sum", "handler": "builtin.echo", "needs": ["fan"]},
        ],
    )
    run = await start(backends, {"accounts": ["a", "b", "c"]})
    async with workers(settings, tmp_path, count=1, scheduler=False):
        [done] = await settled(backends.store, [run.id], within=60)
    assert done.status == RunStatus.SUCCEEDED, done.error
    expected = [{"account": a, "at": i} for i, a in enumerate("abc")]
    assert done.outputs["fan"] == expected
    kids = await children_of(backends, run.id)
    assert [k["payload"] for k in kids] == expected
    assert {(k["scope"], k["scopeId"], k["parentStepId"], k["rootRunId"]) for k in kids} == {
        ("account", "acme", "fan", run.id)
    }
    assert all(k["status"] == "succeeded" for k in kids)
    # The parent waited without a lease, and went on with the same attempt.
    await backends.store.trail.flush()
    doc = await raw(backends.store).runs.find_one({"_id": ObjectId(run.id)})
    assert doc is not None
    moves = [e["metadata"]["transition"] for e in doc["trail"] if e["type"] == "status_changed"]
    assert "wait_children" in moves and "children_done" in moves
    assert done.attempt == 1 and done.attempts == []
    # The API: the map step's counts, the children's links, the list of a run's children.
    api = client_for(ADMIN)
    body = (await api.get(f"/v1/runs/{run.id}")).json()
    [step] = [s for s in body["progress"]["steps"] if s["id"] == "fan"]
    assert step["map"] == {"total": 3, "succeeded": 3, "failed": 0, "active": 0}
    assert body["progress"]["percentage"] == 100
    listed = (await api.get("/v1/runs", params={"parentRunId": run.id})).json()["items"]
    assert sorted(r["id"] for r in listed) == sorted(str(k["_id"]) for k in kids)
    assert {(r["parentRunId"], r["rootRunId"]) for r in listed} == {(run.id, run.id)}


async def test_a_map_of_no_items_succeeds_with_an_empty_list(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register("child", steps=[{"id": "work", "handler": "builtin.echo"}])
    await register("parent", steps=[fan(items="payload.accounts")])
    run = await start(backends, {"accounts": []})
    async with workers(settings, tmp_path, count=1, scheduler=False):
        [done] = await settled(backends.store, [run.id], within=30)
    assert done.status == RunStatus.SUCCEEDED
    assert done.result == [] and await children_of(backends, run.id) == []


async def test_a_map_caps_its_active_children_and_keeps_item_order(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register("child", steps=[{"id": "work", "handler": "builtin.echo"}])
    await register(
        "parent",
        steps=[fan(items="payload.items", payload="{'n': item}", maxConcurrency=20)],
    )
    run = await start(backends, {"items": list(range(1000))})
    active = {"parentRunId": run.id, "status": {"$in": sorted(LEASED)}}
    async with (
        workers(settings, tmp_path, count=2, JOBPLANE_WORKER_CONCURRENCY="32"),
        sampled(backends.store, {"active": active}, every=0.01) as peaks,
    ):
        [done] = await settled(backends.store, [run.id], within=240)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert done.result == [{"n": n} for n in range(1000)]
    assert 1 < peaks["active"] <= 20, peaks
    kids = await children_of(backends, run.id)
    assert len(kids) == 1000 and all(k["status"] == "succeeded" for k in kids)
    assert not any("mapPlace" in k or "mapWait" in k for k in kids), "places let go"


async def test_a_child_failing_fails_the_step_and_cancels_its_siblings(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register(
        "child",
        steps=[
            {"id": "check", "handler": "builtin.fail"},
            {"id": "work", "handler": "builtin.sleep"},
        ],
    )
    await register(
        "parent",
        steps=[
            fan(items="payload.items", payload="{'fatal': item == 3, 'sleepSeconds': 30}"),
            {"id": "sum", "handler": "builtin.echo"},
        ],
    )
    run = await start(backends, {"items": list(range(8))})
    async with workers(settings, tmp_path, count=1, JOBPLANE_WORKER_CONCURRENCY="16"):
        [done] = await settled(backends.store, [run.id], within=60)
        kids = await settled(
            backends.store, [str(k["_id"]) for k in await children_of(backends, run.id)], within=60
        )
    assert done.status == RunStatus.FAILED
    assert done.error is not None and (done.error.code, done.error.step) == ("ChildFailed", "fan")
    assert "(item 3) ended failed" in done.error.message
    assert done.attempt == 1, "a map step is not retried as a whole"
    statuses = {k.map_index: k.status for k in kids}
    assert statuses.pop(3) == RunStatus.FAILED
    assert set(statuses.values()) == {RunStatus.CANCELLED}
    assert {s.id: s.status for s in done.progress.steps} == {"fan": "failed", "sum": "pending"}
    # Each cancelled child says why: its sibling failed.
    await backends.store.trail.flush()
    sibling = next(k for k in kids if k.map_index == 0)
    assert sibling.cancel_reason and sibling.cancel_reason.startswith("a sibling failed")


async def test_on_item_failure_continue_lists_each_item_and_succeeds(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register("child", steps=[{"id": "check", "handler": "builtin.fail"}])
    await register(
        "parent",
        steps=[fan(items="[0, 1, 2]", payload="{'fatal': item == 1}", onItemFailure="continue")],
    )
    run = await start(backends, {})
    async with workers(settings, tmp_path, count=1, scheduler=False):
        [done] = await settled(backends.store, [run.id], within=60)
    assert done.status == RunStatus.SUCCEEDED
    first, failed, last = done.result
    assert first == last == {"status": "succeeded", "result": None}
    assert failed["status"] == "failed" and failed["error"]["code"] == "fatal"


async def test_cancelling_a_parent_cancels_every_active_child(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path, client_for: Client
) -> None:
    await register("child", steps=[{"id": "work", "handler": "builtin.sleep"}])
    await register(
        "parent",
        steps=[fan(items="payload.items", payload="{'sleepSeconds': 60}", maxConcurrency=4)],
    )
    run = await start(backends, {"items": list(range(10))})
    api = client_for(ADMIN)
    async with workers(settings, tmp_path, count=1, JOBPLANE_WORKER_CONCURRENCY="8"):

        async def waiting() -> bool:
            body = (await api.get(f"/v1/runs/{run.id}")).json()
            return (
                body["status"] == "waiting_children"
                and body["progress"]["steps"][0]["map"]["active"] == 4
            )

        await until(waiting, within=30)
        body = (await api.get(f"/v1/runs/{run.id}")).json()
        assert body["waitingFor"] == {"reason": "children", "detail": "0/10"}
        assert body["lockedBy"] is None, "the parent holds no lease while it waits"
        cancelled = await api.post(f"/v1/runs/{run.id}/cancel", json={"reason": "enough"})
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["status"] == "cancelled"
        ids = [str(k["_id"]) for k in await children_of(backends, run.id)]
        kids = await settled(backends.store, ids, within=30)
    assert {k.status for k in kids} == {RunStatus.CANCELLED}
    await backends.store.trail.flush()
    for kid in kids:
        doc = await raw(backends.store).runs.find_one({"_id": ObjectId(kid.id)})
        assert doc is not None
        [ended] = [e for e in doc["trail"] if e.get("to") in ("cancelled", "cancel_requested")][:1]
        assert ended["metadata"]["parentRunId"] == run.id
        assert ended["actor"] == "user:admin", "the actor who cancelled the parent"
    [parent] = await settled(backends.store, [run.id])
    assert parent.cancel_requested_by == "user:admin"
    assert parent.progress.steps[0].status == "cancelled"


async def test_a_worker_killed_while_making_children_leaves_each_child_made_once(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    """Once the first worker claimed the parent, MongoDB holds its every insert and update
    (`failCommand`, by the worker's app name): it stalls while making the children (they have
    dedupe keys of their own, so it makes them one by one) or before it records them, and is
    SIGKILLed there. The reaper queues the parent again, and the next worker makes what is
    missing: 1,000 children in all, each once."""
    admin = raw(backends.store).runs.database.client.admin
    hold = {
        "configureFailPoint": "failCommand",
        "mode": "alwaysOn",
        "data": {
            "failCommands": ["insert", "update"],
            "appName": "maker",
            "blockConnection": True,
            "blockTimeMS": 20_000,
        },
    }
    off = {"configureFailPoint": "failCommand", "mode": "off"}
    try:
        await admin.command(off)
    except OperationFailure as exc:
        pytest.skip(f"this MongoDB has no test commands: {exc}")
    # The first worker may start some children too: they are reaped and run again.
    again = {"maxAttempts": 2, "backoffSeconds": [0]}
    await register(
        "child",
        steps=[{"id": "work", "handler": "builtin.noop"}],
        concurrencyPolicy="queue_same_scope",
        dedupeKeys=["payload.n"],
        retryPolicy=again,
    )
    await register(
        "parent", steps=[fan(items="payload.items", payload="{'n': item}")], retryPolicy=again
    )
    run = await start(backends, {"items": list(range(1000))})
    url = settings.mongodb_url + ("&" if "?" in settings.mongodb_url else "?") + "appName=maker"

    async def claimed() -> bool:
        now = await backends.store.runs.get(run.id)
        return now is not None and now.status == RunStatus.RUNNING

    try:
        async with workers(settings, tmp_path, count=0):  # the scheduler, which reaps
            first = spawn(
                settings,
                "worker",
                tmp_path / "first.log",
                JOBPLANE_WORKER_ID="first",
                JOBPLANE_MONGODB_URL=url,
            )
            try:
                await until(claimed, within=30)
                await admin.command(hold)
                await asyncio.sleep(0.5)  # whatever it still had on its way lands, then it stalls
                first.send_signal(signal.SIGKILL)
            finally:
                first.wait()
            await admin.command(off)
            killed = await backends.store.runs.get(run.id)
            assert killed is not None and killed.progress.steps[0].map is None, "not recorded"
            async with workers(settings, tmp_path, count=1, scheduler=False):
                [done] = await settled(backends.store, [run.id], within=120)
    finally:
        await admin.command(off)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert [a.error.code for a in done.attempts] == ["lease_expired"]
    kids = await children_of(backends, run.id)
    assert sorted(k["mapIndex"] for k in kids) == list(range(1000)), "each item's child once"
    assert done.result == [None] * 1000


async def test_a_run_list_filters_by_parent(
    backends: Backends, register: Register, client_for: Client
) -> None:
    await register("parent", steps=[{"id": "a", "handler": "builtin.noop"}])
    api = client_for(ADMIN)
    response = await api.get("/v1/runs", params={"parentRunId": "nope"})
    assert response.status_code == 200 and response.json()["items"] == []


async def test_the_shipped_map_template_reports_on_each_account_then_sums_up(
    backends: Backends, settings: Settings, tmp_path: Path
) -> None:
    shipped = Path(__file__).parents[2] / "templates"
    for name in ("account_report.yaml", "monthly_reports.yaml"):
        await backends.store.templates.register(load_file(shipped / name))
    service = RunService(backends.store, backends.queue)
    payload = {"accounts": ["acme", "globex", "initech"], "sleepSeconds": 0}
    run, _ = await service.create(RunRequest("monthly_reports", "account", "acme", payload), "t")
    async with workers(settings, tmp_path, count=1, scheduler=False):
        [done] = await settled(backends.store, [run.id], within=60)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert done.outputs["reports"] == [
        {"status": "succeeded", "result": {"account": a, "sleepSeconds": 0}}
        for a in payload["accounts"]
    ]


async def test_a_parent_cancelled_while_a_step_runs_beside_its_map_cancels_the_children(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    """The map waits while a sleeping step beside it holds the run: the cancel is asked of
    the worker, and the children are cancelled at once."""
    await register("child", steps=[{"id": "work", "handler": "builtin.sleep"}])
    await register(
        "parent",
        steps=[
            {**fan(items="[1, 2, 3]", payload="{'sleepSeconds': 60}"), "needs": []},
            {"id": "beside", "handler": "builtin.sleep", "needs": []},
        ],
    )
    run = await start(backends, {"sleepSeconds": 60})
    service = RunService(backends.store, backends.queue)

    async def both() -> bool:
        now = await backends.store.runs.get(run.id)
        assert now is not None
        return [s.status for s in now.progress.steps] == ["waiting", "running"]

    async with workers(settings, tmp_path, count=1, scheduler=False):
        await until(both, within=30)
        asked = await service.cancel(run.id, "user:t", "enough")
        # Asked of its worker, which may have stopped it by the time the answer is read.
        assert asked.status in (RunStatus.CANCEL_REQUESTED, RunStatus.CANCELLED)
        [done] = await settled(backends.store, [run.id], within=30)
        ids = [str(k["_id"]) for k in await children_of(backends, run.id)]
        kids = await settled(backends.store, ids, within=30)
    assert done.status == RunStatus.CANCELLED
    assert {s.id: s.status for s in done.progress.steps} == {
        "fan": "cancelled",
        "beside": "cancelled",
    }
    assert len(kids) == 3 and {k.status for k in kids} == {RunStatus.CANCELLED}
    # By the cancel's follow-up, or by the worker's acknowledgement if it came first.
    reasons = {f"parent run {run.id} was asked to cancel", f"parent run {run.id} was cancelled"}
    assert {k.cancel_reason for k in kids} <= reasons


async def test_a_parent_past_its_deadline_while_waiting_expires_and_cancels_its_children(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    await register("child", steps=[{"id": "work", "handler": "builtin.sleep"}])
    await register(
        "parent",
        steps=[fan(items="[1, 2]", payload="{'sleepSeconds': 60}")],
        timeoutSeconds=2,
    )
    run = await start(backends, {})
    async with workers(settings, tmp_path, count=1):  # and the scheduler, whose reaper expires
        [done] = await settled(backends.store, [run.id], within=30)
        ids = [str(k["_id"]) for k in await children_of(backends, run.id)]
        kids = await settled(backends.store, ids, within=30)
    assert done.status == RunStatus.EXPIRED
    assert done.error is not None and done.error.code == "deadline_exceeded"
    assert done.progress.steps[0].status == "failed"
    assert {k.status for k in kids} == {RunStatus.CANCELLED}
