"""Redis fast path: ready and delayed queues, owner-checked locks, cancel signals.

Nothing here is the truth about a run; MongoDB is. A popped id is only a hint that a run may be
claimable, and everything in Redis can be rebuilt from MongoDB by the reconciler.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from jobplane.groupcommit import GroupCommit
from jobplane.queue.keys import Keys, delayed_member


def _script(redis: "Redis", name: str) -> AsyncScript:
    source = (resources.files("jobplane.queue") / "lua" / f"{name}.lua").read_text()
    return redis.register_script(source)


def epoch_ms(at: datetime) -> int:
    return int(at.timestamp() * 1000)


@dataclass(frozen=True)
class QueueEntry:
    run_id: str
    queue: str
    priority: int
    not_before: datetime | None = None


@dataclass(frozen=True)
class Popped:
    run_ids: list[str]
    # When the earliest delayed run of the queues falls due, so a worker knows how long to block.
    next_due: datetime | None


def lock_owner(worker_id: str, lease_token: str) -> str:
    return f"{worker_id}:{lease_token}"


class RedisQueue:
    def __init__(self, redis: "Redis", keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._claim = _script(redis, "claim")
        self._dequeue = _script(redis, "dequeue")
        self._refresh = _script(redis, "refresh")
        self._release = _script(redis, "release")
        self._acquire = _script(redis, "acquire")
        self._pushes = GroupCommit(self._push_many)
        self._releases = GroupCommit(self._release_many)

    # -- queues --------------------------------------------------------------------------------

    async def push(self, entries: Iterable[QueueEntry], now: datetime) -> None:
        """Make runs visible to workers: ready now, or delayed until `not_before`.

        Concurrent pushes go out together, one ZADD per sorted set.
        """
        placed: list[tuple[str, str, float]] = []
        for e in entries:
            if e.not_before is not None and e.not_before > now:
                member = delayed_member(e.run_id, e.priority)
                placed.append((self.keys.delayed(e.queue), member, epoch_ms(e.not_before)))
            else:
                placed.append((self.keys.queue(e.queue), e.run_id, -e.priority))
        if placed:
            await self._pushes.submit(placed)

    async def _push_many(self, pushes: list[list[tuple[str, str, float]]]) -> list[None]:
        by_key: dict[str, dict[str, float]] = {}
        for placed in pushes:
            for key, member, score in placed:
                by_key.setdefault(key, {})[member] = score
        async with self.redis.pipeline(transaction=False) as pipe:
            for key, members in by_key.items():
                pipe.zadd(key, members)
            await pipe.execute()
        return [None] * len(pushes)

    async def pop(self, queues: Sequence[str], n: int, now: datetime) -> Popped:
        """Pop up to `n` ready ids across `queues` in order, promoting due delayed runs first."""
        ids: list[str] = []
        next_due: int | None = None
        for queue in queues:
            keys = [self.keys.queue(queue), self.keys.delayed(queue)]
            reply = await self._claim(keys=keys, args=[epoch_ms(now), n - len(ids), 1000])
            ids.extend(_text(v) for v in reply[:-1])
            if reply[-1]:
                due = int(float(_text(reply[-1])))
                next_due = due if next_due is None else min(next_due, due)
        due_at = datetime.fromtimestamp(next_due / 1000, now.tzinfo) if next_due else None
        return Popped(ids, due_at)

    async def wait(self, queues: Sequence[str], block_seconds: float) -> str | None:
        """Block until a ready id arrives in one of `queues` (popping it), or the time is up."""
        keys = [self.keys.queue(q) for q in queues]
        reply = await self.redis.bzpopmin(keys, timeout=block_seconds)
        return _text(reply[1]) if reply else None

    async def remove(self, run_id: str, queue: str, priority: int) -> None:
        keys = [self.keys.queue(queue), self.keys.delayed(queue)]
        await self._dequeue(keys=keys, args=[run_id, delayed_member(run_id, priority)])

    async def missing(self, entries: Sequence[QueueEntry]) -> list[QueueEntry]:
        """The entries that are in neither their ready nor their delayed set."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for e in entries:
                pipe.zscore(self.keys.queue(e.queue), e.run_id)
                pipe.zscore(self.keys.delayed(e.queue), delayed_member(e.run_id, e.priority))
            scores = await pipe.execute()
        return [
            e for i, e in enumerate(entries) if scores[2 * i] is None and scores[2 * i + 1] is None
        ]

    # -- locks ---------------------------------------------------------------------------------

    async def lock_runs(
        self, owners: dict[str, str], ttl_seconds: float, only_if_free: bool = False
    ) -> None:
        """Mirror leases MongoDB granted.

        On a claim MongoDB decided, so an older owner's value is overwritten; `only_if_free`
        restores a missing lock without touching one that someone else holds.
        """
        async with self.redis.pipeline(transaction=False) as pipe:
            for run_id, owner in owners.items():
                px = int(ttl_seconds * 1000)
                pipe.set(self.keys.lock(run_id), owner, px=px, nx=only_if_free)
            await pipe.execute()

    async def refresh_runs(self, owners: dict[str, str], ttl_seconds: float) -> dict[str, bool]:
        """Extend each run lock if its owner still holds it; False marks a lost lock."""
        ttl = int(ttl_seconds * 1000)
        async with self.redis.pipeline(transaction=False) as pipe:
            for run_id, owner in owners.items():
                await self._refresh(keys=[self.keys.lock(run_id)], args=[owner, ttl], client=pipe)
            replies = await pipe.execute()
        return {run_id: bool(r) for run_id, r in zip(owners, replies, strict=True)}

    async def release_run(self, run_id: str, owner: str) -> bool:
        """Delete a run's lock if `owner` holds it; concurrent releases share a round trip."""
        return await self._releases.submit((run_id, owner))

    async def _release_many(self, releases: list[tuple[str, str]]) -> list[bool]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for run_id, owner in releases:
                await self._release(keys=[self.keys.lock(run_id)], args=[owner], client=pipe)
            replies = await pipe.execute()
        return [bool(r) for r in replies]

    async def refresh_lock(self, key: str, owner: str, ttl_seconds: float) -> bool:
        ttl = int(ttl_seconds * 1000)
        return bool(await self._refresh(keys=[key], args=[owner, ttl]))

    async def release_lock(self, key: str, owner: str) -> bool:
        return bool(await self._release(keys=[key], args=[owner]))

    async def acquire_lock(self, key: str, owner: str, ttl_seconds: float) -> bool:
        """Take `key` if free, or extend it if `owner` already holds it."""
        return bool(await self._acquire(keys=[key], args=[owner, int(ttl_seconds * 1000)]))

    # -- signals and liveness ------------------------------------------------------------------

    async def signal_cancel(self, run_id: str, ttl_seconds: float = 86400) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.cancel(run_id), "1", ex=int(ttl_seconds))
            pipe.publish(self.keys.cancel_channel, run_id)
            await pipe.execute()

    async def mark_alive(self, worker_id: str, ttl_seconds: float, running: int) -> None:
        await self.redis.set(self.keys.worker(worker_id), str(running), px=int(ttl_seconds * 1000))


def _text(value: bytes | str | float) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
