"""Handlers of the "CPU" workers of a mixed fleet (`JOBPLANE_HANDLERS` of a worker process)."""

from typing import Any

from jobplane.worker import StepContext, handler


@handler("fleet.prepare")
async def prepare(ctx: StepContext) -> dict[str, Any]:
    return {"preparedBy": "cpu"}
