"""Run and step statuses, and the one table of allowed run transitions.

Every lifecycle write in the store is one of the named transitions below, made by the store
method of the same name. A row says everything that write decides: the statuses it moves from,
the guards its filter adds, and what entering the target means for the run's lease, its dedupe
key and its attempt. The store turns a row into one conditional write (`store/transitions.py`)
and nowhere else decides these things; tests walk the same table against a real database.
"""

from dataclasses import dataclass
from enum import StrEnum


class RunStatus(StrEnum):
    PENDING = "pending"
    QUEUED = "queued"
    RUNNING = "running"
    WAITING_WORKER = "waiting_worker"
    # Only map steps are left, and their child runs run: no worker holds the run.
    WAITING_CHILDREN = "waiting_children"
    CANCEL_REQUESTED = "cancel_requested"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


class StepStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    # A map step whose child runs are under way.
    WAITING = "waiting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"


TERMINAL: frozenset[RunStatus] = frozenset(
    {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.EXPIRED}
)
ACTIVE: frozenset[RunStatus] = frozenset(RunStatus) - TERMINAL
CLAIMABLE: frozenset[RunStatus] = frozenset({RunStatus.PENDING, RunStatus.QUEUED})
# Statuses in which a worker may hold a lease (lockedBy + leaseToken + lockedUntil are set).
LEASED: frozenset[RunStatus] = frozenset(
    {RunStatus.RUNNING, RunStatus.WAITING_WORKER, RunStatus.CANCEL_REQUESTED}
)


class Guard(StrEnum):
    """A condition a transition's write checks besides the run's status."""

    # The writer holds the run's lease: its worker id and lease token (a fenced write).
    LEASE = "lease"
    # The run waits for no dedupe key, nor for a place among its map's children: a waiting
    # run may be neither queued nor claimed.
    NOT_WAITING = "not_waiting"
    # The run has no limit to pass as it starts (`maxRunning`, `rateLimit`): those that have
    # are claimed by `claim_limited`, under their limits.
    UNLIMITED = "unlimited"
    # The run's `notBefore` has come, or it has none.
    DUE = "due"
    # The run waits for the kind of external worker that claims it.
    EXTERNAL_TYPE = "external_type"
    # The run's status and lease token are still those the reaper read and decided on.
    AS_READ = "as_read"
    LEASE_EXPIRED = "lease_expired"
    DEADLINE_PASSED = "deadline_passed"
    GRACE_PASSED = "grace_passed"


class LeaseChange(StrEnum):
    """What entering the target does to the run's lease."""

    # A new lease: holder, token, expiry and a first renewal.
    GRANT = "grant"
    KEEP = "keep"
    # Nobody holds the run now: holder, token and expiry are removed.
    DROP = "drop"
    # The run ended: token and expiry are removed; the holder stays as the run's last one.
    END = "end"


class KeyChange(StrEnum):
    """What entering the target does to the run's dedupe key."""

    KEEP = "keep"
    # The key is let go (and a run waiting for one stops waiting): the next run may take it.
    FREE = "free"
    # Let go if the template is repeatable; otherwise kept for good, so that the unique index
    # refuses every later run for that key.
    SPEND = "spend"


class AttemptChange(StrEnum):
    """What the transition does to the run's attempt."""

    NONE = "none"
    # A claim: the next attempt begins, unless one handed back goes on.
    START = "start"
    # The attempt in progress ended in an error: it joins `attempts`, and is the run's error
    # if the run ended with it.
    FAIL = "fail"
    # The attempt is given back, not spent (a shutdown or a hand-over).
    HAND_BACK = "hand_back"


@dataclass(frozen=True)
class Transition:
    """A named edge set: from any of `sources` to `target`, under `guards`."""

    name: str
    sources: frozenset[RunStatus]
    target: RunStatus
    guards: frozenset[Guard]
    lease: LeaseChange
    key: KeyChange
    attempt: AttemptChange

    @property
    def fenced(self) -> bool:
        """A lease holder's write: it must prove it still holds the lease."""
        return Guard.LEASE in self.guards

    @property
    def ends(self) -> bool:
        """Entering the target ends the run (`completedAt` is set)."""
        return self.target in TERMINAL


def _t(
    name: str,
    sources: set[RunStatus],
    target: RunStatus,
    *guards: Guard,
    lease: LeaseChange = LeaseChange.KEEP,
    key: KeyChange = KeyChange.KEEP,
    attempt: AttemptChange = AttemptChange.NONE,
) -> Transition:
    if target in TERMINAL:
        # Every ended run loses its lease the same way and lets go of its key (a success may
        # spend it): one rule, whichever transition ended the run.
        lease = LeaseChange.END
        key = key if key is KeyChange.SPEND else KeyChange.FREE
    return Transition(name, frozenset(sources), target, frozenset(guards), lease, key, attempt)


