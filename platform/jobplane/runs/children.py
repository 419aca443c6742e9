"""Map steps' rules: when a parent waiting for its children goes on, and what its map step's
children's ends make of it.

A map step is done when every child ended, or as soon as one failed it (`onItemFailure:
fail`). The parent decides from its children's ends alone, read from MongoDB, so a wake-up
that came twice, late or for nothing changes nothing: it only asks the question again.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jobplane.model import MapProgress, MapSpec, Run, RunStatus, StepStatus, Template, WaitingFor
from jobplane.model.graph import ENDED
from jobplane.store.children import ChildEnd


def idempotency_key(parent: Run, step_id: str, index: int) -> str:
    """The key that makes a child once, however often its parent's step tries to make it."""
    return f"map:{parent.id}:{step_id}:{index}"


def waiting_steps(run: Run) -> list[int]:
    return [i for i, s in enumerate(run.progress.steps) if s.status == StepStatus.WAITING]


def ended(counts: MapProgress) -> int:
    return (counts.succeeded or 0) + (counts.failed or 0)


def resumes(run: Run, template: Template, counts: Mapping[str, MapProgress]) -> bool:
    """A run waiting for its children goes on: a waiting map step's children all ended, or
    one failed a step that fails with it."""
    for index in waiting_steps(run):
        step = template.steps[index]
        found = counts.get(step.id)
        if found is None:
            return True  # made none it could count (archived already): let the step decide
        assert step.map is not None
        if ended(found) >= found.total:
            return True
        if found.failed and step.map.on_item_failure == "fail":
            return True
    return False


def detail(run: Run, counts: Mapping[str, MapProgress]) -> str:
    """`<ended>/<total>` of the run's waiting map steps' children, for `waitingFor`."""
    waiting = [run.progress.steps[i].id for i in waiting_steps(run)]
    found = [counts[s] for s in waiting if s in counts]
    return f"{sum(ended(c) for c in found)}/{sum(c.total for c in found)}"


def counted(run: Run, counts: Mapping[str, MapProgress]) -> Run:
    """`run` as its reader sees it: each map step with its children's counts, the run's
    percentage with each waiting step's ended children, and, waiting for them, why."""
    if not counts:
        return run
    steps = [
        s.model_copy(update={"map": counts[s.id]}) if s.id in counts else s
        for s in run.progress.steps
    ]
    waiting = [s.map for s in steps if s.status == StepStatus.WAITING and s.map]
    done = sum(1 for s in steps if s.status in ENDED) + sum(ended(m) / m.total for m in waiting)
    percentage = max(run.progress.percentage, round(100 * done / max(1, len(steps)), 2))
    progress = run.progress.model_copy(update={"steps": steps, "percentage": percentage})
    update: dict[str, Any] = {"progress": progress}
    if run.status == RunStatus.WAITING_CHILDREN:
        update["waiting_for"] = WaitingFor(reason="children", detail=detail(run, counts))
    return run.model_copy(update=update)


def place_wait(run: Run) -> WaitingFor | None:
    """A child waiting for a place among its map step's active children."""
    if not run.map_wait:
        return None
    where = f"map step {run.parent_step_id!r} of run {run.parent_run_id}"
    return WaitingFor(reason="concurrency", detail=f"{where}: maxConcurrency {run.map_limit}")


@dataclass(frozen=True)
class FanIn:
    """What a map step's children's ends make of it: its output once every child ended, or
    the child that failed it."""

    output: list[Any] | None = None
    failed: ChildEnd | None = None


def fan_in(spec: MapSpec, total: int, ends: Sequence[ChildEnd]) -> FanIn | None:
    """The step's outcome, or None while children it waits for are active."""
    if spec.on_item_failure == "fail":
        failed = next((end for end in ends if end.status != RunStatus.SUCCEEDED), None)
        if failed is not None:
            return FanIn(failed=failed)
    if len(ends) < total:
        return None
    if spec.on_item_failure == "fail":
        return FanIn(output=[end.result for end in ends])
    return FanIn(output=[_item(end) for end in ends])


def _item(end: ChildEnd) -> dict[str, Any]:
    """One item of an `onItemFailure: continue` step's output."""
    if end.status == RunStatus.SUCCEEDED:
        return {"status": end.status.value, "result": end.result}
    return {"status": end.status.value, "error": end.error}


def failure_message(failed: ChildEnd) -> str:
    error = (failed.error or {}).get("message")
    because = f": {error}" if error else ""
    return f"child run {failed.id} (item {failed.index}) ended {failed.status.value}{because}"
