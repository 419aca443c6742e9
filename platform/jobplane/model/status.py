"""Run and step statuses, and the one table of allowed run transitions.

Every lifecycle write in the store is one of the named transitions below; the store builds its
conditional filters from `TRANSITIONS`, and tests walk the same table against a real database.
"""

from dataclasses import dataclass
from enum import StrEnum


class RunStatus(StrEnum):
    PENDING = "pending"
    QUEUED = "queued"
    RUNNING = "running"
    WAITING_WORKER = "waiting_worker"
    CANCEL_REQUESTED = "cancel_requested"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


class StepStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"


TERMINAL: frozenset[RunStatus] = frozenset(
    {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.EXPIRED}
)
ACTIVE: frozenset[RunStatus] = frozenset(RunStatus) - TERMINAL
CLAIMABLE: frozenset[RunStatus] = frozenset({RunStatus.PENDING, RunStatus.QUEUED})
# Statuses in which a worker holds a lease (lockedBy + leaseToken + lockedUntil are set).
LEASED: frozenset[RunStatus] = frozenset(
    {RunStatus.RUNNING, RunStatus.WAITING_WORKER, RunStatus.CANCEL_REQUESTED}
)


@dataclass(frozen=True)
class Transition:
    """A named edge set: from any of `sources` to `target`."""

    name: str
    sources: frozenset[RunStatus]
    target: RunStatus
    # Worker writes must prove they still hold the lease (lockedBy + leaseToken).
    fenced: bool = False


def _t(name: str, sources: set[RunStatus], target: RunStatus, fenced: bool = False) -> Transition:
    return Transition(name, frozenset(sources), target, fenced)


S = RunStatus
_ALL = [
    _t("enqueue", {S.PENDING}, S.QUEUED),
    _t("claim", {S.PENDING, S.QUEUED}, S.RUNNING),
    # An external step: the inline worker lets go, and an external worker's claim resumes it.
    _t("wait_worker", {S.RUNNING}, S.WAITING_WORKER, fenced=True),
    _t("resume", {S.WAITING_WORKER}, S.RUNNING),
    _t("complete", {S.RUNNING, S.WAITING_WORKER}, S.SUCCEEDED, fenced=True),
    _t("fail", {S.RUNNING, S.WAITING_WORKER}, S.FAILED, fenced=True),
    _t("retry", {S.RUNNING, S.WAITING_WORKER}, S.QUEUED, fenced=True),
    # Graceful shutdown hands the run back without spending an attempt.
    _t("release", {S.RUNNING, S.WAITING_WORKER}, S.QUEUED, fenced=True),
    _t("cancel", {S.PENDING, S.QUEUED}, S.CANCELLED),
    _t("request_cancel", {S.RUNNING, S.WAITING_WORKER}, S.CANCEL_REQUESTED),
    _t("acknowledge_cancel", {S.CANCEL_REQUESTED}, S.CANCELLED, fenced=True),
    # The reaper acts on runs whose lease ran out; its filters add `lockedUntil < now`.
    _t("reap_requeue", {S.RUNNING, S.WAITING_WORKER}, S.QUEUED),
    _t("reap_expire", {S.RUNNING, S.WAITING_WORKER, S.CANCEL_REQUESTED}, S.EXPIRED),
    _t("reap_cancel", {S.RUNNING, S.WAITING_WORKER, S.CANCEL_REQUESTED}, S.CANCELLED),
    # A worker that does not converge within `cancelPolicy.graceSeconds` is overruled.
    _t("cancel_timeout", {S.CANCEL_REQUESTED}, S.CANCELLED),
    # The run's `deadline` (template `timeoutSeconds` from its first start) passed.
    _t("deadline_expire", {S.RUNNING, S.WAITING_WORKER, S.CANCEL_REQUESTED}, S.EXPIRED),
]
del S

TRANSITIONS: dict[str, Transition] = {t.name: t for t in _ALL}

# The status graph of SPEC.md, derived from the named transitions so it exists once.
ALLOWED: dict[RunStatus, frozenset[RunStatus]] = {
    status: frozenset(t.target for t in _ALL if status in t.sources) for status in RunStatus
}
