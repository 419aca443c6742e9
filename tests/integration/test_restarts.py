"""Servers that stop and come back: nothing accepted is lost."""

from pathlib import Path

import pytest

from jobplane.backends import open_backends
from jobplane.devstack import MongoServer, RedisServer, free_port
from jobplane.model import RunStatus
from jobplane.runs import RunRequest, RunService
from jobplane.settings import Settings
from tests.integration.conftest import template_spec
from tests.integration.workers import running, settled


@pytest.mark.slow
async def test_runs_created_while_redis_is_down_run_once_it_is_back(
    settings: Settings, tmp_path: Path
) -> None:
    redis = RedisServer(tmp_path / "redis", free_port(), tmp_path / "redis.log")
    redis.start()
    settings = settings.model_copy(update={"redis_url": redis.url})
    try:
        async with open_backends(settings) as backends:
            await backends.store.templates.register(template_spec())
            service = RunService(backends.store, backends.queue)
            redis.stop()
            created = [
                (await service.create(RunRequest("t_noop", "user", "u"), "user:a"))[0]
                for _ in range(20)
            ]
            for run in created:
                stored = await backends.store.runs.get(run.id)
                # Durable and queued in MongoDB: the reconciler pushes what Redis is missing.
                assert stored is not None and stored.status == RunStatus.QUEUED

            redis.start()
            async with running(backends, settings, scheduler=True):
                runs = await settled(backends.store, [r.id for r in created])
            assert [r.status for r in runs] == [RunStatus.SUCCEEDED] * 20
            for run in runs:
                path = [
                    (e.from_, e.to)
                    for e in await backends.store.trail.events_of(run.id)
                    if e.type == "status_changed"
                ]
                assert path == [
                    (RunStatus.QUEUED, RunStatus.RUNNING),
                    (RunStatus.RUNNING, RunStatus.SUCCEEDED),
                ]
    finally:
        redis.stop()


@pytest.mark.slow
async def test_templates_and_runs_survive_a_mongod_restart(
    settings: Settings, tmp_path: Path
) -> None:
    mongo = MongoServer(tmp_path / "db", free_port(), tmp_path / "mongod.log")
    mongo.start()
    settings = settings.model_copy(update={"mongodb_url": mongo.url})
    try:
        async with open_backends(settings) as backends:
            template, _ = await backends.store.templates.register(template_spec())
            run, _ = await RunService(backends.store, backends.queue).create(
                RunRequest("t_noop", "user", "u", {"k": "v"}), "user:a"
            )
        mongo.stop()
        mongo.start()
        async with open_backends(settings) as backends:
            assert await backends.store.templates.get("t_noop") == template
            again = await backends.store.runs.get(run.id)
            assert again is not None and again.payload == {"k": "v"}
            assert again.status == RunStatus.QUEUED
            events = await backends.store.trail.events_of(run.id)
            assert [(e.type, e.to) for e in events] == [("created", RunStatus.QUEUED)]
    finally:
        mongo.stop()
