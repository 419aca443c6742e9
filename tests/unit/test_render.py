"""What the CLI draws: progress bars that line up whatever the step ids."""

from datetime import UTC, datetime

from jobplane.cli.render import bar, render
from jobplane.model import MapProgress, Run, RunStatus, StepStatus
from jobplane.model.documents import Progress, StepProgress

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def run_of(status: RunStatus, progress: Progress) -> Run:
    return Run(
        id="r1",
        template_type="t",
        template_version=1,
        scope="system",
        scope_id="cli",
        status=status,
        progress=progress,
        create_at=NOW,
        update_at=NOW,
    )


def drawn(*step_ids: str) -> list[str]:
    steps = [StepProgress(id=step_id, percentage=50) for step_id in step_ids]
    return render(run_of(RunStatus.RUNNING, Progress(percentage=50, steps=steps)))[1:]


def test_a_label_never_runs_into_its_bar() -> None:
    for ids in [("extract", "transform", "load"), ("a",), ("a_much_longer_step_id", "b")]:
        lines = drawn(*ids)
        bars = {line.index("[") for line in lines}
        assert len(bars) == 1, lines  # every bar starts in the same column
        assert all(line[line.index("[") - 2 : line.index("[")] == "  " for line in lines), lines
    # A pending step's mark is a space.
    assert drawn("transform") == [
        f"  overall      {bar(50)}  ",
        f"    transform  {bar(50)}  ",
    ]


def test_a_waiting_map_step_counts_its_children() -> None:
    made = MapProgress(total=40, succeeded=10, failed=2, active=5)
    step = StepProgress(id="fan", status=StepStatus.WAITING, map=made)
    run = run_of(RunStatus.WAITING_CHILDREN, Progress(percentage=30, steps=[step]))
    [_, _, line] = render(run)
    assert line == f"  ~ fan    {bar(30)}  children 12/40: 10 succeeded, 2 failed, 5 active"
