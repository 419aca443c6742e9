"""A map step as its run's worker carries it out: its children made from its items, then its
output from their ends.

The first time the step is ready it makes one child run per item in one batch
(`RunService.create_children`) and writes itself `waiting` with their number; the walk goes
on with the other steps, and the run waits for its children once nothing else is left
(`wait_children`). When they end the run is queued again, and the step, ready again, reads
their ends instead of making any (`runs/children.py` decides what they make of it).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jobplane.errors import JobplaneError
from jobplane.model import MAX_MAP_ITEMS, MapSpec
from jobplane.runs import children
from jobplane.runs.lifecycle import HeldStep, StepStart
from jobplane.runs.service import RunService, validate_payload
from jobplane.store import Lost, Store
from jobplane.templates.expressions import ExpressionError, evaluate_items, evaluate_payload
from jobplane.worker.context import FatalError


class MapFailed(FatalError):
    """The map step failed for good: its children are not retried as a whole (each has its
    own retries), so neither is the step."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ChildrenActive(Exception):
    """The step's children have not all ended: it waits for them."""


@dataclass(frozen=True)
class Fanout:
    store: Store
    service: RunService
    # Stops the run when a write was lost (the runner's).
    check: Callable[[Lost | None], None]

    async def run(
        self, at: HeldStep, start: StepStart, activation: dict[str, Any], made: int | None
    ) -> Any:
        """The step's output once its children ended; `ChildrenActive` while they run,
        `MapFailed` when it fails. `made`: how many children it made already (None: none
        yet)."""
        spec = at.template.steps[at.index].map
        assert spec is not None, "a map step has `map` (registration)"
        if made is None:
            made = await self._make(at, start, spec, activation)
            if made == 0:
                return []
            raise ChildrenActive
        ends = await self.store.children.ends(at.run, at.id)
        outcome = children.fan_in(spec, made, ends)
        if outcome is None:
            raise ChildrenActive
        if outcome.failed is not None:
            message = children.failure_message(outcome.failed)
            await self.service.lifecycle.cancel_children(
                at.run, at.lease.actor, f"a sibling failed: {message}", at.id
            )
            raise MapFailed("ChildFailed", message)
        return outcome.output

    async def _make(
        self, at: HeldStep, start: StepStart, spec: MapSpec, activation: dict[str, Any]
    ) -> int:
        """Make the step's children and write it waiting; how many it made."""
        try:
            items = evaluate_items(spec.items, activation)
        except ExpressionError as exc:
            raise MapFailed("MapError", f"items: {exc}") from None
        if len(items) > MAX_MAP_ITEMS:
            raise MapFailed(
                "MapTooLarge", f"items gave {len(items)} items; at most {MAX_MAP_ITEMS} may map"
            )
        if not items:
            return 0
        template = await self.store.templates.cached(spec.template)
        if template is None or not template.enabled:
            state = "not found" if template is None else "disabled"
            raise MapFailed("MapError", f"template {spec.template!r} {state}")
        payloads = [self._payload(spec, activation, i, item) for i, item in enumerate(items)]
        for i, payload in enumerate(payloads):
            try:
                validate_payload(template, payload)
            except JobplaneError as exc:
                raise MapFailed("MapError", f"item {i}: {exc}") from None
        refused = await self.service.create_children(
            at.run, at.id, template, payloads, spec.max_concurrency, at.lease.actor
        )
        if refused:
            # Those made stop with the step: a map step's children are all or none.
            await self.service.lifecycle.cancel_children(
                at.run, at.lease.actor, f"step {at.id!r} could not make all its children", at.id
            )
            raise MapFailed("MapError", f"{len(refused)} children refused: {refused[0]}")
        self.check(await self.service.lifecycle.wait_step(at, start, len(payloads)))
        return len(payloads)

    @staticmethod
    def _payload(spec: MapSpec, activation: dict[str, Any], index: int, item: Any) -> Any:
        if spec.payload is None:
            if not isinstance(item, dict):
                raise MapFailed(
                    "MapError",
                    f"item {index} is {type(item).__name__}, not an object: give the map a "
                    "`payload` to make one",
                )
            return item
        seen = {
            "item": item,
            "index": index,
            "payload": activation["payload"],
            "outputs": activation["outputs"],
        }
        try:
            return evaluate_payload(spec.payload, seen)
        except ExpressionError as exc:
            raise MapFailed("MapError", f"payload of item {index}: {exc}") from None
