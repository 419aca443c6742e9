"""Admissions under `maxRunning`: each capped template's gate (`job_gates`) lists the runs it
admitted to start, and MongoDB decides each admission in one single-document update.

A claim of capped runs first asks the gate to admit them (`admit`): in one pipeline update,
each run in the caller's order is added while the list is shorter than the run's own cap. The
claim then takes the admitted runs under the admission's token, fenced by time: its filter
holds only until `ADMISSION_SECONDS` after the admission, by the server's clock. A run leaves
the list when it leaves its started statuses (`leave`, which `transitions` calls after every
such write), so the list always holds every started capped run, and a run started under it
never takes a place the list does not show.

What a process that died leaves behind (an admission its claim never used, or one its run's
end never took back) only holds a place too many: the cap errs on the side of fewer starts.
`sweep` takes such admissions back once they are old enough that no claim can still use them
(the fence) and their run is not started under them.
"""

import asyncio
from collections.abc import Sequence
from datetime import datetime, timedelta

from bson import ObjectId
from pymongo import ReturnDocument, UpdateOne
from pymongo.write_concern import WriteConcern

from jobplane.groupcommit import GroupCommit
from jobplane.model import LEASED
from jobplane.store.convert import Doc
from jobplane.store.database import Collections
from jobplane.store.types import Admission

# How long an admission lets its claim take the run, by the server's clock. A claim that
# arrives later takes nothing and gives the admission back.
ADMISSION_SECONDS = 10.0
# An admission this old is past its claim's fence on any server whose clock is within
# `SWEEP_AFTER_SECONDS - ADMISSION_SECONDS` of the gate's.
SWEEP_AFTER_SECONDS = 60.0


class MongoGateStore:
    def __init__(self, db: Collections) -> None:
        self._gates = db.gates
        self._runs = db.runs
        # A place given back too late only keeps a run waiting (a write lost to a failover is
        # swept), so taking it back waits for no journal.
        self._freeing = db.gates.with_options(write_concern=WriteConcern(w=1))
        # Runs end by the hundred a second: their admissions leave in one write per batch.
        self._leaving = GroupCommit(self._leave_many)

    async def admit(
        self, template_type: str, runs: Sequence[tuple[ObjectId, int]], token: str
    ) -> tuple[list[ObjectId], datetime | None]:
        """Admit, in order, each of `runs` (id, its own cap) while fewer than its cap are
        admitted, under `token`: the ids admitted, and until when (the server's clock) their
        claim may take them (None when none was). A run admitted already (under another
        token) is not admitted again: its claim is on its way, or its admission waits for
        `sweep`."""
        candidates = [{"run": oid, "cap": cap} for oid, cap in runs]
        entry = {"run": "$$this.run", "token": {"$literal": token}, "at": "$$NOW"}
        fits = {
            "$and": [
                {"$lt": [{"$size": "$$value"}, "$$this.cap"]},
                {"$not": [{"$in": ["$$this.run", "$$value.run"]}]},
            ]
        }
        admitted = {
            "$reduce": {
                "input": {"$literal": candidates},
                "initialValue": {"$ifNull": ["$admitted", []]},
                "in": {"$cond": [fits, {"$concatArrays": ["$$value", [entry]]}, "$$value"]},
            }
        }
        mine = {"$eq": ["$$this.token", {"$literal": token}]}
        doc = await self._gates.find_one_and_update(
            {"_id": template_type},
            [{"$set": {"admitted": admitted}}],
            {"admitted": {"$filter": {"input": "$admitted", "cond": mine}}},
            upsert=True,
            return_document=ReturnDocument.AFTER,
        )
        assert doc is not None  # upserted
        entries: list[Doc] = doc["admitted"]
        if not entries:
            return [], None
        # One update: every entry has the same `$$NOW`.
        until = entries[0]["at"] + timedelta(seconds=ADMISSION_SECONDS)
        return [e["run"] for e in entries], until

    async def leave(self, admissions: Sequence[Admission]) -> None:
        """Take admissions back: their runs left their started statuses, or their claim did
        not take them. Concurrent callers share one write per gate."""
        await asyncio.gather(*(self._leaving.submit(a) for a in admissions))

    async def admitted(self, template_type: str) -> int:
        """How many runs the template's gate admits now: its started runs, plus admissions on
        their way to a claim or left behind by a process that died."""
        cursor = await self._gates.aggregate(
            [
                {"$match": {"_id": template_type}},
                {"$project": {"n": {"$size": {"$ifNull": ["$admitted", []]}}}},
            ]
        )
        found = await cursor.to_list()
        return int(found[0]["n"]) if found else 0

    async def sweep(self, template_type: str) -> int:
        """Take back the template's admissions that no run is started under and no claim can
        still use (older than `SWEEP_AFTER_SECONDS`); how many."""
        old = {"$lt": ["$$this.at", {"$subtract": ["$$NOW", SWEEP_AFTER_SECONDS * 1000]}]}
        cursor = await self._gates.aggregate(
            [
                {"$match": {"_id": template_type}},
                {"$project": {"old": {"$filter": {"input": "$admitted", "cond": old}}}},
            ]
        )
        found = await cursor.to_list()
        entries: list[Doc] = found[0]["old"] if found and found[0]["old"] else []
        if not entries:
            return 0
        started = self._runs.find(
            {
                "_id": {"$in": [e["run"] for e in entries]},
                "status": {"$in": sorted(LEASED)},
            },
            {"admissionToken": 1},
        )
        live = {(d["_id"], d.get("admissionToken")) async for d in started}
        # A claim can no longer use these (their fence has passed), so no run starts under
        # them between this read and the write below.
        dead = [e for e in entries if (e["run"], e["token"]) not in live]
        if dead:
            await self._freeing.update_one(
                {"_id": template_type},
                {"$pull": {"admitted": {"$or": [_entry(e["run"], e["token"]) for e in dead]}}},
            )
        return len(dead)

    async def _leave_many(self, admissions: list[Admission]) -> list[None]:
        by_gate: dict[str, list[Admission]] = {}
        for a in admissions:
            by_gate.setdefault(a.template_type, []).append(a)
        await self._freeing.bulk_write(
            [
                UpdateOne(
                    {"_id": template_type},
                    {"$pull": {"admitted": {"$or": [_entry(a.run_id, a.token) for a in some]}}},
                )
                for template_type, some in by_gate.items()
            ],
            ordered=False,
        )
        return [None] * len(admissions)


def _entry(run_id: ObjectId, token: str) -> Doc:
    """The condition on a gate's list that matches one admission, and no later one of its
    run."""
    return {"run": run_id, "token": token}
