"""The invariant checker finds what it is meant to find: hand-made trails with one flaw each.

Without these, a chaos scenario reporting "0 violations" would prove nothing.
"""

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.chaos.invariants import (
    Doc,
    Templates,
    Trailed,
    _shared_keys,
    check_run,
    lock_overlaps,
    map_families,
    over_concurrency_limit,
    over_max_running,
    peak,
    started_spans,
    webhook_deliveries,
)

NOW = datetime(2026, 11, 21, tzinfo=UTC)
STEPS = ["a", "b"]
W1, W2 = "worker:w1", "worker:w2"


def moved(version: int, from_: str | None, to: str, actor: str = W1) -> Doc:
    event: Doc = {"_id": version * 10, "runVersion": version, "type": "status_changed"}
    event |= {"to": to, "actor": actor, "metadata": {}}
    if from_ is not None:
        event["from"] = from_
    return event


def step(version: int, kind: str, step_id: str, actor: str = W1, **metadata: Any) -> Doc:
    return {
        "_id": version * 10 + (1 if kind == "step_started" else 2),
        "runVersion": version,
        "type": kind,
        "actor": actor,
        "metadata": {"step": step_id, **metadata},
    }


def good() -> list[Doc]:
    """pending -> queued -> running (w1) -> a, b -> succeeded: a run that waited for its
    dedupe key (others are created `queued`)."""
    return [
        moved(1, None, "pending", "user:u"),
        moved(2, "pending", "queued", "user:u"),
        moved(3, "queued", "running"),
        step(4, "step_started", "a"),
        step(4, "step_finished", "a"),
        step(5, "step_started", "b"),
        step(5, "step_finished", "b"),
        moved(6, "running", "succeeded"),
    ]


def run(status: str = "succeeded", version: int = 6, **fields: Any) -> Doc:
    return {"status": status, "version": version, **fields}


def test_a_good_trail_passes() -> None:
    assert check_run(run(), good(), STEPS, NOW) == []


def test_a_run_created_queued_passes() -> None:
    trail = [moved(1, None, "queued", "user:u"), *good()[2:]]
    assert check_run(run(), trail, STEPS, NOW) == []


def test_a_retried_run_passes_when_its_last_lease_ran_every_step() -> None:
    trail = [
        *good()[:5],
        moved(5, "running", "queued", "reaper"),
        moved(6, "queued", "running", W2),
        step(7, "step_started", "b", W2),
        step(7, "step_finished", "b", W2),
        moved(8, "running", "succeeded", W2),
    ]
    assert check_run(run(version=8), trail, STEPS, NOW) == []


@pytest.mark.parametrize(
    ("trail", "found"),
    [
        ([*good()[:-1], moved(6, "running", "failed")], "trail ends failed"),
        ([*good(), moved(7, "succeeded", "queued", "reaper")], "not in SPEC's table"),
        ([*good()[:2], moved(3, "pending", "running"), *good()[3:]], "moves from pending"),
        ([moved(1, None, "running"), *good()[2:]], "begins as running"),
        ([*good()[:3], step(4, "step_started", "a", W2), *good()[4:]], "lease held by worker:w1"),
        ([*good()[:3], *good()[5:7], *good()[3:5], good()[-1]], "started before the step ahead"),
        ([*good()[:5], good()[-1]], "without a recorded run of step b"),
        ([*good()[:3], *reversed(good()[3:5]), *good()[5:]], "without a recorded run of step a"),
        ([*good()[:4], {**good()[4], "runVersion": 2}, *good()[5:]], "goes back to version 2"),
    ],
)
def test_a_flawed_trail_is_a_violation(trail: list[Doc], found: str) -> None:
    assert any(found in line for line in check_run(run(), trail, STEPS, NOW)), found


def test_two_successes_are_a_violation() -> None:
    trail = [
        *good(),
        {**moved(7, "succeeded", "running"), "from": "running"},
        moved(8, "running", "succeeded"),
    ]
    assert any("succeeded 2 times" in v for v in check_run(run(version=8), trail, STEPS, NOW))


