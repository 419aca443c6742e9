"""The dashboard's figures from MongoDB: runs by status, the last hour by the minute, failing
templates and the runs workers hold.

Read-only, and each query is bounded by an index of `indexes.index_models` and by time,
never by the size of the collection: active runs by `(status, _id)`, runs finished in the last
hour or day by the partial `(status, dedupeKey, updateAt)` of ended runs (those with
`completedAt`) or `(updateAt)` (a finished run is not written again, so its `updateAt` is when
it ended), runs created in the last hour by `_id` (an ObjectId starts with its creation time),
and held runs by the partial `(status, lockedUntil)` of leased runs. A scoped caller's queries
add their scopes, which `(scope, scopeId, _id)` serves as well.
"""

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from bson import ObjectId
from pymongo.asynchronous.collection import AsyncCollection

from jobplane.model import ACTIVE, LEASED, TERMINAL, RunStatus
from jobplane.store.convert import listed
from jobplane.store.database import Collections

Doc = dict[str, Any]
Runs = AsyncCollection[Doc]

# The chart's span, and how far back failures count towards a failing template.
HOUR = timedelta(hours=1)
DAY = timedelta(days=1)
# Most failing templates, and most held runs, an overview lists.
FAILING_LIMIT = 10
HELD_LIMIT = 500
_DEAD = (RunStatus.FAILED, RunStatus.EXPIRED)
# Statuses in lifecycle order, as the overview lists them.
_ACTIVE = [s for s in RunStatus if s in ACTIVE]
_TERMINAL = [s for s in RunStatus if s in TERMINAL]


