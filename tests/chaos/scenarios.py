"""The six chaos scenarios. Each puts a cluster under a load of mixed runs, injects its
faults until the backlog is drained, and ends with the invariant checker's audit.

A scenario runs at a `Scale`: `SHORT` inside `make test`, `FULL` from `make chaos`.
"""

import asyncio
import contextlib
import random
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path

import redis.asyncio as aioredis
import redis.cluster
from bson import ObjectId
from pymongo import AsyncMongoClient
from pymongo.errors import ConnectionFailure

from jobplane.devstack import RedisServer, ReplicaSet, free_port
from jobplane.devstack.topologies import RedisClusterNodes, SentinelGroup
from jobplane.queue.keys import Keys
from tests.chaos.cluster import Stage, as_read, staged
from tests.chaos.invariants import ENDED, Audit, audit, ends_to_deliver, webhook_deliveries
from tests.chaos.steps import traces


@dataclass(frozen=True)
class Scale:
    runs: int
    # Runs created a second: the load is spread over the time the faults are injected.
    rate: float
    # Seconds between two faults, injected while the load comes in.
    every: float
    # How long the backlog may take to drain after the last fault.
    drain: float
    # MongoDB's electionTimeoutMillis for the three-member replica set.
    election_ms: int


SHORT = Scale(runs=400, rate=30, every=1.5, drain=90, election_ms=2_000)
FULL = Scale(runs=5_000, rate=100, every=3.0, drain=300, election_ms=10_000)
# How long after the drain the runs' ends may take to reach their webhooks: a try cut short
# by a fault keeps its claim (twice the notifiers' timeout and a margin: 20 s) before it is
# tried again.
DELIVERED_WITHIN = 60.0


@dataclass
class Outcome:
    scenario: str
    runs: int
    faults: int
    violations: list[str]
    # The longest time in which no run finished: what the worst fault cost.
    stall: float
    # From the end of the last fault until every run was terminal: the time to recover.
    drain: float
    seconds: float
    notes: list[str] = field(default_factory=list)


@dataclass
class Where:
    """Where a scenario runs: its folder, and the MongoDB (and database) it may use."""

    folder: Path
    mongodb_url: str
    db: str


Scenario = Callable[[Where, Scale], Awaitable[Outcome]]


async def faulting(stage: Stage, scale: Scale, inject: Callable[[], Awaitable[None]]) -> int:
    """Create the load, injecting a fault every `scale.every` seconds while it comes in;
    returns how many faults were injected."""
    creating = asyncio.create_task(stage.load.create(scale.runs, scale.rate))
    faults = 0
    try:
        while not creating.done():
            await asyncio.sleep(scale.every)
            stage.cluster.check()
            await inject()
            faults += 1
    finally:
        await creating
    return faults


async def outcome(
    stage: Stage, name: str, faults: int, scale: Scale, began: float, extra: list[str]
) -> Outcome:
    """Wait for the backlog to drain after the last fault, then audit, and wait for the runs'
    ends to reach their webhooks."""
    drained = await stage.settled(scale.drain)
    found = await audit(stage.db, stage.load.accepted.values(), locks_lost=stage.locks_lost)
    hooks, delivery_notes = await _webhooks(stage)
    return Outcome(
        scenario=name,
        runs=found.runs,
        faults=faults,
        violations=[*stage.load.broken, *found.violations, *hooks, *extra],
        stall=await stage.longest_stall(),
        drain=drained,
        seconds=time.monotonic() - began,
        notes=[*_notes(stage, found), await _waits(stage), *delivery_notes],
    )


async def _webhooks(stage: Stage) -> tuple[list[str], list[str]]:
    """Wait until every run's end in `job_events` reached its scope's webhook; the violations
    (lost, misdelivered, not verified) and notes (received twice, tried again, and how each
    lost one's delivery stands)."""
    ends, waited = await stage.delivered(DELIVERED_WITHIN)
    receiver = stage.receiver
    bad = webhook_deliveries(ends, receiver.subscribed, receiver.received)
    bad += receiver.forged.values()
    expected = ends_to_deliver(ends, receiver.subscribed)
    got = {message for _, message in receiver.received}
    deliveries = stage.db.job_webhook_deliveries
    retried = await deliveries.count_documents({"attempts": {"$gt": 1}})
    notes = [
        f"{len(expected.keys() & got)} of {len(expected)} runs' ends reached their webhooks "
        f"(waited {waited:.1f} s after the drain); "
        f"{len(receiver.received) - len(set(receiver.received))} received more than once "
        f"(at least once), {retried} deliveries tried more than once"
    ]
    if uncopied := await _ends_not_copied(stage):
        notes.append(f"{uncopied} runs' ends are in their trails, not yet in job_events")
    for message in [m for m in expected if m not in got][:10]:
        delivery = await deliveries.find_one({"messageId": message}, {"body": 0}) or {}
        fields = ("status", "attempts", "lastStatusCode", "lastError", "nextAttemptAt")
        stands = {k: delivery[k] for k in fields if k in delivery} if delivery else "not stored"
        notes.append(f"lost {message}: its delivery is {stands}")
    return bad, notes