def test_only_a_failed_or_expired_run_has_an_error_its_last_attempts() -> None:
    boom, later = {"code": "boom", "attempt": 1}, {"code": "boom", "attempt": 2}
    attempts = [{"attempt": 1, "error": boom}, {"attempt": 2, "error": later}]
    failed = [*good()[:-1], moved(6, "running", "failed")]
    assert check_run(run("failed", error=later, attempts=attempts), failed, STEPS, NOW) == []
    stale = check_run(run("failed", error=boom, attempts=attempts), failed, STEPS, NOW)
    assert stale == ["is failed without its last attempt's error"]
    # A retried run that then succeeded keeps its attempts, not an error.
    assert check_run(run(attempts=attempts[:1]), good(), STEPS, NOW) == []
    assert check_run(run(error=boom), good(), STEPS, NOW) == ["is succeeded with an error"]


def test_a_run_left_unfinished_is_a_violation_unless_it_is_due_later() -> None:
    queued = good()[:2]
    later = {"notBefore": NOW + timedelta(hours=1)}
    assert "is queued, not terminal" in check_run(run("queued", 2), queued, STEPS, NOW)
    assert check_run(run("queued", 2, **later), queued, STEPS, NOW) == []


def test_shared_keys_are_violations() -> None:
    at = NOW
    runs = [
        {"_id": "r1", "status": "running", "dedupeKey": "k", "scope": "account", "scopeId": "a"},
        {"_id": "r2", "status": "queued", "dedupeKey": "k", "scope": "account", "scopeId": "a"},
        {"_id": "r3", "status": "succeeded", "scheduleId": "s", "scheduledFor": at},
        {"_id": "r4", "status": "succeeded", "scheduleId": "s", "scheduledFor": at},
        {"_id": "r5", "status": "failed", "idempotencyKey": "i", "scope": "user", "scopeId": "u"},
        {"_id": "r6", "status": "failed", "idempotencyKey": "i", "scope": "user", "scopeId": "u"},
        {"_id": "r7", "status": "failed", "idempotencyKey": "i", "scope": "user", "scopeId": "v"},
    ]
    found = _shared_keys(runs)
    assert [line.split(" ")[0:2] for line in found] == [
        ["active", "dedupe"],
        ["schedule", "fire"],
        ["idempotency", "key"],
    ]
    assert "r7" not in " ".join(found)


# Flow control: trails of several runs, each event at a time (ms after T0), as the audit reads
# them from MongoDB (naive UTC).
T0 = datetime(2026, 11, 21, 12)
SCOPE = {"scope": "account", "scopeId": "a"}


def at(ms: float) -> datetime:
    return T0 + timedelta(milliseconds=ms)


def event(kind: str, ms: float, to: str | None = None, **metadata: Any) -> Doc:
    doc: Doc = {"type": kind, "createAt": at(ms), "metadata": metadata}
    return doc if to is None else doc | {"to": to}


def of(template: Doc, run_id: str, payload: Doc, trail: list[Doc], **fields: Any) -> Trailed:
    run = {"_id": run_id, "templateType": template["type"], "templateVersion": 1}
    return {**run, **SCOPE, "payload": payload, **fields}, trail


def holding(run_id: str, group: str, created: float, ended: float) -> Trailed:
    """A run of LIMITED created holding a place of its group's key, claimed 10 ms later."""
    trail = [
        event("created", created, "queued"),
        event("status_changed", created + 10, "running"),
        event("status_changed", ended, "succeeded"),
    ]
    return of(LIMITED, run_id, {"group": group}, trail)


def waited(run_id: str, took: float, ended: float) -> Trailed:
    """A run of LIMITED created waiting for its key, which it took at `took`."""
    trail = [
        event("created", took - 500, "pending"),
        event("dedupe_key_taken", took),
        event("status_changed", took + 1, "queued"),
        event("status_changed", took + 10, "running"),
        event("status_changed", ended, "succeeded"),
    ]
    return of(LIMITED, run_id, {"group": "g"}, trail)


LIMITED: Doc = {
    "type": "limited",
    "concurrencyPolicy": "queue_same_scope",
    "concurrencyLimit": 2,
    "dedupeKeys": ["payload.group"],
}
ONCE: Doc = {
    "type": "once",
    "repeatable": False,
    "concurrencyPolicy": "reject_same_scope",
    "dedupeKeys": ["payload.group"],
}


def templates(*docs: Doc) -> Templates:
    return {(t["type"], 1): t for t in docs}


def test_a_key_held_by_no_more_runs_than_its_limit_passes() -> None:
    trailed = [
        holding("r1", "g", 0, 300),
        holding("r2", "g", 100, 400),
        # Took r1's place in the millisecond r1 ended.
        waited("r3", 300, 600),
        # Another key.
        holding("r4", "h", 200, 500),
    ]
    assert over_concurrency_limit(trailed, templates(LIMITED)) == []


