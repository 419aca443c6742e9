"""Admissions under `maxRunning`: each capped template's gate (`job_gates`) lists the places it
granted to start runs in, and MongoDB decides each grant in one single-document update.

A claim of capped runs first takes a place for each (`admit`): in one pipeline update, places
are added while the list is shorter than the runs' cap. The claim then takes its runs, each
under its place's token, fenced by time: its filter holds only until `ADMISSION_SECONDS` after
the place was granted, by the server's clock. A run gives its place back when it leaves its
started statuses (`free`, which `transitions` calls after every such write), so the list
always holds every started capped run's place, and a run started under it never takes a place
the list does not show.

Under a cap of `SPARE_MIN_CAP` or more, a grant also takes spare places while the list is
under half full, which this process keeps for its next claims of that template: those start
their runs without waiting for a grant of their own. A run that ends here leaves its place to
the spares likewise (`free`), without a write. A place is used only while it is fresh (well
within its fence); older spares go back (`give_back_spares`), as do the places of runs that
end later. Such a place starts runs without the gate's say, so its entry keeps its cap, which
binds every later grant (`_grant`).

What a process that died leaves behind (a place its claim never used, its spares, or one its
run's end never gave back) only holds a place too many: the cap errs on the side of fewer
starts. `sweep` takes such places back once they are old enough that no claim can still use
them (the fence) and no run is started under them.
"""

import asyncio
import secrets
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from bson import ObjectId
from pymongo import ReturnDocument, UpdateOne
from pymongo.write_concern import WriteConcern

from jobplane.groupcommit import GroupCommit
from jobplane.model import LEASED
from jobplane.store.convert import Doc
from jobplane.store.database import Collections
from jobplane.store.types import Admission

# How long a place lets a claim take a run in it, by the server's clock. A claim that arrives
# later takes nothing.
ADMISSION_SECONDS = 10.0
# A place this old is past its claim's fence on any server whose clock is within
# `SWEEP_AFTER_SECONDS - ADMISSION_SECONDS` of the gate's.
SWEEP_AFTER_SECONDS = 60.0
# Caps below this get no spare places: a place idle in one worker's hands would keep another
# worker's run waiting, and a small cap is there to be reached.
SPARE_MIN_CAP = 64
# Spare places a grant asks for, and the most a process keeps per template and cap.
SPARES = 32
# The share of a place's fence within which this process still uses it as a spare: the rest
# is margin for the grant's round trip and for the claim that uses it.
SPARE_SHARE = 0.8


@dataclass(frozen=True)
class Place:
    """A place granted under a template's cap: a claim takes one run in it, under its token,
    before `until` (the server's clock). As a spare it is used only before `spare_until`
    (this process's monotonic clock)."""

    token: str
    cap: int
    until: datetime
    spare_until: float


