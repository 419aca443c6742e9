"""A map step's children as its parent sees them: counted, listed, and given their places
under the step's `maxConcurrency`.

Children live in their parent's scope, so every read and write here names it and goes to one
shard. Places work as a dedupe key's do (`store/runs.py`): a unique index on (scope, scope id,
parent, step, place) decides every race, so no two children ever hold one place, whatever
process admits them.
"""

import random
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from bson import ObjectId
from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError

from jobplane.model import LEASED, TERMINAL, MapProgress, Run, RunStatus
from jobplane.store import convert
from jobplane.store.convert import NO_TRAIL, Doc, owner
from jobplane.store.writes import RunWrites

# A child that ended any other way than succeeded counts as failed for its map step.
_ENDED_BADLY = sorted(TERMINAL - {RunStatus.SUCCEEDED})


@dataclass(frozen=True)
class ChildEnd:
    """How one child ended, for its map step's output."""

    id: str
    index: int
    status: RunStatus
    result: Any
    error: dict[str, Any] | None


def _of(parent: Run, step_id: str | None = None) -> Doc:
    found: Doc = {**owner(parent.scope, parent.scope_id), "parentRunId": parent.id}
    if step_id is not None:
        found["parentStepId"] = step_id
    return found


class MongoChildStore:
    def __init__(self, writes: RunWrites) -> None:
        # The runs' collections, clock and trail, shared with every other writer of runs.
        self._db, self._clock, self._trail = writes.db, writes.clock, writes.trail

    async def counts(self, parent: Run) -> dict[str, MapProgress]:
        """Each of `parent`'s map steps that made children: how many it made, and how many
        succeeded, failed (any other end), and are active (started and not ended)."""
        made = {s.id: s.map.total for s in parent.progress.steps if s.map is not None}
        if not made:
            return {}
        found: dict[str, dict[str, int]] = {step: {} for step in made}
        cursor = await self._db.runs.aggregate(
            [
                {"$match": _of(parent)},
                {"$group": {"_id": {"s": "$parentStepId", "t": "$status"}, "n": {"$sum": 1}}},
            ]
        )
        async for row in cursor:
            if row["_id"]["s"] in found:
                found[row["_id"]["s"]][row["_id"]["t"]] = row["n"]
        return {
            step: MapProgress(
                total=made[step],
                succeeded=n.get(RunStatus.SUCCEEDED, 0),
                failed=sum(n.get(s, 0) for s in _ENDED_BADLY),
                active=sum(n.get(s, 0) for s in LEASED | {RunStatus.WAITING_CHILDREN}),
            )
            for step, n in found.items()
        }

    async def ends(self, parent: Run, step_id: str) -> list[ChildEnd]:
        """The children of `parent`'s step `step_id` that ended, in item order."""
        found = {**_of(parent, step_id), "status": {"$in": sorted(TERMINAL)}}
        fields = {"mapIndex": 1, "status": 1, "result": 1, "error": 1}
        ended = [
            ChildEnd(
                str(d["_id"]),
                d["mapIndex"],
                RunStatus(d["status"]),
                d.get("result"),
                d.get("error"),
            )
            async for d in self._db.runs.find(found, fields)
        ]
        return sorted(ended, key=lambda end: end.index)

    async def active(self, parent: Run, step_id: str | None = None) -> list[Run]:
        """The children of `parent` (of its step `step_id`) that have not ended."""
        found = {**_of(parent, step_id), "status": {"$nin": sorted(TERMINAL)}}
        return [convert.run(d) async for d in self._db.runs.find(found, NO_TRAIL)]

    async def any_left(self, child: Run) -> bool:
        """Whether a sibling of `child` (of the same map step) has not ended."""
        assert child.parent_run_id is not None
        found = {
            **owner(child.scope, child.scope_id),
            "parentRunId": child.parent_run_id,
            "parentStepId": child.parent_step_id,
            "status": {"$nin": sorted(TERMINAL)},
        }
        return await self._db.runs.find_one(found, {"_id": 1}) is not None

    async def admit_next(self, child: Run, actor: str) -> Run | None:
        """Give a free place of `child`'s map step to its next waiting sibling (about item
        order), which stays `pending`, ready to queue; None if no place is free or no sibling
        waits. The sibling is picked and given the place in one write, so admitters never
        lose a race for the same sibling; the unique index decides between them for a place."""
        assert child.parent_run_id is not None and child.map_limit is not None
        siblings = {
            **owner(child.scope, child.scope_id),
            "parentRunId": child.parent_run_id,
            "parentStepId": child.parent_step_id,
        }
        for _ in range(child.map_limit + 1):
            # Hinted: the planner may otherwise walk every sibling under `children`.
            held = self._db.runs.find(
                {**siblings, "mapPlace": {"$exists": True}}, {"mapPlace": 1}, hint="map_places"
            )
            taken = {d["mapPlace"] async for d in held}
            free = [p for p in range(child.map_limit) if p not in taken]
            if not free:
                return None
            # Children ending together admit together: each tries a place of its own.
            place = random.choice(free)
            try:
                doc = await self._db.runs.find_one_and_update(
                    {**siblings, "status": RunStatus.PENDING, "mapWait": True},
                    _taking(place, actor, self._clock.now()),
                    {"trail": {"$slice": -1}},
                    sort=[("_id", 1)],
                    return_document=ReturnDocument.AFTER,
                )
            except DuplicateKeyError:
                continue  # another admitter took this place first: look again
            if doc is None:
                return None
            await self._trail.hand(doc["trail"])
            return convert.run(doc)
        return None

    # -- the scheduler's repairs: each finds what a process that died left undone -------------

    async def waiting_parents(self, limit: int) -> list[Run]:
        """Runs waiting for their children, longest waiting first."""
        found = {"status": RunStatus.WAITING_CHILDREN}
        cursor = self._db.runs.find(found, NO_TRAIL).sort("updateAt", 1).limit(limit)
        return [convert.run(d) async for d in cursor]

    async def waiting_children(self, limit: int) -> list[Run]:
        """A child waiting for a place, one for each map step that has any."""
        cursor = await self._db.runs.aggregate(
            [
                {"$match": {"status": RunStatus.PENDING, "mapWait": True}},
                {"$project": {"trail": 0}},
                {"$group": {"_id": ["$parentRunId", "$parentStepId"], "doc": {"$first": "$$ROOT"}}},
                {"$limit": limit},
            ]
        )
        return [convert.run(row["doc"]) async for row in cursor]

    async def orphaned(self, limit: int, ended_before: datetime) -> list[Run]:
        """Runs that ended before `ended_before` and still have children not ended (their end
        was not carried to them)."""
        cursor = await self._db.runs.aggregate(
            [
                {
                    "$match": {
                        "parentRunId": {"$exists": True},
                        "status": {"$nin": sorted(TERMINAL)},
                    }
                },
                {"$group": {"_id": "$parentRunId"}},
                {"$limit": 10 * limit},
            ]
        )
        ids = [ObjectId(row["_id"]) async for row in cursor]
        if not ids:
            return []
        ended = {
            "_id": {"$in": ids},
            "status": {"$in": sorted(TERMINAL)},
            "completedAt": {"$lt": ended_before},
        }
        return [convert.run(d) async for d in self._db.runs.find(ended, NO_TRAIL).limit(limit)]


def _taking(place: int, actor: str, now: datetime) -> list[Doc]:
    """A waiting child takes `place`, with its `map_place_taken` event, built from the run as
    the write finds it (as a claim's event is)."""
    event = {
        "_id": ObjectId(),
        "jobId": {"$toString": "$_id"},
        "type": "map_place_taken",
        "actor": {"$literal": actor},
        "scope": "$scope",
        "scopeId": "$scopeId",
        "metadata": {"place": {"$literal": place}},
        "runVersion": {"$add": ["$version", 1]},
        "createAt": now,
    }
    return [
        {
            "$set": {
                "mapPlace": {"$literal": place},
                "updateAt": now,
                "version": {"$add": ["$version", 1]},
                "trail": {"$concatArrays": [{"$ifNull": ["$trail", []]}, [event]]},
            }
        },
        {"$unset": "mapWait"},
    ]