def test_a_key_held_by_more_runs_than_its_limit_is_a_violation() -> None:
    trailed = [holding("r1", "g", 0, 300), holding("r2", "g", 100, 400), waited("r3", 299, 600)]
    assert over_concurrency_limit(trailed, templates(LIMITED)) == [
        f'dedupe key ["limited","account","a","g"]: 3 runs held a place at {at(299)} '
        "(concurrencyLimit 2): ['r1', 'r2', 'r3']"
    ]


def test_a_key_of_one_place_counts_from_the_takers_next_event() -> None:
    """The insert that took the place read its clock before the holder's end was written
    (its write was in flight): it counts from its claim, once it is known to hold it."""
    one = {**LIMITED, "concurrencyLimit": 1}
    taken_in_flight = [holding("r1", "g", 0, 300), holding("r2", "g", 295, 600)]
    assert over_concurrency_limit(taken_in_flight, templates(one)) == []
    claimed_before_the_end = [holding("r1", "g", 0, 300), holding("r2", "g", 280, 600)]
    [found] = over_concurrency_limit(claimed_before_the_end, templates(one))
    assert f"2 runs held a place at {at(290)} (concurrencyLimit 1)" in found


def test_a_key_spent_by_a_success_is_held_for_good() -> None:
    spent = [
        of(ONCE, "r1", {"group": "g"}, holding("r1", "g", 0, 300)[1]),
        of(ONCE, "r2", {"group": "g"}, holding("r2", "g", 5_000, 6_000)[1]),
    ]
    [found] = over_concurrency_limit(spent, templates(ONCE))
    assert "['r1', 'r2']" in found
    # A run that ended otherwise let go of it.
    failed = [
        of(ONCE, "r1", {"group": "g"}, [*spent[0][1][:2], event("status_changed", 300, "failed")])
    ]
    assert over_concurrency_limit([*failed, spent[1]], templates(ONCE)) == []


CAPPED: Doc = {"type": "capped"}


def started(run_id: str, cap: int, *moves: tuple[float, str]) -> Trailed:
    trail = [event("created", 0, "queued"), *(event("status_changed", ms, to) for ms, to in moves)]
    return of(CAPPED, run_id, {}, trail, maxRunning=cap)


def test_no_more_runs_started_than_max_running_passes() -> None:
    trailed = [
        started("r1", 2, (100, "running"), (300, "queued"), (500, "running"), (900, "succeeded")),
        started("r2", 2, (200, "running"), (800, "succeeded")),
        # Claimed in the millisecond r1 was requeued, and again as r2 ended.
        started("r3", 2, (300, "running"), (400, "failed")),
        started("r4", 2, (800, "running"), (850, "succeeded")),
    ]
    assert over_max_running(trailed) == []
    assert peak(started_spans(trailed)["capped"]) == 2


def test_more_runs_started_than_max_running_is_a_violation() -> None:
    trailed = [
        # Asked to cancel, it is still started until the cancel is acknowledged.
        started("r1", 2, (100, "running"), (200, "cancel_requested"), (700, "cancelled")),
        started("r2", 2, (150, "running"), (800, "succeeded")),
        started("r3", 2, (600, "running"), (900, "succeeded")),
    ]
    assert over_max_running(trailed) == [
        f"template capped: 3 runs started at {at(600)} (maxRunning 2): ['r1', 'r2', 'r3']"
    ]


def test_each_run_is_held_to_its_own_versions_max_running() -> None:
    """A newer version raised the cap to 3: its runs may start beside an older one's, which
    may not start as the third."""
    trailed = [
        started("old", 2, (100, "running"), (900, "succeeded")),
        started("new1", 3, (200, "running"), (900, "succeeded")),
        started("new2", 3, (300, "running"), (900, "succeeded")),
    ]
    assert over_max_running(trailed) == []
    late = started("old2", 2, (400, "running"), (500, "succeeded"))
    [found] = over_max_running([*trailed, late])
    assert "4 runs started" in found and "(maxRunning 2)" in found


LOCKED: Doc = {
    "type": "locked",
    "steps": [
        {"id": "prepare", "handler": "builtin.echo"},
        {"id": "call", "handler": "chaos.nap", "locks": [{"name": "p", "key": ["payload.p"]}]},
    ],
}


