"""The locks a held run's steps hold: taken as each step starts (those of its first steps
beside its claim, `Locks.take_ahead`), or by its handler (`ctx.lock`), and let go as the step
ends. The heartbeat renews them (`Worker._renew_locks`); what they are, and what a Redis wipe
does to them, is `runs/admission/locks.py`'s.
"""

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from jobplane.clock import Clock
from jobplane.queue.locks import Blocked
from jobplane.runs.admission.keys import lock_id, lock_named
from jobplane.runs.admission.locks import Locks, holder
from jobplane.runs.lifecycle import HeldStep, Lifecycle
from jobplane.worker.context import LockTimeout
from jobplane.worker.held import Held, Stopped, stop_if_lost

log = logging.getLogger("jobplane.worker")


class LockHeld(Exception):
    """A lock the next step needs is held by another run."""

    def __init__(self, blocked: Blocked) -> None:
        super().__init__(blocked.lock_id)
        self.blocked = blocked


@dataclass(frozen=True)
class StepLocks:
    locks: Locks
    lifecycle: Lifecycle
    clock: Clock

    async def take(self, held: Held, at: HeldStep) -> list[str]:
        """Take the step's locks, all or none; `LockHeld` when another run holds one. A run
        that waited for one says so no more."""
        wanted = [lock_id(lock, held.run) for lock in at.template.steps[at.index].locks]
        if not wanted:
            return []
        if held.taken_ahead.issuperset(wanted):
            held.taken_ahead.difference_update(wanted)
        else:
            asked = time.monotonic()
            taken = await self.locks.take(wanted, holder(held.run.id, held.lease.token))
            if isinstance(taken, Blocked):
                raise LockHeld(taken)
            held.locks.update(taken.tokens)
            held.answered(asked)
        if held.run.lock_wait is not None:
            try:
                stop_if_lost(await self.lifecycle.locks_taken(at, wanted))
            except BaseException:
                await self.let_go(held, wanted)  # the step will not run: nobody else waits
                raise
            held.run = held.run.model_copy(update={"lock_wait": None})
        return wanted

    async def confirm(self, held: Held, lock_ids: list[str]) -> None:
        """Before a step's end is written, make sure it held its locks all along. A holder
        that missed renewals for a TTL (a stalled process, a slow heartbeat) may have shared a
        lock meanwhile; then `Stopped("lock")`: its end is not written as if it had held it,
        and the run is handed back to run the step again under the lock, as when its
        heartbeat finds a lock lost.

        Within half a TTL of the last take or renewal that answered for the locks they are
        surely its own (the steady state: the heartbeat renews them every few seconds), and
        nothing is asked. Past that, they are renewed: each is still its own only if it never
        lapsed (a lapsed lock is gone from Redis, or another's). A Redis that cannot answer
        cannot vouch for them either."""
        if not lock_ids or time.monotonic() - held.locks_answered < self.locks.ttl_seconds / 2:
            return
        try:
            lost = await self.locks.renew(lock_ids, holder(held.run.id, held.lease.token))
        except Exception as exc:
            log.warning("run %s: locks %s not confirmed: %s", held.run.id, lock_ids, exc)
            raise Stopped("lock") from exc
        if lost:
            log.warning("run %s: locks %s lapsed while its step ran", held.run.id, sorted(lost))
            raise Stopped("lock")

    @staticmethod
    async def adopt_ahead(held: Held) -> None:
        """The locks its worker took for the run's first steps beside its claim become the
        run's (its heartbeat renews them from now on)."""
        if held.ahead is None:
            return
        ahead, held.ahead = held.ahead, None
        taken = (await ahead).get(held.run.id)
        if taken is not None:
            held.locks.update(taken.tokens)
            held.taken_ahead = set(taken.tokens)

    async def let_go_unused(self, held: Held) -> None:
        """Let go of the locks taken ahead that no step took up: a `when` skipped its step,
        the step is another worker's, or the run stopped before it."""
        if held.taken_ahead:
            unused, held.taken_ahead = sorted(held.taken_ahead), set()
            await self.let_go(held, unused)

    async def let_go(self, held: Held, lock_ids: list[str]) -> None:
        """Let go of the step's locks (and wake a run waiting for each); a Redis that does not
        answer lets them expire with the lease length instead."""
        if not lock_ids:
            return
        for lock in lock_ids:
            held.locks.pop(lock, None)
        try:
            owner = holder(held.run.id, held.lease.token)
            await self.locks.release(lock_ids, owner, self.clock.now())
        except Exception as exc:
            log.warning("run %s: locks %s not let go, they expire: %s", held.run.id, lock_ids, exc)

    async def take_for_handler(
        self, held: Held, name: str, values: list[Any], wait: float
    ) -> tuple[str, int, bool]:
        """`ctx.lock`: take the lock for the run, waiting up to `wait` seconds for another
        holder to let go (`LockTimeout` then). Returns the lock, its token, and whether this
        took it (a lock the step holds already is held on)."""
        lock = lock_named(name, values)
        if lock in held.locks:
            return lock, held.locks[lock], False
        owner = holder(held.run.id, held.lease.token)
        loop, pause = asyncio.get_running_loop(), 0.05
        until = loop.time() + wait
        while True:
            asked = time.monotonic()
            if not isinstance(taken := await self.locks.take([lock], owner), Blocked):
                break
            if loop.time() >= until:
                by = taken.holder.split(":", 1)[0]
                raise LockTimeout(f"lock {lock} is held by run {by}")
            await asyncio.sleep(min(pause, max(0.0, until - loop.time())))
            pause = min(2 * pause, 1.0)
        held.locks.update(taken.tokens)
        held.answered(asked)
        return lock, taken.tokens[lock], True
