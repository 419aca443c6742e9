"""The invariant checker finds what it is meant to find: hand-made trails with one flaw each.

Without these, a chaos scenario reporting "0 violations" would prove nothing.
"""

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.chaos.invariants import Doc, _shared_keys, check_run

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