def stepped(
    run_id: str, began: float, ended: float, partner: str = "acme", *before: Doc
) -> Trailed:
    """A run of LOCKED whose step `call` began at `began` (its progress says so) and ended at
    `ended`, its start written with its end; `before`: earlier events of the run."""
    trail = [
        event("created", 0, "queued"),
        *before,
        event("status_changed", began - 10, "running"),
        event("step_started", ended, step="call"),
        event("step_finished", ended, step="call"),
        event("status_changed", ended, "succeeded"),
    ]
    progress = {"steps": [{"id": "prepare"}, {"id": "call", "startedAt": at(began)}]}
    return of(LOCKED, run_id, {"p": partner}, trail, progress=progress)


def test_steps_holding_a_lock_one_after_another_pass() -> None:
    trailed = [
        stepped("r1", 100, 300),
        # Began in the millisecond r1's step ended.
        stepped("r2", 300, 500),
        stepped("r3", 200, 400, "globex"),
    ]
    assert lock_overlaps(trailed, templates(LOCKED)) == []


def test_steps_of_two_runs_holding_a_lock_at_once_are_a_violation() -> None:
    trailed = [stepped("r1", 100, 300), stepped("r2", 299, 500)]
    assert lock_overlaps(trailed, templates(LOCKED)) == [
        f"lock p:[\"acme\"]: runs ['r1', 'r2'] held it at once at {at(299)}"
    ]


def test_steps_overlapping_across_a_fault_that_took_the_lock_away_pass() -> None:
    """Redis was wiped (or r1's worker paused past its lease) between 1,150 and 1,160 ms: r2
    took the lock while r1's step went on, as the locks' design allows; not so r3, whose lock
    r2 still held."""
    trailed = [stepped("r1", 1_100, 2_300), stepped("r2", 2_200, 3_400)]
    assert lock_overlaps(trailed, templates(LOCKED), [(at(1_150), at(1_160))]) == []
    assert lock_overlaps(trailed, templates(LOCKED), [(at(2_250), at(2_260))]) != []
    assert lock_overlaps(trailed, templates(LOCKED), [(at(50), at(60))]) != []
    r3 = stepped("r3", 3_350, 3_450)
    [found] = lock_overlaps([*trailed, r3], templates(LOCKED), [(at(1_150), at(1_160))])
    assert f"runs ['r2', 'r3'] held it at once at {at(3_350)}" in found


def test_a_step_may_read_its_start_a_moment_after_a_fault_took_its_lock() -> None:
    """r1 took its lock before a FLUSHALL at 1,150 ms and read its start after it (its take's
    answer came back late): r2 took the emptied lock. Within `TAKE_TO_START` of the fault,
    that is the fault's doing; a full second later it is not."""
    trailed = [stepped("r1", 1_170, 1_300), stepped("r2", 1_200, 1_400)]
    assert lock_overlaps(trailed, templates(LOCKED), [(at(1_150), at(1_152))]) == []
    late = [stepped("r1", 2_170, 2_300), stepped("r2", 2_200, 2_400)]
    assert lock_overlaps(late, templates(LOCKED), [(at(1_150), at(1_152))]) != []


def test_a_step_cut_short_holds_no_recorded_span() -> None:
    """r1's first lease ran out in its step (no `step_finished`): when it stopped is not on
    the record, and r2 took the lock after it expired."""
    lost = [
        event("status_changed", 50, "running"),
        event("step_started", 100, step="call"),
        event("status_changed", 2_500, "queued"),
    ]
    trailed = [stepped("r1", 3_000, 3_100, "acme", *lost), stepped("r2", 2_100, 2_200)]
    assert lock_overlaps(trailed, templates(LOCKED)) == []


