"""Lent steps in MongoDB: a run's holder lends a ready step whose handler it lacks to a worker
that offers it, while the run's other steps run (docs/architecture.md, "Lent steps").

Every write here is a move of `model/status.py`'s `STEP_MOVES`, its filter built from the
move's sources (`_in`). The holder's moves are fenced by the run's lease; a borrower's claim
needs the run running and the step lent, and its later moves are fenced by the step's lease.
No move changes the run's status.
"""

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta

from bson import ObjectId
from pymongo import UpdateOne

from jobplane.model import (
    LEASED,
    STEP_MOVES,
    Run,
    RunStatus,
    StepLease,
    StepLeaseState,
    StepOutcome,
    StepProgress,
    StepStatus,
    StepWriter,
)
from jobplane.store import convert
from jobplane.store.convert import NO_TRAIL, Doc, known_owner
from jobplane.store.types import Known, Lease, Lost, lease_token
from jobplane.store.writes import RunWrites, TrailEntry, fence, recorded


def _in(index: int, *states: StepLeaseState) -> Doc:
    """The filter of a step whose lease is in one of `states`."""
    s = f"progress.steps.{index}.lease"
    options: list[Doc] = []
    for state in states:
        match state:
            case StepLeaseState.NONE:
                options.append({s: {"$exists": False}})
            case StepLeaseState.LENT:
                options.append({s: {"$exists": True}, f"{s}.workerId": {"$exists": False}})
            case StepLeaseState.CLAIMED:
                options.append({f"{s}.token": {"$exists": True}})
            case StepLeaseState.REPORTED:
                options.append({f"{s}.outcome": {"$exists": True}})
    return options[0] if len(options) == 1 else {"$or": options}


def _from(move: str, index: int, *states: StepLeaseState) -> Doc:
    """The filter of `move` from `states` (all its sources when none are named)."""
    sources = STEP_MOVES[move].sources
    assert set(states) <= sources, f"{move} moves from {sorted(sources)}"
    return _in(index, *(states or sorted(sources)))


