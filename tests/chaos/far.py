"""The handler only some chaos workers offer (`JOBPLANE_HANDLERS`): a run held by a worker
without it lends the step to one with it (docs/architecture.md, "Lent steps")."""

from typing import Any

from jobplane.worker import StepContext, handler
from tests.chaos.steps import nap


@handler("chaos.far")
async def far(ctx: StepContext) -> dict[str, Any]:
    return await nap(ctx)
