"""The rows of the transition table in MongoDB's words: the one place a row's guards become
a filter and what entering its target means becomes an update.

`model/status.py` decides; `transitions.py` calls these for every row, the claim's pipeline
included, so a row changed in the table is written differently everywhere at once.
"""

from datetime import datetime, timedelta
from typing import Any

from bson import ObjectId

from jobplane.model import (
    Attempt,
    AttemptChange,
    Guard,
    KeyChange,
    LeaseChange,
    Run,
    RunError,
    Transition,
)
from jobplane.store.convert import Doc
from jobplane.store.types import Known, Lease, worker_actor
from jobplane.store.writes import held_by

# What each change of the lease removes. An ended run keeps `lockedBy`: the worker that held
# it last, whichever transition ended it (docs/contract.md, "Entering a status").
_LEASE_REMOVED = {
    LeaseChange.DROP: ("lockedBy", "leaseToken", "lockedUntil"),
    LeaseChange.END: ("leaseToken", "lockedUntil"),
}


def guarded(
    t: Transition,
    now: datetime,
    lease: Lease | None = None,
    read: Run | None = None,
    external_type: str | None = None,
) -> Doc:
    """The filter of the row: its source statuses and its guards. `lease` is the writer's,
    `read` the run as the deciding reader saw it, `external_type` the claimer's."""
    query: Doc = {"status": {"$in": sorted(t.sources)}}
    for guard in t.guards:
        match guard:
            case Guard.LEASE:
                assert lease is not None, f"{t.name} is a worker write and needs a lease"
                query |= held_by(lease.worker_id, lease.token)
            case Guard.NOT_WAITING:
                query["dedupeWait"] = {"$exists": False}
                query["mapWait"] = {"$exists": False}
            case Guard.UNLIMITED:
                query["maxRunning"] = {"$exists": False}
                query["rate"] = {"$exists": False}
            case Guard.DUE:
                query["$or"] = [{"notBefore": None}, {"notBefore": {"$lte": now}}]
            case Guard.EXTERNAL_TYPE:
                query["externalType"] = external_type
            case Guard.AS_READ:
                assert read is not None, f"{t.name} decides on a run it read"
                query["status"] = {"$in": sorted(t.sources & {read.status})}
                query["leaseToken"] = read.lease_token
            case Guard.LEASE_EXPIRED:
                query["lockedUntil"] = {"$lt": now}
            case Guard.DEADLINE_PASSED:
                query["deadline"] = {"$lte": now}
            case Guard.GRACE_PASSED:
                query["cancelDeadline"] = {"$lte": now}
    return query


def entering(
    t: Transition, now: datetime, granted: Lease | None, lease_seconds: float, spend_key: bool
) -> Doc:
    """The update of what entering the row's target means: the status, the run's end, its
    lease (`granted` by the row, for `lease_seconds`), its dedupe key and its attempt."""
    fields: Doc = {"status": t.target, "updateAt": now}
    removed = list(_LEASE_REMOVED.get(t.lease, ()))
    count: Doc = {"version": 1}
    if t.ends:
        fields["completedAt"] = now
    if t.lease is LeaseChange.GRANT:
        assert granted is not None, f"{t.name} grants a lease"
        until = now + timedelta(seconds=lease_seconds)
        fields |= _lease(granted.worker_id, granted.token, until, now)
    if t.key is KeyChange.FREE or (t.key is KeyChange.SPEND and not spend_key):
        removed += ["dedupeKey", "dedupeSlot", "dedupeWait"]
    if t.ends:
        # An ended child lets go of its place among its map's children.
        removed += ["mapPlace", "mapWait"]
    if t.attempt is AttemptChange.HAND_BACK:
        count["attempt"] = -1
    update: Doc = {"$set": fields, "$inc": count}
    if removed:
        update["$unset"] = dict.fromkeys(removed, "")
    return update


