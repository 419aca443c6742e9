"""The branch handler only the first worker of the lent-steps tests offers
(`JOBPLANE_HANDLERS`); `branch_two` holds the second's."""

import asyncio
import os
from pathlib import Path
from typing import Any

from jobplane.worker import FatalError, StepContext


async def b(ctx: StepContext) -> dict[str, Any]:
    return await _branch(ctx, "b")


async def _branch(ctx: StepContext, step: str) -> dict[str, Any]:
    """With `payload[step].meet` ({dir, with}), say it started (a file named after the step in
    `dir`) and wait until step `with` has said so too: two branches that meet ran at once,
    however slowly their workers came. Then sleep `payload[step].sleep` seconds (a list: by the
    run's attempt), looking for a cancel every 50 ms, then fail for good if
    `payload[step].fail` says so; answers which worker ran it."""
    asked = ctx.run.payload.get(step, {})
    if meet := asked.get("meet"):
        await asyncio.to_thread(Path(meet["dir"], step).touch)
        while not await asyncio.to_thread(Path(meet["dir"], meet["with"]).exists):
            ctx.checkpoint()
            await asyncio.sleep(0.05)
    sleep = asked.get("sleep", 0)
    if isinstance(sleep, list):
        sleep = sleep[min(ctx.run.attempt, len(sleep)) - 1]
    loop = asyncio.get_running_loop()
    until = loop.time() + sleep
    while loop.time() < until:
        ctx.checkpoint()
        await asyncio.sleep(0.05)
    if asked.get("fail"):
        raise FatalError(f"{step} failed as asked")
    return {"ranBy": os.environ["JOBPLANE_WORKER_ID"]}
