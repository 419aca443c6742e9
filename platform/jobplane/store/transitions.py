"""A run's transitions: each row of `model.status.TRANSITIONS` as the store method of its name.

Each method is one conditional write of its row (`rows.py` turns the row's guards into the
filter and what entering its target means into the update) plus what only its caller knows:
a step's output, an error, a cancel's reason. The write appends a `status_changed` event
naming the row, and the method's other events, to the run's trail.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from bson import ObjectId
from pymongo.errors import PyMongoError

from jobplane.model import (
    LEASED,
    TRANSITIONS,
    AttemptChange,
    LockWait,
    Run,
    RunError,
    StartLimits,
    StepStatus,
)
from jobplane.store import convert, rows, steps
from jobplane.store.convert import NO_TRAIL, OWNER_FIELDS, Doc, known_owner, merged, object_id
from jobplane.store.gates import MongoGateStore
from jobplane.store.steps import HELD_STEP, RUNNING_STEP, UNDONE_STEP, WAITING_STEP
from jobplane.store.types import Admission, Known, Lease, Lost, Moved, lease_token
from jobplane.store.writes import RunWrites, TrailEntry, held_by, recorded

log = logging.getLogger("jobplane.store")


@dataclass(frozen=True)
class _Claim:
    """A claim's write: the runs it was over, its events' ids and its lease."""

    oids: list[ObjectId]
    event_ids: list[ObjectId]
    worker_id: str
    token: str


class MongoTransitionStore:
    def __init__(self, writes: RunWrites, gates: MongoGateStore) -> None:
        self._writes = writes
        self._gates = gates
        self._db, self._clock, self._trail = writes.db, writes.clock, writes.trail

    async def enqueue(
        self, run_id: str, actor: str, scope: tuple[str, str] | None = None
    ) -> Moved | Lost:
        """pending → queued: a run that took the dedupe key it waited for, or one the
        reconciler found `pending` (its process died before it could queue it).

        Here and in the other writes by run id, `scope` is the run's scope, when the caller
        knows it: the write then goes to the run's shard alone (see `SHARD_KEYS`).
        """
        return await self._apply("enqueue", run_id, actor, scope=scope)

    async def claim(
        self,
        run_ids: Sequence[str],
        worker_id: str,
        lease_seconds: float,
        token: str | None = None,
    ) -> list[tuple[Run, Lease]]:
        """Lease every claimable run without limits among `run_ids` to `worker_id` under
        `token` (the worker's, which took the runs' first locks under it), or a fresh one.

        One conditional `update_many` and one read-back take the leases; ids whose runs are no
        longer claimable (cancelled, claimed by another worker, not yet due) or have limits to
        pass (`claim_limited`) are not returned. Ids popped from Redis come without their runs'
        scopes, so on a sharded cluster both go to every shard: a `find_one_and_update` would
        need the shard key (MongoDB 6.0), while a multi-document update and a read may go by
        `_id` alone.
        """
        oids = [oid for oid in map(object_id, run_ids) if oid]
        if not oids:
            return []
        now = self._clock.now()
        taken = await self._take("claim", oids, worker_id, lease_seconds, now, token=token)
        docs = await self._read(taken)
        return await self._leased(docs, worker_id)

    async def claim_limited(
        self,
        runs: Sequence[tuple[str, StartLimits]],
        worker_id: str,
        lease_seconds: float,
        at: datetime,
    ) -> tuple[list[tuple[Run, Lease]], list[str]]:
        """Lease runs (ids, with their limits) that have limits to pass as they start, which
        the caller checked but for `maxRunning`: returns the runs leased, and the ids of those
        their template's `maxRunning` held back.

        Runs of a template with `maxRunning` are claimed once their template's gate admits
        them (`_claim_capped`): a Redis wipe cannot let more start. Runs without one are
        claimed at `at`, the time their rate window counted them from.
        """
        claimed: list[tuple[Run, Lease]] = []
        held: list[str] = []
        free = [oid for i, limits in runs if limits.max_running is None if (oid := object_id(i))]
        if free:
            taken = await self._take("claim_limited", free, worker_id, lease_seconds, at)
            docs = await self._read(taken)
            claimed += await self._leased(docs, worker_id)
        capped: dict[str, list[tuple[ObjectId, int]]] = {}
        for run_id, limits in runs:
            if limits.max_running is not None and (oid := object_id(run_id)):
                capped.setdefault(limits.template_type, []).append((oid, limits.max_running))
        for template_type, batch in capped.items():
            docs, over = await self._claim_capped(template_type, batch, worker_id, lease_seconds)
            claimed += await self._leased(docs, worker_id)
            held += over
        return claimed, held

    async def _claim_capped(
        self,
        template_type: str,
        runs: Sequence[tuple[ObjectId, int]],
        worker_id: str,
        lease_seconds: float,
    ) -> tuple[list[Doc], list[str]]:
        """Claim runs of one capped template (ids, each with its own `maxRunning`): the
        claimed runs' documents, and the ids of the runs the cap held back.

        The gate gives a place, in the caller's order (priority, then age), to the runs their
        own `maxRunning` leaves room for; the claim takes each in its place, before the
        places' fence. A place the claim did not use (its run cancelled meanwhile, claimed by
        another worker's pop of it, or the fence passed) is kept as a spare or given back.
        """
        placed, over = await self._gates.admit(template_type, runs)
        if not placed:
            return [], [str(oid) for oid in over]
        oids = [oid for oid, _ in placed]
        tokens = [place.token for _, place in placed]
        fence = min(place.until for _, place in placed)
        now = self._clock.now()
        taken = await self._take(
            "claim_limited", oids, worker_id, lease_seconds, now, (tokens, fence)
        )
        docs = await self._read(taken)
        await self._gates.settle(template_type, placed, {d["_id"] for d in docs})
        return docs, [str(oid) for oid in over]

    async def _take(
        self,
        name: str,
        oids: list[ObjectId],
        worker_id: str,
        lease_seconds: float,
        now: datetime,
        places: tuple[list[str], datetime] | None = None,
        token: str | None = None,
    ) -> _Claim:
        """The write of the claim row `name` over `oids`, under `token` or a fresh lease
        token; under `maxRunning`, each run in its place (`places`: their tokens, in the order
        of `oids`, and until when the server may let the claim take them)."""
        t = TRANSITIONS[name]
        lease = token or lease_token()
        claim = _Claim(oids, [ObjectId() for _ in oids], worker_id, lease)
        until = now + timedelta(seconds=lease_seconds)
        claimable, take = rows.claiming(
            t, oids, claim.event_ids, worker_id, claim.token, until, now, places
        )
        await self._db.runs.update_many(claimable, take)
        return claim

    async def _read(self, claim: _Claim) -> list[Doc]:
        """The documents of the runs `claim` leased, each with only the claim's event in its
        trail (the rest is not the worker's to copy)."""
        mine = {"$in": ["$$this._id", {"$literal": claim.event_ids}]}
        cursor = await self._db.runs.aggregate(
            [
                {"$match": {"_id": {"$in": claim.oids}, **held_by(claim.worker_id, claim.token)}},
                {"$set": {"trail": {"$filter": {"input": "$trail", "cond": mine}}}},
            ],
        )
        docs: list[Doc] = await cursor.to_list()
        return docs

    async def _leased(self, docs: list[Doc], worker_id: str) -> list[tuple[Run, Lease]]:
        """The runs a claim leased, once it is durable; their claim events go to be copied."""
        claimed = [
            (convert.run(d), Lease(str(d["_id"]), worker_id, d["leaseToken"], convert.known(d)))
            for d in docs
        ]
        await self._trail.hand([e for d in docs for e in d.get("trail", [])])
        return claimed

    async def wait_worker(
        self, lease: Lease, index: int, step_id: str, worker_type: str
    ) -> Moved | Lost:
        """Hand the current step to an external worker: the inline worker lets go of the lease
        (a step may wait for an external worker longer than any lease), and the run waits
        for `resume`."""
        now = self._clock.now()
        s = f"progress.steps.{index}"
        return await self._apply(
            "wait_worker",
            lease.run_id,
            lease.actor,
            lease=lease,
            set_={
                "phase": step_id,
                "externalType": worker_type,
                f"{s}.status": StepStatus.RUNNING,
                f"{s}.startedAt": now,
            },
        )

    async def wait_children(self, lease: Lease) -> Moved | Lost:
        """Only map steps are left and their children run: the holder lets go of the run
        (children may take longer than any lease), and the attempt goes on when it is queued
        again (`children_done`)."""
        return await self._apply(
            "wait_children",
            lease.run_id,
            lease.actor,
            lease=lease,
            message="waits for its children",
        )

    async def children_done(self, run: Run, actor: str, detail: str) -> Moved | Lost:
        """The children a waiting run waits for have ended (or one failed it): it is queued
        to go on."""
        return await self._apply(
            "children_done",
            run.id,
            actor,
            scope=(run.scope, run.scope_id),
            message=f"its children ended ({detail})",
        )

    async def resume(
        self, worker_type: str, worker_id: str, lease_seconds: float
    ) -> tuple[Run, Lease] | None:
        """Lease the oldest run waiting for a `worker_type` worker to `worker_id`: an external
        worker's claim.

        Two external workers may pick the same run; the guarded write lets one have it and the
        other tries the next.
        """
        waiting = rows.guarded(TRANSITIONS["resume"], self._clock.now(), external_type=worker_type)
        for _ in range(5):
            doc = await self._db.runs.find_one(waiting, OWNER_FIELDS, sort=[("_id", 1)])
            if doc is None:
                return None
            lease = Lease(str(doc["_id"]), worker_id, lease_token())
            moved = await self._apply(
                "resume",
                lease.run_id,
                lease.actor,
                lease=lease,
                lease_seconds=lease_seconds,
                external_type=worker_type,
                unset=["externalType"],
                scope=(doc["scope"], doc["scopeId"]),
            )
            if isinstance(moved, Moved):
                resumed = await self._db.find_run(lease.run_id, NO_TRAIL)
                assert resumed is not None
                return convert.run(resumed), lease
        return None

    async def complete(
        self,
        lease: Lease,
        index: int | None,
        step_id: str | None,
        output: Any,
        result: Any,
        started_at: datetime | None = None,
        spend_key: bool = False,
        attempt: int = 0,
    ) -> Moved | Lost:
        """The run's steps are all done: with the success of step `index` (None when the last
        step to end was skipped or failed with `onFailure: continue`, written already). With
        `spend_key` (a template that is not `repeatable`) the run keeps its dedupe key, so the
        unique index refuses every later run for that key."""
        now = self._clock.now()
        set_: Doc = {"result": result, "progress.percentage": 100}
        before: list[TrailEntry] = []
        if index is not None and step_id is not None:
            started, before = steps.unwritten_start(index, step_id, started_at, attempt)
            before.append(("step_finished", None, {"step": step_id}))
            set_ |= {**started, **steps.succeeded(index, step_id, output, now)}
        return await self._apply(
            "complete",
            lease.run_id,
            lease.actor,
            lease=lease,
            spend_key=spend_key,
            set_=set_,
            unset=list(steps.unlent([index])) if index is not None else (),
            before=before,
        )

    async def fail(
        self,
        lease: Lease,
        index: int,
        error: RunError,
        started_at: datetime | None = None,
        attempt: int = 0,
    ) -> Moved | Lost:
        """End the run `failed`: retries exhausted or a non-retryable error (a dead letter)."""
        return await self._step_failed("fail", lease, index, error, (started_at, attempt))

    async def retry(
        self,
        lease: Lease,
        index: int,
        error: RunError,
        not_before: datetime,
        started_at: datetime | None = None,
        attempt: int = 0,
    ) -> Moved | Lost:
        """Queue the run again after a retryable failure; it resumes at the failed step."""
        scheduled = ("retry_scheduled", None, {"notBefore": not_before.isoformat()})
        later = {"notBefore": not_before}
        start = (started_at, attempt)
        return await self._step_failed("retry", lease, index, error, start, later, scheduled)

    async def release(
        self, lease: Lease, handler: str | None = None, lock_wait: LockWait | None = None
    ) -> Moved | Lost:
        """Hand a run back without spending the attempt it was on: on shutdown, (with
        `handler`, its current step's) to a worker that offers the handler this one lacks, or
        (with `lock_wait`) to wait for a lock its step needs."""
        set_: Doc = {"progress.steps.$[r].status": StepStatus.PENDING}
        message = None
        if handler is not None:
            set_["handler"] = handler
            message = f"handed on for handler {handler!r}"
        if lock_wait is not None:
            set_["lockWait"] = lock_wait.model_dump(by_alias=True)
            message = f"waits for lock {lock_wait.lock}" + (
                f" held by run {lock_wait.holder}" if lock_wait.holder else ""
            )
        return await self._apply(
            "release",
            lease.run_id,
            lease.actor,
            lease=lease,
            set_=set_,
            array_filters=[HELD_STEP],
            message=message,
        )

    async def cancel(
        self,
        run_id: str,
        actor: str,
        reason: str | None,
        scope: tuple[str, str] | None = None,
        metadata: Doc | None = None,
    ) -> Moved | Lost:
        """A run no worker holds yet ends at once; its pending steps are skipped. `metadata`
        goes in its event."""
        return await self._apply(
            "cancel",
            run_id,
            actor,
            set_={
                **_cancel_asked(self._clock.now(), actor, reason),
                "progress.steps.$[w].status": StepStatus.CANCELLED,
                "progress.steps.$[p].status": StepStatus.SKIPPED,
            },
            array_filters=[WAITING_STEP, UNDONE_STEP],
            message=reason,
            metadata=metadata,
            scope=scope,
        )

    async def request_cancel(
        self,
        run_id: str,
        actor: str,
        reason: str | None,
        grace_seconds: float = 30,
        scope: tuple[str, str] | None = None,
        metadata: Doc | None = None,
    ) -> Moved | Lost:
        """Ask the worker holding the run to stop; it converges via `acknowledge_cancel`, or
        the reaper overrules it once `grace_seconds` have passed (`cancel_timeout`).
        `metadata` goes in its events."""
        now = self._clock.now()
        return await self._apply(
            "request_cancel",
            run_id,
            actor,
            set_={
                **_cancel_asked(now, actor, reason),
                "cancelDeadline": now + timedelta(seconds=grace_seconds),
            },
            also=[("cancel_requested", reason, dict(metadata or {}))],
            message=reason,
            metadata=metadata,
            scope=scope,
        )

    async def acknowledge_cancel(self, lease: Lease, interrupted: bool) -> Moved | Lost:
        """The worker stopped: steps not done are skipped, and the step it was in is cancelled
        if a checkpoint interrupted it (skipped if the cancel came between steps)."""
        stopped = StepStatus.CANCELLED if interrupted else StepStatus.SKIPPED
        return await self._apply(
            "acknowledge_cancel",
            lease.run_id,
            lease.actor,
            lease=lease,
            set_=_stopped(self._clock.now(), stopped),
            array_filters=[RUNNING_STEP, WAITING_STEP, UNDONE_STEP],
        )

    async def reap_requeue(self, run: Run, actor: str) -> Moved | Lost:
        """Queue again a run whose lease expired, its step to be run again."""
        return await self._reap("reap_requeue", run, actor, StepStatus.PENDING)

    async def reap_expire(self, run: Run, actor: str) -> Moved | Lost:
        """End a run whose lease expired with no attempt left."""
        return await self._reap("reap_expire", run, actor, StepStatus.FAILED)

    async def reap_cancel(self, run: Run, actor: str) -> Moved | Lost:
        """End a run whose lease expired after a cancel was asked."""
        return await self._reap("reap_cancel", run, actor, StepStatus.CANCELLED)

    async def cancel_timeout(self, run: Run, actor: str) -> Moved | Lost:
        """The worker did not acknowledge a cancel within the grace: cancel it without it."""
        grace = run.cancel_grace_seconds
        return await self._apply(
            "cancel_timeout",
            run.id,
            actor,
            read=run,
            set_=_stopped(self._clock.now(), StepStatus.CANCELLED),
            array_filters=[RUNNING_STEP, WAITING_STEP, UNDONE_STEP],
            message=f"cancel not acknowledged within {grace}s",
            also=[("cancel_timeout", None, {"graceSeconds": grace})],
        )

    async def deadline_expire(self, run: Run, actor: str) -> Moved | Lost:
        """End a run whose deadline passed, even if its worker still heartbeats: the lease is
        taken away, so the worker's later writes are fenced."""
        error = RunError(
            code="deadline_exceeded",
            message=f"run exceeded its timeout of {run.timeout_seconds}s (deadline {run.deadline})",
            step=run.phase,
        )
        return await self._apply(
            "deadline_expire",
            run.id,
            actor,
            read=run,
            error=error,
            set_=_stopped(self._clock.now(), StepStatus.FAILED),
            array_filters=[RUNNING_STEP, WAITING_STEP, UNDONE_STEP],
            message=error.message,
        )

    async def _step_failed(
        self,
        name: str,
        lease: Lease,
        index: int,
        error: RunError,
        start: tuple[datetime | None, int],
        more: Doc | None = None,
        *also: TrailEntry,
    ) -> Moved | Lost:
        """A worker's row for a step that raised: the step failed (its start written too, if
        it was not yet), and the attempt with it."""
        started, before = steps.ended_badly(index, error, *start)
        failed = steps.failed(index, error, self._clock.now())
        return await self._apply(
            name,
            lease.run_id,
            lease.actor,
            lease=lease,
            error=error,
            set_={**started, **failed, **(more or {})},
            unset=list(steps.unlent([index])),
            before=before,
            message=error.message,
            also=also,
        )

    async def _reap(self, name: str, run: Run, actor: str, step: StepStatus) -> Moved | Lost:
        """A reaper's row: the filter repeats what its choice was made on (`Guard.AS_READ`),
        so a heartbeat that renewed the lease, or a cancel asked, since the read wins."""
        fails = TRANSITIONS[name].attempt is AttemptChange.FAIL
        error = RunError(
            code="lease_expired",
            message=f"lease of {run.locked_by} expired at {run.locked_until}",
            step=run.phase,
        )
        lost = ("lease_expired", f"lease of {run.locked_by} expired", {"attempt": run.attempt})
        set_: Doc = {"progress.steps.$[r].status": step}
        # Requeued, a map step waits on and a lent step runs on; an end stops both.
        filters: list[Doc] = [HELD_STEP]
        if TRANSITIONS[name].ends:
            set_["progress.steps.$[w].status"] = step
            filters = [RUNNING_STEP, WAITING_STEP]
        return await self._apply(
            name,
            run.id,
            actor,
            read=run,
            error=error if fails else None,
            set_=set_,
            array_filters=filters,
            also=[lost],
        )

    async def _apply(
        self,
        name: str,
        run_id: str,
        actor: str,
        *,
        lease: Lease | None = None,
        read: Run | None = None,
        external_type: str | None = None,
        lease_seconds: float = 0,
        error: RunError | None = None,
        spend_key: bool = False,
        set_: Doc | None = None,
        unset: Sequence[str] = (),
        array_filters: list[Doc] | None = None,
        before: Sequence[TrailEntry] = (),
        also: Sequence[TrailEntry] = (),
        message: str | None = None,
        metadata: Doc | None = None,
        scope: tuple[str, str] | None = None,
    ) -> Moved | Lost:
        """Make the row `name` one conditional write, then hand its events to the copier.

        `lease` is the writer's (proved by a fenced row, granted by a row that grants one);
        `read` is the run as the deciding reader saw it (its scope routes the write);
        `error` is the one the attempt in progress ended with. `before` events are written
        ahead of the `status_changed` event, `also` after it.
        """
        t = TRANSITIONS[name]
        assert (error is not None) == (t.attempt is AttemptChange.FAIL), name
        oid = object_id(run_id)
        if oid is None:
            return Lost(run_id, "missing")
        now = self._clock.now()
        if read is not None:
            scope = scope or (read.scope, read.scope_id)
        owner = known_owner(lease.known if lease else None, scope)
        query = {"_id": oid, **owner, **rows.guarded(t, now, lease, read, external_type)}
        update = rows.entering(t, now, lease, lease_seconds, spend_key)
        update["$set"] |= set_ or {}
        if unset:
            update.setdefault("$unset", {}).update(dict.fromkeys(unset, ""))

        def changes(state: Known) -> Doc:
            if error is None:
                return update
            return merged(update, rows.attempt_failed(error, state, t, now))

        def events(state: Known) -> list[Doc]:
            # In trail order: an event's `_id` orders it among its write's events.
            ahead = recorded(run_id, actor, state, now, before)
            moved = convert.event(
                run_id,
                "status_changed",
                actor,
                state.scope,
                state.scope_id,
                state.version + 1,
                from_=state.status,
                to=t.target,
                message=message,
                metadata={"transition": name, **(metadata or {})},
                now=now,
            )
            return [*ahead, moved, *recorded(run_id, actor, state, now, also)]

        known = lease.known if lease else None
        written = await self._writes.write(query, changes, known, t.sources, array_filters, events)
        if written is None:
            # Only a fenced write can come from a superseded lease: a lease offered to an
            # unfenced move (an external worker's `resume` that lost the race) was never granted.
            return await self._writes.lost(run_id, lease if t.fenced else None, name, owner)
        state, trail = written
        started = t.target in LEASED
        if lease is not None:
            lease.known = replace(
                state,
                status=t.target,
                version=state.version + 1,
                admission=state.admission if started else None,
            )
        await self._trail.hand(trail)
        if state.admission is not None and not started:
            await self._leave(state.admission)
        return Moved(run_id, state.status, t.target)

    async def _leave(self, admission: Admission) -> None:
        """A run left its started statuses: its place under `maxRunning` is free. Should the
        write fail, the place stays taken until the scheduler's sweep (`gates.sweep`)."""
        try:
            await self._gates.free(admission)
        except PyMongoError as exc:
            log.warning("run %s left its place under maxRunning late: %s", admission.run_id, exc)


def _cancel_asked(now: datetime, actor: str, reason: str | None) -> Doc:
    return {"cancelRequestedAt": now, "cancelReason": reason, "cancelRequestedBy": actor}


def _stopped(now: datetime, step: StepStatus) -> Doc:
    """The steps of a run stopped before it ended them itself: the ones it was in (a map step
    waiting included) become `step`, the ones not done are skipped."""
    return {
        "progress.steps.$[r].status": step,
        "progress.steps.$[r].completedAt": now,
        "progress.steps.$[w].status": step,
        "progress.steps.$[w].completedAt": now,
        "progress.steps.$[p].status": StepStatus.SKIPPED,
    }
