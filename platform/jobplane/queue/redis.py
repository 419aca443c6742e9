"""Redis fast path: ready and delayed queues, the queues' pauses, cancel signals, the worker
registry; its pop (`queue/pop.py`), locks (`queue/locks.py`) and start limits (`queue/limits.py`)
hang off it.

Nothing here is the truth about a run; MongoDB is. A popped id is only a hint that a run may be
claimable, and everything in Redis can be rebuilt from MongoDB by the reconciler.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, cast

from bson import ObjectId
from redis.asyncio import RedisCluster

from jobplane.groupcommit import GroupCommit
from jobplane.queue.calls import answered_within, bounded, epoch_ms, eval_in, script, text
from jobplane.queue.connect import RedisClient
from jobplane.queue.entry import QueueEntry, run_of
from jobplane.queue.keys import Keys, bell_member, bell_run, delayed_member
from jobplane.queue.limits import RedisLimits
from jobplane.queue.locks import RedisLocks
from jobplane.queue.pop import Popped, Popper


@dataclass(frozen=True)
class Offer:
    """What a live worker serves, as its last heartbeat said."""

    held: int
    queues: list[str]
    handlers: list[str]

    def serves(self, queue: str, handler: str | None) -> bool:
        return queue in self.queues and (handler is None or handler in self.handlers)


@dataclass(frozen=True)
class LaneDepth:
    ready: int
    # Delayed runs now due (a pop promotes them), and all delayed runs.
    due: int
    delayed: int
    # When the oldest ready run was created or fell due.
    oldest_at: datetime | None


# What a pub/sub message signals (`RedisQueue.signals`).
Signal = Literal["cancel", "reported"]
# Where a push puts a run: its queue and lane, the sorted set, the member and its score.
_Placed = tuple[str, str | None, str, str, float]
# A ready run of a fair lane: its queue and lane, its ring, group and bell, its id and priority.
_Entered = tuple[str, str | None, str, str, str, str, int]


class RedisQueue:
    """The operations jobplane runs on Redis, grouped as callers use them: push; pop and
    promote due runs; removal and the reconciler's check; cancel signals; the worker registry.
    `locks` and `limits` hold the owner-checked locks and the start limits' state."""

    def __init__(self, redis: RedisClient, keys: Keys, timeout_seconds: float = 10.0) -> None:
        self.redis = redis
        self.keys = keys
        # The longest any call may take, beyond the wait of a blocking pop (see `bounded`).
        self.timeout_seconds = timeout_seconds
        self._popper = Popper(redis, keys)
        self._enter = script(redis, "enter", "fair")
        self._pauses = script(redis, "pauses")
        self._alive = script(redis, "alive")
        self._workers = script(redis, "workers")
        self._pushes = GroupCommit(self._push_many)
        self.locks = RedisLocks(redis, keys, timeout_seconds, self.wake)
        self.limits = RedisLimits(redis, keys, timeout_seconds, self.push)

    # -- push ----------------------------------------------------------------------------------

    async def push(self, entries: Iterable[QueueEntry], now: datetime) -> None:
        """Make runs visible to workers: ready now, or delayed until `not_before`.

        Concurrent pushes go out together, one ZADD per sorted set.
        """
        placed = self._placed(entries, now)
        if placed:
            await self._pushes.submit(placed)

    async def wake(self, entries: Sequence[QueueEntry], now: datetime) -> None:
        """Move runs waiting in their delayed sets (for a lock) to their lanes, ready now."""
        async with answered_within(self.timeout_seconds, "wake"):
            async with self.redis.pipeline(transaction=False) as pipe:
                for entry in entries:
                    pipe.zrem(self.keys.delayed(entry.queue, entry.handler), self._delayed(entry))
                await pipe.execute()
        await self.push(entries, now)

    def _placed(self, entries: Iterable[QueueEntry], now: datetime) -> list[_Placed | _Entered]:
        """Where pushing `entries` puts them: their ready or delayed sets, or fair groups."""
        placed: list[_Placed | _Entered] = []
        for e in entries:
            if e.not_before is not None and e.not_before > now:
                member = delayed_member(e.member, e.priority, self._group(e))
                key = self.keys.delayed(e.queue, e.handler)
                placed.append((e.queue, e.handler, key, member, epoch_ms(e.not_before)))
            elif e.group is not None:
                ring, bell = self.keys.ring(e.queue, e.handler), self.keys.bell(e.queue, e.handler)
                group = self.keys.group(e.queue, e.handler, e.group)
                placed.append((e.queue, e.handler, ring, group, bell, e.member, e.priority))
            elif e.rated:
                # Out of a blocking pop's reach: its bell wakes a worker, whose pop script
                # takes the run and its window together (pop.lua promotes one alike).
                for lane_set in (self.keys.rated, self.keys.bell):
                    key = lane_set(e.queue, e.handler)
                    placed.append((e.queue, e.handler, key, e.member, -e.priority))
            else:
                key = self.keys.queue(e.queue, e.handler)
                placed.append((e.queue, e.handler, key, e.member, -e.priority))
        return placed

    @bounded
    async def _push_many(self, pushes: list[list[_Placed | _Entered]]) -> list[None]:
        by_key: dict[str, dict[str, float]] = {}
        entered: list[_Entered] = []
        lanes: dict[str, set[str]] = {}
        for placed in pushes:
            for item in placed:
                queue, handler = item[0], item[1]
                if len(item) == 7:
                    entered.append(item)
                else:
                    _, _, key, member, score = item
                    by_key.setdefault(key, {})[member] = score
                if handler is not None:
                    lanes.setdefault(queue, set()).add(handler)
        async with self.redis.pipeline(transaction=False) as pipe:
            for key, members in by_key.items():
                pipe.zadd(key, members)
            if entered:
                keys = [self.keys.turn, *(k for e in entered for k in e[2:5])]
                eval_in(pipe, self._enter, keys, [a for e in entered for a in e[5:]])
            for queue, handlers in lanes.items():
                pipe.sadd(self.keys.lanes(queue), *handlers)
            await pipe.execute()
        return [None] * len(pushes)

    def _group(self, entry: QueueEntry) -> str | None:
        """The key of the entry's group, in a fair lane."""
        if entry.group is None:
            return None
        return self.keys.group(entry.queue, entry.handler, entry.group)

    async def lanes(self, queue: str) -> list[str]:
        """The handlers of the lanes of `queue` that runs were ever pushed to."""
        return sorted(text(h) for h in await self.redis.smembers(self.keys.lanes(queue)))

    # -- pop and promote -----------------------------------------------------------------------

    async def pop(
        self,
        queues: Sequence[str],
        n: int,
        now: datetime,
        block_seconds: float = 0,
        handlers: Sequence[str] = (),
        paused: Collection[str] = (),
    ) -> Popped:
        """Pop up to `n` ready ids across `queues` in order, promoting due delayed runs first.

        Of each queue, the lanes popped are its own and those of `handlers`; within a queue,
        its lanes' runs come out by priority as if they were one set (a fair lane's in turns
        across its groups). A paused queue's runs stay; the answer names the paused queues.
        A popped run with a rate limit passes its window in the same script; one over it
        goes back to its delayed set, due when the window allows (`Popped.refused`).

        With `block_seconds` (and `n` > 0) a BZPOPMIN over the ready sets and bells of the
        queues not in `paused` (the caller's last answer) goes first: it takes a ready id at
        once (the first non-empty lane's, so a caller that wants strict priority under a
        backlog does not block), or waits up to that long for one to be pushed. It shares a
        round trip with the pop of the others: a worker waiting for work pays one round trip
        a wake-up, not a pop that finds nothing and then a wait.
        """
        if not queues:
            return Popped([], None)
        async with answered_within(self.timeout_seconds + max(block_seconds, 0), "pop"):
            return await self._popper.pop(queues, handlers, n, now, block_seconds, paused)

    @bounded
    async def promote(self, queues: Sequence[str], now: datetime) -> None:
        """Move the due delayed runs of every lane of `queues` to their ready sets. Workers
        do it for their own lanes as they pop; this covers lanes no worker pops."""
        for queue in queues:
            # A pop of none: the pop script promotes, and takes nothing.
            await self._popper.pop([queue], await self.lanes(queue), 0, now, 0, ())

    # -- the queues' pauses ----------------------------------------------------------------------

    @bounded
    async def mirror_pauses(self, states: Sequence[tuple[str, int, bool]], complete: bool) -> None:
        """Copy queues' pauses (name, version, paused) into the mirror the pops read; a copy
        older than the mirror's is left out. `complete`: these are every queue MongoDB holds,
        so the mirror counts as loaded."""
        args: list[str | int] = [1 if complete else 0]
        for queue, version, paused in states:
            args += [queue, version, 1 if paused else 0]
        await self._pauses(keys=[self.keys.paused], args=args)

    # -- removal, and the reconciler's check ---------------------------------------------------

    @bounded
    async def remove(self, entry: QueueEntry) -> None:
        """Take a run out of its lane, ready or delayed, or out of its template's held runs."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(self._ready(entry), entry.member)
            pipe.zrem(self.keys.delayed(entry.queue, entry.handler), self._delayed(entry))
            if entry.group is not None or entry.rated:
                bell = self.keys.bell(entry.queue, entry.handler)
                pipe.zrem(bell, bell_member(entry.member, self._group(entry)))
            if entry.capped is not None:
                pipe.zrem(self.keys.held(entry.capped), entry.held())
            await pipe.execute()

    @bounded
    async def missing(self, entries: Sequence[QueueEntry]) -> list[QueueEntry]:
        """The entries that are in none of their ready set, their delayed set and their
        template's held runs."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for e in entries:
                pipe.zscore(self._ready(e), e.member)
                pipe.zscore(self.keys.delayed(e.queue, e.handler), self._delayed(e))
                if e.capped is not None:
                    pipe.zscore(self.keys.held(e.capped), e.held())
            scores = iter(await pipe.execute())
        found = [(e, [next(scores) for _ in range(2 if e.capped is None else 3)]) for e in entries]
        return [e for e, places in found if all(p is None for p in places)]

    @bounded
    async def delayed_until(self, entries: Sequence[QueueEntry]) -> list[datetime | None]:
        """When each entry's delayed member falls due, or None when it is not delayed."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for e in entries:
                pipe.zscore(self.keys.delayed(e.queue, e.handler), self._delayed(e))
            scores = await pipe.execute()
        return [None if s is None else datetime.fromtimestamp(s / 1000, UTC) for s in scores]

    def _ready(self, entry: QueueEntry) -> str:
        """The sorted set that holds the entry while it is ready: its lane's, its group's, or
        its lane's rated set."""
        if entry.group is not None:
            return self.keys.group(entry.queue, entry.handler, entry.group)
        if entry.rated:
            return self.keys.rated(entry.queue, entry.handler)
        return self.keys.queue(entry.queue, entry.handler)

    def _delayed(self, entry: QueueEntry) -> str:
        return delayed_member(entry.member, entry.priority, self._group(entry))

    # -- what the lanes hold ---------------------------------------------------------------------

    @bounded
    async def lane_depth(self, queue: str, handler: str | None, now: datetime) -> LaneDepth:
        """What a lane holds, counted (never read whole), for `/metrics` and the overview: its
        fair part's ready runs (its bell) with the others."""
        delayed_key = self.keys.delayed(queue, handler)
        ready_keys = [self.keys.queue(queue, handler), self.keys.bell(queue, handler)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in ready_keys:
                pipe.zcard(key)
            pipe.zcount(delayed_key, "-inf", epoch_ms(now))
            pipe.zcard(delayed_key)
            pipe.zrange(delayed_key, 0, 0, withscores=True)
            plain, fair, due, delayed, first_delayed = await pipe.execute()
        times: list[datetime] = []
        if due:
            times.append(datetime.fromtimestamp(first_delayed[0][1] / 1000, UTC))
        # A ready set orders by -priority, then by id; ids are ObjectIds, which begin with
        # their creation time, so the first member of each priority is its oldest. One read per
        # priority present (at most 201), each O(log n).
        for key in ready_keys:
            after = "-inf"
            while head := await self.redis.zrangebyscore(
                key, after, "+inf", start=0, num=1, withscores=True
            ):
                member, score = cast(tuple[bytes, float], head[0])
                if ObjectId.is_valid(run_id := run_of(bell_run(text(member)))[0]):
                    times.append(ObjectId(run_id).generation_time)
                after = f"({score}"
        return LaneDepth(plain + fair, due, delayed, min(times, default=None))

    @bounded
    async def ping(self) -> None:
        await self.redis.ping()

    # -- cancel signals ------------------------------------------------------------------------

    @bounded
    async def signal_cancel(self, run_id: str) -> None:
        """Tell every worker listening that `run_id`'s cancel was requested. Only a hint: a
        worker that misses it hears of the cancel from MongoDB at its next heartbeat."""
        await self.redis.publish(self.keys.cancel_channel, run_id)

    @bounded
    async def signal_reported(self, key: str) -> None:
        """Tell the holder of lent step `key` that its borrower reported its end. Only a
        hint: a holder that misses it reads the report at its next look."""
        await self.redis.publish(self.keys.reported_channel, key)

    async def signals(self, until: asyncio.Event) -> AsyncIterator[tuple[Signal, str]]:
        """Each signal sent from now on, until `until` is set (looked at every half second):
        a cancel (of a run, or a stop of a lent step) or a lent step's report, with the id it
        names. A lost subscription raises a Redis error."""
        kinds: dict[str, Signal] = {
            self.keys.cancel_channel: "cancel",
            self.keys.reported_channel: "reported",
        }
        async with self.redis.pubsub(ignore_subscribe_messages=True) as pubsub:
            async with answered_within(self.timeout_seconds, "subscribe"):
                if isinstance(self.redis, RedisCluster):
                    # A cluster's pub/sub finds its node in the slot map, which the client
                    # loads with its first command: subscribing first failed with a KeyError.
                    await self.redis.initialize()
                await pubsub.subscribe(*kinds)
            while not until.is_set():
                message = await pubsub.get_message(timeout=0.5)
                if message is not None:
                    yield kinds[text(message["channel"])], text(message["data"])

    # -- the worker registry -------------------------------------------------------------------

    @bounded
    async def mark_alive(
        self,
        worker_id: str,
        ttl_seconds: float,
        running: int,
        queues: Sequence[str] = (),
        handlers: Sequence[str] = (),
    ) -> None:
        """Count the worker as alive for `ttl_seconds` more, holding `running` runs, and
        serving the lanes of `handlers` in `queues`."""
        offer = json.dumps({"queues": list(queues), "handlers": list(handlers)})
        args: list[str | int] = [worker_id, int(ttl_seconds * 1000), running, offer]
        await self._alive(keys=self._registry, args=args)

    @bounded
    async def withdraw(self, worker_id: str) -> None:
        """Take a stopping worker out of the live ones at once, rather than when its time ends."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(self.keys.workers, worker_id)
            pipe.hdel(self.keys.workers_held, worker_id)
            pipe.hdel(self.keys.workers_offers, worker_id)
            await pipe.execute()

    @bounded
    async def live_workers(self) -> dict[str, Offer]:
        """Each live worker's id, the runs it held at its last heartbeat and what it serves,
        in one read."""
        flat = await self._workers(keys=self._registry)
        live: dict[str, Offer] = {}
        for i in range(0, len(flat), 3):
            offer = json.loads(text(flat[i + 2]))
            held = int(text(flat[i + 1]))
            live[text(flat[i])] = Offer(held, offer.get("queues", []), offer.get("handlers", []))
        return live

    @property
    def _registry(self) -> list[str]:
        return [self.keys.workers, self.keys.workers_held, self.keys.workers_offers]
