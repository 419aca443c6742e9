"""The Redis fast path: queue order, delayed promotion, the scheduler lock, cancel signals."""

import asyncio
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

from bson import ObjectId
from redis.asyncio import RedisCluster

from jobplane.backends import Backends
from jobplane.clock import ManualClock
from jobplane.model import RunRate, RunStatus, StartLimits
from jobplane.queue.connect import RedisClient
from jobplane.queue.entry import QueueEntry
from jobplane.queue.locks import Blocked, Taken
from jobplane.queue.redis import RedisQueue
from jobplane.runs import RunRequest, RunService
from jobplane.runs.admission.locks import Locks
from jobplane.scheduler import Scheduler
from jobplane.settings import Settings
from jobplane.store import MongoStore
from tests.conftest import REDIS_TOPOLOGIES
from tests.integration.conftest import Register
from tests.integration.db import raw

pytestmark = REDIS_TOPOLOGIES


async def test_the_scheduler_lock_is_taken_extended_and_released_by_its_owner_only(
    queue: RedisQueue,
) -> None:
    assert await queue.locks.singleton_holder("scheduler") == (None, 0)
    assert await queue.locks.take_singleton("scheduler", "s1", 10)
    assert not await queue.locks.take_singleton("scheduler", "s2", 100), "held by another owner"
    assert not await queue.locks.release_singleton("scheduler", "s2")
    holder, left = await queue.locks.singleton_holder("scheduler")
    assert holder == "s1" and 0 < left <= 10, "a stranger's acquire did not extend it"

    assert await queue.locks.take_singleton("scheduler", "s1", 100)
    holder, left = await queue.locks.singleton_holder("scheduler")
    assert holder == "s1" and 10 < left <= 100
    assert await queue.locks.release_singleton("scheduler", "s1")
    assert await queue.locks.singleton_holder("scheduler") == (None, 0)


async def test_pipelined_scripts_cost_no_extra_round_trip(
    queue: RedisQueue, store: MongoStore
) -> None:
    """redis-py asks SCRIPT EXISTS before a pipeline that calls scripts by hash; ours send
    their source, so a blocking pop is one round trip, even after a flush."""
    await queue.redis.script_flush()
    before = await _command_calls(queue.redis)
    assert (await queue.pop(["q"], 4, store.clock.now(), 0.01)).run_ids == []
    after = await _command_calls(queue.redis)
    calls = {k: n - before.get(k, 0) for k, n in after.items()}
    assert calls.get("cmdstat_script", 0) == 0 and calls.get("cmdstat_evalsha", 0) == 0
    assert calls["cmdstat_eval"] == 1 and calls["cmdstat_bzpopmin"] == 1


async def _command_calls(redis: RedisClient) -> Counter[str]:
    """Calls of each command so far, summed over a cluster's nodes."""
    if isinstance(redis, RedisCluster):
        per_node = await redis.info("commandstats", target_nodes=RedisCluster.PRIMARIES)
        stats = list(per_node.values())
    else:
        stats = [await redis.info("commandstats")]
    return sum((Counter({k: v["calls"] for k, v in s.items()}) for s in stats), Counter())


async def test_pop_orders_by_priority_then_age_and_promotes_due_delayed(
    queue: RedisQueue, store: MongoStore
) -> None:
    now = store.clock.now()
    entries = [
        QueueEntry("00000000000000000000000b", "q", 0),
        QueueEntry("00000000000000000000000a", "q", 0),
        QueueEntry("00000000000000000000000c", "q", 9),
        QueueEntry("00000000000000000000000d", "q", 0, now - timedelta(seconds=1)),
        QueueEntry("00000000000000000000000e", "q", 0, now + timedelta(seconds=60)),
    ]
    await queue.push(entries, now)
    popped = await queue.pop(["q"], 10, now)
    assert [i[-1] for i in popped.run_ids] == ["c", "a", "b", "d"]
    assert popped.next_due is not None
    assert abs((popped.next_due - (now + timedelta(seconds=60))).total_seconds()) < 0.01
    later = await queue.pop(["q"], 10, now + timedelta(seconds=61))
    assert [i[-1] for i in later.run_ids] == ["e"] and later.next_due is None


