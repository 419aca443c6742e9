"""Locks a step holds while it runs (its `locks`), and a handler takes (`ctx.lock`).

A lock is `<name>:<key values>`, shared by every template that names it. It lives in Redis as
the product's owner-checked lock: its value names its holder, the run and its lease
(`<run id>:<lease token>`); only the holder renews it (with its heartbeat) or lets it go, and
it expires a lease length after its holder's last renewal, so a holder that died frees it
within a lease length. A step's locks are taken together, all or none, before it starts, and
let go when it ends, whatever the end.

Each grant carries a fencing token, greater than every token granted before it for any lock,
so a downstream system can refuse a stale holder. Redis hands tokens out of blocks MongoDB
allots (`store/locks.py`); a wiped Redis gets a block past every token it could have given, so
tokens keep growing. A wipe does lose the locks themselves: a second run may take a lock its
first holder still believes it holds, until that holder's next renewal finds the lock gone
and stops its step. Fencing tokens are what protects a downstream system meanwhile.

A run whose step finds a lock held goes back to its queue (no attempt spent) with a back-off
that doubles with each time in a row (0.5 s up to 30 s), and is woken at once when the lock is
let go: it never holds a worker slot while it waits.
"""

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from jobplane.model import LockWait, Run, WaitingFor
from jobplane.queue.locks import Blocked, Taken, TokensNeeded
from jobplane.queue.redis import RedisQueue
from jobplane.store import Store

log = logging.getLogger("jobplane.runs")

# How often a take may find the token counter empty before it gives up.
_REFILLS = 5


def holder(run_id: str, lease_token: str) -> str:
    """A lock's owner: the run, under the lease it holds."""
    return f"{run_id}:{lease_token}"


def backoff_seconds(waits: int) -> float:
    """How long a run waits after finding a lock held `waits` times in a row."""
    return float(min(30.0, 0.5 * 2 ** (waits - 1)))


class Locks:
    def __init__(self, store: Store, queue: RedisQueue, ttl_seconds: float) -> None:
        self.store = store
        self.queue = queue
        self.ttl_seconds = ttl_seconds

    async def take(self, lock_ids: Sequence[str], owner: str) -> Taken | Blocked:
        """Take every lock of `lock_ids` for `owner`, or none (`Blocked`: who holds one)."""
        for _ in range(_REFILLS):
            outcome = await self.queue.locks.take(lock_ids, owner, self.ttl_seconds)
            if not isinstance(outcome, TokensNeeded):
                return outcome
            await self._refill(outcome.fresh)
        raise RuntimeError("Redis's lock token counter could not be filled from MongoDB")

    async def take_ahead(
        self, runs: Mapping[str, Sequence[str]], lease_token: str
    ) -> dict[str, Taken]:
        """Take the locks of runs about to be claimed under `lease_token` (by run id, the
        locks their first steps take), each run's all or none, as their owners will be once
        claimed: the runs whose locks were taken. A run that found one held, or whose take
        failed, takes them as its steps start, as any run does."""
        ids = list(runs)
        takes = (self.take(runs[i], holder(i, lease_token)) for i in ids)
        outcomes = await asyncio.gather(*takes, return_exceptions=True)
        return {i: o for i, o in zip(ids, outcomes, strict=True) if isinstance(o, Taken)}

    async def give_back(self, taken: Mapping[str, Taken], lease_token: str, now: datetime) -> None:
        """Let go of locks taken ahead for runs their claim did not lease (another worker has
        them, or they were cancelled); a Redis that does not answer lets them expire."""
        lets = (self.release(list(t.tokens), holder(i, lease_token), now) for i, t in taken.items())
        for failed in await asyncio.gather(*lets, return_exceptions=True):
            if failed is not None:
                log.warning("locks taken ahead not let go, they expire: %s", failed)

    async def renew(self, lock_ids: Sequence[str], owner: str) -> set[str]:
        """Extend the locks `owner` holds; those it lost."""
        return await self.queue.locks.renew(lock_ids, owner, self.ttl_seconds)

    async def release(self, lock_ids: Sequence[str], owner: str, now: datetime) -> None:
        """Let go of the locks, and wake the run that waited longest for each."""
        await self.queue.locks.release(lock_ids, owner, now)

    def wait(self, run: Run, blocked: Blocked, now: datetime) -> tuple[LockWait, datetime]:
        """What the run, handed back for a lock held, waits with: the lock, and until when at
        the latest; it is woken sooner when the lock is let go."""
        before = run.lock_wait
        waits = before.count + 1 if before is not None and before.lock == blocked.lock_id else 1
        held_by = blocked.holder.split(":", 1)[0]
        wait = LockWait(lock=blocked.lock_id, holder=held_by, count=waits)
        until = now + timedelta(seconds=backoff_seconds(waits))
        return wait, until

    async def _refill(self, fresh: bool) -> None:
        """A block of tokens from MongoDB for Redis's counter, under the counter's current
        name: a block allotted before a wipe is refused by the counter after it."""
        if fresh:
            log.info("Redis holds no lock token counter (new, or wiped): starting one")
        incarnation = await self.queue.locks.incarnation(os.urandom(8).hex())
        first, end = await self.store.locks.token_block()
        await self.queue.locks.add_tokens(incarnation, first, end)


def waiting_for(run: Run) -> WaitingFor | None:
    """A run handed back for a lock says which, and who held it."""
    if run.lock_wait is None:
        return None
    detail = f"lock {run.lock_wait.lock} is held"
    if run.lock_wait.holder:
        detail += f" by run {run.lock_wait.holder}"
    return WaitingFor(reason="lock", detail=detail)
