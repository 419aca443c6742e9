"""The fields and events of a run's steps, for the writes that start and end them."""

from datetime import datetime
from typing import Any

from jobplane.model import RunError, StepStatus
from jobplane.store.convert import Doc
from jobplane.store.types import StepEnd
from jobplane.store.writes import TrailEntry

# Array filters: the steps a worker was in, and steps that will not run now (a step that failed
# in an earlier attempt is retried later, so it counts as not done).
RUNNING_STEP = {"r.status": StepStatus.RUNNING}
# The steps the run's holder was in, which a hand-back makes pending again; a step lent to
# another worker runs on under its own lease, and the run's next holder waits for its end.
HELD_STEP: Doc = {"r.status": StepStatus.RUNNING, "r.lease": {"$exists": False}}
# A map step waiting for its children: a hand-back leaves it waiting (the children go on), and
# an end of the run stops it with the step the run was in.
WAITING_STEP = {"w.status": StepStatus.WAITING}
UNDONE_STEP = {
    "p.status": {"$in": [StepStatus.PENDING, StepStatus.FAILED]},
    # A step that failed for good with `onFailure: continue` is done.
    "p.final": {"$ne": True},
}


def unlent(indexes: list[int]) -> Doc:
    """The `$unset` of ended steps' leases: a lent step's end, written by its run's holder
    from the borrower's report, settles the lease (`STEP_MOVES["settle"]`)."""
    return {f"progress.steps.{i}.lease": "" for i in indexes}


def unwritten_start(
    index: int, step_id: str, started_at: datetime | None, attempt: int = 0, phase: bool = True
) -> tuple[Doc, list[TrailEntry]]:
    """The fields and event of a step's start (its `attempt`-th try, when known), to go along
    with the write that ends it. The step becomes the run's `phase`, unless it is a lent
    step's start (`phase` False): the phase is its holder's, and the lent step runs beside it."""
    if started_at is None:
        return {}, []
    s = f"progress.steps.{index}"
    fields: Doc = {f"{s}.startedAt": started_at}
    if phase:
        fields["phase"] = step_id
    if attempt:
        fields[f"{s}.attempt"] = attempt
    return fields, [("step_started", None, {"step": step_id})]


def ended_badly(
    index: int, error: RunError, started_at: datetime | None, attempt: int = 0
) -> tuple[Doc, list[TrailEntry]]:
    """A step's unwritten start and its failed end's event."""
    fields, events = unwritten_start(index, error.step or "", started_at, attempt)
    events.append(("step_finished", error.message, {"step": error.step, "status": "failed"}))
    return fields, events


def ended(end: StepEnd, now: datetime) -> tuple[Doc, list[TrailEntry]]:
    """The fields and events of a step that ended without a result (`StepEnd`)."""
    s = f"progress.steps.{end.index}"
    fields: Doc = {f"{s}.status": end.status, f"{s}.completedAt": now}
    if end.status == StepStatus.SKIPPED:
        return fields | {f"{s}.message": end.reason}, [
            ("step_skipped", end.reason, {"step": end.step_id})
        ]
    started, events = unwritten_start(end.index, end.step_id, end.started_at, end.attempt)
    fields |= started
    if end.final:
        fields[f"{s}.final"] = True
    if end.error is not None:
        fields[f"{s}.error"] = end.error.message
        status = {"step": end.step_id, "status": "failed"}
        events.append(("step_finished", end.error.message, status))
    else:
        events.append(("step_finished", None, {"step": end.step_id, "status": end.status.value}))
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