S = RunStatus
G = Guard
_HELD = {S.RUNNING, S.WAITING_WORKER}
_ALL = [
    _t("enqueue", {S.PENDING}, S.QUEUED, G.NOT_WAITING),
    _t(
        "claim",
        {S.PENDING, S.QUEUED},
        S.RUNNING,
        G.NOT_WAITING,
        G.DUE,
        G.UNLIMITED,
        lease=LeaseChange.GRANT,
        attempt=AttemptChange.START,
    ),
    # A run with limits to pass as it starts: its rate window granted the start, and its
    # template's `maxRunning` is checked in the same transaction as the claim.
    _t(
        "claim_limited",
        {S.PENDING, S.QUEUED},
        S.RUNNING,
        G.NOT_WAITING,
        G.DUE,
        lease=LeaseChange.GRANT,
        attempt=AttemptChange.START,
    ),
    # An external step: the inline worker lets go, and an external worker's claim resumes it.
    _t("wait_worker", {S.RUNNING}, S.WAITING_WORKER, G.LEASE, lease=LeaseChange.DROP),
    _t("resume", {S.WAITING_WORKER}, S.RUNNING, G.EXTERNAL_TYPE, lease=LeaseChange.GRANT),
    _t("complete", _HELD, S.SUCCEEDED, G.LEASE, key=KeyChange.SPEND),
    _t("fail", _HELD, S.FAILED, G.LEASE, attempt=AttemptChange.FAIL),
    _t("retry", _HELD, S.QUEUED, G.LEASE, lease=LeaseChange.DROP, attempt=AttemptChange.FAIL),
    # Graceful shutdown hands the run back without spending an attempt.
    _t(
        "release",
        _HELD,
        S.QUEUED,
        G.LEASE,
        lease=LeaseChange.DROP,
        attempt=AttemptChange.HAND_BACK,
    ),
    # A run whose steps left are map steps lets go while their children run; the end of the
    # children it waits for queues it again, to go on with the same attempt.
    _t(
        "wait_children",
        {S.RUNNING},
        S.WAITING_CHILDREN,
        G.LEASE,
        lease=LeaseChange.DROP,
        attempt=AttemptChange.HAND_BACK,
    ),
    _t("children_done", {S.WAITING_CHILDREN}, S.QUEUED),
    _t("cancel", {S.PENDING, S.QUEUED, S.WAITING_CHILDREN}, S.CANCELLED),
    _t("request_cancel", _HELD, S.CANCEL_REQUESTED),
    _t("acknowledge_cancel", {S.CANCEL_REQUESTED}, S.CANCELLED, G.LEASE),
    # The reaper acts on runs whose lease ran out, as it read them: a heartbeat or a cancel
    # that came after its read wins.
    _t(
        "reap_requeue",
        _HELD,
        S.QUEUED,
        G.AS_READ,
        G.LEASE_EXPIRED,
        lease=LeaseChange.DROP,
        attempt=AttemptChange.FAIL,
    ),
    _t(
        "reap_expire",
        set(LEASED),
        S.EXPIRED,
        G.AS_READ,
        G.LEASE_EXPIRED,
        attempt=AttemptChange.FAIL,
    ),
    _t("reap_cancel", set(LEASED), S.CANCELLED, G.AS_READ, G.LEASE_EXPIRED),
    # A worker that does not converge within `cancelPolicy.graceSeconds` is overruled.
    _t("cancel_timeout", {S.CANCEL_REQUESTED}, S.CANCELLED, G.GRACE_PASSED),
    # The run's `deadline` (template `timeoutSeconds` from its first start) passed.
    _t(
        "deadline_expire",
        {*LEASED, S.WAITING_CHILDREN},
        S.EXPIRED,
        G.DEADLINE_PASSED,
        attempt=AttemptChange.FAIL,
    ),
]
del S, G

TRANSITIONS: dict[str, Transition] = {t.name: t for t in _ALL}

# The status graph of docs/contract.md, derived from the named transitions so it exists once.
ALLOWED: dict[RunStatus, frozenset[RunStatus]] = {
    status: frozenset(t.target for t in _ALL if status in t.sources) for status in RunStatus
}


class StepLeaseState(StrEnum):
    """Where a step's own lease stands (`progress.steps[i].lease`): a step the run's holder
    cannot run (its handler is offered elsewhere) is lent while the run's other steps run."""

    # Not lent: the run's holder runs the step, or will.
    NONE = "none"
    # Lent, and waiting in its handler's lane for a worker to claim it.
    LENT = "lent"
    # A borrower holds it: its worker id, token and expiry, renewed by its heartbeat.
    CLAIMED = "claimed"
    # The borrower reported how the step ended; the run's holder writes that end.
    REPORTED = "reported"


class StepWriter(StrEnum):
    """Who makes a step lease move, and so which lease fences it."""

    # The run's lease holder: fenced by the run's lease.
    HOLDER = "holder"
    # A worker the step is lent to: its claim needs the run running and the step lent;
    # its later moves are fenced by the step's lease.
    BORROWER = "borrower"


@dataclass(frozen=True)
class StepMove:
    """A step-level lease move: from any of `sources` to `target`, by `by`. None changes the
    run's status: the run stays its holder's, and every run transition above stays whole."""

    name: str
    sources: frozenset[StepLeaseState]
    target: StepLeaseState
    by: StepWriter


L = StepLeaseState
STEP_MOVES: dict[str, StepMove] = {
    m.name: m
    for m in [
        StepMove("lend", frozenset({L.NONE}), L.LENT, StepWriter.HOLDER),
        # The step-level claim: a new token and expiry, and the step's try starts.
        StepMove("claim_step", frozenset({L.LENT}), L.CLAIMED, StepWriter.BORROWER),
        # The borrower shuts down before the step ends: lent again, to another worker.
        StepMove("give_back", frozenset({L.CLAIMED}), L.LENT, StepWriter.BORROWER),
        StepMove("report_step", frozenset({L.CLAIMED}), L.REPORTED, StepWriter.BORROWER),
        # Nobody claimed it in time, or its borrower's lease ran out (a claimed step only
        # then): the holder takes it back, to run elsewhere or to fail its try.
        StepMove("take_back", frozenset({L.LENT, L.CLAIMED}), L.NONE, StepWriter.HOLDER),
        # The holder writes the reported end as it would its own step's: the lease goes.
        StepMove("settle", frozenset({L.REPORTED}), L.NONE, StepWriter.HOLDER),
    ]
}
del L
