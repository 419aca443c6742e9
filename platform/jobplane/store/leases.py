"""What a lease holder writes besides its transitions: renewals, its steps' starts and ends,
and progress. Each write is fenced by the lease (`writes.fence`: the run's, or a lent step's
for its borrower's start and progress) and changes no status.
"""

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from bson import ObjectId

from jobplane.model import LEASED, RunStatus, StepStatus
from jobplane.store import convert, steps
from jobplane.store.convert import STATE_FIELDS, Doc, known_owner, owner
from jobplane.store.types import Lease, Lost, StepEnd
from jobplane.store.writes import RunWrites, TrailEntry


class MongoLeaseStore:
    def __init__(self, writes: RunWrites) -> None:
        self._writes = writes
        self._db, self._clock, self._trail = writes.db, writes.clock, writes.trail

    async def heartbeat(
        self, worker_id: str, leases: Sequence[Lease], lease_seconds: float
    ) -> tuple[set[str], set[str]]:
        """Renew many leases at once.

        Returns the ids still held and, among them, those whose cancel was requested, and keeps
        each held lease's `known` state current. Only the worker can tell a lease lost from a
        run it finished meanwhile, so nothing is recorded.
        """
        # Grouped by token and by scope where the lease knows it: on a sharded cluster each
        # group goes only to the shard of its scope.
        groups: dict[tuple[str, str | None, str | None], list[ObjectId]] = {}
        for lease in leases:
            known = lease.known
            group = (lease.token, *((known.scope, known.scope_id) if known else (None, None)))
            groups.setdefault(group, []).append(ObjectId(lease.run_id))
        if not groups:
            return set(), set()
        now = self._clock.now()
        held_filter = {
            "lockedBy": worker_id,
            "status": {"$in": sorted(LEASED)},
            "$or": [
                {
                    "leaseToken": token,
                    **(owner(scope, scope_id) if scope and scope_id else {}),
                    "_id": {"$in": ids},
                }
                for (token, scope, scope_id), ids in groups.items()
            ],
        }
        until = now + timedelta(seconds=lease_seconds)
        await self._db.runs.update_many(
            held_filter,
            {"$set": {"lockedUntil": until, "heartbeatAt": now}, "$inc": {"version": 1}},
        )
        found = await self._db.runs.find(held_filter, STATE_FIELDS).to_list()
        docs = {str(d["_id"]): d for d in found}
        for lease in leases:
            doc = docs.get(lease.run_id)
            # The beat moved the version: the worker's next write would miss and read it again.
            if doc and (lease.known is None or lease.known.version < doc["version"]):
                lease.known = convert.known(doc)
        cancel = {i for i, d in docs.items() if d["status"] == RunStatus.CANCEL_REQUESTED}
        return set(docs), cancel

    async def start_step(
        self, lease: Lease, index: int, step_id: str, at: datetime | None = None, attempt: int = 0
    ) -> Lost | None:
        """Mark a step running (its `attempt`-th try). Workers write this only for steps that
        are not over at once."""
        now = self._clock.now()
        lent = lease.step is not None
        started, events = steps.unwritten_start(index, step_id, at or now, attempt, not lent)
        s = f"progress.steps.{index}"
        update = {**started, f"{s}.status": StepStatus.RUNNING, f"{s}.percentage": 0}
        return await self._writes.fenced(lease, "start_step", {"$set": update}, events, now)

    async def wait_step(
        self, lease: Lease, index: int, step_id: str, total: int, at: datetime, attempt: int
    ) -> Lost | None:
        """A map step made its `total` children: it waits for them (its `attempt`-th try,
        started `at`)."""
        now = self._clock.now()
        started, events = steps.unwritten_start(index, step_id, at, attempt)
        s = f"progress.steps.{index}"
        update = {**started, f"{s}.status": StepStatus.WAITING, f"{s}.map": {"total": total}}
        events.append(("children_created", None, {"step": step_id, "total": total}))
        return await self._writes.fenced(lease, "wait_step", {"$set": update}, events, now)

    async def finish_step(
        self,
        lease: Lease,
        index: int,
        step_id: str,
        output: Any,
        percentage: float,
        started_at: datetime | None = None,
        *,
        next_handler: str | None,
        attempt: int = 0,
    ) -> Lost | None:
        """Record a step's success (and its start, its `attempt`-th try, when that was not
        written yet); the run's `handler` becomes that of the step it goes on with."""
        now = self._clock.now()
        update, events = steps.unwritten_start(index, step_id, started_at, attempt)
        update |= {
            **steps.succeeded(index, step_id, output, now),
            "progress.percentage": percentage,
        }
        events.append(("step_finished", None, {"step": step_id}))
        write: Doc = {"$set": update, "$unset": steps.unlent([index])}
        if next_handler is None:
            write["$unset"]["handler"] = ""
        else:
            update["handler"] = next_handler
        return await self._writes.fenced(lease, "finish_step", write, events, now)

    async def end_steps(
        self, lease: Lease, ends: Sequence[StepEnd], percentage: float
    ) -> Lost | None:
        """Record steps that ended without a result while the run goes on (`StepEnd`)."""
        now = self._clock.now()
        update: Doc = {}
        events: list[TrailEntry] = []
        for end in ends:
            fields, entries = steps.ended(end, now)
            update |= fields
            events += entries
        write = {
            "$set": update,
            "$max": {"progress.percentage": percentage},
            "$unset": steps.unlent([end.index for end in ends]),
        }
        return await self._writes.fenced(lease, "end_steps", write, events, now)

    async def report_progress(
        self,
        lease: Lease,
        index: int,
        step_percentage: float,
        percentage: float,
        message: str | None,
    ) -> Lost | None:
        """Progress is frequent, so it writes the run only; no event per tick. Its
        `reportedAt` is how the notifier's feed knows a report (`store/feed.py`)."""
        now = self._clock.now()
        s = f"progress.steps.{index}"
        update: Doc = {
            f"{s}.percentage": step_percentage,
            f"{s}.message": message,
            "progress.reportedAt": now,
        }
        if message is not None:
            update["progress.summary"] = message
        # $max: the run's progress never goes back, whatever order writes land in.
        write = {"$set": update, "$max": {"progress.percentage": percentage}}
        return await self._writes.fenced(lease, "progress", write, [], now)

    async def locks_taken(self, lease: Lease) -> Lost | None:
        """The run took the locks it was handed back for: it waits for none now."""
        write = {"$set": {}, "$unset": {"lockWait": ""}}
        return await self._writes.fenced(lease, "locks_taken", write, [], self._clock.now())

    async def lease_lost(self, lease: Lease, what: str) -> Lost:
        """Record why `lease` no longer holds its run (for a loss the worker found itself)."""
        return await self._writes.lost(lease.run_id, lease, what, known_owner(lease.known))
