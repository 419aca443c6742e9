"""`jobplane runs watch` says why a run that could start does not."""

from datetime import UTC, datetime

from jobplane.cli.render import render
from jobplane.model import Run, RunStatus, WaitingFor


def test_a_run_waiting_for_a_handler_says_which() -> None:
    now = datetime.now(UTC)
    run = Run(
        id="0" * 24,
        template_type="t",
        template_version=1,
        scope="user",
        scope_id="u",
        status=RunStatus.QUEUED,
        create_at=now,
        update_at=now,
        waiting_for=WaitingFor(reason="handler", detail="reports.render"),
    )
    assert "  waiting for handler: reports.render" in render(run)
    assert not any(
        "waiting" in line for line in render(run.model_copy(update={"waiting_for": None}))
    )
