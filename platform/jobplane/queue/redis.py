"""Redis fast path: ready and delayed queues, the scheduler lock, cancel signals, the worker
registry.

Nothing here is the truth about a run; MongoDB is. A popped id is only a hint that a run may be
claimable, and everything in Redis can be rebuilt from MongoDB by the reconciler.
"""

import asyncio
import contextlib
import json
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Coroutine,
    Iterable,
    Sequence,
)
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from bson import ObjectId
from redis.asyncio import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from jobplane.groupcommit import GroupCommit
from jobplane.model import Run
from jobplane.queue.connect import RedisClient, RedisPipeline
from jobplane.queue.keys import Keys, delayed_member

P = ParamSpec("P")
R = TypeVar("R")


@contextlib.asynccontextmanager
async def _answered_within(seconds: float, what: str) -> AsyncIterator[None]:
    """Fail with redis-py's `TimeoutError` (a `RedisError`) past `seconds`.

    Socket timeouts bound each read and write, but a call can still wait without end inside
    the driver: under a Redis Cluster node's restart, redis-py's cluster client was seen to
    leave a call waiting for good. Every caller already treats a Redis error as "Redis did not
    answer" and carries on (the reconciler and the heartbeat repair what was not written), so
    the bound turns such a wait into one of those.

    Under the same restarts it was also seen writing to a connection uvloop had closed
    (`RuntimeError: unable to perform operation on <TCPTransport closed=True ...>`), out of a
    create's push: the create answered 500 for a run it had stored. That is Redis not
    answering too."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise RedisTimeoutError(f"Redis did not answer {what} within {seconds:g} s") from None
    except RuntimeError as exc:
        raise RedisConnectionError(f"Redis client failed {what}: {exc}") from exc


def _bounded(
    method: Callable[Concatenate["RedisQueue", P], Awaitable[R]],
) -> Callable[Concatenate["RedisQueue", P], Coroutine[Any, Any, R]]:
    """The call is bounded by the queue's `timeout_seconds` (see `_answered_within`)."""

    async def bounded(queue: "RedisQueue", /, *args: P.args, **kwargs: P.kwargs) -> R:
        async with _answered_within(queue.timeout_seconds, method.__name__):
            return await method(queue, *args, **kwargs)

    return bounded


def _script(redis: RedisClient, name: str, *preludes: str) -> AsyncScript:
    """The script `lua/<name>.lua`, after the `preludes` it shares functions with."""
    lua = resources.files("jobplane.queue") / "lua"
    source = "\n".join((lua / f"{part}.lua").read_text() for part in [*preludes, name])
    return redis.register_script(source)


def _eval(
    pipe: RedisPipeline, script: AsyncScript, keys: Sequence[str], args: Sequence[Any]
) -> None:
    # A script called by its hash in a pipeline makes redis-py ask SCRIPT EXISTS first, a round
    # trip of its own for every pipeline. EVAL carries the source instead: Redis hashes it and
    # runs its cached copy, and never answers NOSCRIPT after a restart or a SCRIPT FLUSH.
    pipe.eval(cast(str, script.script), len(keys), *keys, *args)  # `_script` registers text


def epoch_ms(at: datetime) -> int:
    return int(at.timestamp() * 1000)


@dataclass(frozen=True)
class QueueEntry:
    run_id: str
    queue: str
    priority: int
    not_before: datetime | None = None
    # The lane: the handler of the run's current step (None: any worker may take it).
    handler: str | None = None
    # In a fair lane, the run's group: its scope and scope id, which take turns with others.
    group: str | None = None
    # The template whose `maxRunning` the run counts against, if it has one: a claim over it
    # holds the run back, and it goes back to its lane as the template's runs end.
    capped: str | None = None
    # The run has limits to pass as it starts (`maxRunning`, `rateLimit`): its member says so,
    # so that the worker that pops it claims it under them without trying the plain claim.
    limited: bool = False

    @classmethod
    def of(cls, run: Run) -> "QueueEntry":
        group = f"{run.scope}:{run.scope_id}" if run.fairness == "round_robin" else None
        capped = run.template_type if run.max_running is not None else None
        limited = capped is not None or run.rate is not None
        return cls(
            run.id, run.queue, run.priority, run.not_before, run.handler, group, capped, limited
        )

    @property
    def member(self) -> str:
        """The run in a ready, delayed or bell set: its id, marked when it has limits."""
        return f"{self.run_id}{LIMITED}" if self.limited else self.run_id

    def held(self) -> str:
        """The entry as a member of its template's held runs or of a lock's waiters: ready (no
        `notBefore`), its id first, so that members of one priority sort by age."""
        parts = [
            self.run_id,
            self.priority,
            self.queue,
            self.handler,
            self.group,
            self.capped,
            self.limited,
        ]
        return json.dumps(parts, separators=(",", ":"))

    @classmethod
    def unheld(cls, member: str) -> "QueueEntry":
        run_id, priority, queue, handler, group, capped, limited = json.loads(member)
        return cls(run_id, queue, priority, None, handler, group, capped, limited)


