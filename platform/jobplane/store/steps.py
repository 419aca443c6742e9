"""The fields and events of a run's steps, for the writes that start and end them."""

from datetime import datetime
from typing import Any

from jobplane.model import RunError, StepStatus
from jobplane.store.convert import Doc
from jobplane.store.writes import TrailEntry

# Array filters: the step a worker was in, and steps that will not run now (a step that failed
# in an earlier attempt is retried later, so it counts as not done).
RUNNING_STEP = {"r.status": StepStatus.RUNNING}
UNDONE_STEP = {"p.status": {"$in": [StepStatus.PENDING, StepStatus.FAILED]}}


def unwritten_start(
    index: int, step_id: str, started_at: datetime | None
) -> tuple[Doc, list[TrailEntry]]:
    """The fields and event of a step's start, to go along with the write that ends it."""
    if started_at is None:
        return {}, []
    fields = {"phase": step_id, f"progress.steps.{index}.startedAt": started_at}
    return fields, [("step_started", None, {"step": step_id})]


def ended_badly(
    index: int, error: RunError, started_at: datetime | None
) -> tuple[Doc, list[TrailEntry]]:
    """A step's unwritten start and its failed end's event."""
    fields, events = unwritten_start(index, error.step or "", started_at)
    events.append(("step_finished", error.message, {"step": error.step, "status": "failed"}))
    return fields, events


def succeeded(index: int, step_id: str, output: Any, now: datetime) -> Doc:
    s = f"progress.steps.{index}"
    return {
        f"{s}.status": StepStatus.SUCCEEDED,
        f"{s}.completedAt": now,
        f"{s}.percentage": 100,
        # An earlier attempt's error at this step is in the run's `attempts`.
        f"{s}.error": None,
        f"outputs.{step_id}": output,
    }


def failed(index: int, error: RunError, now: datetime) -> Doc:
    s = f"progress.steps.{index}"
    return {f"{s}.status": StepStatus.FAILED, f"{s}.completedAt": now, f"{s}.error": error.message}
