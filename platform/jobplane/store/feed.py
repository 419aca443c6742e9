"""The notifier's feed: what it fans out to webhooks, and where it is in it.

The feed is one change stream over the database, with one position: the trail events that
reach `job_events`, and the steps' progress reports, which write the run only (`progress` is
frequent, so it has no trail event). A report is known by the `progress.reportedAt` it sets.
Both kinds come in the order they were written, so one resume token says where the notifier
is in both.

The stream's filter never changes: a token can only resume a stream whose filter still matches
the change it names.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pymongo.asynchronous.change_stream import AsyncChangeStream

from jobplane.model import Run
from jobplane.store import convert
from jobplane.store.convert import Doc, object_id
from jobplane.store.database import Collections
from jobplane.store.types import WATCH_WAIT_MS

# The type the feed gives a step's progress report, which is no trail event.
PROGRESS_REPORTED = "progress_reported"
# The trail fields a delivery's `sequence` needs (a run's trail can be long). Excluding more
# of them cost mongod more than decoding them cost the notifier (`docs/benchmarks.md`).
_TRAIL_ORDER = {"trail.metadata": 0, "trail.message": 0, "trail.actor": 0, "trail.from": 0}
_POSITION = "webhook_feed"


@dataclass(frozen=True)
class Position:
    """Where the notifier is in the feed: the change stream's resume token after the last
    news it fanned out (None before the first notifier, or while idle), the time of the last
    of them, and since when it has been idle (no webhook enabled, so nothing followed)."""

    token: Any
    at: datetime | None
    idle_since: datetime | None


@dataclass(frozen=True)
class FedRun:
    """A run as the fan-out reads it, with its trail as (event id, run version), in order."""

    run: Run
    trail: tuple[tuple[str, int], ...]


class MongoFeedStore:
    def __init__(self, db: Collections) -> None:
        self._db = db

    async def watch(self, after: Any, types: Sequence[str]) -> AsyncChangeStream[Doc]:
        """Trail events of `types` as they reach `job_events`, and progress reports as they
        reach their runs, in the order they do: after the change whose resume token is
        `after`, or from now on if it is None. Every event reaches `job_events` once (a second
        copy is a no-op), whether its writer or the sweep copied it: late, if the sweep did."""
        reported = {
            "$getField": {
                "field": "progress.reportedAt",
                "input": "$updateDescription.updatedFields",
            }
        }
        match = {
            "$or": [
                {
                    "ns.coll": self._db.events.name,
                    "operationType": "insert",
                    "fullDocument.type": {"$in": list(types)},
                },
                {
                    "ns.coll": self._db.runs.name,
                    "operationType": "update",
                    "$expr": {"$ne": [{"$type": reported}, "missing"]},
                },
            ]
        }
        return await self._db.runs.database.watch(
            [{"$match": match}], start_after=after, max_await_time_ms=WATCH_WAIT_MS
        )

    def news(self, change: Doc) -> Doc:
        """What a change of `watch` brings, shaped as a trail event: a progress report is a
        `progress_reported` of its run, known by the run's version after it."""
        if change["ns"]["coll"] == self._db.events.name:
            return dict(change["fullDocument"])
        fields = change["updateDescription"]["updatedFields"]
        run_id, version = str(change["documentKey"]["_id"]), fields["version"]
        return {
            "_id": f"{run_id}.{version}",
            "type": PROGRESS_REPORTED,
            "jobId": run_id,
            "runVersion": version,
            "createAt": fields["progress.reportedAt"],
            "metadata": {},
        }

    async def runs_of(self, run_ids: Sequence[str]) -> dict[str, FedRun]:
        """The runs, live or archived, each with its trail's order."""
        ids = [oid for r in set(run_ids) if (oid := object_id(r)) is not None]
        found: dict[str, FedRun] = {}
        for collection in (self._db.runs, self._db.archive):
            missing = [oid for oid in ids if str(oid) not in found]
            if not missing:
                break
            async for doc in collection.find({"_id": {"$in": missing}}, _TRAIL_ORDER):
                trail = tuple((str(e["_id"]), e["runVersion"]) for e in doc.pop("trail", []))
                found[str(doc["_id"])] = FedRun(convert.run(doc), trail)
        return found

    async def position(self) -> Position:
        doc = await self._db.meta.find_one({"_id": _POSITION}) or {}
        return Position(doc.get("token"), doc.get("at"), doc.get("idleSince"))

    async def save_position(self, token: Any, at: datetime | None) -> None:
        """Save the stream's position, and with `at` the time of the last news before it."""
        fields: Doc = {"token": token, "idleSince": None}
        if at is not None:
            fields["at"] = at
        await self._db.meta.update_one({"_id": _POSITION}, {"$set": fields}, upsert=True)

    async def go_idle(self, since: datetime) -> None:
        """The notifier stopped following the feed at `since`: no webhook was enabled."""
        await self._db.meta.update_one(
            {"_id": _POSITION}, {"$set": {"token": None, "idleSince": since}}, upsert=True
        )
