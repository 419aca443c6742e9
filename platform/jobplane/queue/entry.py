"""A run as Redis holds it: its queue, lane and priority, and the limits it must pass as it
starts, in the members of the sets it waits in."""

import json
from dataclasses import dataclass
from datetime import datetime

from jobplane.model import Run, StartLimits
from jobplane.store.types import step_key


@dataclass(frozen=True)
class QueueEntry:
    run_id: str
    queue: str
    priority: int
    not_before: datetime | None = None
    # The lane: the handler of the run's current step (None: any worker may take it).
    handler: str | None = None
    # In a fair lane, the run's group: its scope and scope id, which take turns with others.
    group: str | None = None
    # What the run must pass as it starts (`maxRunning`, `rateLimit`): its member carries it,
    # so that the worker that pops it claims it under them without reading it first.
    limits: StartLimits | None = None

    @classmethod
    def of(cls, run: Run) -> "QueueEntry":
        group = f"{run.scope}:{run.scope_id}" if run.fairness == "round_robin" else None
        limits = run.start_limits
        return cls(run.id, run.queue, run.priority, run.not_before, run.handler, group, limits)

    @classmethod
    def lent(cls, run: Run, index: int, handler: str) -> "QueueEntry":
        """A step of `run` lent to a worker offering `handler`: in that handler's lane, with
        its run's priority; no limit applies, the run has started."""
        return cls(step_key(run.id, index), run.queue, run.priority, handler=handler)

    @property
    def capped(self) -> str | None:
        """The template whose `maxRunning` the run counts against, if it has one: a claim over
        it holds the run back, and it goes back to its lane as the template's runs end."""
        limits = self.limits
        return limits.template_type if limits and limits.max_running is not None else None

    @property
    def rated(self) -> bool:
        """It waits in its lane's rated set while ready (`Keys.rated`): it has a rate window
        to pass and no fair group (a fair run waits in its group, and the pop takes its window
        all the same)."""
        limits = self.limits
        return self.group is None and limits is not None and limits.rate is not None

    @property
    def member(self) -> str:
        """The run in a ready, delayed or bell set: its id, then its limits when it has some."""
        if self.limits is None:
            return self.run_id
        limits = json.dumps(self.limits.as_list(), separators=(",", ":"))
        # A delayed member is `<member>|<priority>[|<group>]`: no `|` may be in the member's
        # own text, and JSON may spell any character as an escape.
        return self.run_id + LIMITED + limits.replace("|", "\\u007c")

    def held(self) -> str:
        """The entry as a member of its template's held runs or of a lock's waiters: ready (no
        `notBefore`), its id first, so that members of one priority sort by age."""
        limits = self.limits.as_list() if self.limits else None
        parts = [self.run_id, self.priority, self.queue, self.handler, self.group, limits]
        return json.dumps(parts, separators=(",", ":"))

    @classmethod
    def unheld(cls, member: str) -> "QueueEntry":
        run_id, priority, queue, handler, group, limits = json.loads(member)
        started = StartLimits.from_list(limits) if limits else None
        return cls(run_id, queue, priority, None, handler, group, started)


# What separates a run's id from its limits in a member (no run id holds it).
LIMITED = "+"


def run_of(member: str) -> tuple[str, StartLimits | None]:
    """A ready set's member as the run id and its limits."""
    run_id, _, limits = member.partition(LIMITED)
    return run_id, StartLimits.from_list(json.loads(limits)) if limits else None
