"""Schedules: a template on a cron, with the fire times each has handled."""

from collections.abc import Sequence
from datetime import datetime

from bson import ObjectId
from pymongo import ReturnDocument

from jobplane.clock import Clock
from jobplane.model import Schedule
from jobplane.store import convert
from jobplane.store.convert import Doc, listed, object_id
from jobplane.store.database import Collections
from jobplane.store.types import ScheduleQuery


class MongoScheduleStore:
    def __init__(self, db: Collections, clock: Clock) -> None:
        self._db = db
        self._clock = clock

    async def insert(self, schedule: Schedule) -> None:
        doc = schedule.model_dump(by_alias=True)
        doc["_id"] = ObjectId(doc.pop("id"))
        await self._db.schedules.insert_one(doc)

    async def get(self, schedule_id: str) -> Schedule | None:
        oid = object_id(schedule_id)
        doc = await self._db.schedules.find_one({"_id": oid}) if oid else None
        return convert.schedule(doc) if doc else None

    async def page(
        self, query: ScheduleQuery, within: Sequence[tuple[str, str]] | None, limit: int
    ) -> list[Schedule]:
        """Schedules matching `query`, newest first, only in the scopes `within` unless None."""
        find = listed(
            (
                ("templateType", query.template_type),
                ("scope", query.scope),
                ("scopeId", query.scope_id),
                ("enabled", query.enabled),
            ),
            within,
        )
        if query.before is not None:
            find["_id"] = {"$lt": ObjectId(query.before)}
        cursor = self._db.schedules.find(find).sort("_id", -1).limit(limit)
        return [convert.schedule(d) async for d in cursor]

    async def replace(self, schedule: Schedule) -> Schedule | None:
        """Write `schedule` over the stored one if that is still at `schedule.version`; None
        if another change got there first (the caller reads again)."""
        doc = schedule.model_dump(by_alias=True, exclude={"id"})
        doc |= {"version": schedule.version + 1, "updateAt": self._clock.now()}
        stored = await self._db.schedules.find_one_and_replace(
            {"_id": ObjectId(schedule.id), "version": schedule.version},
            doc,
            return_document=ReturnDocument.AFTER,
        )
        return convert.schedule(stored) if stored else None

    async def due(self, now: datetime, limit: int) -> list[Schedule]:
        """Enabled schedules whose next fire time has come, the most overdue first."""
        due = {"enabled": True, "nextRunAt": {"$lte": now}}
        cursor = self._db.schedules.find(due).sort("nextRunAt", 1).limit(limit)
        return [convert.schedule(d) async for d in cursor]

    async def next_fire_time(self) -> datetime | None:
        """The earliest `nextRunAt` of any enabled schedule: when the tick must look next."""
        doc = await self._db.schedules.find_one(
            {"enabled": True, "nextRunAt": {"$ne": None}}, {"nextRunAt": 1}, sort=[("nextRunAt", 1)]
        )
        return doc["nextRunAt"] if doc else None

    async def advance(
        self, schedule: Schedule, next_run_at: datetime, fired: tuple[datetime, str] | None
    ) -> bool:
        """Move a schedule past the fire times it handled, if nobody else did (another
        scheduler, or a change that recomputed `nextRunAt`) since it was read."""
        fields: Doc = {"nextRunAt": next_run_at, "updateAt": self._clock.now()}
        if fired is not None:
            fields |= {"lastRunAt": fired[0], "lastRunId": fired[1]}
        result = await self._db.schedules.update_one(
            {
                "_id": ObjectId(schedule.id),
                "nextRunAt": schedule.next_run_at,
                "version": schedule.version,
            },
            {"$set": fields, "$inc": {"version": 1}},
        )
        return result.modified_count == 1

    async def note_run(self, schedule_id: str, at: datetime, run_id: str) -> None:
        """Record a run a schedule made off its cron (a trigger) as its last one, unless a
        later one is recorded already. A new version, so that a change read before this write
        does not put the old last run back."""
        await self._db.schedules.update_one(
            {"_id": ObjectId(schedule_id), "lastRunAt": {"$not": {"$gt": at}}},
            {
                "$set": {"lastRunAt": at, "lastRunId": run_id, "updateAt": self._clock.now()},
                "$inc": {"version": 1},
            },
        )

    async def delete(self, schedule_id: str) -> bool:
        oid = object_id(schedule_id)
        return bool(oid and (await self._db.schedules.delete_one({"_id": oid})).deleted_count)
