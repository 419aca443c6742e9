"""The whole API from `jobplane.Client` and `jobplane.SyncClient`: templates, runs listed and
waited for, schedules, the trail and keys, over HTTP and directly, with the same answers."""

import asyncio
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from starlette.types import Receive, Scope, Send

from jobplane import Client, Step, SyncClient, Template
from jobplane.api import create_app
from jobplane.backends import Backends
from jobplane.errors import Forbidden, NotFound, ValidationFailed
from jobplane.model import Run, RunStatus
from jobplane.settings import Settings
from tests.integration.conftest import Register, options, served
from tests.integration.flow import until
from tests.integration.workers import running

U1 = {"scope": "user", "scope_id": "u1"}
REPORT = Template(
    "t_report",
    payload={"type": "object", "required": ["account"]},
    steps=[Step("render", "builtin.echo"), Step("rest", "builtin.noop", timeout_seconds=5)],
    retry_policy={"max_attempts": 2},
)


async def test_templates_apply_once_from_code_a_dict_or_a_file(
    client: Client, tmp_path: Path
) -> None:
    first = await client.templates.apply(REPORT)
    assert (first.type, first.version, first.created) == ("t_report", 1, True)
    again = await client.templates.apply(REPORT)
    assert (again.version, again.created) == (1, False)
    assert (await client.templates.apply(REPORT.body())).created is False
    (tmp_path / "report.yaml").write_text(REPORT.yaml())
    assert (await client.templates.apply(tmp_path / "report.yaml")).created is False

    changed = REPORT.body() | {"priority": 5}
    second = await client.templates.apply(changed)
    assert (second.version, second.created, second.priority) == (2, True, 5)
    assert (await client.templates.get("t_report")).version == 2
    assert (await client.templates.get("t_report", 1)).priority == 0
    assert [t.type for t in await client.templates.list()] == ["t_report"]
    with pytest.raises(NotFound):
        await client.templates.get("t_nope")
    with pytest.raises(ValidationFailed) as refused:
        await client.templates.apply({"type": "t", "steps": [{"id": "s"}]})
    assert refused.value.details["errors"][0]["pointer"] == "/steps/0"


async def test_runs_list_every_page_newest_first_under_filters(
    client: Client, register: Register
) -> None:
    await register()
    made = await client.create_many(
        [{"template_type": "t_noop", "scope": "user", "scope_id": f"u{i % 2}"} for i in range(130)]
    )
    ids = [r.id for r in made if isinstance(r, Run)]
    listed = [run.id async for run in client.runs.list()]  # 3 pages of 50
    assert listed == ids[::-1]
    mine = [run.id async for run in client.runs.list(scope="user", scope_id="u1")]
    assert mine == ids[1::2][::-1]
    assert [r async for r in client.runs.list(status=RunStatus.SUCCEEDED)] == []


async def test_schedules_from_create_to_delete(client: Client, register: Register) -> None:
    await register(schedulable=True)
    schedule = await client.schedules.create(
        "t_noop", cron="0 9 * * *", scope="account", scope_id="acme", timezone="Asia/Shanghai"
    )
    assert (await client.schedules.get(schedule.id)).cron == "0 9 * * *"
    paused = await client.schedules.update(schedule.id, enabled=False, cron="30 9 * * *")
    assert (paused.enabled, paused.cron) == (False, "30 9 * * *")
    after = datetime(2030, 1, 1, tzinfo=UTC)
    preview = await client.schedules.preview(schedule.id, count=2, after=after)
    assert [t.local.hour for t in preview.times] == [9, 9]
    assert preview.times[0].utc == datetime(2030, 1, 1, 1, 30, tzinfo=UTC)
    fired = await client.schedules.trigger(schedule.id)
    assert fired.template_type == "t_noop" and fired.scope_id == "acme"
    assert [s.id async for s in client.schedules.list(scope="account")] == [schedule.id]
    assert [s async for s in client.schedules.list(enabled=True)] == []
    with pytest.raises(ValidationFailed):
        await client.schedules.create("t_noop", cron="61 * * * *", scope="user", scope_id="u")
    await client.schedules.delete(schedule.id)
    with pytest.raises(NotFound):
        await client.schedules.get(schedule.id)


async def test_the_trail_and_keys(client: Client, mode: str, register: Register) -> None:
    await register()
    started = datetime.now(UTC) - timedelta(seconds=1)
    run = await client.create("t_noop", scope="user", scope_id="u1")
    await client.cancel(run.id)

    async def both() -> bool:  # the trail has them within milliseconds (a direct client's too)
        return len([e async for e in client.events.list(job_id=run.id)]) == 2

    await until(both)
    trail = [e async for e in client.events.list(job_id=run.id, since=started)]
    assert [e.type for e in trail] == ["created", "status_changed"]
    assert trail[1].to == RunStatus.CANCELLED
    assert [e async for e in client.events.list(job_id=run.id, until=started)] == []

    made = await client.keys.create("shop", role="user", scopes=["user:u1"])
    assert made.key.startswith("jp_") and made.scopes == ["user:u1"]
    assert [k.id async for k in client.keys.list()] == [made.id]
    revoked = await client.keys.revoke(made.id)
    assert revoked.revoked_at is not None
    assert revoked.revoked_by == ("user:admin" if mode == "http" else "client:test")
    with pytest.raises(ValidationFailed):
        await client.keys.create("nobody", role="user")


