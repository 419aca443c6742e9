"""Handlers of the "GPU" workers of a mixed fleet (`JOBPLANE_HANDLERS` of a worker process)."""

from typing import Any

from jobplane.worker import StepContext


async def render(ctx: StepContext) -> dict[str, Any]:
    """Offered by its `module:function` name, as a loaded module's function."""
    return {"renderedBy": "gpu", "prepared": ctx.outputs.get("prepare")}
