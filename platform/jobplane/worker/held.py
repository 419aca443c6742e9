"""A run a worker holds: its lease, its locks and handlers, and what stops it; and each step
of it the worker runs.

The runner (`worker/runner.py`) walks the run's steps, `worker/call.py` calls a step's handler,
and `worker/steplocks.py` keeps the locks its steps hold; this is the state they share.
"""

import asyncio
import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from jobplane.model import Run
from jobplane.queue.locks import Taken
from jobplane.runs.lifecycle import HeldStep, StepStart
from jobplane.runs.policy import cancel_asked
from jobplane.store import Lease, Lost, Moved
from jobplane.worker.context import CancelRequested, StepContext

# Why a run's handler was interrupted: its lease was lost, the worker shuts down, or a lock
# its step held was lost.
Stop = Literal["lost", "shutdown", "lock"]


@dataclass
class Held:
    """A run this worker holds, with what it needs to stop it."""

    run: Run
    lease: Lease
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    # The running handlers, one a step (a graph's steps may run side by side). Stopping a run
    # interrupts only these, never the worker's own writes, so a transition and its events
    # are never cut in half.
    handlers: set[asyncio.Future[Any]] = field(default_factory=set)
    stop: Stop | None = None
    # The locks its steps hold (the steps' and their handlers'), each with its fencing token:
    # the heartbeat renews them.
    locks: dict[str, int] = field(default_factory=dict)
    # The locks of its first steps its worker took beside its claim (`Locks.take_ahead`),
    # until the run has them...
    ahead: asyncio.Future[dict[str, Taken]] | None = None
    # ...then those of them no step has taken up yet: a step whose locks are all here starts
    # without asking Redis, and what is left once the first steps started is let go.
    taken_ahead: set[str] = field(default_factory=set)
    # When (monotonic seconds) the oldest of the takes and renewals that last answered for the
    # locks in `locks` was sent: each lives a TTL after that (`StepLocks.confirm`).
    locks_answered: float = math.inf
    # When MongoDB last confirmed the lease (monotonic seconds); past the lease length the
    # worker assumes the reaper may have given the run away and stops its handlers itself.
    renewed: float = field(default_factory=time.monotonic)
    # Only steps lent to other workers run now: the run takes no slot here.
    watching: bool = False

    @property
    def busy(self) -> bool:
        """A handler of the run's runs now."""
        return bool(self.handlers)

    @property
    def log_fields(self) -> dict[str, str]:
        """For lines about the run logged outside its own task (whose context has them)."""
        return {"run_id": self.run.id, "lease_token": self.lease.token}

    def answered(self, asked: float) -> None:
        """Locks were taken by a call sent at `asked` (monotonic seconds)."""
        self.locks_answered = min(self.locks_answered, asked)

    def interrupt(self, reason: Stop) -> None:
        self.stop = reason
        for handler in self.handlers:
            handler.cancel()


@dataclass
class RunningStep:
    """A step this worker runs: where it is, its start (until written) and its context."""

    at: HeldStep
    start: StepStart
    start_written: bool = False
    ctx: StepContext | None = None
    # The locks taken for it, let go once its end is written.
    locks: list[str] = field(default_factory=list)
    # Lent to a worker offering this handler, which this one lacks (`worker/lending.py`).
    lent: str | None = None
    # Lent, and a step beside it failed the run: its borrower is asked to stop (a step run
    # here is asked through its context).
    stop_asked: bool = False

    @property
    def unwritten_start(self) -> StepStart | None:
        return None if self.start_written else self.start


class Stopped(Exception):
    """The run must stop: its lease was lost (write nothing), the worker shuts down, or a lock
    its step held was lost (both hand the run back)."""

    def __init__(self, reason: Stop) -> None:
        super().__init__(reason)
        self.reason = reason


class Overdue(Exception):
    """The run's deadline passed: it ends `expired`, whatever its step was doing."""


def stop_if_lost(outcome: Moved | Lost | None) -> None:
    """Stop the run when a write was lost.

    Lost to a cancel request, the worker still holds the lease and must acknowledge it;
    lost any other way, someone else decides the run's fate now.
    """
    if isinstance(outcome, Lost):
        if cancel_asked(outcome):
            raise CancelRequested(outcome.run_id)
        raise Stopped("lost")


def time_left(run: Run, now: datetime) -> float | None:
    """Seconds until the run's deadline (0 once passed), or None without one."""
    if run.deadline is None:
        return None
    return max(0.0, (run.deadline - now).total_seconds())