class MongoGateStore:
    def __init__(self, db: Collections) -> None:
        self._gates = db.gates
        self._runs = db.runs
        # A place given back too late only keeps a run waiting (a write lost to a failover is
        # swept), so giving it back waits for no journal.
        self._freeing = db.gates.with_options(write_concern=WriteConcern(w=1))
        # Runs end by the hundred a second: their places leave in one write per batch.
        self._leaving = GroupCommit(self._leave_many)
        # This process's spare places, by template and cap.
        self._spares: dict[tuple[str, int], list[Place]] = {}
        # Whether the last grant under a template and cap found the list under half full (it
        # got spares): only then are places kept as spares.
        self._roomy: dict[tuple[str, int], bool] = {}
        # The places this process's claims started runs in, by token: a run that ends here
        # leaves its place to this process's next claim rather than to the gate.
        self._started: dict[str, Place] = {}

    async def admit(
        self, template_type: str, runs: Sequence[tuple[ObjectId, int]]
    ) -> tuple[list[tuple[ObjectId, Place]], list[ObjectId]]:
        """A place, in order, for each of `runs` (id, its own cap) while fewer than its cap
        are taken: the runs placed, each with its place, and the runs the cap held back.
        Spares are used first; a grant is asked only for the runs they do not cover. The
        caller's claim then says which places it used (`settle`)."""
        by_cap: dict[int, list[ObjectId]] = {}
        for oid, cap in runs:
            by_cap.setdefault(cap, []).append(oid)
        placed: list[tuple[ObjectId, Place]] = []
        over: list[ObjectId] = []
        for cap, oids in by_cap.items():
            places = self._take_spares(template_type, cap, len(oids))
            if need := len(oids) - len(places):
                granted = await self._grant(template_type, cap, need)
                places += granted[:need]
                await self._keep_or_leave(template_type, granted[need:])
            placed += zip(oids, places, strict=False)
            over += oids[len(places) :]
        return placed, over

    async def settle(
        self, template_type: str, placed: Sequence[tuple[ObjectId, Place]], started: set[ObjectId]
    ) -> None:
        """After the claim of `placed`: the places of the runs it `started` are theirs until
        they end (`free`); the others are kept as spares or given back."""
        for oid, place in placed:
            if oid in started:
                self._started[place.token] = place
        await self._keep_or_leave(
            template_type, [place for oid, place in placed if oid not in started]
        )

    async def free(self, admission: Admission) -> None:
        """A run left its started statuses: its place goes back to the gate, or, if this
        process started it there and the place is fresh, to this process's spares."""
        mine = self._started.pop(admission.token, None)
        if mine is None:
            await self.leave([admission])
        else:
            await self._keep_or_leave(admission.template_type, [mine])

    async def give_back_spares(self, everything: bool = False) -> dict[str, int]:
        """Give back the spares too old to use (all of them with `everything`, as the process
        stops): how many, by template."""
        now = time.monotonic()
        # Places of runs started here that are too old to keep: their ends give them back.
        for token in [t for t, p in self._started.items() if p.spare_until <= now]:
            del self._started[token]
        stale: list[Admission] = []
        for (template_type, _), spares in self._spares.items():
            old = [p for p in spares if everything or p.spare_until <= now]
            stale += [Admission(template_type, None, p.token) for p in old]
            spares[:] = [p for p in spares if p not in old]
        if stale:
            await self.leave(stale)
        return dict(Counter(a.template_type for a in stale))

    async def leave(self, admissions: Sequence[Admission]) -> None:
        """Give places back: their runs left their started statuses, or no claim used them.
        Concurrent callers share one write per gate."""
        await asyncio.gather(*(self._leaving.submit(a) for a in admissions))

    async def admitted(self, template_type: str) -> int:
        """How many places the template's gate has granted now: its started runs', plus
        places on their way to a claim, spares, and places left by a process that died."""
        cursor = await self._gates.aggregate(
            [
                {"$match": {"_id": template_type}},
                {"$project": {"n": {"$size": {"$ifNull": ["$admitted", []]}}}},
            ]
        )
        found = await cursor.to_list()
        return int(found[0]["n"]) if found else 0

    async def sweep(self, template_type: str) -> int:
        """Take back the template's places that no run is started in and no claim can still
        use (older than `SWEEP_AFTER_SECONDS`); how many."""
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
                "admissionToken": {"$in": sorted({e["token"] for e in entries})},
                "status": {"$in": sorted(LEASED)},
            },
            {"admissionToken": 1},
        )
        live = {(d["_id"], d["admissionToken"]) async for d in started}
        tokens = {token for _, token in live}
        # A claim can no longer use these (their fence has passed), so no run starts in them
        # between this read and the write below.
        dead = [
            e
            for e in entries
            if ((e["run"], e["token"]) not in live if "run" in e else e["token"] not in tokens)
        ]
        if dead:
            await self._freeing.update_one(
                {"_id": template_type},
                {"$pull": {"admitted": {"$or": [_entry(e.get("run"), e["token"]) for e in dead]}}},
            )
        return len(dead)

    def _keep(self, template_type: str, places: Sequence[Place]) -> list[Place]:
        """Keep places as spares where their cap has spares, the gate was roomy at its last
        grant, and they are fresh enough; returns those not kept."""
        now = time.monotonic()
        kept: list[Place] = []
        for place in places:
            key = (template_type, place.cap)
            if place.spare_until <= now or not self._roomy.get(key):
                continue
            spares = self._spares.setdefault(key, [])
            # Stale spares wait in the list for `give_back_spares`, and do not count.
            if sum(p.spare_until > now for p in spares) < SPARES:
                spares.append(place)
                kept.append(place)
        return [p for p in places if p not in kept]

    async def _keep_or_leave(self, template_type: str, places: Sequence[Place]) -> None:
        if back := self._keep(template_type, places):
            await self.leave([Admission(template_type, None, p.token) for p in back])

    def _take_spares(self, template_type: str, cap: int, n: int) -> list[Place]:
        """Up to `n` of this process's spares for the template and cap, still fresh."""
        spares = self._spares.get((template_type, cap))
        if not spares:
            return []
        now = time.monotonic()
        usable = [p for p in spares if p.spare_until > now][:n]
        spares[:] = [p for p in spares if p not in usable]
        return usable

    async def _grant(self, template_type: str, cap: int, n: int) -> list[Place]:
        """Grant up to `n` places under `cap`, in one update that MongoDB applies alone to
        the gate; under a cap with spares, up to `SPARES` more while the list is under half
        full. The places granted, those for the `n` first. The cap is the smaller of `cap`
        and that of every place in the list that names one."""
        spare = SPARES if cap >= SPARE_MIN_CAP else 0
        tokens = [secrets.token_hex(12) for _ in range(n + spare)]
        # A place under a cap with spares may start a run later without asking the gate
        # (as a spare, or kept when its run ends here): so that the run, whenever it starts,
        # finds fewer than its cap started, no grant goes past the cap of such a place in the
        # list, whatever its own (versions may differ). Their entries keep their cap for it.
        named = {"cap": cap} if spare else {}
        candidates = [
            {"token": t, "most": cap if i < n else cap // 2, **named} for i, t in enumerate(tokens)
        ]
        entry = {"token": "$$this.token", "at": "$$NOW", "cap": "$$this.cap"}
        most = {"$min": ["$$this.most", {"$min": "$$value.cap"}]}
        fits = {"$lt": [{"$size": "$$value"}, most]}
        admitted = {
            "$reduce": {
                "input": {"$literal": candidates},
                "initialValue": {"$ifNull": ["$admitted", []]},
                "in": {"$cond": [fits, {"$concatArrays": ["$$value", [entry]]}, "$$value"]},
            }
        }
        mine = {"$in": ["$$this.token", {"$literal": tokens}]}
        asked = time.monotonic()
        doc = await self._gates.find_one_and_update(
            {"_id": template_type},
            [{"$set": {"admitted": admitted}}],
            {"admitted": {"$filter": {"input": "$admitted", "cond": mine}}},
            upsert=True,
            return_document=ReturnDocument.AFTER,
        )
        assert doc is not None  # upserted
        entries: list[Doc] = doc["admitted"]
        if spare:
            # Spares fit only while the list is under half full.
            self._roomy[(template_type, cap)] = len(entries) > n
        spare_until = asked + ADMISSION_SECONDS * SPARE_SHARE
        return [
            Place(e["token"], cap, e["at"] + timedelta(seconds=ADMISSION_SECONDS), spare_until)
            for e in entries
        ]

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


def _entry(run_id: ObjectId | None, token: str) -> Doc:
    """The condition on a gate's list that matches one place, by its token. Places granted
    before spares existed name their run and share their claim's token: of those, only the
    run's own."""
    if run_id is None:
        return {"token": token}
    return {"token": token, "run": {"$in": [run_id, None]}}
