"""The transition table is docs/contract.md's status graph, exactly, with the moves of map steps (a
parent waiting for its children, `docs/contract.md`)."""

from jobplane.model import ACTIVE, ALLOWED, LEASED, TERMINAL, TRANSITIONS, RunStatus

S = RunStatus

# docs/contract.md, "Transitions", written out edge by edge.
SPEC_EDGES = {
    (S.PENDING, S.QUEUED),
    (S.PENDING, S.RUNNING),
    (S.QUEUED, S.RUNNING),
    (S.RUNNING, S.WAITING_WORKER),
    (S.WAITING_WORKER, S.RUNNING),
    (S.RUNNING, S.SUCCEEDED),
    (S.WAITING_WORKER, S.SUCCEEDED),
    (S.RUNNING, S.FAILED),
    (S.WAITING_WORKER, S.FAILED),
    (S.RUNNING, S.QUEUED),
    (S.WAITING_WORKER, S.QUEUED),
    (S.PENDING, S.CANCELLED),
    (S.QUEUED, S.CANCELLED),
    (S.RUNNING, S.CANCEL_REQUESTED),
    (S.WAITING_WORKER, S.CANCEL_REQUESTED),
    (S.CANCEL_REQUESTED, S.CANCELLED),
    # the reaper, on an expired lease
    (S.RUNNING, S.EXPIRED),
    (S.WAITING_WORKER, S.EXPIRED),
    (S.CANCEL_REQUESTED, S.EXPIRED),
    (S.RUNNING, S.CANCELLED),
    (S.WAITING_WORKER, S.CANCELLED),
    # Map steps: the parent lets go while its children run, and is queued when they end; it
    # is cancelled at once, and expires at its deadline.
    (S.RUNNING, S.WAITING_CHILDREN),
    (S.WAITING_CHILDREN, S.QUEUED),
    (S.WAITING_CHILDREN, S.CANCELLED),
    (S.WAITING_CHILDREN, S.EXPIRED),
}


def test_allowed_edges_are_exactly_the_spec() -> None:
    edges = {(a, b) for a, targets in ALLOWED.items() for b in targets}
    assert edges == SPEC_EDGES


def test_terminal_statuses_have_no_way_out() -> None:
    assert TERMINAL == {S.SUCCEEDED, S.FAILED, S.CANCELLED, S.EXPIRED}
    for status in TERMINAL:
        assert ALLOWED[status] == frozenset()
    assert ACTIVE | TERMINAL == set(RunStatus)


def test_worker_transitions_are_fenced() -> None:
    worker_writes = {"complete", "fail", "retry", "release", "acknowledge_cancel"}
    for name in worker_writes | {"wait_worker", "wait_children"}:
        assert TRANSITIONS[name].fenced, name
    # `resume` is an external worker's claim: it issues a lease rather than proving one.
    for name in ("enqueue", "claim", "resume", "cancel", "request_cancel", "reap_requeue"):
        assert not TRANSITIONS[name].fenced, name


def test_reaper_acts_only_on_leased_runs() -> None:
    for name in ("reap_requeue", "reap_expire", "reap_cancel", "cancel_timeout"):
        assert TRANSITIONS[name].sources <= LEASED
    # A deadline passes for a run waiting for its children too, which nobody holds.
    assert TRANSITIONS["deadline_expire"].sources == LEASED | {S.WAITING_CHILDREN}
