"""`fairness: round_robin`: one scope's backlog does not hold up another scope's runs."""

from pathlib import Path

from jobplane.backends import Backends
from jobplane.model import RunStatus
from jobplane.runs import RunRequest, RunService
from jobplane.settings import Settings
from tests.integration.conftest import Register
from tests.integration.db import raw
from tests.integration.flow import until, workers
from tests.integration.workers import settled

BACKLOG = 10_000


async def test_a_scope_with_10000_queued_runs_does_not_delay_another_scopes_10(
    backends: Backends, settings: Settings, register: Register, tmp_path: Path
) -> None:
    steps = [{"id": "s", "handler": "builtin.sleep"}]
    await register("report", fairness="round_robin", steps=steps)
    service = RunService(backends.store, backends.queue)
    busy = RunRequest("report", "account", "big", {"sleepSeconds": 0.05})
    created = await service.create_many([busy] * BACKLOG, "user:t")
    assert len(created) == BACKLOG
    runs = raw(backends.store).runs
    async with workers(settings, tmp_path):
        # The workers are into the backlog.
        await until(lambda: runs.count_documents({"status": "succeeded"}, limit=1), 60)
        small = [
            (await service.create(RunRequest("report", "account", "small", {}), "user:t"))[0]
            for _ in range(10)
        ]
        done = await settled(backends.store, [r.id for r in small], within=60)
        left = await runs.count_documents({"scopeId": "big", "status": "queued"})
    assert {r.status for r in done} == {RunStatus.SUCCEEDED}
    waits = [(r.started_at - r.create_at).total_seconds() for r in done if r.started_at]
    assert len(waits) == 10 and max(waits) < 3, waits
    assert left > BACKLOG / 2, "the backlog was still there: without turns they would wait"