async def test_a_pop_takes_only_its_handlers_lanes_merged_by_priority(
    queue: RedisQueue, store: MongoStore
) -> None:
    now = store.clock.now()
    entries = [
        QueueEntry("00000000000000000000000a", "q", 0, handler="a"),
        QueueEntry("00000000000000000000000b", "q", 5, handler="b"),
        QueueEntry("00000000000000000000000c", "q", 7, handler="c"),
        QueueEntry("00000000000000000000000d", "q", 3),
        QueueEntry("00000000000000000000000e", "q", 9, now - timedelta(seconds=1), "b"),
        QueueEntry("00000000000000000000000f", "q", 0, now + timedelta(seconds=30), "c"),
        QueueEntry("000000000000000000000010", "q", 0, handler="a"),
    ]
    await queue.push(entries, now)
    assert await queue.lanes("q") == ["a", "b", "c"]
    # The queue's own lane and those of a and b, as one set would order them; not c's.
    popped = await queue.pop(["q"], 4, now, handlers=["a", "b"])
    assert [i[-2:] for i in popped.run_ids] == ["0e", "0b", "0d", "0a"]
    assert popped.next_due is None, "c's delayed run is not this pop's to promote"
    rest = await queue.pop(["q"], 10, now, 1, handlers=["a", "b"])
    assert [i[-2:] for i in rest.run_ids] == ["10"]
    assert await queue.redis.zcard(queue.keys.queue("q", "c")) == 1


async def test_missing_finds_runs_redis_lost(queue: RedisQueue, store: MongoStore) -> None:
    now = store.clock.now()
    ready = QueueEntry("00000000000000000000000a", "q", 1)
    delayed = QueueEntry("00000000000000000000000b", "q", 2, now + timedelta(seconds=60))
    lost = QueueEntry("00000000000000000000000c", "q", 0)
    await queue.push([ready, delayed], now)
    assert await queue.missing([ready, delayed, lost]) == [lost]
    await queue.remove(delayed)
    assert await queue.missing([ready, delayed]) == [delayed]


async def test_a_blocking_pop_waits_for_a_push(queue: RedisQueue, store: MongoStore) -> None:
    now = store.clock.now()
    assert (await queue.pop(["q"], 4, now, 0.05)).run_ids == []

    async def push_soon() -> None:
        await asyncio.sleep(0.1)
        ids = [f"00000000000000000000000{c}" for c in "abc"]
        await queue.push([QueueEntry(i, "q", 0) for i in ids], store.clock.now())

    pusher = asyncio.create_task(push_soon())
    began = time.monotonic()
    popped = await queue.pop(["q"], 4, now, 5)
    assert time.monotonic() - began < 4, "woken by the push, not by the timeout"
    await pusher
    # The wait takes the first id; the pop after it, in the same round trip, the ones pushed
    # with it.
    assert [i[-1] for i in popped.run_ids] == ["a", "b", "c"]


async def test_signals_reach_a_listener_until_it_stops(queue: RedisQueue) -> None:
    until = asyncio.Event()
    heard: list[tuple[str, str]] = []

    async def listen() -> None:
        async for signal in queue.signals(until):
            heard.append(signal)
            if len({kind for kind, _ in heard}) == 2:
                until.set()

    listener = asyncio.create_task(listen())
    async with asyncio.timeout(10):
        # A signal sent before the listener subscribed reaches nobody: send until both land.
        while not until.is_set():
            await queue.signal_cancel("00000000000000000000000a")
            await queue.signal_reported("00000000000000000000000a#1")
            await asyncio.sleep(0.05)
        await listener
    assert set(heard) == {
        ("cancel", "00000000000000000000000a"),
        ("reported", "00000000000000000000000a#1"),
    }


async def test_a_wait_under_a_millisecond_is_not_forever(queue: RedisQueue) -> None:
    """Redis reads a timeout that truncates to 0 ms as "block forever"."""
    async with asyncio.timeout(10):
        assert (await queue.pop(["q"], 1, datetime.now(UTC), 0.0001)).run_ids == []


async def test_a_blocking_pop_takes_no_more_than_asked_across_queues(
    queue: RedisQueue, store: MongoStore
) -> None:
    now = store.clock.now()
    first = [QueueEntry(f"{i:024x}", "q1", 0) for i in range(1, 11)]
    second = [QueueEntry(f"{i:024x}", "q2", 0) for i in range(11, 21)]
    await queue.push(second, now)
    # q1 is empty: the wait takes q2's first run, and the pops fill the rest from q2.
    popped = await queue.pop(["q1", "q2"], 5, now, 1)
    assert popped.run_ids == [e.run_id for e in second[:5]]
    await queue.push(first, now)
    popped = await queue.pop(["q1", "q2"], 5, now, 1)
    assert popped.run_ids == [e.run_id for e in first[:5]], "q1 first, and five in all"
    assert await queue.redis.zcard(queue.keys.queue("q2")) == 5


