"""What Redis keeps for the limits a run passes as it starts: the runs a template's
`maxRunning` holds back, and the starts counted in `rateLimit` windows that did not happen.

MongoDB decides a claim under `maxRunning` (docs/architecture.md, "Admission"); the held runs
here only say which runs to put back in their lanes as room frees. A rate window's log is the
limit itself (`lua/rate.lua`, taken by the pop script as it pops the run): it trusts the
clocks of the workers that write it.
"""

from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime
from typing import cast

from jobplane.queue.calls import answered_within, bounded, text
from jobplane.queue.connect import RedisClient
from jobplane.queue.entry import QueueEntry
from jobplane.queue.keys import Keys

# Makes runs visible to workers in their lanes (`RedisQueue.push`).
Push = Callable[[Iterable[QueueEntry], datetime], Awaitable[None]]


class RedisLimits:
    def __init__(self, redis: RedisClient, keys: Keys, timeout_seconds: float, push: Push) -> None:
        self.redis = redis
        self.keys = keys
        self.timeout_seconds = timeout_seconds
        self._push = push

    # -- runs held back by their template's maxRunning -------------------------------------------

    @bounded
    async def hold(self, entries: Sequence[QueueEntry]) -> None:
        """Hold runs back until their template's started runs go below its `maxRunning`:
        out of every lane, so no worker pops them meanwhile."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for e in entries:
                assert e.capped is not None, e
                pipe.zadd(self.keys.held(e.capped), {e.held(): -e.priority})
            pipe.sadd(self.keys.held_types, *{e.capped for e in entries if e.capped})
            await pipe.execute()

    async def release(self, template_type: str, n: int, now: datetime) -> int:
        """Put up to `n` of the template's held runs back in their lanes, highest priority and
        oldest first; how many went."""
        if n <= 0:
            return 0
        async with answered_within(self.timeout_seconds, "release"):
            taken = await self.redis.zpopmin(self.keys.held(template_type), n)
        members = cast(list[tuple[bytes, float]], taken)
        entries = [QueueEntry.unheld(text(member)) for member, _ in members]
        if entries:
            await self._push(entries, now)
        return len(entries)

    @bounded
    async def held_counts(self) -> dict[str, int]:
        """How many runs each template has held back."""
        types = sorted(text(t) for t in await self.redis.smembers(self.keys.held_types))
        async with self.redis.pipeline(transaction=False) as pipe:
            for t in types:
                pipe.zcard(self.keys.held(t))
            counts = await pipe.execute()
        return dict(zip(types, counts, strict=True))

    @bounded
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

    @bounded
    async def rate_return(self, starts: Sequence[tuple[str, str]]) -> None:
        """Take back starts a pop counted for (run id, window) that did not happen (the run's
        `maxRunning` held it back)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for run_id, window in starts:
                pipe.zrem(self.keys.rate(window), run_id)
            await pipe.execute()