def test_an_earlier_run_of_a_step_counts_from_its_own_events() -> None:
    """r1's step failed at its first attempt (its start written 50 ms in) and ran again later,
    which the progress dates; r2's step ran inside the first."""
    failed = [
        event("status_changed", 50, "running"),
        event("step_started", 150, step="call"),
        event("step_finished", 400, step="call", status="failed"),
        event("status_changed", 400, "queued"),
    ]
    trailed = [stepped("r1", 1_000, 1_100, "acme", *failed), stepped("r2", 200, 300)]
    [found] = lock_overlaps(trailed, templates(LOCKED))
    assert f"held it at once at {at(200)}" in found
    # A step whose start was written with its end is a point: it counts inside another's
    # span, not at its edges.
    point = [event("status_changed", 50, "running"), *stepped("r3", 0, 250)[1][-3:-1]]
    inside = of(LOCKED, "r3", {"p": "acme"}, [*point, event("status_changed", 250, "queued")])
    assert lock_overlaps([inside, stepped("r2", 200, 300)], templates(LOCKED)) != []
    edge = of(LOCKED, "r3", {"p": "acme"}, [*point[:1], *stepped("r3", 0, 300)[1][-3:-1]])
    assert lock_overlaps([edge, stepped("r2", 200, 300)], templates(LOCKED)) == []


DIAMOND = ["a", "b", "c", "d"]
DIAMOND_NEEDS = {"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"]}


def diamond(d_starts_early: bool = False, c: str = "run") -> list[Doc]:
    """a, then b and c side by side (c finishing last), then d; or c skipped by its `when`."""
    c_events = (
        [step(5, "step_started", "c"), step(7, "step_finished", "c")]
        if c == "run"
        else [step(5, "step_skipped", "c")]
    )
    d_at = 6 if d_starts_early else 8
    events = [
        moved(1, None, "queued", "user:u"),
        moved(2, "queued", "running"),
        step(3, "step_started", "a"),
        step(3, "step_finished", "a"),
        step(4, "step_started", "b"),
        *c_events,
        step(5, "step_finished", "b"),
        step(d_at, "step_started", "d"),
        step(d_at, "step_finished", "d"),
        moved(9, "running", "succeeded"),
    ]
    return sorted(events, key=lambda e: (e["runVersion"], e["_id"]))


def test_steps_of_a_graph_may_overlap_but_not_start_before_what_they_need() -> None:
    done = run(version=9)
    assert check_run(done, diamond(), DIAMOND, NOW, DIAMOND_NEEDS) == []
    early = check_run(done, diamond(d_starts_early=True), DIAMOND, NOW, DIAMOND_NEEDS)
    assert early == ["step d started before the step ahead of it (c) finished"]
    # Read as a line, b and c side by side are out of order.
    assert check_run(done, diamond(), DIAMOND, NOW) != []


def lent(then: str = "finished") -> list[Doc]:
    """w1 holds the run and runs a; it lends b to w2, which claims it and starts it; w1 writes
    b's end from w2's report (`then`: or w2 starts b only after w1 took it back)."""
    trail = [
        moved(1, None, "queued", "user:u"),
        moved(2, "queued", "running"),
        step(3, "step_started", "a"),
        step(3, "step_finished", "a"),
        step(4, "step_lent", "b"),
        step(5, "step_claimed", "b", W2),
    ]
    if then == "taken_back":
        trail.append(step(6, "step_taken_back", "b"))
    trail += [step(7, "step_started", "b", W2), step(8, "step_finished", "b")]
    return [*trail, moved(9, "running", "succeeded")]


def test_a_lent_steps_start_is_its_borrowers_while_it_holds_the_step_lease() -> None:
    assert check_run(run(version=9), lent(), STEPS, NOW) == []
    assert check_run(run(version=9), lent("taken_back"), STEPS, NOW) == [
        f"step_started b by {W2}, lease held by {W1}"
    ]
    unclaimed = [e for e in lent() if e["type"] != "step_claimed"]
    assert check_run(run(version=9), unclaimed, STEPS, NOW) == [
        f"step_started b by {W2}, lease held by {W1}"
    ]


def test_a_skipped_step_needs_no_recorded_run_but_a_missing_one_does() -> None:
    skipped = {"progress": {"steps": [{"id": "c", "status": "skipped"}]}}
    assert (
        check_run(run(version=9, **skipped), diamond(c="skip"), DIAMOND, NOW, DIAMOND_NEEDS) == []
    )
    assert check_run(run(version=9), diamond(c="skip"), DIAMOND, NOW, DIAMOND_NEEDS) == [
        "succeeded without a recorded run of step c"
    ]