async def test_a_user_key_lists_only_its_scopes_and_direct_mode_takes_no_key(
    url: str, settings: Settings, register: Register
) -> None:
    await register()
    async with Client(url, api_key=settings.admin_key) as admin:
        key = (await admin.keys.create("shop", role="user", scopes=["user:u1"])).key
        await admin.create("t_noop", scope="user", scope_id="u2")
    async with Client(url, api_key=key) as shop:
        mine = await shop.create("t_noop", scope="user", scope_id="u1")
        assert [r.id async for r in shop.runs.list()] == [mine.id]
        with pytest.raises(Forbidden):
            await shop.keys.create("more", role="admin")
    with pytest.raises(ValueError, match="HTTP API"):
        Client(mongodb_url=settings.mongodb_url, redis_url=settings.redis_url, api_key=key)


async def test_the_sync_client_has_the_same_names(
    mode: str, url: str, settings: Settings, register: Register
) -> None:
    await register(schedulable=True)

    def work() -> None:
        with SyncClient(**options(mode, url, settings)) as sync:
            assert sync.templates.apply(REPORT).created is True
            assert sync.templates.get("t_report").version == 1
            assert {t.type for t in sync.templates.list()} == {"t_noop", "t_report"}

            made = [sync.runs.create("t_noop", scope="user", scope_id="u1") for _ in range(59)]
            [more] = sync.runs.create_many([{"template_type": "t_noop", **U1}])
            assert isinstance(more, Run)
            made.append(more)
            every = sync.runs.list()
            assert [next(every).id for _ in range(3)] == [r.id for r in made[:-4:-1]]
            every.close()  # left after the first page: its generator is closed in the loop
            assert len(list(sync.runs.list(template_type="t_noop"))) == 60
            assert sync.runs.get(made[0].id).id == made[0].id
            with pytest.raises(TimeoutError):
                sync.runs.wait_many([made[1].id], timeout=0.1)
            assert sync.runs.cancel(made[0].id).status == RunStatus.CANCELLED
            assert sync.runs.wait(made[0].id, timeout=5).status == RunStatus.CANCELLED
            [ended] = sync.runs.wait_many([made[0].id], timeout=5)
            assert ended.status == RunStatus.CANCELLED

            cron = sync.schedules.create("t_noop", cron="@daily", scope="user", scope_id="u1")
            assert [s.id for s in sync.schedules.list()] == [cron.id]
            assert sync.schedules.get(cron.id).cron == "@daily"
            assert sync.schedules.update(cron.id, enabled=False).enabled is False
            assert len(sync.schedules.preview(cron.id, count=3).times) == 3
            assert sync.schedules.trigger(cron.id).schedule_id == cron.id
            sync.schedules.delete(cron.id)
            with pytest.raises(NotFound):
                sync.schedules.get(cron.id)

            assert next(e.type for e in sync.events.list(job_id=made[0].id)) == "created"
            key = sync.keys.create("k", role="auditor")
            assert key.id in [k.id for k in sync.keys.list()]
            assert sync.keys.revoke(key.id).revoked_at is not None

    await asyncio.to_thread(work)


async def test_wait_many_on_100_runs_makes_a_request_per_run(
    settings: Settings, backends: Backends, register: Register
) -> None:
    """Each run's live stream says when it ends: 100 runs of 2 s, waited for together, cost
    a stream each and nothing more (polling would read each a few times a second)."""
    await register("t_sleep", steps=[{"id": "nap", "handler": "builtin.sleep"}])
    app = create_app(settings, backends)
    seen: Counter[str] = Counter()

    async def counting(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            kind = "stream" if scope["path"].endswith("/stream") else scope["path"].count("/")
            seen[f"{scope['method']} {kind}"] += 1
        await app(scope, receive, send)

    fast = settings.model_copy(update={"worker_concurrency": 100})
    async with served(counting) as url, Client(url, api_key=settings.admin_key) as client:
        made = await client.create_many(
            [
                {"template_type": "t_sleep", "scope": "user", "scope_id": "u1"}
                | {"payload": {"sleepSeconds": 2}}
                for _ in range(100)
            ]
        )
        ids = [r.id for r in made if isinstance(r, Run)]
        seen.clear()
        async with running(backends, fast):
            ended = await client.runs.wait_many(ids, timeout=60)
    assert [r.id for r in ended] == ids
    assert all(r.status == RunStatus.SUCCEEDED for r in ended)
    assert seen == {"GET stream": 100}, seen


async def test_wait_many_says_which_runs_are_still_going(
    client: Client, register: Register
) -> None:
    await register()
    runs = [await client.create("t_noop", scope="user", scope_id="u1") for _ in range(7)]
    # Long enough for a loaded machine to answer the first run's stream (or read), which is
    # where its status comes from: 0.3 s was not.
    with pytest.raises(TimeoutError) as late:
        await client.runs.wait_many([r.id for r in runs], timeout=3)
    said = str(late.value)
    assert said.startswith("still going after 3 s: ") and said.endswith(" and 2 more")
    assert f"{runs[0].id} (queued)" in said
    with pytest.raises(NotFound):
        await client.runs.wait_many([runs[0].id, "6b0000000000000000000000"], timeout=5)
