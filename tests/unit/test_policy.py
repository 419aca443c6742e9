from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from jobplane.errors import ResourceInvalidState
from jobplane.model import TERMINAL, Attempt, RetryPolicy, Run, RunError, RunStatus, Template
from jobplane.runs.policy import (
    backoff_seconds,
    cancel_asked,
    cancel_grace,
    cancel_of,
    charged,
    lease_expired,
    retry_at,
)
from jobplane.store import Lost, Moved

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def run_in(status: RunStatus, attempt: int = 1, max_attempts: int = 3) -> Run:
    return Run(
        id="r1",
        template_type="t",
        template_version=1,
        scope="user",
        scope_id="u",
        status=status,
        attempt=attempt,
        max_attempts=max_attempts,
        cancel_grace_seconds=30,
        create_at=NOW,
        update_at=NOW,
    )


def test_explicit_list_is_used_as_written_and_its_last_value_repeats() -> None:
    policy = RetryPolicy(max_attempts=5, backoff_seconds=[30, 120])
    assert [backoff_seconds(policy, n) for n in (1, 2, 3, 4)] == [30, 120, 120, 120]


def test_exponential_without_jitter_grows_and_is_capped() -> None:
    policy = RetryPolicy(initial_seconds=2, multiplier=3, max_seconds=50, jitter="none")
    assert [backoff_seconds(policy, n) for n in (1, 2, 3, 4)] == [2, 6, 18, 50]


def test_full_jitter_spans_zero_to_the_delay() -> None:
    policy = RetryPolicy(initial_seconds=10, multiplier=2, jitter="full")
    assert backoff_seconds(policy, 2, rand=lambda: 0.0) == 0
    assert backoff_seconds(policy, 2, rand=lambda: 0.999) == 20 * 0.999


def test_equal_jitter_keeps_at_least_half() -> None:
    policy = RetryPolicy(initial_seconds=10, multiplier=2, jitter="equal")
    assert backoff_seconds(policy, 2, rand=lambda: 0.0) == 10
    assert backoff_seconds(policy, 2, rand=lambda: 1.0) == 20


def template_with(policy: RetryPolicy, *steps: dict[str, Any]) -> Template:
    return Template.model_validate(
        {
            "type": "t",
            "retryPolicy": policy.model_dump(by_alias=True),
            "steps": list(steps) or [{"id": "s", "handler": "h"}],
            "version": 1,
            "createAt": NOW,
            "updateAt": NOW,
        }
    )


def failed_at(*steps: str) -> list[Attempt]:
    error = {"code": "e", "message": "m"}
    return [
        Attempt(attempt=i + 1, error=RunError(**error, step=s), ended_at=NOW)
        for i, s in enumerate(steps)
    ]


def test_a_failed_attempt_retries_after_the_backoff_while_attempts_are_left() -> None:
    t = template_with(RetryPolicy(max_attempts=3, backoff_seconds=[30, 120]))
    later = [NOW + timedelta(seconds=30), NOW + timedelta(seconds=120), None]
    assert [retry_at(run_in(RunStatus.RUNNING, n), t, "s", True, NOW) for n in (1, 2, 3)] == later
    assert retry_at(run_in(RunStatus.RUNNING, 1), t, "s", False, NOW) is None


def test_a_step_with_its_own_policy_is_charged_its_own_failures_the_rest_the_templates() -> None:
    t = template_with(
        RetryPolicy(max_attempts=2, backoff_seconds=[5]),
        {"id": "a", "handler": "h"},
        {"id": "b", "handler": "h", "retryPolicy": {"maxAttempts": 3, "backoffSeconds": [60]}},
    )
    # Attempt 4, after b failed twice and a once: b has its third and last try in progress,
    # a its second and last (the run's maxAttempts is the template's, as at creation).
    run = run_in(RunStatus.RUNNING, 4, max_attempts=2)
    run = run.model_copy(update={"attempts": failed_at("b", "a", "b")})
    assert charged(run, t, "b") == (t.steps[1].retry_policy, 3, 3)
    assert charged(run, t, "a") == (t.retry_policy, 2, 2)
    assert retry_at(run, t, "b", True, NOW) is None
    assert retry_at(run, t, "a", True, NOW) is None
    once = run_in(RunStatus.RUNNING, 2, max_attempts=2)
    once = once.model_copy(update={"attempts": failed_at("a")})
    assert retry_at(once, t, "b", True, NOW) == NOW + timedelta(seconds=60)


def test_an_expired_lease_is_cancelled_requeued_or_expired() -> None:
    assert lease_expired(run_in(RunStatus.CANCEL_REQUESTED, 3)) == "reap_cancel"
    assert lease_expired(run_in(RunStatus.RUNNING, 2)) == "reap_requeue"
    assert lease_expired(run_in(RunStatus.WAITING_WORKER, 3)) == "reap_expire"


@pytest.mark.parametrize("status", sorted(RunStatus))
def test_a_cancel_is_carried_out_as_the_status_allows(status: RunStatus) -> None:
    run = run_in(status)
    if status in TERMINAL:
        with pytest.raises(ResourceInvalidState):
            cancel_of(run)
        return
    expected = {
        RunStatus.PENDING: "cancel",
        RunStatus.QUEUED: "cancel",
        RunStatus.RUNNING: "request_cancel",
        RunStatus.WAITING_WORKER: "request_cancel",
        # Nobody holds a run waiting for its children: it ends at once.
        RunStatus.WAITING_CHILDREN: "cancel",
        RunStatus.CANCEL_REQUESTED: None,
    }
    assert cancel_of(run) == expected[status]


def test_no_one_acknowledges_the_cancel_of_a_run_waiting_for_an_external_worker() -> None:
    assert cancel_grace(run_in(RunStatus.RUNNING)) == 30
    assert cancel_grace(run_in(RunStatus.WAITING_WORKER)) == 0


def test_only_a_write_refused_for_a_cancel_is_acknowledged() -> None:
    asked = RunStatus.CANCEL_REQUESTED
    assert cancel_asked(Lost("r1", "status", asked))
    assert not cancel_asked(Lost("r1", "lease", asked)), "a superseded lease writes nothing"
    assert not cancel_asked(Lost("r1", "status", RunStatus.CANCELLED))
    assert not cancel_asked(Moved("r1", RunStatus.RUNNING, RunStatus.SUCCEEDED))
    assert not cancel_asked(None)


def test_a_lost_lease_is_charged_to_the_policy_of_the_step_the_run_was_on() -> None:
    t = template_with(
        RetryPolicy(max_attempts=1),
        {"id": "a", "handler": "h"},
        {"id": "b", "handler": "h", "retryPolicy": {"maxAttempts": 3}},
    )
    on_b = run_in(RunStatus.RUNNING, 2, max_attempts=1).model_copy(
        update={"phase": "b", "attempts": failed_at("b")}
    )
    assert lease_expired(on_b) == "reap_expire", "counted by the run alone: 2 of 1"
    assert lease_expired(on_b, t) == "reap_requeue", "b's second of 3"
    on_a = on_b.model_copy(update={"phase": "a"})
    assert lease_expired(on_a, t) == "reap_expire", "a's first and only"