def _family(
    children: list[tuple[int, str, list[tuple[int, int]]]], parent_step: str = "succeeded"
) -> tuple[list[Trailed], Templates]:
    """A parent whose map step `fan` (maxConcurrency 2) made `children`: (item, status, the
    seconds each stretch of it was active)."""
    parent: Doc = {
        "_id": "p",
        "scope": "account",
        "scopeId": "a",
        "templateType": "parent",
        "templateVersion": 1,
        "status": "succeeded",
        "progress": {"steps": [{"id": "fan", "status": parent_step, "map": {"total": 3}}]},
    }
    template = {"steps": [{"id": "fan", "workerType": "map", "map": {"maxConcurrency": 2}}]}
    trailed: list[Trailed] = [(parent, [])]
    for n, (item, status, active) in enumerate(children):
        child: Doc = {"_id": f"c{n}", "scope": "account", "scopeId": "a", "status": status}
        child |= {"parentRunId": "p", "parentStepId": "fan", "mapIndex": item, "mapLimit": 2}
        events = []
        for start, end in active:
            events.append({"to": "running", "createAt": NOW + timedelta(seconds=start)})
            events.append({"to": status, "createAt": NOW + timedelta(seconds=end)})
        trailed.append((child, events))
    return trailed, {("parent", 1): template}


def test_a_map_step_makes_each_items_child_once_and_within_its_cap() -> None:
    fine = [(0, "succeeded", [(0, 2)]), (1, "succeeded", [(1, 3)]), (2, "succeeded", [(2, 4)])]
    assert map_families(*_family(fine)) == []
    twice = [*fine[:2], (1, "succeeded", [(5, 6)])]
    assert any("two children" in v for v in map_families(*_family(twice)))
    assert any("made 2 of 3" in v for v in map_families(*_family(fine[:2])))
    crowded_ = [(0, "succeeded", [(0, 3)]), (1, "succeeded", [(1, 3)]), (2, "succeeded", [(2, 4)])]
    assert any("3 children active" in v for v in map_families(*_family(crowded_)))


def test_a_map_step_that_succeeded_under_fail_has_only_succeeded_children() -> None:
    failed = [(0, "succeeded", [(0, 1)]), (1, "failed", [(1, 2)]), (2, "succeeded", [(2, 3)])]
    assert any("did not" in v for v in map_families(*_family(failed)))
    assert map_families(*_family(failed, parent_step="failed")) == []


A0, A1, A2 = ("account", "a0"), ("account", "a1"), ("account", "a2")


def ended(event_id: int, scope: tuple[str, str], to: str = "succeeded") -> Doc:
    """A run's end, as `job_events` holds it."""
    return {
        "_id": event_id,
        "jobId": f"run{event_id}",
        "type": "status_changed",
        "to": to,
        "scope": scope[0],
        "scopeId": scope[1],
    }


def test_every_run_end_of_a_subscribed_scope_reaches_its_webhook_at_least_once() -> None:
    events = [
        ended(1, A0),
        ended(2, A1, "failed"),
        ended(3, A0, "cancelled"),
        ended(4, A1, "expired"),
        # Not ends: a move that is not terminal, and an event of another kind.
        {**ended(5, A0), "to": "running"},
        {**ended(6, A0), "type": "step_finished"},
        # An end in a scope no webhook subscribed to.
        ended(7, A2),
    ]
    subscribed = {A0, A1}
    received = [(A0, "msg_1"), (A1, "msg_2"), (A0, "msg_3"), (A1, "msg_4")]
    assert webhook_deliveries(events, subscribed, received) == []
    # At least once: a message received again is no violation.
    assert webhook_deliveries(events, subscribed, [*received, (A0, "msg_1")]) == []
    [lost] = webhook_deliveries(events, subscribed, received[1:])
    assert "run run1" in lost and "never reached" in lost and "a0" in lost


def test_a_message_no_subscribed_run_end_explains_is_a_violation() -> None:
    events = [ended(1, A0), {**ended(5, A0), "to": "running"}, ended(7, A2)]
    received = [(A0, "msg_1")]
    for stray in [(A0, "msg_5"), (A0, "msg_7"), (A0, "msg_99")]:
        [wrong] = webhook_deliveries(events, {A0}, [*received, stray])
        assert stray[1] in wrong and "not the end of a run of a subscribed scope" in wrong
    # An end delivered to another scope's webhook: misdelivered there, and lost for its own.
    wrong, lost = webhook_deliveries([ended(1, A0)], {A0, A1}, [(A1, "msg_1")])
    assert "webhook of account a1 received msg_1, the end of a run of account a0" in wrong
    assert "never reached the webhook of account a0" in lost