# What marks a member of a run with limits to pass as it starts (no run id holds it).
LIMITED = "+"


def run_of(member: str) -> tuple[str, bool]:
    """A ready set's member as the run id and whether the run has limits."""
    return (member[:-1], True) if member.endswith(LIMITED) else (member, False)


@dataclass(frozen=True)
class Offer:
    """What a live worker serves, as its last heartbeat said."""

    held: int
    queues: list[str]
    handlers: list[str]

    def serves(self, queue: str, handler: str | None) -> bool:
        return queue in self.queues and (handler is None or handler in self.handlers)


@dataclass(frozen=True)
class Popped:
    run_ids: list[str]
    # When the earliest delayed run of the queues falls due, so a worker knows how long to block.
    next_due: datetime | None
    # The queues asked for that are paused: none of their runs were popped.
    paused: frozenset[str] = frozenset()
    # False while Redis holds no copy of the queues' pauses (new, or wiped): nothing was popped,
    # and the caller loads the copy from MongoDB (`mirror_pauses`) before it pops again.
    mirrored: bool = True
    # Those of `run_ids` whose runs have limits to pass as they start.
    limited: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Taken:
    """Locks taken (or held already): each lock's fencing token."""

    tokens: dict[str, int]


@dataclass(frozen=True)
class Blocked:
    """A lock another owner holds."""

    lock_id: str
    holder: str


@dataclass(frozen=True)
class TokensNeeded:
    """The token counter needs a block of tokens from MongoDB first; `fresh`: it has none at
    all (a new or wiped Redis)."""

    fresh: bool


@dataclass(frozen=True)
class LaneDepth:
    ready: int
    # Delayed runs now due (a pop promotes them), and all delayed runs.
    due: int
    delayed: int
    # When the oldest ready run was created or fell due.
    oldest_at: datetime | None


# Where a push puts a run: its queue and lane, the sorted set, the member and its score.
_Placed = tuple[str, str | None, str, str, float]
# A ready run of a fair lane: its queue and lane, its ring, group and bell, its id and priority.
_Entered = tuple[str, str | None, str, str, str, str, int]