async def _ends_not_copied(stage: Stage) -> int:
    """The runs' ends in the webhooks' scopes that are not in `job_events` (their writer died
    before it copied them, and the scheduler's sweep, once a minute, did not yet): they reach
    the notifier once swept, and are not waited for."""
    scopes = [{"scope": s, "scopeId": i} for s, i in sorted(stage.receiver.subscribed)]
    cursor = await stage.db.job_runs.aggregate(
        [
            {"$match": {"$or": scopes}},
            {"$unwind": "$trail"},
            {"$match": {"trail.type": "status_changed", "trail.to": {"$in": sorted(ENDED)}}},
            {
                "$lookup": {
                    "from": "job_events",
                    "localField": "trail._id",
                    "foreignField": "_id",
                    "as": "copy",
                    "pipeline": [{"$project": {"_id": 1}}],
                }
            },
            {"$match": {"copy": {"$size": 0}}},
            {"$count": "n"},
        ]
    )
    counted = await cursor.to_list()
    return int(counted[0]["n"]) if counted else 0


def _notes(stage: Stage, found: Audit) -> list[str]:
    load = stage.load
    statuses = ", ".join(f"{n} {s}" for s, n in sorted(found.by_status.items()))
    notes = [statuses, f"{found.stale_writes} stale writes rejected"]
    if found.started_peak:
        notes.append(f"most runs started at once under maxRunning: {found.started_peak}")
    if stage.locks_lost:
        notes.append(f"{len(stage.locks_lost)} faults took the steps' locks from their holders")
    if load.unavailable:
        notes.append(f"{load.unavailable} calls answered 503 or not at all (retried)")
    if load.refused:
        notes.append(f"refused by design: {dict(load.refused)}")
    return notes


async def _waits(stage: Stage) -> str:
    """How often flow control held runs back, as their trails say: the contention the limits'
    invariants were checked under."""
    runs = stage.db.job_runs
    place = await runs.count_documents({"trail.type": "dedupe_key_taken"})
    handed_back = {"trail": {"$elemMatch": {"message": {"$regex": "^waits for lock"}}}}
    lock = await runs.count_documents(handed_back)
    lent = await runs.count_documents({"trail.type": "step_claimed"})
    return (
        f"{place} runs waited for a place of their key, {lock} for a lock; "
        f"{lent} lent a step to another worker"
    )


async def workers_die(where: Where, scale: Scale) -> Outcome:
    """SIGKILL a random worker every few seconds, and start another in its place; one time in
    three, a random notifier instead (perhaps mid-fan-out, or mid-try)."""
    began, rng = time.monotonic(), random.Random(1)
    async with staged(where.folder, where.mongodb_url, where.db, workers=3) as stage:

        async def kill() -> None:
            crew = stage.cluster.notifiers if rng.random() < 1 / 3 else stage.cluster.workers
            stage.cluster.kill(rng.choice(crew))

        faults = await faulting(stage, scale, kill)
        return await outcome(stage, "workers die", faults, scale, began, [])


