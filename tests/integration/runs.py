"""Test helpers that put runs into a given state directly, bypassing the transitions.

Only tests write lifecycle fields like this: it is how a table-walking test starts a run in
every status.
"""

from datetime import timedelta
from typing import Any

from jobplane.model import TERMINAL, Run, RunStatus, Template
from jobplane.runs.policy import lease_expired
from jobplane.store import Lease, Lost, MongoStore, Moved, NewRun
from tests.integration.db import raw

WORKER = "w-test"
TOKEN = "token-test"


async def run_in(
    store: MongoStore, template: Template, status: RunStatus, **fields: Any
) -> tuple[Run, Lease]:
    """A run of `template` in `status`, held by WORKER/TOKEN with a lease that has expired."""
    run = await store.runs.insert(NewRun(template, "user", "u1"), "user:test")
    now = store.clock.now()
    doc: dict[str, Any] = {
        "status": status.value,
        "lockedBy": WORKER,
        "leaseToken": TOKEN,
        "lockedUntil": now - timedelta(seconds=1),
        "attempt": 1,
        "maxAttempts": 3,
    }
    if status in TERMINAL:
        doc["completedAt"] = now
    doc.update(fields)
    await raw(store).runs.update_one({"_id": _oid(run.id)}, {"$set": doc})
    fresh = await store.runs.get(run.id)
    assert fresh is not None
    return fresh, Lease(run.id, WORKER, TOKEN)


async def reap(store: MongoStore, run: Run) -> Moved | Lost:
    """The reaper's write for `run`, read with its lease run out: the transition the policy
    picks (`runs.policy.lease_expired`)."""
    moved: Moved | Lost = await getattr(store.transitions, lease_expired(run))(run, "reaper")
    return moved


def _oid(run_id: str) -> Any:
    from bson import ObjectId

    return ObjectId(run_id)
