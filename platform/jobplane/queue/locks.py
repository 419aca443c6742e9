"""Owner-checked locks in Redis: the scheduler's, and the resource locks steps take.

A lock's value names its owner; only the owner extends it or lets it go, and it expires a
time-to-live after its owner's last extension. The scripts (`lua/lock.lua`, `unlock.lua`,
`renew.lua`, `tokens.lua`) are shared by both kinds: a resource lock also gets a fencing token
as it is taken, and its let-go wakes the run that waited longest for it.
"""

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from redis.commands.core import AsyncScript

from jobplane.groupcommit import GroupCommit
from jobplane.queue.calls import bounded, epoch_ms, eval_in, script, text
from jobplane.queue.connect import RedisClient
from jobplane.queue.entry import QueueEntry
from jobplane.queue.keys import Keys, Singleton


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


# Puts runs that waited for a lock back in their lanes, ready at the time given.
Wake = Callable[[Sequence[QueueEntry], datetime], Awaitable[None]]


class RedisLocks:
    def __init__(self, redis: RedisClient, keys: Keys, timeout_seconds: float, wake: Wake) -> None:
        self.redis = redis
        self.keys = keys
        self.timeout_seconds = timeout_seconds
        self._wake = wake
        self._lock = script(redis, "lock")
        self._unlock = script(redis, "unlock")
        self._renew = script(redis, "renew")
        self._tokens = script(redis, "tokens")
        self._takes = GroupCommit(self._take_many)
        self._renewals = GroupCommit(self._renew_many)
        self._releases = GroupCommit(self._release_many)

    # -- the singletons' locks ------------------------------------------------------------------

    @bounded
    async def take_singleton(self, role: Singleton, owner: str, ttl_seconds: float) -> bool:
        """Take the lock of `role` if free, or extend it if `owner` already holds it."""
        keys, ttl = [self.keys.singleton_lock(role)], int(ttl_seconds * 1000)
        taken = await self._lock(keys=keys, args=[owner, ttl, 0])
        return int(taken[0]) == 1

    @bounded
    async def release_singleton(self, role: Singleton, owner: str) -> bool:
        """Let go of the lock of `role` if `owner` holds it."""
        released = await self._unlock(keys=[self.keys.singleton_lock(role)], args=[owner, 0])
        return bool(int(released[0]))

    @bounded
    async def singleton_holder(self, role: Singleton) -> tuple[str | None, float]:
        """Who holds the lock of `role` (None: no one) and its seconds left (0 when no one
        does)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(self.keys.singleton_lock(role))
            pipe.pttl(self.keys.singleton_lock(role))
            owner, ttl_ms = await pipe.execute()
        return (None if owner is None else text(owner)), max(ttl_ms, 0) / 1000

    # -- resource locks --------------------------------------------------------------------------

    async def take(
        self, lock_ids: Sequence[str], owner: str, ttl_seconds: float
    ) -> Taken | Blocked | TokensNeeded:
        """Take every lock of `lock_ids` for `owner`, or none: the locks it holds already are
        extended and keep their tokens; each lock taken gets the next fencing token.
        Concurrent takes share one round trip (group commit)."""
        reply = await self._takes.submit((list(lock_ids), owner, int(ttl_seconds * 1000)))
        outcome = int(reply[0])
        if outcome == 1:
            return Taken(dict(zip(lock_ids, (int(text(t)) for t in reply[1:]), strict=True)))
        if outcome == 0:
            holder = text(reply[2]).split("\n", 1)[0]
            return Blocked(lock_ids[int(reply[1]) - 1], holder)
        return TokensNeeded(fresh=outcome == -1)

    @bounded
    async def _take_many(self, takes: list[tuple[list[str], str, int]]) -> list[Any]:
        keys = self.keys
        calls = [
            ([*map(keys.lock, ids), keys.lock_tokens], [owner, ttl, 1]) for ids, owner, ttl in takes
        ]
        return await self._each(self._lock, calls)

    async def renew(self, lock_ids: Sequence[str], owner: str, ttl_seconds: float) -> set[str]:
        """Extend the locks `owner` still holds; returns those it lost. Concurrent renewals
        (a heartbeat's, one per held run) share one round trip (group commit)."""
        if not lock_ids:
            return set()
        kept = await self._renewals.submit((list(lock_ids), owner, int(ttl_seconds * 1000)))
        return {i for i, k in zip(lock_ids, kept, strict=True) if not int(k)}

    @bounded
    async def _renew_many(self, renewals: list[tuple[list[str], str, int]]) -> list[Any]:
        calls = [(list(map(self.keys.lock, ids)), [owner, ttl]) for ids, owner, ttl in renewals]
        return await self._each(self._renew, calls)

    async def release(self, lock_ids: Sequence[str], owner: str, now: datetime) -> int:
        """Let go of the locks `owner` holds, and put the run that waited longest for each back
        in its lane, ready now; returns how many locks it held. Concurrent releases share one
        round trip (group commit)."""
        released: int = await self._releases.submit((list(lock_ids), owner, now))
        return released

    @bounded
    async def _release_many(self, releases: list[tuple[list[str], str, datetime]]) -> list[Any]:
        keys = self.keys
        calls = [
            ([*map(keys.lock, ids), *map(keys.lock_waiters, ids)], [owner, 1])
            for ids, owner, _ in releases
        ]
        replies = await self._each(self._unlock, calls)
        woken = [
            QueueEntry.unheld(text(member))
            for reply in replies
            if not isinstance(reply, Exception)
            for member in reply[1:]
        ]
        if woken:
            await self._wake(woken, releases[0][2])
        return [r if isinstance(r, Exception) else int(r[0]) for r in replies]

    async def _each(
        self, script: AsyncScript, calls: list[tuple[list[str], list[Any]]]
    ) -> list[Any]:
        """`script` once for each (keys, args) of `calls`, in one round trip: each call's
        reply, or the error that call alone met (the group commit hands it to its caller)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                eval_in(pipe, script, keys, args)
            replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies

    @bounded
    async def incarnation(self, candidate: str) -> str:
        """The name of this Redis's token counter, `candidate` if it had none (it is new or
        was wiped)."""
        name = await self._tokens(keys=[self.keys.lock_tokens], args=["incarnation", candidate])
        return text(name)

    @bounded
    async def add_tokens(self, incarnation: str, first: int, end: int) -> bool:
        """Give the token counter of `incarnation` the block of tokens after `first` up to
        `end`; False when Redis's counter is another incarnation's."""
        args: list[str | int] = ["block", incarnation, first, end]
        return bool(await self._tokens(keys=[self.keys.lock_tokens], args=args))

    # -- a lock's waiters --------------------------------------------------------------------

    @bounded
    async def wait(self, lock_id: str, entry: QueueEntry, since: datetime) -> None:
        """Note that `entry` waits for `lock_id`, to be woken when it is let go."""
        await self.redis.zadd(self.keys.lock_waiters(lock_id), {entry.held(): epoch_ms(since)})

    @bounded
    async def stop_waiting(self, lock_ids: Sequence[str], entry: QueueEntry) -> None:
        """`entry` waits for `lock_ids` no more (it took them, or was cancelled): a wake-up of
        the lock goes to the next waiter."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for lock_id in lock_ids:
                pipe.zrem(self.keys.lock_waiters(lock_id), entry.held())
            await pipe.execute()
