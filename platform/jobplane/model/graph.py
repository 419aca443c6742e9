"""The graph of a template's steps: which steps each one needs, and what may run next.

A step's `needs` names the steps that must end before it starts; omitted, it is the step
before it in the list (none for the first), so a template written as a line is a line. A step
is ready once each step it needs has succeeded or been skipped. A step that fails for good
with `onFailure: continue` skips every step that depends on it, however far down: each of them
has a need that can no longer be met.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from jobplane.model.status import StepStatus

# A need is met by a step that ended one of these ways.
MET: frozenset[StepStatus] = frozenset({StepStatus.SUCCEEDED, StepStatus.SKIPPED})
# A step in one of these will not be run again in this run.
ENDED: frozenset[StepStatus] = frozenset(
    {StepStatus.SUCCEEDED, StepStatus.SKIPPED, StepStatus.CANCELLED}
)


class GraphError(ValueError):
    """A template's `needs` that make no graph: each problem with the JSON pointer to it."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(message for _, message in problems))
        self.problems = problems


@dataclass(frozen=True)
class Graph:
    """Step ids in template order, and for each step the indexes of the steps it needs."""

    ids: tuple[str, ...]
    needs: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, steps: Sequence[tuple[str, Sequence[str] | None]]) -> "Graph":
        """The graph of `(id, needs)` pairs in template order; `GraphError` if the needs name
        unknown steps, the step itself, or a cycle."""
        ids = tuple(step_id for step_id, _ in steps)
        index = {step_id: i for i, step_id in enumerate(ids)}
        problems: list[tuple[str, str]] = []
        needs: list[tuple[int, ...]] = []
        for i, (step_id, named) in enumerate(steps):
            if named is None:
                needs.append((i - 1,) if i else ())
                continue
            found: list[int] = []
            for j, need in enumerate(named):
                pointer = f"/steps/{i}/needs/{j}"
                if need == step_id:
                    problems.append((pointer, f"step {step_id!r} needs itself"))
                elif need not in index:
                    problems.append((pointer, f"step {step_id!r} needs {need!r}, no such step"))
                elif index[need] not in found:
                    found.append(index[need])
            needs.append(tuple(found))
        graph = cls(ids, tuple(needs))
        if not problems and (cycle := graph._cycle()):
            # Start at a step whose needs were written (a cycle has one), to point at them.
            first = next(k for k, i in enumerate(cycle) if steps[i][1] is not None)
            cycle = cycle[first:] + cycle[:first]
            names = " → ".join(ids[i] for i in [*cycle, cycle[0]])
            message = f"the steps' needs make a cycle: {names} (each needs the next)"
            problems.append((f"/steps/{cycle[0]}/needs", message))
        if problems:
            raise GraphError(problems)
        return graph

    @cached_property
    def linear(self) -> bool:
        """Each step needs exactly the one before it: the line every template used to be."""
        return all(need == ((i - 1,) if i else ()) for i, need in enumerate(self.needs))

    @cached_property
    def layers(self) -> tuple[tuple[str, ...], ...]:
        """The steps by depth: the first layer needs nothing, each next one needs only steps
        of layers above it."""
        depth: dict[int, int] = {}
        for i in self._order():
            depth[i] = 1 + max((depth[n] for n in self.needs[i]), default=-1)
        rows: list[list[str]] = [[] for _ in range(1 + max(depth.values(), default=-1))]
        for i, step_id in enumerate(self.ids):
            rows[depth[i]].append(step_id)
        return tuple(tuple(row) for row in rows)

    def ready(self, statuses: Sequence[StepStatus]) -> list[int]:
        """The pending steps whose every need is met, in template order."""
        return [
            i
            for i, status in enumerate(statuses)
            if status == StepStatus.PENDING and all(statuses[n] in MET for n in self.needs[i])
        ]

    def dependents(self, index: int) -> list[int]:
        """Every step that needs `index`, directly or through others, in template order."""
        below: set[int] = set()
        for i in self._order():
            if any(n == index or n in below for n in self.needs[i]):
                below.add(i)
        return sorted(below)

    def _order(self) -> list[int]:
        """The steps in an order where each comes after every step it needs (Kahn's)."""
        waiting = [len(needs) for needs in self.needs]
        needed_by: list[list[int]] = [[] for _ in self.ids]
        for i, needs in enumerate(self.needs):
            for n in needs:
                needed_by[n].append(i)
        order = [i for i, count in enumerate(waiting) if count == 0]
        for i in order:  # grows as it goes
            for j in needed_by[i]:
                waiting[j] -= 1
                if waiting[j] == 0:
                    order.append(j)
        return order

    def _cycle(self) -> list[int] | None:
        """The steps of one cycle, each needing the next (the last needs the first), if any."""
        if len(self._order()) == len(self.ids):
            return None
        # Every step off the order is on a cycle or needs one: walking needs among them from
        # any of them must come back to a step already walked.
        stuck = set(range(len(self.ids))) - set(self._order())
        walk = [min(stuck)]
        while True:
            step = next(n for n in self.needs[walk[-1]] if n in stuck)
            if step in walk:
                return walk[walk.index(step) :]
            walk.append(step)
