"""What becomes of a run when an attempt fails, its lease runs out or a cancel is asked.

Decisions only, the same for inline and external steps: made from the run, its template and
what happened; `runs.lifecycle` carries them out. The store's filters repeat the facts a
decision was made on (the status, the lease), so a run that moved meanwhile is not overruled.
"""

import random
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Literal

from jobplane.errors import ResourceInvalidState
from jobplane.model import TERMINAL, TRANSITIONS, RetryPolicy, Run, RunStatus, Template
from jobplane.store import Lost, Moved

# The reaper's transitions for a run whose lease ran out.
LeaseExpiry = Literal["reap_cancel", "reap_requeue", "reap_expire"]


def backoff_seconds(
    policy: RetryPolicy, attempt: int, rand: Callable[[], float] = random.random
) -> float:
    """The delay after failed attempt number `attempt` (1-based).

    An explicit `backoffSeconds` list is used as written, its last value repeating. Otherwise
    the delay grows exponentially up to `maxSeconds`, with full jitter (uniform in [0, d]),
    equal jitter (uniform in [d/2, d]) or none; jitter keeps many failing runs from retrying
    in lockstep.
    """
    if policy.backoff_seconds:
        return policy.backoff_seconds[min(attempt, len(policy.backoff_seconds)) - 1]
    delay = min(policy.max_seconds, policy.initial_seconds * policy.multiplier ** (attempt - 1))
    if policy.jitter == "full":
        return rand() * delay
    if policy.jitter == "equal":
        return delay / 2 + rand() * delay / 2
    return delay


def retry_at(
    run: Run, template: Template, step_id: str, retryable: bool, now: datetime
) -> datetime | None:
    """When a run whose step `step_id` failed tries again, after the backoff of the step's
    policy; None when it fails for good: the error is not retryable, or the attempts its policy
    allows are spent."""
    policy, tries, allowed = charged(run, template, step_id)
    if not retryable or tries >= allowed:
        return None
    return now + timedelta(seconds=backoff_seconds(policy, tries))


def charged(run: Run, template: Template, step_id: str) -> tuple[RetryPolicy, int, int]:
    """The retry policy that governs step `step_id` (its own `retryPolicy`, else the
    template's), how many of the run's attempts are charged to it (the one in progress
    included), and how many it allows. A step with its own policy is charged the attempts that
    ended in its errors; the template's policy, the rest, and it allows the run's `maxAttempts`
    (copied from it at creation). Without step policies that is every attempt of the run."""
    own = {s.id: s.retry_policy for s in template.steps if s.retry_policy is not None}
    if not own:
        return template.retry_policy, run.attempt, run.max_attempts
    if (policy := own.get(step_id)) is not None:
        ended = sum(1 for a in run.attempts if a.error.step == step_id)
        return policy, 1 + ended, policy.max_attempts
    ended = sum(1 for a in run.attempts if a.error.step not in own)
    return template.retry_policy, 1 + ended, run.max_attempts


def lease_expired(run: Run, template: Template | None = None) -> LeaseExpiry:
    """What the reaper makes of a run whose lease ran out: a cancel asked is carried out; a run
    with attempts left is queued again (the lost lease spent an attempt, so a run that kills
    its worker cannot loop forever); any other expires. The lost attempt is charged to the
    policy of the step the run was on (its `phase`), as `template` says; without it, to the
    run's own count."""
    if run.status == RunStatus.CANCEL_REQUESTED:
        return "reap_cancel"
    if template is None:
        left = run.attempt < run.max_attempts
    else:
        _, tries, allowed = charged(run, template, run.phase or "")
        left = tries < allowed
    return "reap_requeue" if left else "reap_expire"


def cancel_of(run: Run) -> Literal["cancel", "request_cancel"] | None:
    """How a cancel of `run` is carried out (SPEC rule 4): a run no worker holds ends at once
    (`cancel`), a held one is asked to stop (`request_cancel`), and one asked already is left
    as it is (None). A finished run cannot be cancelled."""
    if run.status in TERMINAL:
        raise ResourceInvalidState(f"run {run.id} is {run.status.value}")
    if run.status == RunStatus.CANCEL_REQUESTED:
        return None
    # No worker holds a run the `cancel` transition moves: it ends at once.
    return "cancel" if run.status in TRANSITIONS["cancel"].sources else "request_cancel"


def cancel_grace(run: Run) -> float:
    """How long the run's holder has to acknowledge a cancel before the reaper overrules it. A
    run waiting for an external worker has no one to acknowledge it: it ends at the next tick."""
    return 0 if run.status == RunStatus.WAITING_WORKER else run.cancel_grace_seconds


def cancel_asked(outcome: Moved | Lost | None) -> bool:
    """The holder's write was refused because a cancel was asked: the holder, whose lease still
    holds the run, stops and acknowledges the cancel."""
    return (
        isinstance(outcome, Lost)
        and outcome.reason == "status"
        and outcome.status == RunStatus.CANCEL_REQUESTED
    )
