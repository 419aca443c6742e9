"""`waitingFor` is only an explanation: a registry that cannot be read leaves it null."""

from datetime import UTC, datetime
from typing import cast

from jobplane.model import Run, RunStatus
from jobplane.queue.redis import Offer, RedisQueue
from jobplane.runs.waiting import Waiting


class _TornConnection:
    """What redis-py's cluster client raised mid node restart, from a torn-down connection."""

    async def live_workers(self) -> dict[str, Offer]:
        raise AttributeError("'NoneType' object has no attribute 'writelines'")


async def test_an_unreadable_registry_leaves_waiting_for_null() -> None:
    now = datetime.now(UTC)
    run = Run(
        id="0" * 24,
        template_type="t",
        template_version=1,
        scope="user",
        scope_id="u",
        status=RunStatus.QUEUED,
        handler="reports.render",
        create_at=now,
        update_at=now,
    )
    [explained] = await Waiting(cast(RedisQueue, _TornConnection())).explain([run])
    assert explained.waiting_for is None
