"""Every index of jobplane's collections, and how the large ones are sharded.

`ensure_indexes` runs at every start; `shard` is `jobplane db shard`. The shard key lives here
once: the indexes that must start with it and the command that shards read the same
`SHARD_KEYS`.
"""

import contextlib
from typing import Any

from pymongo import ASCENDING, DESCENDING, HASHED, AsyncMongoClient, IndexModel
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.errors import OperationFailure

from jobplane.store.types import NotSharded

Doc = dict[str, Any]

# The audit query's equality filters, each with an index ending in (createAt, _id).
_EVENT_FILTERS: list[list[tuple[str, int]]] = [
    [],
    [("jobId", ASCENDING)],
    [("scope", ASCENDING), ("scopeId", ASCENDING)],
    [("type", ASCENDING)],
    [("actor", ASCENDING)],
]
DELIVERY_RETENTION_SECONDS = 30 * 86400
# Indexes of earlier versions, replaced by partial ones (fewer entries to keep up on every
# write), by ones that start with the shard key, or found unused; `ensure_indexes` drops them.
_REPLACED_INDEXES = {
    "job_runs": {
        "status_1_lockedUntil_1",
        "status_1_deadline_1",
        "status_1_cancelDeadline_1",
        "scheduleId_1__id_-1",
        "status_1_dedupeKey_1_updateAt_1",
        # Unique indexes that did not start with the shard key (see `SHARD_KEYS`).
        "dedupeKey_1",
        # Unique on the key alone: one place a key. Now (key, place), for `concurrencyLimit`.
        "scope_1_scopeId_1_dedupeKey_1",
        "scheduleId_1_scheduledFor_1",
        # Capped runs by template and status, which claims under `maxRunning` counted before
        # the template's gate listed its admissions.
        "capped_by_template",
    },
    "job_events": {"jobId_1_runVersion_1__id_1"},
}
# Every large collection is sharded on its runs' owner: the scope and, hashed, the scope id. Its
# unique indexes must start with the shard key for a sharded cluster to enforce them, and the
# guarantees are per scope anyway (see `index_models`); a run's writes know its scope, so they
# go to one shard. `scope` first keeps the idempotency index (scope, scopeId, idempotencyKey) as
# it was; hashing spreads scope ids evenly. One scope's runs live on one shard.
SHARD_KEYS: dict[str, list[tuple[str, int | str]]] = {
    collection: [("scope", ASCENDING), ("scopeId", HASHED)]
    for collection in ("job_runs", "job_events", "job_runs_archive")
}


