"""How many runs of one dedupe key may be active, and what a run meets when all are.

A key has `concurrencyLimit` places (1 unless the template says more). A run holds one from
its creation, or from its admission, to its end; MongoDB's unique index on (scope, scope id,
key, place) decides every race for a place, so no Redis state can let more runs of a key be
active than it has places. When every place is held, the template's policy decides:

- `reject_same_scope` refuses the new run (409 `ConcurrencyConflict`, naming the oldest
  holder);
- `queue_same_scope` (and a schedule's `overlapPolicy: queue`) keeps it `pending` until a
  place frees up, the oldest waiting run first;
- `cancel_previous` ("latest wins") keeps it `pending` too, and asks the older runs beyond the
  limit to stop: of a key's active runs only the newest `concurrencyLimit` go on.
"""

from collections.abc import Sequence
from typing import Literal

from jobplane.model import Run, RunStatus, Template, WaitingFor

KeyFull = Literal["refuse", "wait", "displace"]


def when_full(template: Template, queue_behind: bool) -> KeyFull:
    """What a new run does when every place of its key is held."""
    if queue_behind or template.concurrency_policy == "queue_same_scope":
        return "wait"
    if template.concurrency_policy == "cancel_previous":
        return "displace"
    # `reject_same_scope`, and a template that is not repeatable under `allow`: its key is
    # held from creation to success so that two runs of it cannot both succeed.
    return "refuse"


def places(template: Template, queue_behind: bool) -> int:
    """How many runs of the new run's key may be active at once. A schedule's runs queued
    behind each other hold its key one at a time."""
    return 1 if queue_behind else template.concurrency_limit


def displaced(active: Sequence[Run], limit: int) -> list[Run]:
    """Of a key's active runs (oldest first), those `cancel_previous` stops: every one but the
    newest `limit`, oldest first. A run asked to stop already is on its way out and neither
    counts among the newest nor is asked again."""
    going_on = [r for r in active if r.status != RunStatus.CANCEL_REQUESTED]
    return going_on[: max(0, len(going_on) - limit)]


def displaced_reason(newest: str) -> str:
    return f"displaced by run {newest} (concurrencyPolicy cancel_previous)"


def waiting_for(run: Run) -> WaitingFor | None:
    """A run kept `pending` until a place of its key frees up says which key."""
    if run.dedupe_wait is None:
        return None
    return WaitingFor(reason="concurrency", detail=run.dedupe_wait)