async def zombies(where: Where, scale: Scale) -> Outcome:
    """SIGSTOP a random worker past its lease, then SIGCONT it: it wakes up holding leases
    that other workers may have taken since, and must not write over them. One time in three,
    a random notifier instead: it wakes up past its lock and its tries' claims."""
    began, rng = time.monotonic(), random.Random(2)
    async with staged(
        where.folder, where.mongodb_url, where.db, workers=3, nap=(0.2, 1.0)
    ) as stage:
        frozen_for = stage.cluster.settings.lease_seconds * 2
        loop = asyncio.get_running_loop()

        def wake(proc: subprocess.Popen[bytes], frozen_at: datetime) -> None:
            proc.send_signal(signal.SIGCONT)
            # A worker's steps' locks expired meanwhile: it may wake inside a step whose lock
            # another run took, and finish it before a renewal finds the lock gone.
            if proc in stage.cluster.workers:
                stage.locks_lost.append((frozen_at, as_read()))

        async def freeze() -> None:
            crew = stage.cluster.notifiers if rng.random() < 1 / 3 else stage.cluster.workers
            proc = rng.choice(crew)
            frozen_at = as_read()
            proc.send_signal(signal.SIGSTOP)
            # Woken later, while the faults go on.
            loop.call_later(frozen_for, wake, proc, frozen_at)

        faults = await faulting(stage, scale, freeze)
        return await outcome(stage, "zombies", faults, scale, began, [])


async def redis_dies(where: Where, scale: Scale) -> Outcome:
    """Alternately restart redis-server (empty: it keeps nothing on disk) after a second
    down, and FLUSHALL it, under load."""
    began = time.monotonic()
    async with staged(where.folder, where.mongodb_url, where.db, workers=3) as stage:
        turn = 0

        async def fault() -> None:
            nonlocal turn
            turn += 1
            assert isinstance(stage.redis, RedisServer)
            with stage.losing_locks():
                if turn % 2:
                    stage.redis.kill()
                    await asyncio.sleep(1)
                    stage.redis.start()
                else:
                    async with aioredis.Redis.from_url(stage.redis.url) as client:
                        await client.flushall()

        faults = await faulting(stage, scale, fault)
        return await outcome(stage, "Redis dies", faults, scale, began, [])


async def sentinel_fails_over(where: Where, scale: Scale) -> Outcome:
    """Redis behind Sentinel: SIGKILL the master under load, so that the Sentinels promote its
    replica, then start the killed server again for them to make it the new replica. Whatever
    the failover lost of Redis (a replica lags its master) the reconciler and the heartbeat
    rebuild."""
    began = time.monotonic()
    group = SentinelGroup(where.folder / "sentinel")
    async with staged(where.folder, where.mongodb_url, where.db, workers=3, redis=group) as stage:
        failovers: list[float] = []

        async def fault() -> None:
            master, t0 = group.current_master(), time.monotonic()
            # The replica may not have the last locks taken.
            with stage.losing_locks():
                master.kill()
                while group.current_master() is master:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
                failovers.append(time.monotonic() - t0)
                master.start()  # empty; the Sentinels turn it into the new master's replica
                await asyncio.to_thread(group.wait_ready)

        # A failover takes seconds (a second to call the master down, then an election).
        spaced = replace(scale, every=scale.every * 2)
        faults = await faulting(stage, spaced, fault)
        result = await outcome(stage, "Sentinel fails over", faults, scale, began, [])
        result.notes.append("new master after " + ", ".join(f"{s:.1f}" for s in failovers) + " s")
        return result


async def cluster_node_restarts(where: Where, scale: Scale) -> Outcome:
    """A Redis Cluster of three masters: SIGKILL one node in turn under load and start it
    again a second later, empty. While it is down its slots answer nothing; the queues' slot
    is among them one time in three."""
    began = time.monotonic()
    nodes = RedisClusterNodes(where.folder / "redis-cluster")
    async with staged(where.folder, where.mongodb_url, where.db, workers=3, redis=nodes) as stage:
        turn = 0
        locks = _serving(nodes, Keys(stage.cluster.settings.redis_prefix).lock_tokens)

        async def fault() -> None:
            nonlocal turn
            node = turn % len(nodes.nodes)
            with stage.losing_locks() if node == locks else contextlib.nullcontext():
                await asyncio.to_thread(nodes.restart, node, 1.0)
            turn += 1

        faults = await faulting(stage, replace(scale, every=scale.every * 2), fault)
        return await outcome(stage, "Redis Cluster node restarts", faults, scale, began, [])


def _serving(nodes: RedisClusterNodes, key: str) -> int:
    """Which of the nodes serves `key`'s slot (slots stay where the cluster put them)."""
    with redis.cluster.RedisCluster("127.0.0.1", nodes.nodes[0].port) as client:
        port = client.get_node_from_key(key).port
    return [node.port for node in nodes.nodes].index(port)