def index_models() -> dict[str, list[IndexModel]]:
    """Every index `ensure_indexes` creates, by collection."""
    # Every index is work for every write that changes its keys. Fields only some runs have (a
    # lease, a deadline, a schedule) get partial indexes, so a run is in them only while it has
    # the field; terminal runs enter the retention index only once they end.
    runs = [
        # Claim path: the reconciler finds claimable runs missing from Redis.
        IndexModel([("status", ASCENDING), ("_id", ASCENDING)]),
        # The reaper's scans: leases that ran out, deadlines and cancel graces passed.
        _only_with(
            "lockedUntil", [("status", ASCENDING), ("lockedUntil", ASCENDING)], name="leases"
        ),
        _only_with("deadline", [("status", ASCENDING), ("deadline", ASCENDING)], name="deadlines"),
        _only_with(
            "cancelDeadline",
            [("status", ASCENDING), ("cancelDeadline", ASCENDING)],
            name="cancel_deadlines",
        ),
        # The unique indexes start with the shard key (scope, scopeId). For dedupe that is the
        # same guarantee as a unique (`dedupeKey`, `dedupeSlot`): a key is
        # `runs.admission.keys.dedupe_key`, which holds the run's scope and scope id, or a
        # schedule's `schedule:<id>` (overlapPolicy queue), whose runs all carry the
        # schedule's scope, which never changes. A key has `concurrencyLimit` places; a run
        # holding the first has no `dedupeSlot` (indexed as null), so a key of one place is
        # stored as before places existed.
        _only_with(
            "dedupeKey",
            [
                ("scope", ASCENDING),
                ("scopeId", ASCENDING),
                ("dedupeKey", ASCENDING),
                ("dedupeSlot", ASCENDING),
            ],
            unique=True,
        ),
        _only_with(
            "idempotencyKey",
            [("scope", ASCENDING), ("scopeId", ASCENDING), ("idempotencyKey", ASCENDING)],
            unique=True,
        ),
        # One run per fire time: a schedule's runs all carry its scope, which never changes
        # (`ScheduleService.update`), so this is unique on (scheduleId, scheduledFor).
        _only_with(
            "scheduleId",
            [
                ("scope", ASCENDING),
                ("scopeId", ASCENDING),
                ("scheduleId", ASCENDING),
                ("scheduledFor", ASCENDING),
            ],
            unique=True,
        ),
        IndexModel([("scope", ASCENDING), ("scopeId", ASCENDING), ("_id", DESCENDING)]),
        IndexModel([("templateType", ASCENDING), ("_id", DESCENDING)]),
        # Ended runs of a template by status (its dead letters): without it a list of a rare
        # status of one template walks every run of that status. Only ended runs, which never
        # change status again: an entry per run, written once.
        _only_with(
            "completedAt",
            [("templateType", ASCENDING), ("status", ASCENDING), ("_id", DESCENDING)],
            name="ended_by_template",
        ),
        _only_with(
            "scheduleId", [("scheduleId", ASCENDING), ("_id", DESCENDING)], name="schedule_runs"
        ),
        # Runs handed back for a lock their step needs, for `/metrics`.
        _only_with("lockWait", [("lockWait", ASCENDING)], name="lock_waits"),
        # A map step's children: counted by status, the next waiting one found, listed.
        _only_with(
            "parentRunId",
            [
                ("parentRunId", ASCENDING),
                ("parentStepId", ASCENDING),
                ("status", ASCENDING),
                ("_id", ASCENDING),
            ],
            name="children",
        ),
        _only_with(
            "parentRunId", [("parentRunId", ASCENDING), ("_id", DESCENDING)], name="child_list"
        ),
        # A map step's places under `maxConcurrency`, as a dedupe key's: a child is always in
        # its parent's scope, so this is unique on (parentRunId, parentStepId, mapPlace).
        _only_with(
            "mapPlace",
            [
                ("scope", ASCENDING),
                ("scopeId", ASCENDING),
                ("parentRunId", ASCENDING),
                ("parentStepId", ASCENDING),
                ("mapPlace", ASCENDING),
            ],
            unique=True,
            name="map_places",
        ),
        # Runs waiting for a dedupe key, oldest first.
        _only_with("dedupeWait", [("dedupeWait", ASCENDING), ("_id", ASCENDING)]),
        # The sweep: runs written since its last pass.
        IndexModel([("updateAt", ASCENDING)]),
        # Retention: terminal runs (those with `completedAt`) by age. Runs holding a spent
        # dedupe key never move (the key must stay under the unique index); a null `dedupeKey`
        # bound keeps the pass from even reading them.
        _only_with(
            "completedAt",
            [("status", ASCENDING), ("dedupeKey", ASCENDING), ("updateAt", ASCENDING)],
            name="ended",
        ),
    ]
    return {
        "job_templates": [
            IndexModel([("type", ASCENDING), ("version", ASCENDING)], unique=True),
            # The latest version of each type, and every queue templates name.
            IndexModel([("type", ASCENDING), ("version", DESCENDING)]),
            IndexModel([("queue", ASCENDING)]),
        ],
        "job_runs": runs,
        "job_schedules": [
            IndexModel([("enabled", ASCENDING), ("nextRunAt", ASCENDING)]),
            IndexModel([("scope", ASCENDING), ("scopeId", ASCENDING), ("_id", DESCENDING)]),
        ],
        # The audit query pages by (createAt, _id) under at most one equality filter, and each
        # such filter has its index, so no query scans the collection. A run's own events are
        # found by the `jobId` one.
        "job_events": [
            IndexModel([*fields, ("createAt", ASCENDING), ("_id", ASCENDING)])
            for fields in _EVENT_FILTERS
        ],
        "api_keys": [IndexModel([("name", ASCENDING)], unique=True)],
        "job_webhooks": [
            IndexModel([("scope", ASCENDING), ("scopeId", ASCENDING), ("_id", DESCENDING)]),
            IndexModel([("enabled", ASCENDING)]),
        ],
        "job_webhook_deliveries": [
            # One delivery per (webhook, event), however many notifiers fan the event out.
            IndexModel([("webhookId", ASCENDING), ("eventId", ASCENDING)], unique=True),
            IndexModel([("webhookId", ASCENDING), ("_id", DESCENDING)]),
            # Due deliveries; only pending ones, so an ended delivery leaves the index.
            IndexModel(
                [("nextAttemptAt", ASCENDING)],
                partialFilterExpression={"status": "pending"},
                name="due",
            ),
            # Kept a month: long past their last try, long enough to look into.
            IndexModel([("createAt", ASCENDING)], expireAfterSeconds=DELIVERY_RETENTION_SECONDS),
        ],
    }


def _only_with(field: str, keys: list[tuple[str, int]], **options: Any) -> IndexModel:
    """An index of the runs that have `field` only: a write to any other run skips it."""
    return IndexModel(keys, partialFilterExpression={field: {"$exists": True}}, **options)


async def ensure_indexes(db: AsyncDatabase[Doc]) -> None:
    """Create every index of `index_models`; safe to run at each start-up and from several
    processes.

    Indexes an earlier version made and this one replaced are dropped after their
    replacements exist, so no query is left without an index, and no guarantee without its
    unique index, meanwhile.
    """
    for collection, models in index_models().items():
        await db[collection].create_indexes(models)
    for collection, names in _REPLACED_INDEXES.items():
        existing = await db[collection].index_information()
        for name in names & existing.keys():
            with contextlib.suppress(OperationFailure):  # another process dropped it first
                await db[collection].drop_index(name)


async def shard(client: AsyncMongoClient[Doc], db: AsyncDatabase[Doc]) -> list[str]:
    """Shard the large collections of `db` on `SHARD_KEYS` (a mongos only).

    Indexes are brought up to date first: a collection with data can be sharded only once
    each of its unique indexes starts with the shard key. Safe to run again. Returns the
    namespaces sharded; raises `NotSharded` if the server is not a mongos.
    """
    hello = await client.admin.command("hello")
    if hello.get("msg") != "isdbgrid":
        raise NotSharded(
            f"the MongoDB server is not a sharded cluster's mongos: {db.name} stays unsharded"
        )
    await ensure_indexes(db)
    await client.admin.command("enableSharding", db.name)
    sharded = []
    for collection, key in SHARD_KEYS.items():
        # A collection with data needs the hashed index before it is sharded (MongoDB
        # builds it itself only for an empty one).
        await db[collection].create_index(key)
        namespace = f"{db.name}.{collection}"
        await client.admin.command("shardCollection", namespace, key=dict(key))
        sharded.append(namespace)
    return sharded
