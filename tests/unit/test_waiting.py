"""`waitingFor`: only an explanation, so a registry that cannot be read leaves it null (and is
not asked again at once); `jobplane runs watch` says it."""

from datetime import UTC, datetime
from typing import Any, cast

from jobplane.cli.render import render
from jobplane.model import QueueState, Run, RunStatus, WaitingFor
from jobplane.queue.redis import Offer, RedisQueue
from jobplane.runs.waiting import Waiting
from jobplane.store import Store


def queued(**fields: Any) -> Run:
    now = datetime.now(UTC)
    return Run(
        id="0" * 24,
        template_type="t",
        template_version=1,
        scope="user",
        scope_id="u",
        status=RunStatus.QUEUED,
        create_at=now,
        update_at=now,
        **fields,
    )


class _TornConnection:
    """What redis-py's cluster client raised mid node restart, from a torn-down connection."""

    reads = 0

    async def live_workers(self) -> dict[str, Offer]:
        self.reads += 1
        raise AttributeError("'NoneType' object has no attribute 'writelines'")


class _NothingPaused:
    class queues:  # the store's aggregate, by its name
        @staticmethod
        async def states() -> list[QueueState]:
            return []


async def test_an_unreadable_registry_leaves_waiting_for_null() -> None:
    run = queued(handler="reports.render")
    torn = _TornConnection()
    waiting = Waiting(cast(Store, _NothingPaused), cast(RedisQueue, torn), max_age=60)
    [explained] = await waiting.explain([run])
    assert explained.waiting_for is None
    await waiting.explain([run])
    assert torn.reads == 1, "a failed read is not repeated for every answer"


def test_a_run_waiting_for_a_handler_says_which() -> None:
    run = queued(waiting_for=WaitingFor(reason="handler", detail="reports.render"))
    assert "  waiting for handler: reports.render" in render(run)
    assert not any(
        "waiting" in line for line in render(run.model_copy(update={"waiting_for": None}))
    )