async def mongodb_fails_over(where: Where, scale: Scale) -> Outcome:
    """A three-member replica set: alternately SIGKILL the primary (restarting it as a
    member a few seconds later) and step it down, under load."""
    began = time.monotonic()
    members = ReplicaSet(
        where.folder / "rs", [free_port() for _ in range(3)], election_timeout_ms=scale.election_ms
    )
    members.start()
    try:
        async with staged(where.folder, members.url, where.db, workers=3) as stage:
            turn, elections = 0, []

            async def fault() -> None:
                nonlocal turn
                turn += 1
                primary = members.primary()
                if primary is None:
                    return
                t0 = time.monotonic()
                # Until a primary is elected, workers cannot renew their runs' leases nor, with
                # them, their steps' locks.
                with stage.losing_locks():
                    if turn % 2:
                        primary.kill()
                    else:
                        await _step_down(primary.port)
                    while members.primary() is None:  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                elections.append(time.monotonic() - t0)
                if primary.pid is None:
                    primary.launch()  # rejoins as a secondary

            # Each election takes seconds; faults closer than a few of them would only stack up.
            spaced = replace(scale, every=scale.every * 3)
            faults = await faulting(stage, spaced, fault)
            result = await outcome(stage, "MongoDB fails over", faults, scale, began, [])
            result.notes.append(
                "new primary after " + ", ".join(f"{s:.1f}" for s in elections) + " s"
            )
            return result
    finally:
        members.kill()


async def _step_down(port: int) -> None:
    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(
        "127.0.0.1", port, directConnection=True
    )
    async with client:
        # The member may drop our connection as it steps down; it steps down all the same.
        with contextlib.suppress(ConnectionFailure):
            await client.admin.command("replSetStepDown", 10)


async def schedulers_fight(where: Where, scale: Scale) -> Outcome:
    """Two schedulers and a schedule firing every second: alternately SIGKILL the lock's
    holder (a new standby starts) and SIGSTOP it past the lock's TTL, then SIGCONT it. The
    holder of the notifiers' lock (the one fanning the trail out) goes with it."""
    began = time.monotonic()
    async with staged(where.folder, where.mongodb_url, where.db, workers=2, schedulers=2) as stage:
        tick = await stage.load.http.post(
            "/v1/schedules",
            json={
                "templateType": "chaos_tick",
                "scope": "account",
                "scopeId": "acct0",
                "cron": "* * * * * *",
            },
        )
        assert tick.status_code == 201, tick.text
        schedule_id = tick.json()["id"]
        turn = 0
        keys = Keys(stage.cluster.settings.redis_prefix)
        crews = [
            (keys.singleton_lock("scheduler"), stage.cluster.schedulers),
            (keys.singleton_lock("notifier"), stage.cluster.notifiers),
        ]
        frozen_for = stage.cluster.settings.scheduler_lock_seconds * 2

        async def fault() -> None:
            nonlocal turn
            turn += 1
            holders = [
                h for lock, crew in crews if (h := await _holder(stage, lock, crew)) is not None
            ]
            if not holders:
                return
            if turn % 2:
                for holder in holders:
                    stage.cluster.kill(holder)
            else:
                for holder in holders:
                    holder.send_signal(signal.SIGSTOP)
                await asyncio.sleep(frozen_for)
                for holder in holders:
                    holder.send_signal(signal.SIGCONT)

        faults = await faulting(stage, scale, fault)
        paused = await stage.load.http.post(f"/v1/schedules/{schedule_id}/pause")
        assert paused.status_code == 200, paused.text
        missed = await _missed_fires(stage, schedule_id)
        return await outcome(stage, "schedulers fight", faults, scale, began, missed)


async def _holder(
    stage: Stage, lock: str, crew: list[subprocess.Popen[bytes]]
) -> subprocess.Popen[bytes] | None:
    """The process of `crew` holding the lock; its owner string is `<command>-<pid>-<hex>`."""
    async with aioredis.Redis.from_url(stage.redis.url) as client:
        owner = await client.get(lock)
    if owner is None:
        return None
    text = owner.decode() if isinstance(owner, bytes) else owner
    pid = int(text.split("-")[1])
    return next((p for p in crew if p.pid == pid), None)


async def _missed_fires(stage: Stage, schedule_id: str) -> list[str]:
    """Fire times between the first and the last with no run and no `fire_skipped` event."""
    cursor = stage.db.job_runs.find({"scheduleId": schedule_id}, {"scheduledFor": 1})
    times = sorted([r["scheduledFor"] async for r in cursor])
    skipped = await stage.db.job_events.count_documents(
        {"type": "fire_skipped", "metadata.reason": "misfire"}
    )
    gaps = sum(int((b - a).total_seconds()) - 1 for a, b in pairwise(times))
    if len(times) < 5:
        return [f"the schedule fired only {len(times)} times"]
    if gaps > skipped:
        return [f"{gaps} fire times between {times[0]} and {times[-1]} have no run"]
    return []


