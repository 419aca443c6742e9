"""The scheduler's scans and retention: what the reaper, the reconciler and the admission of
waiting runs look for, and the archiving of ended runs.

Each scan is bounded by a partial index and a limit, never by the size of `job_runs`; the
writes that follow a scan are transitions, made on the runs as read.
"""

from datetime import datetime

from bson import ObjectId
from pymongo import ReplaceOne

from jobplane.clock import Clock
from jobplane.model import CLAIMABLE, LEASED, TERMINAL, TRANSITIONS, Run, RunStatus
from jobplane.store import convert
from jobplane.store.convert import NO_TRAIL, Doc, run_key
from jobplane.store.database import Collections

_DEADLINE = TRANSITIONS["deadline_expire"]


def archivable(before: datetime) -> Doc:
    """Terminal runs last written before `before` that hold no dedupe key."""
    return {
        "status": {"$in": sorted(TERMINAL)},
        "dedupeKey": None,
        "updateAt": {"$lt": before},
        "completedAt": {"$exists": True},
    }


class MongoMaintenanceStore:
    def __init__(self, db: Collections, clock: Clock) -> None:
        self._db = db
        self._clock = clock

    async def expired_leases(self, limit: int) -> list[Run]:
        """Leased runs whose `lockedUntil` has passed, oldest lease first: the reaper's."""
        query = {"status": {"$in": sorted(LEASED)}, "lockedUntil": {"$lt": self._clock.now()}}
        cursor = self._db.runs.find(query, NO_TRAIL).sort("lockedUntil", 1).limit(limit)
        return [convert.run(d) async for d in cursor]

    async def overdue(self, limit: int) -> tuple[list[Run], list[Run]]:
        """Runs past their deadline, and cancel-requested runs past their grace."""
        now = self._clock.now()
        late = {"status": {"$in": sorted(_DEADLINE.sources)}, "deadline": {"$lt": now}}
        slow = {"status": RunStatus.CANCEL_REQUESTED, "cancelDeadline": {"$lt": now}}
        return (
            [convert.run(d) async for d in self._db.runs.find(late, NO_TRAIL).limit(limit)],
            [convert.run(d) async for d in self._db.runs.find(slow, NO_TRAIL).limit(limit)],
        )

    async def to_reconcile(self, after: str | None, limit: int, idle_since: datetime) -> list[Run]:
        """Pending and queued runs untouched since `idle_since`, in id order, for the reconciler
        to check against Redis (younger ones are most likely being created right now); runs
        waiting for a dedupe key are not to be queued."""
        query: Doc = {
            "status": {"$in": sorted(CLAIMABLE)},
            "updateAt": {"$lt": idle_since},
            "dedupeWait": {"$exists": False},
            "mapWait": {"$exists": False},
        }
        if after:
            query["_id"] = {"$gt": ObjectId(after)}
        cursor = self._db.runs.find(query, NO_TRAIL).sort("_id", 1).limit(limit)
        return [convert.run(d) async for d in cursor]

    async def waited_keys(self, limit: int) -> list[str]:
        """Keys that pending runs wait for and that have a free place (fewer active holders
        than the runs' `concurrencyLimit`): the process that freed it may have died before it
        admitted the next run (full keys are left out, so a backlog of them cannot crowd out
        the free ones)."""
        cursor = await self._db.runs.aggregate(
            [
                {"$match": {"dedupeWait": {"$exists": True}, "status": RunStatus.PENDING}},
                # A key's runs are all of one scope (see `index_models`), so the holders are
                # looked up under the unique index, which starts with the scope.
                {
                    "$group": {
                        "_id": "$dedupeWait",
                        "scope": {"$first": "$scope"},
                        "scopeId": {"$first": "$scopeId"},
                        "places": {"$min": {"$ifNull": ["$concurrencyLimit", 1]}},
                    }
                },
                {
                    "$lookup": {
                        "from": self._db.runs.name,
                        "localField": "_id",
                        "foreignField": "dedupeKey",
                        "let": {"scope": "$scope", "scopeId": "$scopeId"},
                        "as": "holder",
                        "pipeline": [
                            {
                                "$match": {
                                    "$expr": {
                                        "$and": [
                                            {"$eq": ["$scope", "$$scope"]},
                                            {"$eq": ["$scopeId", "$$scopeId"]},
                                        ]
                                    },
                                    "status": {"$nin": sorted(TERMINAL)},
                                }
                            },
                            {"$project": {"_id": 1}},
                        ],
                    }
                },
                {"$match": {"$expr": {"$lt": [{"$size": "$holder"}, "$places"]}}},
                {"$limit": limit},
            ]
        )
        return [d["_id"] async for d in cursor]

    async def archive(self, before: datetime, limit: int) -> int:
        """Move up to `limit` runs that ended before `before` to `job_runs_archive`; returns
        how many moved.

        Each run is copied (replacing an earlier copy a crashed pass left) before it is deleted,
        and deleted only at the version copied, so a reader always finds it in one of the two.
        Runs holding a dedupe key stay: a non-repeatable template's key must stay unique.
        """
        docs = await self._db.runs.find(archivable(before)).limit(limit).to_list()
        if not docs:
            return 0
        # Both by shard key too: a sharded cluster refuses an upsert without it, and sends
        # the delete only to the shards of the runs' scopes.
        await self._db.archive.bulk_write(
            [ReplaceOne(run_key(d), d, upsert=True) for d in docs], ordered=False
        )
        moved = await self._db.runs.delete_many(
            {"$or": [{**run_key(d), "version": d["version"]} for d in docs]}
        )
        return moved.deleted_count