async def test_the_tick_promotes_delayed_runs_of_a_queue_no_worker_polls(
    backends: Backends, settings: Settings, register: Register
) -> None:
    clock = ManualClock(datetime(2026, 3, 1, tzinfo=UTC))
    store = MongoStore(backends.store.client, settings.db, clock=clock)
    await register(queue="reports")
    request = RunRequest("t_noop", "user", "u1", delay_seconds=60)
    run, _ = await RunService(store, backends.queue).create(request, "user:test")
    scheduler = Scheduler(store, backends.queue, settings, clock)
    ready = backends.queue.keys.queue("reports", run.handler)

    await scheduler.reconcile()
    assert await backends.queue.redis.zscore(ready, run.id) is None, "not due yet"
    clock.advance(61)
    await scheduler.reconcile()
    assert await backends.queue.redis.zscore(ready, run.id) is not None


async def test_the_tick_queues_a_run_left_pending_and_pushes_it_once_queued(
    backends: Backends, settings: Settings, register: Register
) -> None:
    """A run whose process died after it took its dedupe key, before it queued the run."""
    clock = ManualClock(datetime(2026, 3, 1, tzinfo=UTC))
    store = MongoStore(backends.store.client, settings.db, clock=clock)
    await register()
    run, _ = await RunService(store, backends.queue).create(
        RunRequest("t_noop", "user", "u1"), "user:test"
    )
    await backends.queue.remove(QueueEntry.of(run))
    await raw(store).runs.update_one({"_id": ObjectId(run.id)}, {"$set": {"status": "pending"}})
    scheduler = Scheduler(store, backends.queue, settings, clock)
    ready = backends.queue.keys.queue("default", run.handler)

    clock.advance(settings.reconcile_seconds + 1)
    assert await scheduler.reconcile() == 1
    found = await store.runs.get(run.id)
    assert found is not None and found.status == RunStatus.QUEUED
    assert await backends.queue.redis.zscore(ready, run.id) is not None
    assert await scheduler.reconcile() == 0, "queued and in Redis: nothing more to do"


def _ids(n: int, start: int = 1) -> list[str]:
    return [f"{i:024x}" for i in range(start, start + n)]


async def test_a_fair_lane_takes_its_groups_in_turns_within_a_priority(
    queue: RedisQueue, store: MongoStore
) -> None:
    now = store.clock.now()
    big = [QueueEntry(i, "q", 0, group="account:big") for i in _ids(20)]
    small = [QueueEntry(i, "q", 0, group="account:small") for i in _ids(3, 100)]
    urgent = QueueEntry(f"{200:024x}", "q", 5, group="account:big")
    plain = QueueEntry(f"{300:024x}", "q", 1)
    await queue.push(big, now)
    await queue.push([*small, urgent, plain], now)
    popped = (await queue.pop(["q"], 9, now)).run_ids
    # Priorities first (the fair and the plain runs alike), then the groups take turns: big
    # was served last (its urgent run), so small goes first.
    assert popped[:2] == [urgent.run_id, plain.run_id]
    assert popped[2:] == [
        small[0].run_id,
        big[0].run_id,
        small[1].run_id,
        big[1].run_id,
        small[2].run_id,
        big[2].run_id,
        big[3].run_id,
    ]
    depth = await queue.lane_depth("q", None, now)
    assert depth.ready == 16, "the fair runs still ready count as ready"
    assert (await queue.pop(["q"], 100, now)).run_ids == [e.run_id for e in big[4:]]
    assert await queue.redis.zcard(queue.keys.ring("q")) == 0
    assert await queue.redis.zcard(queue.keys.bell("q")) == 0


async def test_a_fair_run_is_delayed_removed_and_found_missing_in_its_group(
    queue: RedisQueue, store: MongoStore
) -> None:
    now = store.clock.now()
    later = QueueEntry(_ids(1)[0], "q", 2, now + timedelta(seconds=30), "h", "user:u1")
    ready = QueueEntry(_ids(1, 2)[0], "q", 0, handler="h", group="user:u2")
    gone = QueueEntry(_ids(1, 3)[0], "q", 0, handler="h", group="user:u2")
    await queue.push([later, ready, gone], now)
    assert await queue.missing([later, ready, gone]) == []
    await queue.remove(gone)
    assert await queue.missing([later, ready, gone]) == [gone]
    popped = await queue.pop(["q"], 5, now + timedelta(seconds=31), handlers=["h"])
    assert popped.run_ids == [later.run_id, ready.run_id], "promoted into its group, priority 2"