class RedisQueue:
    """The operations jobplane runs on Redis, grouped as callers use them: push; pop and
    promote due runs; removal and the reconciler's check; the scheduler lock; cancel signals;
    the worker registry."""

    def __init__(self, redis: RedisClient, keys: Keys, timeout_seconds: float = 10.0) -> None:
        self.redis = redis
        self.keys = keys
        # The longest any call may take, beyond the wait of a blocking pop (see `_bounded`).
        self.timeout_seconds = timeout_seconds
        self._pop_script = _script(redis, "pop", "fair")
        self._enter = _script(redis, "enter", "fair")
        self._pauses = _script(redis, "pauses")
        self._rate = _script(redis, "rate")
        self._lock = _script(redis, "lock")
        self._unlock = _script(redis, "unlock")
        self._renew = _script(redis, "renew")
        self._tokens = _script(redis, "tokens")
        self._alive = _script(redis, "alive")
        self._workers = _script(redis, "workers")
        self._pushes = GroupCommit(self._push_many)

    # -- push ----------------------------------------------------------------------------------

    async def push(self, entries: Iterable[QueueEntry], now: datetime) -> None:
        """Make runs visible to workers: ready now, or delayed until `not_before`.

        Concurrent pushes go out together, one ZADD per sorted set.
        """
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
            else:
                key = self.keys.queue(e.queue, e.handler)
                placed.append((e.queue, e.handler, key, e.member, -e.priority))
        if placed:
            await self._pushes.submit(placed)

    @_bounded
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
                _eval(pipe, self._enter, keys, [a for e in entered for a in e[5:]])
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
        return sorted(_text(h) for h in await self.redis.smembers(self.keys.lanes(queue)))

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

        With `block_seconds` (and `n` > 0) a BZPOPMIN over the ready sets and bells of the
        queues not in `paused` (the caller's last answer) goes first: it takes a ready id at
        once (the first non-empty lane's, so a caller that wants strict priority under a
        backlog does not block), or waits up to that long for one to be pushed. It shares a
        round trip with the pop of the others: a worker waiting for work pays one round trip
        a wake-up, not a pop that finds nothing and then a wait.
        """
        if not queues:
            return Popped([], None)
        async with _answered_within(self.timeout_seconds + max(block_seconds, 0), "pop"):
            return await self._pop(queues, handlers, n, now, block_seconds, paused)

    @_bounded
    async def promote(self, queues: Sequence[str], now: datetime) -> None:
        """Move the due delayed runs of every lane of `queues` to their ready sets. Workers
        do it for their own lanes as they pop; this covers lanes no worker pops."""
        for queue in queues:
            # A pop of none: the pop script promotes, and takes nothing.
            await self._pop([queue], await self.lanes(queue), 0, now, 0, ())

    async def _pop(
        self,
        queues: Sequence[str],
        handlers: Sequence[str],
        n: int,
        now: datetime,
        block_seconds: float,
        paused: Collection[str],
    ) -> Popped:
        lanes = [(q, h) for q in queues for h in [None, *handlers]]
        keys = [self.keys.paused, self.keys.turn]
        for q, h in lanes:
            keys += [self.keys.queue(q, h), self.keys.delayed(q, h)]
            keys += [self.keys.ring(q, h), self.keys.bell(q, h)]
        args: list[str | int] = [epoch_ms(now), n, 1000]
        for q in queues:
            args += [q, len(handlers) + 1]
        # Redis truncates a timeout to whole milliseconds (0.001 s can come out as 0.999 ms)
        # and reads 0 as "forever".
        timeout = max(block_seconds, 0.002)
        awake = [(q, h) for q, h in lanes if q not in paused]
        waiting = [k for q, h in awake for k in (self.keys.queue(q, h), self.keys.bell(q, h))]
        blocking = block_seconds > 0 and n > 0 and bool(waiting)
        async with self.redis.pipeline(transaction=False) as pipe:
            if blocking:
                pipe.bzpopmin(waiting, timeout=timeout)
            args[1] = n - 1 if blocking else n
            _eval(pipe, self._pop_script, keys, args)
            replies = await pipe.execute()
        waited, (popped, due_text, paused_now, mirrored) = (
            replies[0] if blocking else None,
            replies[-1],
        )
        members = [_text(v) for v in popped]
        paused_now = frozenset(_text(q) for q in paused_now)
        if waited:
            key, member, score = _text(waited[0]), _text(waited[1]), waited[2]
            stays = not mirrored or self._queue_of(key, lanes) in paused_now
            if stays or key in self._bells(awake):
                # A fair run's bell only woke this worker (the run is still in its group,
                # unless the pop took it), or the queue may not be popped (paused since the
                # last answer, or Redis has no copy of the pauses): the member goes back.
                if member not in members:
                    async with self.redis.pipeline(transaction=False) as pipe:
                        pipe.zadd(key, {member: score})
                        if not stays and not members:
                            # Woken for a fair run, and the pop after the wait took none (it
                            # was asked for one less): pop now, rather than at the next call.
                            args[1] = n
                            _eval(pipe, self._pop_script, keys, args)
                        again = await pipe.execute()
                    if len(again) > 1:
                        members = [_text(v) for v in again[1][0]]
            else:
                members.insert(0, member)
        elif block_seconds > 0 and n > 0 and not waiting and not members:
            await asyncio.sleep(block_seconds)  # every queue paused: wait as a pop would
        due = int(float(_text(due_text))) if due_text else None
        next_due = datetime.fromtimestamp(due / 1000, now.tzinfo) if due is not None else None
        runs = [run_of(m) for m in members]
        limited = frozenset(run_id for run_id, has in runs if has)
        return Popped([run_id for run_id, _ in runs], next_due, paused_now, bool(mirrored), limited)

    def _bells(self, lanes: Sequence[tuple[str, str | None]]) -> set[str]:
        return {self.keys.bell(q, h) for q, h in lanes}

    def _queue_of(self, key: str, lanes: Sequence[tuple[str, str | None]]) -> str | None:
        return next((q for q, h in lanes if self.keys.queue(q, h) == key), None)

    # -- the queues' pauses ----------------------------------------------------------------------

    @_bounded
    async def mirror_pauses(self, states: Sequence[tuple[str, int, bool]], complete: bool) -> None:
        """Copy queues' pauses (name, version, paused) into the mirror the pops read; a copy
        older than the mirror's is left out. `complete`: these are every queue MongoDB holds,
        so the mirror counts as loaded."""
        args: list[str | int] = [1 if complete else 0]
        for queue, version, paused in states:
            args += [queue, version, 1 if paused else 0]
        await self._pauses(keys=[self.keys.paused], args=args)

    # -- removal, and the reconciler's check ---------------------------------------------------

    @_bounded
    async def remove(self, entry: QueueEntry) -> None:
        """Take a run out of its lane, ready or delayed, or out of its template's held runs."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(self._ready(entry), entry.member)
            pipe.zrem(self.keys.delayed(entry.queue, entry.handler), self._delayed(entry))
            if entry.group is not None:
                pipe.zrem(self.keys.bell(entry.queue, entry.handler), entry.member)
            if entry.capped is not None:
                pipe.zrem(self.keys.held(entry.capped), entry.held())
            await pipe.execute()

    @_bounded
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

    # -- runs held back by their template's maxRunning -------------------------------------------

    @_bounded
    async def hold(self, entries: Sequence[QueueEntry]) -> None:
        """Hold runs back until their template's started runs go below its `maxRunning`:
        out of every lane, so no worker pops them meanwhile."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for e in entries:
                assert e.capped is not None, e
                pipe.zadd(self.keys.held(e.capped), {e.held(): -e.priority})
            pipe.sadd(self.keys.held_types, *{e.capped for e in entries if e.capped})
            await pipe.execute()

    async def release_held(self, template_type: str, n: int, now: datetime) -> int:
        """Put up to `n` of the template's held runs back in their lanes, highest priority and
        oldest first; how many went."""
        if n <= 0:
            return 0
        async with _answered_within(self.timeout_seconds, "release_held"):
            taken = await self.redis.zpopmin(self.keys.held(template_type), n)
        members = cast(list[tuple[bytes, float]], taken)
        entries = [QueueEntry.unheld(_text(member)) for member, _ in members]
        if entries:
            await self.push(entries, now)
        return len(entries)

    @_bounded
    async def held_counts(self) -> dict[str, int]:
        """How many runs each template has held back."""
        types = sorted(_text(t) for t in await self.redis.smembers(self.keys.held_types))
        async with self.redis.pipeline(transaction=False) as pipe:
            for t in types:
                pipe.zcard(self.keys.held(t))
            counts = await pipe.execute()
        return dict(zip(types, counts, strict=True))

    @_bounded
    async def holding(self, entries: Sequence[QueueEntry]) -> set[str]:
        """The ids of those of `entries` that are held back."""
        capped = [e for e in entries if e.capped is not None]
        if not capped:
            return set()
        async with self.redis.pipeline(transaction=False) as pipe:
            for e in capped:
                pipe.zscore(self.keys.held(cast(str, e.capped)), e.held())
            scores = await pipe.execute()
        return {e.run_id for e, score in zip(capped, scores, strict=True) if score is not None}

    # -- rate limits -------------------------------------------------------------------------

    @_bounded
    async def rate_take(
        self, starts: Sequence[tuple[str, str, int, float]], now: datetime
    ) -> list[datetime | None]:
        """For each (run id, window, limit, period in seconds): None if the run may start now
        (its start counts in the window from `now`), or when it should try again."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for run_id, window, limit, period in starts:
                keys = [self.keys.rate(window), self.keys.rate_hint(window)]
                args = [epoch_ms(now), limit, int(period * 1000), run_id]
                _eval(pipe, self._rate, keys, args)
            replies = await pipe.execute()
        return [
            None if not at else datetime.fromtimestamp(int(at) / 1000, now.tzinfo) for at in replies
        ]

    @_bounded
    async def rate_return(self, starts: Sequence[tuple[str, str]]) -> None:
        """Take back starts counted for (run id, window) that did not happen (the run was not
        claimed after all)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for run_id, window in starts:
                pipe.zrem(self.keys.rate(window), run_id)
            await pipe.execute()

    @_bounded
    async def delayed_until(self, entries: Sequence[QueueEntry]) -> list[datetime | None]:
        """When each entry's delayed member falls due, or None when it is not delayed."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for e in entries:
                pipe.zscore(self.keys.delayed(e.queue, e.handler), self._delayed(e))
            scores = await pipe.execute()
        return [None if s is None else datetime.fromtimestamp(s / 1000, UTC) for s in scores]

    def _ready(self, entry: QueueEntry) -> str:
        """The sorted set that holds the entry while it is ready: its lane's, or its group's."""
        if entry.group is not None:
            return self.keys.group(entry.queue, entry.handler, entry.group)
        return self.keys.queue(entry.queue, entry.handler)

    def _delayed(self, entry: QueueEntry) -> str:
        return delayed_member(entry.member, entry.priority, self._group(entry))

    # -- what the lanes hold ---------------------------------------------------------------------

    @_bounded
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
                if ObjectId.is_valid(run_id := run_of(_text(member))[0]):
                    times.append(ObjectId(run_id).generation_time)
                after = f"({score}"
        return LaneDepth(plain + fair, due, delayed, min(times, default=None))

    # -- the scheduler lock --------------------------------------------------------------------

    @_bounded
    async def acquire_scheduler_lock(self, owner: str, ttl_seconds: float) -> bool:
        """Take the lock if free, or extend it if `owner` already holds it."""
        keys, ttl = [self.keys.scheduler_lock], int(ttl_seconds * 1000)
        taken = await self._lock(keys=keys, args=[owner, ttl, 0])
        return int(taken[0]) == 1

    @_bounded
    async def release_scheduler_lock(self, owner: str) -> bool:
        """Let go of the lock if `owner` holds it."""
        released = await self._unlock(keys=[self.keys.scheduler_lock], args=[owner, 0])
        return bool(int(released[0]))

    # -- resource locks --------------------------------------------------------------------------

    @_bounded
    async def take_locks(
        self, lock_ids: Sequence[str], owner: str, ttl_seconds: float
    ) -> "Taken | Blocked | TokensNeeded":
        """Take every lock of `lock_ids` for `owner`, or none: the locks it holds already are
        extended and keep their tokens; each lock taken gets the next fencing token."""
        keys = [*(self.keys.lock(i) for i in lock_ids), self.keys.lock_tokens]
        reply = await self._lock(keys=keys, args=[owner, int(ttl_seconds * 1000), 1])
        outcome = int(reply[0])
        if outcome == 1:
            return Taken(dict(zip(lock_ids, (int(_text(t)) for t in reply[1:]), strict=True)))
        if outcome == 0:
            holder = _text(reply[2]).split("\n", 1)[0]
            return Blocked(lock_ids[int(reply[1]) - 1], holder)
        return TokensNeeded(fresh=outcome == -1)

    @_bounded
    async def renew_locks(
        self, lock_ids: Sequence[str], owner: str, ttl_seconds: float
    ) -> set[str]:
        """Extend the locks `owner` still holds; returns those it lost."""
        if not lock_ids:
            return set()
        keys = [self.keys.lock(i) for i in lock_ids]
        kept = await self._renew(keys=keys, args=[owner, int(ttl_seconds * 1000)])
        return {i for i, k in zip(lock_ids, kept, strict=True) if not int(k)}

    async def release_locks(self, lock_ids: Sequence[str], owner: str, now: datetime) -> int:
        """Let go of the locks `owner` holds, and put the run that waited longest for each back
        in its lane, ready now; returns how many locks it held."""
        keys = [*(self.keys.lock(i) for i in lock_ids), *map(self.keys.lock_waiters, lock_ids)]
        async with _answered_within(self.timeout_seconds, "release_locks"):
            reply = await self._unlock(keys=keys, args=[owner, 1])
        woken = [QueueEntry.unheld(_text(member)) for member in reply[1:]]
        if woken:
            async with _answered_within(self.timeout_seconds, "wake lock waiters"):
                for entry in woken:
                    await self.remove(entry)  # out of the delayed set it waits in
                await self.push(woken, now)
        return int(reply[0])

    @_bounded
    async def lock_incarnation(self, candidate: str) -> str:
        """The name of this Redis's token counter, `candidate` if it had none (it is new or
        was wiped)."""
        name = await self._tokens(keys=[self.keys.lock_tokens], args=["incarnation", candidate])
        return _text(name)

    @_bounded
    async def add_lock_tokens(self, incarnation: str, first: int, end: int) -> bool:
        """Give the token counter of `incarnation` the block of tokens after `first` up to
        `end`; False when Redis's counter is another incarnation's."""
        args: list[str | int] = ["block", incarnation, first, end]
        return bool(await self._tokens(keys=[self.keys.lock_tokens], args=args))

    @_bounded
    async def wait_for_lock(self, lock_id: str, entry: QueueEntry, since: datetime) -> None:
        """Note that `entry` waits for `lock_id`, to be woken when it is let go."""
        await self.redis.zadd(self.keys.lock_waiters(lock_id), {entry.held(): epoch_ms(since)})

    @_bounded
    async def stop_waiting(self, lock_ids: Sequence[str], entry: QueueEntry) -> None:
        """`entry` waits for `lock_ids` no more (it took them, or was cancelled): a wake-up of
        the lock goes to the next waiter."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for lock_id in lock_ids:
                pipe.zrem(self.keys.lock_waiters(lock_id), entry.held())
            await pipe.execute()

    @_bounded
    async def scheduler_lock(self) -> tuple[str | None, float]:
        """Who holds the lock (None: no one) and its seconds left (0 when no one does)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(self.keys.scheduler_lock)
            pipe.pttl(self.keys.scheduler_lock)
            owner, ttl_ms = await pipe.execute()
        return (None if owner is None else _text(owner)), max(ttl_ms, 0) / 1000

    @_bounded
    async def ping(self) -> None:
        await self.redis.ping()

    # -- cancel signals ------------------------------------------------------------------------

    @_bounded
    async def signal_cancel(self, run_id: str) -> None:
        """Tell every worker listening that `run_id`'s cancel was requested. Only a hint: a
        worker that misses it hears of the cancel from MongoDB at its next heartbeat."""
        await self.redis.publish(self.keys.cancel_channel, run_id)

    async def cancel_signals(self, until: asyncio.Event) -> AsyncIterator[str]:
        """The id of each run whose cancel is signalled from now on, until `until` is set
        (looked at every half second). A lost subscription raises a Redis error."""
        async with self.redis.pubsub(ignore_subscribe_messages=True) as pubsub:
            async with _answered_within(self.timeout_seconds, "subscribe"):
                if isinstance(self.redis, RedisCluster):
                    # A cluster's pub/sub finds its node in the slot map, which the client
                    # loads with its first command: subscribing first failed with a KeyError.
                    await self.redis.initialize()
                await pubsub.subscribe(self.keys.cancel_channel)
            while not until.is_set():
                message = await pubsub.get_message(timeout=0.5)
                if message is not None:
                    yield _text(message["data"])

    # -- the worker registry -------------------------------------------------------------------

    @_bounded
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

    @_bounded
    async def withdraw(self, worker_id: str) -> None:
        """Take a stopping worker out of the live ones at once, rather than when its time ends."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(self.keys.workers, worker_id)
            pipe.hdel(self.keys.workers_held, worker_id)
            pipe.hdel(self.keys.workers_offers, worker_id)
            await pipe.execute()

    @_bounded
    async def live_workers(self) -> dict[str, Offer]:
        """Each live worker's id, the runs it held at its last heartbeat and what it serves,
        in one read."""
        flat = await self._workers(keys=self._registry)
        live: dict[str, Offer] = {}
        for i in range(0, len(flat), 3):
            offer = json.loads(_text(flat[i + 2]))
            held = int(_text(flat[i + 1]))
            live[_text(flat[i])] = Offer(held, offer.get("queues", []), offer.get("handlers", []))
        return live

    @property
    def _registry(self) -> list[str]:
        return [self.keys.workers, self.keys.workers_held, self.keys.workers_offers]


def _text(value: bytes | str | float) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
