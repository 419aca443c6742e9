"""The branch handler only the second worker of the lent-steps tests offers."""

from typing import Any

from jobplane.worker import StepContext
from tests.integration.branch_one import _branch


async def c(ctx: StepContext) -> dict[str, Any]:
    return await _branch(ctx, "c")