async def test_a_blocking_pop_wakes_for_a_fair_run(queue: RedisQueue, store: MongoStore) -> None:
    async def push_soon() -> None:
        await asyncio.sleep(0.1)
        entries = [QueueEntry(i, "q", 0, group="user:u") for i in _ids(2)]
        await queue.push(entries, store.clock.now())

    pusher = asyncio.create_task(push_soon())
    began = time.monotonic()
    popped = await queue.pop(["q"], 1, store.clock.now(), 5)
    await pusher
    assert time.monotonic() - began < 4, "woken by the push, not by the timeout"
    # The bell woke the pop; the pop after the wait had no slot left for a run, so it popped
    # again: one run taken, the other still in its group with the bell ringing for it.
    assert popped.run_ids == _ids(1)
    assert await queue.redis.zcard(queue.keys.bell("q")) == 1
    assert (await queue.pop(["q"], 5, store.clock.now(), 1)).run_ids == _ids(1, 2)


async def test_a_paused_queue_keeps_its_runs_and_a_pop_says_so(
    queue: RedisQueue, store: MongoStore
) -> None:
    now = store.clock.now()
    await queue.push([QueueEntry(i, "q1", 0) for i in _ids(2)], now)
    await queue.push([QueueEntry(i, "q2", 0) for i in _ids(2, 10)], now)
    await queue.mirror_pauses([("q1", 1, True)], complete=False)
    popped = await queue.pop(["q1", "q2"], 10, now, 1)
    assert (popped.run_ids, popped.paused) == (_ids(2, 10), frozenset({"q1"}))
    # A blocking pop does not wait on the paused queue's lanes, and takes none of its runs.
    waited = await queue.pop(["q1", "q2"], 10, now, 0.05, paused=popped.paused)
    assert waited.run_ids == [] and await queue.redis.zcard(queue.keys.queue("q1")) == 2
    # An older copy of the pause does not undo a newer one; a newer one resumes.
    await queue.mirror_pauses([("q1", 0, False)], complete=True)
    assert (await queue.pop(["q1"], 10, now)).paused == frozenset({"q1"})
    await queue.mirror_pauses([("q1", 2, False)], complete=False)
    resumed = await queue.pop(["q1"], 10, now)
    assert (resumed.run_ids, resumed.paused) == (_ids(2), frozenset())


async def test_a_redis_without_the_pauses_pops_nothing_until_they_are_loaded(
    queue: RedisQueue, store: MongoStore
) -> None:
    now = store.clock.now()
    await queue.push([QueueEntry(i, "q", 0) for i in _ids(3)], now)
    await queue.redis.delete(queue.keys.paused)  # as a wiped Redis would be
    blocked = await queue.pop(["q"], 10, now, 0.2)
    assert (blocked.run_ids, blocked.mirrored) == ([], False)
    assert await queue.redis.zcard(queue.keys.queue("q")) == 3, "the wait put its run back"
    await queue.mirror_pauses([], complete=True)
    assert (await queue.pop(["q"], 10, now)).run_ids == _ids(3)


async def test_locks_are_taken_together_renewed_and_let_go_to_their_oldest_waiter(
    queue: RedisQueue, store: MongoStore
) -> None:
    """The locks' keys, token counter and waiters share a slot: one script takes several
    locks, gives tokens, and wakes a waiter, on a cluster as on one server."""
    locks = Locks(store, queue, ttl_seconds=5)
    now = store.clock.now()
    first = await locks.take(["a", "b:[1]"], "run-1:lease")
    assert isinstance(first, Taken) and first.tokens["a"] < first.tokens["b:[1]"]
    assert await locks.take(["c", "a"], "run-2:lease") == Blocked("a", "run-1:lease")
    waiter = QueueEntry(_ids(1)[0], "q", 0, now + timedelta(seconds=30), "h")
    await queue.push([waiter], now)
    await queue.locks.wait("a", waiter, now)
    assert await locks.renew(["a", "b:[1]"], "run-1:lease") == set()
    await locks.release(["a", "b:[1]"], "run-1:lease", now)
    popped = await queue.pop(["q"], 5, now, handlers=["h"])
    assert popped.run_ids == [waiter.run_id], "woken at once, out of its delayed set"
    second = await locks.take(["c", "a"], "run-2:lease")
    assert isinstance(second, Taken) and min(second.tokens.values()) > first.tokens["b:[1]"]


