"""Which trail events a webhook receives and under which names, and when a failed try is
tried again."""

import json
import random
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest

from jobplane.model import Run, RunStatus
from jobplane.settings import Settings
from jobplane.store.feed import PROGRESS_REPORTED
from jobplane.webhooks.events import SOURCE_TYPES, webhook_type
from jobplane.webhooks.fanout import _body, _json_of
from jobplane.webhooks.sender import JITTER, MAX_RETRY_AFTER, Sender, _retry_after


def event(kind: str, to: str | None = None, **metadata: Any) -> dict[str, Any]:
    return {"type": kind, "to": to, "metadata": metadata}


@pytest.mark.parametrize(
    ("trail", "name"),
    [
        (event("created"), "run.created"),
        (event("status_changed", "running", transition="claim"), "run.started"),
        (event("status_changed", "running", transition="claim_limited"), "run.started"),
        (event("status_changed", "running", transition="resume"), None),
        (event("status_changed", "queued", transition="retry"), "run.retrying"),
        (event("status_changed", "queued", transition="reap_requeue"), "run.retrying"),
        (event("status_changed", "queued", transition="release"), None),
        (event("status_changed", "succeeded", transition="complete"), "run.succeeded"),
        (event("status_changed", "failed", transition="fail"), "run.failed"),
        (event("status_changed", "cancelled", transition="cancel"), "run.cancelled"),
        (event("status_changed", "expired", transition="reap_expire"), "run.expired"),
        (event("status_changed", "cancel_requested", transition="request_cancel"), None),
        (event("step_finished", step="a"), "step.succeeded"),
        (event("step_finished", step="a", status="succeeded"), "step.succeeded"),
        (event("step_finished", step="a", status="failed"), "step.failed"),
        (event("step_finished", step="a", status="cancelled"), None),
        (event("step_skipped", step="a"), "step.skipped"),
        (event("step_started", step="a"), None),
        (event("lease_expired"), None),
    ],
)
def test_trail_events_become_webhook_events(trail: dict[str, Any], name: str | None) -> None:
    assert webhook_type(trail) == name
    if name is not None:
        assert trail["type"] in SOURCE_TYPES, "the notifier reads the types that map"


def test_a_progress_report_of_the_feed_is_run_progress() -> None:
    """Progress writes no trail event: the feed brings it as its own type, read beside the
    trail's (`store/feed.py`), never replayed from `job_events`."""
    assert webhook_type(event(PROGRESS_REPORTED)) == "run.progress"
    assert PROGRESS_REPORTED not in SOURCE_TYPES


def sender(*waits: float) -> Sender:
    settings = Settings(webhook_retry_seconds=list(waits))
    return Sender(None, settings, None, None, random.Random(7))  # type: ignore[arg-type]


def test_the_retry_schedule_is_followed_with_jitter_and_then_spent() -> None:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    policy = sender(0, 5, 300)
    for tries, wait in ((1, 5), (2, 300)):
        due = policy.next_try(tries, now, None)
        assert due is not None
        assert wait * (1 - JITTER) <= (due - now).total_seconds() <= wait * (1 + JITTER)
    assert policy.next_try(3, now, None) is None, "three waits, three tries"
    assert policy.next_try(1, now, 42.0) == now + timedelta(seconds=42), "Retry-After wins"


def test_retry_after_reads_seconds_and_dates() -> None:
    assert _retry_after("120") == 120
    assert _retry_after(" 7 ") == 7
    assert _retry_after("") is None and _retry_after("soon") is None
    in_a_minute = datetime.now(UTC) + timedelta(seconds=60)
    waited = _retry_after(format_datetime(in_a_minute, usegmt=True))
    assert waited is not None and 55 <= waited <= 61
    assert _retry_after("9999999") == MAX_RETRY_AFTER
    past = format_datetime(datetime.now(UTC) - timedelta(hours=1), usegmt=True)
    assert _retry_after(past) == 0


def test_a_body_holds_the_run_as_the_api_answers_it() -> None:
    """The run's JSON is put into the body as made, not parsed again: the body still reads as
    the contract has it, the run as `GET /v1/runs/{id}` shows it, non-ASCII text too."""
    now = datetime(2026, 11, 28, 9, 30, tzinfo=UTC)
    run = Run(
        id="6b0000000000000000000001",
        template_type="t",
        template_version=1,
        scope="account",
        scope_id="café",
        status=RunStatus.RUNNING,
        payload={"name": "Zoë", "n": 1.5},
        create_at=now,
        update_at=now,
        version=3,
    )
    step = {"_id": "e1", "type": "step_finished", "createAt": now, "metadata": {"step": "a"}}
    made: dict[str, str] = {}
    said = json.loads(_body(step, "step.succeeded", _json_of(run, made), 4))
    assert said == {
        "id": "msg_e1",
        "type": "step.succeeded",
        "timestamp": "2026-11-28T09:30:00Z",
        "sequence": 4,
        "data": {"run": run.model_dump(mode="json", by_alias=True), "step": "a"},
    }
    created = {"_id": "e0", "type": "created", "createAt": now, "metadata": {}}
    assert set(json.loads(_body(created, "run.created", _json_of(run, made), 1))["data"]) == {"run"}
    assert list(made) == [run.id], "a run's JSON is made once"