def attempt_failed(error: RunError, state: Known, t: Transition, now: datetime) -> Doc:
    """What a row that ends the attempt in progress (`state`'s) with `error` writes too
    (`AttemptChange.FAIL`).

    The attempt joins `attempts`, whatever comes next. The run's `error` is its outcome's: set
    only when the run ends with this one, so a run that succeeds on a later attempt has none.
    A run that goes on waits for a new attempt, which its next claim starts.
    """
    error = error.model_copy(update={"attempt": state.attempt})
    attempt = Attempt(
        attempt=state.attempt, error=error, started_at=state.attempt_started_at, ended_at=now
    )
    update: Doc = {"$push": {"attempts": attempt.model_dump(by_alias=True)}}
    if t.ends:
        update["$set"] = {"error": error.model_dump(by_alias=True)}
    else:
        update["$unset"] = {"attemptStartedAt": ""}
    return update


def _each(values: list[Any], oids: list[ObjectId]) -> Doc:
    """The value of `values` at the run's own position in `oids`, in a pipeline over them."""
    return {"$arrayElemAt": [{"$literal": values}, {"$indexOfArray": [{"$literal": oids}, "$_id"]}]}


def claiming(
    t: Transition,
    oids: list[ObjectId],
    event_ids: list[ObjectId],
    worker_id: str,
    token: str,
    until: datetime,
    now: datetime,
    places: tuple[list[str], datetime] | None = None,
) -> tuple[Doc, list[Doc]]:
    """The claim row as one multi-document pipeline update: its filter and its pipeline.

    A pipeline, so that each run's claim event is built from the run as it was before the
    write: its `from` status and version are exact whatever lands after. The event's `_id`
    comes from `event_ids`, so the claimer knows which event in each trail is its own. A
    claim under `maxRunning` names its runs' `places` (each run's place's token, in the order
    of `oids`, and the earliest of their fences): each run keeps its place's token, and the
    server takes them only before the fence.
    """
    assert t.lease is LeaseChange.GRANT and t.attempt is AttemptChange.START, t.name
    claimable = {"_id": {"$in": oids}, **guarded(t, now)}
    admitted: Doc = {}
    if places is not None:
        claimable["$expr"] = {"$lt": ["$$NOW", places[1]]}
        admitted["admissionToken"] = _each(places[0], oids)
    event = {
        "_id": _each(event_ids, oids),
        "jobId": {"$toString": "$_id"},
        "type": "status_changed",
        "actor": {"$literal": worker_actor(worker_id)},
        "scope": "$scope",
        "scopeId": "$scopeId",
        "metadata": {
            "transition": t.name,
            "attempt": {"$add": ["$attempt", 1]},
            "lease": {"$literal": token[:8]},
        },
        "runVersion": {"$add": ["$version", 1]},
        "createAt": now,
        "from": "$status",
        "to": t.target.value,
    }
    granted = _lease(worker_id, token, until, now)
    take = {
        "version": {"$add": ["$version", 1]},
        "status": {"$literal": t.target.value},
        **{name: {"$literal": value} for name, value in granted.items()},
        "updateAt": now,
        # The attempt it starts (`AttemptChange.START`).
        "attempt": {"$add": ["$attempt", 1]},
        "startedAt": {"$ifNull": ["$startedAt", now]},
        # Unset unless a shutdown handed the attempt back: then this claim goes on with it.
        "attemptStartedAt": {"$ifNull": ["$attemptStartedAt", now]},
        # The whole-run limit counts from the first start, across attempts.
        "deadline": {
            "$ifNull": [
                "$deadline",
                {
                    "$cond": [
                        {"$gt": ["$timeoutSeconds", 0]},
                        {"$add": [now, {"$multiply": ["$timeoutSeconds", 1000]}]},
                        "$$REMOVE",
                    ]
                },
            ]
        },
        "trail": {"$concatArrays": [{"$ifNull": ["$trail", []]}, [event]]},
        **admitted,
    }
    return claimable, [{"$set": take}]


def _lease(worker_id: str, token: str, until: datetime, now: datetime) -> Doc:
    """The fields of a lease a row grants (`LeaseChange.GRANT`)."""
    return {"lockedBy": worker_id, "leaseToken": token, "lockedUntil": until, "heartbeatAt": now}