async def test_a_pop_takes_each_popped_runs_rate_window(
    queue: RedisQueue, store: MongoStore
) -> None:
    now = store.clock.now()
    rate = RunRate(key='["t"]', limit=2, period_seconds=1.0)
    runs = [QueueEntry(i, "q", 3, limits=StartLimits("t", rate=rate)) for i in _ids(4)]
    await queue.push(runs, now)
    popped = await queue.pop(["q"], 5, now)
    assert popped.run_ids == _ids(2)
    assert popped.windows == dict.fromkeys(_ids(2), True), "counted now"
    assert [limits for limits, _ in popped.refused] == [runs[2].limits, runs[3].limits]
    dues = [due for _, due in popped.refused]
    assert now < dues[0] < dues[1], "a backlog comes back spread at the limit's pace"
    assert popped.next_due == dues[0], "the worker wakes for the first of them"
    assert await queue.delayed_until(runs[2:]) == dues, "back in their delayed set"
    assert await queue.redis.zcard(queue.keys.bell("q")) == 0
    # A stale pop of a run counted before: it may start, and its count is not its own.
    await queue.push([runs[0]], now)
    again = await queue.pop(["q"], 5, now)
    assert (again.run_ids, again.windows) == ([runs[0].run_id], {runs[0].run_id: False})
    # A start given back makes room in the window (the key the pop script wrote).
    await queue.limits.rate_return([(runs[1].run_id, rate.key)])
    fresh = QueueEntry(_ids(1, 9)[0], "q", 0, limits=runs[0].limits)
    await queue.push([fresh], now)
    assert (await queue.pop(["q"], 5, now)).windows == {fresh.run_id: True}
    # Due, the refused runs come back through their rated set and pass their window again.
    later = await queue.pop(["q"], 5, dues[1] + timedelta(seconds=1))
    assert later.run_ids == _ids(2, 3) and later.windows == dict.fromkeys(_ids(2, 3), True)


async def test_a_pop_counts_a_window_again_for_a_run_of_another_period(
    queue: RedisQueue, store: MongoStore
) -> None:
    """A pop counts a window once for all its runs, but a run of another template version,
    with another period, has the window counted again over its own period."""
    now = store.clock.now()
    long = StartLimits("t", rate=RunRate(key='["t"]', limit=2, period_seconds=60.0))
    short = StartLimits("t", rate=RunRate(key='["t"]', limit=2, period_seconds=1.0))
    earlier = QueueEntry(_ids(1)[0], "q", 0, limits=long)
    await queue.push([earlier], now - timedelta(seconds=5))
    assert (await queue.pop(["q"], 1, now - timedelta(seconds=5))).run_ids == _ids(1)
    first, second = _ids(2, 2)
    runs = [QueueEntry(first, "q", 0, limits=long), QueueEntry(second, "q", 0, limits=short)]
    await queue.push(runs, now)
    popped = await queue.pop(["q"], 5, now)
    # Over 60 s the window holds the earlier start and then the first run's: full. Over 1 s
    # only the first run's: room for the second.
    assert popped.windows == {first: True, second: True}
    assert popped.refused == ()


async def test_a_blocking_pop_wakes_for_a_rated_run_and_takes_its_window(
    queue: RedisQueue, store: MongoStore
) -> None:
    """A rated run rings its lane's bell rather than waiting where BZPOPMIN takes from: the
    worker it wakes takes it in the pop script, past its window, in the same round trip when
    it has more than one free slot, and in a second one otherwise."""
    rate = RunRate(key='["t"]', limit=1, period_seconds=30)
    runs = [QueueEntry(i, "q", 0, limits=StartLimits("t", rate=rate)) for i in _ids(3)]

    async def push_soon(entries: list[QueueEntry]) -> None:
        await asyncio.sleep(0.1)
        await queue.push(entries, store.clock.now())

    pusher = asyncio.create_task(push_soon(runs[:1]))
    popped = await queue.pop(["q"], 2, store.clock.now(), 5)
    await pusher
    assert (popped.run_ids, popped.windows) == ([runs[0].run_id], {runs[0].run_id: True})
    pusher = asyncio.create_task(push_soon(runs[1:]))
    refused = await queue.pop(["q"], 1, store.clock.now(), 5)
    await pusher
    assert (refused.run_ids, len(refused.refused)) == ([], 1), "over the window"
    assert await queue.redis.zcard(queue.keys.bell("q")) == 1, "the other one's bell"
    last = await queue.pop(["q"], 1, store.clock.now(), 5)
    assert (last.run_ids, len(last.refused)) == ([], 1)
    assert await queue.redis.zcard(queue.keys.bell("q")) == 0, "no bell left for a delayed run"
    assert await queue.delayed_until(runs[1:]) == [due for _, due in refused.refused + last.refused]


