"""Where a held run's steps stand while a worker walks its graph: which steps have ended and
how, their outputs, their tries, and what that allows next.

Decisions only; the runner (`worker/runner.py`) runs the steps and writes their ends.
"""

from dataclasses import dataclass, field
from typing import Any

from jobplane.model import Run, StepLease, StepStatus, Template
from jobplane.model.graph import ENDED


@dataclass
class Flow:
    """The run's steps as this attempt found them, kept current as they end."""

    template: Template
    run: Run
    statuses: list[StepStatus] = field(init=False)
    outputs: dict[str, Any] = field(init=False)
    # Each step's tries so far (`progress.steps[i].attempt`).
    tries: list[int] = field(init=False)
    # The steps this worker runs now.
    running: set[int] = field(default_factory=set)
    # How many steps have ended: kept as they end, since every step's end asks.
    done: int = field(init=False)
    # The map steps that made their children already, with how many.
    made: dict[int, int] = field(init=False)
    # The steps an earlier holder lent to other workers that have not ended: watched, not run.
    lent: dict[int, StepLease] = field(init=False)

    def __post_init__(self) -> None:
        steps = self.run.progress.steps
        # A step that was running, or failed and is retried with the run, runs again; one that
        # failed for good with `onFailure: continue` stays failed. A map step waiting is ready
        # again, to look at its children.
        self.statuses = [
            StepStatus.FAILED
            if s.final
            else StepStatus.PENDING
            if s.status in (StepStatus.RUNNING, StepStatus.FAILED, StepStatus.WAITING)
            else s.status
            for s in steps
        ]
        self.made = {i: s.map.total for i, s in enumerate(steps) if s.map is not None}
        self.outputs = dict(self.run.outputs)
        self.tries = [s.attempt for s in steps]
        self.lent = {
            i: s.lease
            for i, s in enumerate(steps)
            if s.lease is not None and s.status in (StepStatus.PENDING, StepStatus.RUNNING)
        }
        for i, lent in self.lent.items():
            self.tries[i] = max(self.tries[i], lent.attempt)
        self.done = sum(1 for s in self.statuses if _ended(s))

    def end(self, index: int, status: StepStatus) -> None:
        """Step `index` ended: succeeded, skipped, or failed for good."""
        self.statuses[index] = status
        self.done += 1

    def wait(self, index: int) -> None:
        """Map step `index` waits for its children."""
        self.statuses[index] = StepStatus.WAITING

    @property
    def waiting(self) -> list[int]:
        return [i for i, s in enumerate(self.statuses) if s == StepStatus.WAITING]

    @property
    def ready(self) -> list[int]:
        """Steps whose needs are met and that are not running yet, in template order."""
        return [i for i in self.template.graph.ready(self.statuses) if i not in self.running]

    @property
    def finished(self) -> bool:
        """Every step has ended: nothing runs, and nothing is left to run."""
        return self.done == len(self.statuses) and not self.running

    @property
    def result(self) -> Any:
        """The run's result: the output of its last step in template order (None if that step
        did not succeed)."""
        return self.outputs.get(self.template.steps[-1].id)

    @property
    def next_handler(self) -> str | None:
        return self.template.next_handler(self.statuses)

    def to_skip(self, failed: int) -> list[int]:
        """The steps a step that failed for good leaves without a need they can meet."""
        below = self.template.graph.dependents(failed)
        return [i for i in below if self.statuses[i] == StepStatus.PENDING]

    def activation(self) -> dict[str, Any]:
        """What a step's `when` sees: the payload, the outputs of the steps that succeeded,
        and the run."""
        run = self.run
        return {
            "payload": run.payload,
            "outputs": self.outputs,
            "run": {
                "scope": run.scope,
                "scopeId": run.scope_id,
                "attempt": run.attempt,
                "templateVersion": run.template_version,
            },
        }


def _ended(status: StepStatus) -> bool:
    # Here a failed step failed for good: one retried with the run went back to pending.
    return status in ENDED or status == StepStatus.FAILED
