"""The Redis fast path: queue order, delayed promotion, owner-checked locks."""

from datetime import UTC, datetime, timedelta

from jobplane.backends import Backends
from jobplane.clock import ManualClock
from jobplane.queue.redis import QueueEntry, RedisQueue
from jobplane.runs import RunRequest, RunService
from jobplane.scheduler import Scheduler
from jobplane.settings import Settings
from jobplane.store import MongoStore
from tests.integration.conftest import Register


async def test_lock_refresh_and_release_need_the_owner(queue: RedisQueue) -> None:
    key = queue.keys.lock("run1")
    assert await queue.acquire_lock(key, "w1:tok1", 10)
    assert not await queue.acquire_lock(key, "w2:tok2", 10), "held by another owner"

    assert not await queue.refresh_lock(key, "w2:tok2", 100)
    assert not await queue.release_lock(key, "w2:tok2")
    assert await queue.redis.get(key) == b"w1:tok1"
    assert 0 < await queue.redis.pttl(key) <= 10_000, "a stranger's refresh did not extend it"

    assert await queue.refresh_lock(key, "w1:tok1", 100)
    assert 10_000 < await queue.redis.pttl(key) <= 100_000
    assert await queue.release_lock(key, "w1:tok1")
    assert await queue.redis.get(key) is None


async def test_run_locks_report_lost_owners(queue: RedisQueue) -> None:
    await queue.lock_runs({"a": "w1:t1", "b": "w1:t1"}, 10)
    await queue.lock_runs({"b": "w2:t2"}, 10)  # a later claim, decided by MongoDB, takes b
    assert await queue.refresh_runs({"a": "w1:t1", "b": "w1:t1"}, 10) == {"a": True, "b": False}
    assert not await queue.release_run("b", "w1:t1")
    assert await queue.redis.get(queue.keys.lock("b")) == b"w2:t2"


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


async def test_missing_finds_runs_redis_lost(queue: RedisQueue, store: MongoStore) -> None:
    now = store.clock.now()
    ready = QueueEntry("00000000000000000000000a", "q", 1)
    delayed = QueueEntry("00000000000000000000000b", "q", 2, now + timedelta(seconds=60))
    lost = QueueEntry("00000000000000000000000c", "q", 0)
    await queue.push([ready, delayed], now)
    assert await queue.missing([ready, delayed, lost]) == [lost]
    await queue.remove(delayed.run_id, "q", 2)
    assert await queue.missing([ready, delayed]) == [delayed]


async def test_wait_blocks_until_a_push(queue: RedisQueue, store: MongoStore) -> None:
    assert await queue.wait(["q"], 0.05) is None
    await queue.push([QueueEntry("00000000000000000000000a", "q", 0)], store.clock.now())
    assert await queue.wait(["q"], 1) == "00000000000000000000000a"


async def test_the_tick_promotes_delayed_runs_of_a_queue_no_worker_polls(
    backends: Backends, settings: Settings, register: Register
) -> None:
    clock = ManualClock(datetime(2026, 3, 1, tzinfo=UTC))
    store = MongoStore(backends.store.client, settings.db, clock=clock)
    await register(queue="reports")
    request = RunRequest("t_noop", "user", "u1", delay_seconds=60)
    run, _ = await RunService(store, backends.queue).create(request, "user:test")
    scheduler = Scheduler(store, backends.queue, settings, clock)
    ready = backends.queue.keys.queue("reports")

    await scheduler.reconcile()
    assert await backends.queue.redis.zscore(ready, run.id) is None, "not due yet"
    clock.advance(61)
    await scheduler.reconcile()
    assert await backends.queue.redis.zscore(ready, run.id) is not None