async def test_a_bell_rung_for_a_run_another_pop_took_rings_no_more(
    queue: RedisQueue, store: MongoStore
) -> None:
    """Two workers race for a run: one's BZPOPMIN takes the bell's member, the other's pop takes
    the run. The first must not put the member back, or every wake-up after it would find
    nothing and put it back again: the workers would spin."""
    now = store.clock.now()
    rate = RunRate(key='["t"]', limit=100, period_seconds=1)
    rated = QueueEntry(_ids(1)[0], "q", 0, limits=StartLimits("t", rate=rate))
    fair = QueueEntry(_ids(1, 2)[0], "q", 0, group="user:u")
    await queue.push([rated, fair], now)
    bell = queue.keys.bell("q")
    rung = await queue.redis.zrange(bell, 0, -1, withscores=True)
    assert len(rung) == 2
    assert (await queue.pop(["q"], 5, now)).run_ids == [rated.run_id, fair.run_id]
    # As the race leaves it: the bell's members back, their runs gone.
    await queue.redis.zadd(bell, dict(rung))
    for _ in rung:
        woken = await queue.pop(["q"], 1, now, 5)
        assert woken.run_ids == []
    assert await queue.redis.zcard(bell) == 0, "no member left for a run gone"
    began = time.monotonic()
    assert (await queue.pop(["q"], 1, now, 0.2)).run_ids == []
    assert time.monotonic() - began >= 0.2, "the next pop waits, woken by nothing"
    # A run that still waits when its wake-up had no slot for it rings again, and is taken.
    await queue.push([fair], now)
    assert (await queue.pop(["q"], 1, now, 5)).run_ids == [fair.run_id]
    assert await queue.redis.zcard(bell) == 0


async def test_held_runs_go_back_by_priority_then_age(queue: RedisQueue, store: MongoStore) -> None:
    now = store.clock.now()
    capped = StartLimits("capped", 5)
    held = [QueueEntry(i, "q", p, limits=capped) for i, p in zip(_ids(3), (0, 5, 0), strict=True)]
    await queue.limits.hold(held)
    assert await queue.missing(held) == []
    assert await queue.limits.holding(held) == {e.run_id for e in held}
    assert await queue.limits.held_counts() == {"capped": 3}
    assert await queue.limits.release("capped", 2, now) == 2
    popped = await queue.pop(["q"], 5, now)
    assert popped.run_ids == [held[1].run_id, held[0].run_id], "priority, then age"
    assert await queue.limits.holding(held) == {held[2].run_id}


async def test_a_pop_says_which_runs_have_limits(queue: RedisQueue, store: MongoStore) -> None:
    now = store.clock.now()
    plain, limited = (QueueEntry(i, "q", 0) for i in _ids(2))
    # A window may hold any character: `|` would cut a delayed member short.
    rate = RunRate(key='["t","a|b+c"]', limit=5, period_seconds=1.5)
    limits = StartLimits("t", 3, rate)
    limited = QueueEntry(limited.run_id, "q", 0, limits=limits)
    later = QueueEntry(_ids(1, 9)[0], "q", 0, now + timedelta(seconds=5), limits=limits)
    await queue.push([plain, limited, later], now)
    assert await queue.missing([plain, limited, later]) == []
    popped = await queue.pop(["q"], 5, now + timedelta(seconds=6))
    assert popped.run_ids == [plain.run_id, limited.run_id, later.run_id]
    assert popped.limits == {limited.run_id: limits, later.run_id: limits}
    await queue.push([limited], now)
    await queue.remove(limited)
    assert await queue.missing([limited]) == [limited]