async def cancel_storm(where: Where, scale: Scale) -> Outcome:
    """Cancel 30% of the runs, each at a random moment of its first few seconds. Every cancel
    the API accepted ends `cancelled`, and no step was still running when the worker
    acknowledged it (the handler's own trace says when it really stopped)."""
    began, rng = time.monotonic(), random.Random(6)
    # Limited runs waiting for a place or a start, and locked ones for their lock, are
    # cancelled while they wait too.
    # Both branches of a diamond must have stopped before its cancel is acknowledged; a map's
    # children are cancelled with it.
    mix = [
        ("chaos_steps", 35),
        ("chaos_diamond", 15),
        ("chaos_map", 10),
        ("chaos_quick", 10),
        ("chaos_limited", 15),
        ("chaos_locked", 15),
    ]
    # Long naps and many slots: most cancels should find their run queued or running, even
    # when a busy machine answers API calls late.
    async with staged(
        where.folder, where.mongodb_url, where.db, workers=3, slots=48, nap=(2.0, 6.0), mix=mix
    ) as stage:
        load = stage.load
        accepted: list[str] = []
        answers: Counter[int] = Counter()

        async def cancel_later(run_id: str) -> None:
            await asyncio.sleep(rng.uniform(0, 3))
            answer = await load.post(f"/v1/runs/{run_id}/cancel", {"reason": "storm"})
            answers[answer.status_code] += 1
            if answer.status_code == 200:
                accepted.append(run_id)
            elif answer.status_code != 409:  # 409: it had finished already
                load.broken.append(f"cancel {run_id}: {answer.status_code} {answer.text[:200]}")

        creating = asyncio.create_task(load.create(scale.runs, scale.rate))
        cancels: list[asyncio.Task[None]] = []
        seen: set[str] = set()
        while not creating.done() or len(seen) < len(load.accepted):
            for run_id in list(load.accepted.values()):
                if run_id not in seen:
                    seen.add(run_id)
                    if rng.random() < 0.3:
                        cancels.append(asyncio.create_task(cancel_later(run_id)))
            await asyncio.sleep(0.05)
        await creating
        await asyncio.gather(*cancels)
        await stage.settled(scale.drain)
        extra = await _cancels_held(stage, accepted)
        result = await outcome(stage, "cancel storm", len(cancels), scale, began, extra)
        result.notes.append(f"cancel answers: {dict(answers)}")
        return result


async def _cancels_held(stage: Stage, accepted: list[str]) -> list[str]:
    if not accepted:
        return ["no cancel found its run unfinished: the storm tested nothing"]
    bad: list[str] = []
    ids = [ObjectId(run_id) for run_id in accepted]
    ended = {
        str(r["_id"]): r
        async for r in stage.db.job_runs.find({"_id": {"$in": ids}}, {"status": 1, "trail": 1})
    }
    napped: dict[str, list[float]] = {}
    for nap in traces(stage.cluster.trace):
        napped.setdefault(nap["run"], []).append(nap["ended"])
    for run_id in accepted:
        run = ended[run_id]
        if run["status"] != "cancelled":
            bad.append(f"run {run_id}: its cancel was accepted, it ended {run['status']}")
            continue
        [done] = [e for e in run["trail"] if e.get("to") == "cancelled"]
        # MongoDB keeps milliseconds: the acknowledgement may read up to 1 ms early.
        acknowledged = done["createAt"].replace(tzinfo=UTC) + timedelta(milliseconds=1)
        late = [t for t in napped.get(run_id, []) if datetime.fromtimestamp(t, UTC) > acknowledged]
        if late:
            bad.append(f"run {run_id}: a step ran until {late} after the cancel at {acknowledged}")
    return bad


SCENARIOS: dict[str, Scenario] = {
    "workers_die": workers_die,
    "zombies": zombies,
    "redis_dies": redis_dies,
    "sentinel_fails_over": sentinel_fails_over,
    "cluster_node_restarts": cluster_node_restarts,
    "mongodb_fails_over": mongodb_fails_over,
    "schedulers_fight": schedulers_fight,
    "cancel_storm": cancel_storm,
}