@dataclass(frozen=True)
class Minute:
    """Runs created and runs finished (by status) in the minute starting at `at`."""

    at: datetime
    created: int = 0
    finished: dict[RunStatus, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ErrorCount:
    code: str
    count: int
    # The latest of these runs' error messages.
    message: str | None
    last_at: datetime


@dataclass
class Failures:
    """A template's dead letters of the last day: counts by status and by error code."""

    template_type: str
    by_status: dict[RunStatus, int]
    errors: list[ErrorCount]
    last_at: datetime


@dataclass(frozen=True)
class HeldRun:
    id: str
    template_type: str
    status: RunStatus
    phase: str | None
    percentage: float
    locked_by: str
    locked_until: datetime | None


@dataclass(frozen=True)
class RunFigures:
    active: dict[RunStatus, int]
    # Runs that ended in the last hour, by status, and the hour minute by minute.
    finished: dict[RunStatus, int]
    minutes: list[Minute]
    failing: list[Failures]
    held: list[HeldRun]


class MongoOverviewStore:
    def __init__(self, db: Collections) -> None:
        self._runs = db.runs

    async def held_back(self) -> dict[tuple[str, str], int]:
        """Runs held back by a limit MongoDB records, by template and reason: `concurrency`
        (pending for a place of their dedupe key, by `(dedupeWait, _id)`) and `lock` (queued
        after a lock was found held, by the partial index of runs with `lockWait`)."""
        held: dict[tuple[str, str], int] = {}
        for reason, match in (
            ("concurrency", {"dedupeWait": {"$exists": True}, "status": RunStatus.PENDING}),
            ("lock", {"lockWait": {"$exists": True}, "status": RunStatus.QUEUED}),
        ):
            cursor = await self._runs.aggregate(
                [{"$match": match}, {"$group": {"_id": "$templateType", "n": {"$sum": 1}}}]
            )
            held |= {(d["_id"], reason): d["n"] async for d in cursor}
        return held

    async def started_by_queue(self) -> dict[str, int]:
        """Runs started and not yet ended (`running`, `waiting_worker`, `cancel_requested`),
        by queue: as many as workers hold, read by `(status, _id)`."""
        cursor = await self._runs.aggregate(
            [
                {"$match": {"status": {"$in": sorted(LEASED)}}},
                {"$group": {"_id": "$queue", "n": {"$sum": 1}}},
            ]
        )
        return {d["_id"]: d["n"] async for d in cursor}

    async def run_figures(
        self, within: Sequence[tuple[str, str]] | None, now: datetime
    ) -> RunFigures:
        """The run figures of the overview, as of `now`, in the scopes `within` (None: all)."""
        if within is not None and not within:
            return _empty(now)  # a key bound to no scope sees no run
        scoped = listed((), within)
        start = _minute(now) - HOUR + timedelta(minutes=1)
        active, finished, created, failing, held = await asyncio.gather(
            _count_active(self._runs, scoped),
            _finished_by_minute(self._runs, scoped, start),
            _created_by_minute(self._runs, scoped, start),
            _failing(self._runs, scoped, now - DAY),
            _held(self._runs, scoped),
        )
        minutes = []
        for i in range(60):
            at = start + timedelta(minutes=i)
            minutes.append(Minute(at, created.get(at, 0), finished.get(at, {})))
        totals: dict[RunStatus, int] = dict.fromkeys(_TERMINAL, 0)
        for by_status in finished.values():
            for status, n in by_status.items():
                totals[status] += n
        return RunFigures(active, totals, minutes, failing, held)


def _empty(now: datetime) -> RunFigures:
    start = _minute(now) - HOUR + timedelta(minutes=1)
    return RunFigures(
        dict.fromkeys(_ACTIVE, 0),
        dict.fromkeys(_TERMINAL, 0),
        [Minute(start + timedelta(minutes=i)) for i in range(60)],
        [],
        [],
    )


def _minute(at: datetime) -> datetime:
    return at.replace(second=0, microsecond=0)


async def _count_active(runs: Runs, scoped: Doc) -> dict[RunStatus, int]:
    counts = dict.fromkeys(_ACTIVE, 0)
    match = {"status": {"$in": sorted(ACTIVE)}, **scoped}
    cursor = await runs.aggregate(
        [{"$match": match}, {"$group": {"_id": "$status", "n": {"$sum": 1}}}]
    )
    async for doc in cursor:
        counts[RunStatus(doc["_id"])] = doc["n"]
    return counts


async def _finished_by_minute(
    runs: Runs, scoped: Doc, start: datetime
) -> dict[datetime, dict[RunStatus, int]]:
    match = {
        "status": {"$in": sorted(TERMINAL)},
        "updateAt": {"$gte": start},
        "completedAt": {"$exists": True},
        **scoped,
    }
    cursor = await runs.aggregate(
        [
            {"$match": match},
            {
                "$group": {
                    "_id": {
                        "minute": {"$dateTrunc": {"date": "$completedAt", "unit": "minute"}},
                        "status": "$status",
                    },
                    "n": {"$sum": 1},
                }
            },
        ]
    )
    minutes: dict[datetime, dict[RunStatus, int]] = {}
    async for doc in cursor:
        at, status = doc["_id"]["minute"], RunStatus(doc["_id"]["status"])
        if at >= start:
            minutes.setdefault(at, {})[status] = doc["n"]
    return minutes


async def _created_by_minute(runs: Runs, scoped: Doc, start: datetime) -> dict[datetime, int]:
    match = {"_id": {"$gte": ObjectId.from_datetime(start)}, **scoped}
    minute = {"$dateTrunc": {"date": {"$toDate": "$_id"}, "unit": "minute"}}
    cursor = await runs.aggregate(
        [{"$match": match}, {"$group": {"_id": minute, "n": {"$sum": 1}}}]
    )
    return {doc["_id"]: doc["n"] async for doc in cursor}


async def _failing(runs: Runs, scoped: Doc, since: datetime) -> list[Failures]:
    """Templates with failed or expired runs that ended since `since`, the most first."""
    match = {
        "status": {"$in": sorted(_DEAD)},
        "updateAt": {"$gte": since},
        "completedAt": {"$exists": True},
        **scoped,
    }
    cursor = await runs.aggregate(
        [
            {"$match": match},
            {
                "$group": {
                    "_id": {
                        "type": "$templateType",
                        "status": "$status",
                        "code": {"$ifNull": ["$error.code", "none"]},
                    },
                    "n": {"$sum": 1},
                    "last": {"$max": "$updateAt"},
                    # No `$sort` stage: it could make the planner walk `updateAt` over every
                    # run written that day instead of the dead ones only.
                    "message": {"$bottom": {"sortBy": {"updateAt": 1}, "output": "$error.message"}},
                }
            },
        ]
    )
    found: dict[str, Failures] = {}
    async for doc in cursor:
        key = doc["_id"]
        failures = found.setdefault(
            key["type"], Failures(key["type"], dict.fromkeys(_DEAD, 0), [], doc["last"])
        )
        failures.by_status[RunStatus(key["status"])] += doc["n"]
        failures.errors.append(ErrorCount(key["code"], doc["n"], doc["message"], doc["last"]))
        failures.last_at = max(failures.last_at, doc["last"])
    for failures in found.values():
        failures.errors = _merged(failures.errors)
    ranked = sorted(found.values(), key=lambda f: (-sum(f.by_status.values()), f.template_type))
    return ranked[:FAILING_LIMIT]


def _merged(errors: list[ErrorCount]) -> list[ErrorCount]:
    """One entry per code (a code can come with both dead statuses), the most first."""
    by_code: dict[str, ErrorCount] = {}
    for e in errors:
        seen = by_code.get(e.code)
        if seen is None:
            by_code[e.code] = e
            continue
        latest = e if e.last_at >= seen.last_at else seen
        by_code[e.code] = ErrorCount(
            e.code, e.count + seen.count, latest.message, max(e.last_at, seen.last_at)
        )
    return sorted(by_code.values(), key=lambda e: (-e.count, e.code))


async def _held(runs: Runs, scoped: Doc) -> list[HeldRun]:
    """Runs a worker holds a lease on, by worker and then id (a run waiting for an external
    worker to claim its step is held by no one)."""
    projection = {
        "templateType": 1,
        "status": 1,
        "phase": 1,
        "lockedBy": 1,
        "lockedUntil": 1,
        "progress.percentage": 1,
    }
    find = {"status": {"$in": sorted(LEASED)}, "lockedUntil": {"$exists": True}, **scoped}
    docs = await runs.find(find, projection).limit(HELD_LIMIT).to_list()
    held = [
        HeldRun(
            str(d["_id"]),
            d["templateType"],
            RunStatus(d["status"]),
            d.get("phase"),
            float(d.get("progress", {}).get("percentage", 0)),
            d["lockedBy"],
            d.get("lockedUntil"),
        )
        for d in docs
    ]
    return sorted(held, key=lambda h: (h.locked_by, h.id))
