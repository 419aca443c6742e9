"""Queue pause: a paused queue accepts and keeps runs but starts none; runs already started go
on.

MongoDB holds each queue's pause (`job_queues`), with who paused it and why, and each pause and
resume is an audited event. Workers learn of it from a copy in Redis that their pops read in
the same script that pops, so no pop after the pause takes a paused queue's run. The copy is
versioned: a write of an older version never overwrites a newer one. Redis without a copy (a
new one, or one wiped) pops nothing until a worker has loaded the copy from MongoDB, so a
pause outlives a Redis loss; the scheduler's tick loads it too, repairing a copy a failed
write left stale.
"""

import logging
import time

from jobplane.model import QueueState, Run, WaitingFor
from jobplane.queue.connect import REDIS_DOWN
from jobplane.queue.redis import RedisQueue
from jobplane.store import Store

log = logging.getLogger("jobplane.runs")


class Pauses:
    def __init__(self, store: Store, queue: RedisQueue, max_age: float = 1.0) -> None:
        self.store = store
        self.queue = queue
        # How long `paused` trusts what it read (it explains runs; it decides nothing).
        self.max_age = max_age
        self._paused: frozenset[str] = frozenset()
        self._read_at = -max_age

    async def set_paused(
        self, queue: str, paused: bool, actor: str, reason: str | None = None
    ) -> QueueState:
        """Pause or resume `queue` in MongoDB (audited), then in the pops' copy. A copy Redis
        did not take is written by the scheduler's next tick; the pause holds in MongoDB."""
        state, changed = await self.store.queues.set_paused(queue, paused, actor, reason)
        if changed:
            try:
                await self.queue.mirror_pauses([_mirrored(state)], complete=False)
            except REDIS_DOWN as exc:
                log.warning(
                    "queue %s %s in MongoDB; Redis will have it at the next tick: %s",
                    queue,
                    "paused" if paused else "resumed",
                    exc,
                )
        return state

    async def mirror(self) -> None:
        """Copy every queue's pause from MongoDB into Redis, where the pops read it."""
        states = await self.store.queues.states()
        await self.queue.mirror_pauses([_mirrored(s) for s in states], complete=True)

    async def paused(self) -> frozenset[str]:
        """The queues paused now, as read from MongoDB at most `max_age` ago."""
        if time.monotonic() - self._read_at > self.max_age:
            self._paused = frozenset(s.queue for s in await self.store.queues.states() if s.paused)
            self._read_at = time.monotonic()
        return self._paused


def _mirrored(state: QueueState) -> tuple[str, int, bool]:
    return state.queue, state.version, state.paused


def waiting_for(run: Run, paused: frozenset[str]) -> WaitingFor | None:
    if run.queue not in paused:
        return None
    return WaitingFor(reason="queue_paused", detail=f"queue {run.queue} is paused")
