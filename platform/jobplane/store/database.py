"""jobplane's collections in one database.

They are the store's own: each aggregate store is handed the ones it reads and writes, and no
code outside `jobplane.store` touches them (tests that must, to set up a state no transition
makes or to count what was written, go through `tests/integration/db.py`).
"""

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pymongo import AsyncMongoClient
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.write_concern import WriteConcern

from jobplane.store.convert import object_id

Doc = dict[str, Any]
T = TypeVar("T")


@dataclass(frozen=True)
class Collections:
    templates: AsyncCollection[Doc]
    runs: AsyncCollection[Doc]
    # Runs past retention (`MaintenanceStore.archive`), still readable by id.
    archive: AsyncCollection[Doc]
    schedules: AsyncCollection[Doc]
    # Copies of the runs' trails, plus events that belong to no run write.
    events: AsyncCollection[Doc]
    api_keys: AsyncCollection[Doc]
    # Bookkeeping of the background passes (the trail sweep's last window), and the floor of
    # the lock tokens Redis hands out.
    meta: AsyncCollection[Doc]
    # Each queue an operator paused or resumed, with who did and why.
    queues: AsyncCollection[Doc]
    # One document per template type with `maxRunning`: the runs it admitted to start
    # (`store/gates.py`).
    gates: AsyncCollection[Doc]
    # Webhook subscriptions (`store/webhooks.py`), and each event's delivery to one.
    webhooks: AsyncCollection[Doc]
    deliveries: AsyncCollection[Doc]

    @classmethod
    def of(cls, db: AsyncDatabase[Doc]) -> "Collections":
        return cls(
            templates=db["job_templates"],
            runs=db["job_runs"],
            archive=db["job_runs_archive"],
            schedules=db["job_schedules"],
            events=db["job_events"],
            api_keys=db["api_keys"],
            meta=db["job_meta"],
            queues=db["job_queues"],
            gates=db["job_gates"],
            webhooks=db["job_webhooks"],
            deliveries=db["job_webhook_deliveries"],
        )

    async def find_run(self, run_id: str, projection: Doc) -> Doc | None:
        """A run, live or archived."""
        oid = object_id(run_id)
        if oid is None:
            return None
        # Archiving copies before it deletes, so a run that is not in `job_runs` by the time
        # this reads it is in the archive already.
        doc = await self.runs.find_one({"_id": oid}, projection)
        return doc if doc is not None else await self.archive.find_one({"_id": oid}, projection)


async def transaction(
    client: AsyncMongoClient[Doc],
    concern: WriteConcern,
    write: Callable[[AsyncClientSession], Awaitable[T]],
) -> T:
    """`write` in one transaction, committed with `concern`; a write conflict (a transient
    error) runs it again."""
    async with client.start_session() as session:
        return await session.with_transaction(write, write_concern=concern)