class MongoLendingStore:
    def __init__(self, writes: RunWrites) -> None:
        self._writes = writes
        self._db, self._clock, self._trail = writes.db, writes.clock, writes.trail

    async def lend(
        self, lease: Lease, index: int, step_id: str, handler: str, attempt: int
    ) -> Lost | None:
        """The holder lends step `index` (its `attempt`-th try) to a worker offering
        `handler`."""
        assert STEP_MOVES["lend"].by is StepWriter.HOLDER and lease.step is None
        now = self._clock.now()
        lent = StepLease(handler=handler, attempt=attempt, lent_at=now)
        update = {"$set": {f"progress.steps.{index}.lease": _doc(lent)}}
        events: list[TrailEntry] = [("step_lent", None, {"step": step_id, "handler": handler})]
        where = _from("lend", index)
        return await self._writes.fenced(lease, "lend", update, events, now, where)

    async def claim(
        self, steps: Sequence[tuple[str, int]], worker_id: str, lease_seconds: float
    ) -> list[tuple[Run, Lease]]:
        """The step-level claim: a worker offering lent steps' handlers takes their leases.
        `steps` are (run id, step index); one read finds their runs, and each step still lent
        is claimed by a conditional write of its own, which group commit sends together. A
        step lent no more, or whose run does not run, is left out."""
        oids = sorted({oid for run_id, _ in steps if (oid := convert.object_id(run_id))})
        running = {"_id": {"$in": oids}, "status": RunStatus.RUNNING}
        docs = {str(d["_id"]): d async for d in self._db.runs.find(running, NO_TRAIL)}
        claims = [
            self._claim(docs[run_id], index, worker_id, lease_seconds)
            for run_id, index in steps
            if run_id in docs
        ]
        return [claimed for claimed in await asyncio.gather(*claims) if claimed is not None]

    async def _claim(
        self, doc: Doc, index: int, worker_id: str, lease_seconds: float
    ) -> tuple[Run, Lease] | None:
        run = convert.run(doc)
        steps = run.progress.steps
        lent = steps[index].lease if index < len(steps) else None
        if lent is None or lent.worker_id is not None or lent.stop:
            return None  # as read: the write below would refuse it too
        now = self._clock.now()
        token = lease_token()
        s = f"progress.steps.{index}.lease"
        until = now + timedelta(seconds=lease_seconds)
        update: Doc = {
            "$set": {f"{s}.workerId": worker_id, f"{s}.token": token, f"{s}.until": until},
            "$inc": {"version": 1},
        }
        lease = Lease(run.id, worker_id, token, step=index)
        claimed = ("step_claimed", None, {"step": steps[index].id, "lease": token[:8]})

        def trail(state: Known) -> list[Doc]:
            return recorded(run.id, lease.actor, state, now, [claimed])

        query = {
            "_id": doc["_id"],
            **known_owner(None, (run.scope, run.scope_id)),
            "status": RunStatus.RUNNING,
            **_from("claim_step", index),
            # A step its holder asked to stop before anyone claimed it is not started.
            f"{s}.stop": {"$exists": False},
        }
        running = frozenset({RunStatus.RUNNING})
        written = await self._writes.write(
            query, lambda _: update, convert.known(doc), running, None, trail
        )
        if written is None:
            return None
        state, appended = written
        lease.known = replace(state, version=state.version + 1)
        await self._trail.hand(appended)
        return run, lease

    async def give_back(self, lease: Lease, step_id: str) -> Lost | None:
        """The borrower shuts down before the step ends: it is lent again, to another
        worker."""
        assert lease.step is not None
        index, now = lease.step, self._clock.now()
        s = f"progress.steps.{index}"
        update: Doc = {
            "$set": {f"{s}.status": StepStatus.PENDING},
            "$unset": {f"{s}.lease.workerId": "", f"{s}.lease.token": "", f"{s}.lease.until": ""},
        }
        events: list[TrailEntry] = [("step_given_back", None, {"step": step_id})]
        where = _from("give_back", index)
        return await self._writes.fenced(lease, "give_back", update, events, now, where)

    async def report(self, lease: Lease, outcome: StepOutcome) -> Lost | None:
        """The borrower says how the step ended; its lease ends with it."""
        assert lease.step is not None
        index, now = lease.step, self._clock.now()
        s = f"progress.steps.{index}.lease"
        update: Doc = {
            "$set": {f"{s}.outcome": _doc(outcome)},
            "$unset": {f"{s}.token": "", f"{s}.until": ""},
        }
        where = _from("report_step", index)
        return await self._writes.fenced(lease, "report_step", update, [], now, where)

    async def take_back(
        self, lease: Lease, index: int, step_id: str, token: str | None, reason: str
    ) -> Lost | None:
        """The holder takes back step `index`: unclaimed (`token` None), or claimed under
        `token` whose lease ran out."""
        now = self._clock.now()
        s = f"progress.steps.{index}"
        if token is None:
            where = _from("take_back", index, StepLeaseState.LENT)
        else:
            where = {
                **_from("take_back", index, StepLeaseState.CLAIMED),
                f"{s}.lease.token": token,
                f"{s}.lease.until": {"$lt": now},
            }
        update: Doc = {"$set": {f"{s}.status": StepStatus.PENDING}, "$unset": {f"{s}.lease": ""}}
        events: list[TrailEntry] = [("step_taken_back", reason, {"step": step_id})]
        return await self._writes.fenced(lease, "take_back", update, events, now, where)

    async def ask_stop(self, lease: Lease, index: int) -> Lost | None:
        """The holder asks the borrower to stop (a step beside it failed the run): it hears
        so at its next heartbeat, or at once from a cancel signal."""
        s = f"progress.steps.{index}.lease"
        update: Doc = {"$set": {f"{s}.stop": True}}
        where = {s: {"$exists": True}}
        return await self._writes.fenced(lease, "ask_stop", update, [], self._clock.now(), where)

    async def step(self, lease: Lease, index: int) -> StepProgress | None:
        """Step `index` of the run as it stands, for the holder watching it while lent; None
        once `lease` holds the run no more."""
        query = {
            "_id": ObjectId(lease.run_id),
            **known_owner(lease.known),
            "status": {"$in": sorted(LEASED)},
            **fence(lease),
        }
        only = {"progress.steps": {"$slice": [index, 1]}, "_id": 1}
        doc = await self._db.runs.find_one(query, only)
        if doc is None:
            return None
        return StepProgress.model_validate(doc["progress"]["steps"][0])

    async def heartbeat(
        self, leases: Sequence[Lease], lease_seconds: float
    ) -> tuple[set[str], set[str]]:
        """Renew step leases. Returns the keys of those still held and, among them, those
        asked to stop: their run's cancel was requested, or their holder asked."""
        if not leases:
            return set(), set()
        now = self._clock.now()
        until = now + timedelta(seconds=lease_seconds)
        ops = []
        for lease in leases:
            assert lease.step is not None
            query = {
                "_id": ObjectId(lease.run_id),
                **known_owner(lease.known),
                "status": {"$in": sorted(LEASED)},
                **fence(lease),
            }
            s = f"progress.steps.{lease.step}.lease.until"
            ops.append(UpdateOne(query, {"$set": {s: until}}))
        await self._db.runs.bulk_write(ops, ordered=False)
        ids = sorted({ObjectId(lease.run_id) for lease in leases})
        found = self._db.runs.find({"_id": {"$in": ids}}, {"status": 1, "progress.steps.lease": 1})
        docs = {str(d["_id"]): d for d in await found.to_list()}
        kept: set[str] = set()
        stop: set[str] = set()
        for lease in leases:
            doc = docs.get(lease.run_id)
            assert lease.step is not None
            steps = doc.get("progress", {}).get("steps", []) if doc else []
            lent = (steps[lease.step].get("lease") or {}) if lease.step < len(steps) else {}
            if doc is None or doc["status"] not in LEASED or lent.get("token") != lease.token:
                continue
            kept.add(lease.key)
            if doc["status"] == RunStatus.CANCEL_REQUESTED or lent.get("stop"):
                stop.add(lease.key)
        return kept, stop


def _doc(value: StepLease | StepOutcome) -> Doc:
    return value.model_dump(by_alias=True, exclude_none=True)
