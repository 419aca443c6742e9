"""Handlers of the lock tests' worker processes (`JOBPLANE_HANDLERS` of a worker process)."""

import asyncio
import time
from typing import Any

from jobplane.worker import StepContext, handler


@handler("locks.hold")
async def hold(ctx: StepContext) -> dict[str, Any]:
    """Holds the step's locks for `payload.seconds`; returns the token it held them under."""
    token = ctx.lock_token
    await asyncio.sleep(float(ctx.payload.get("seconds", 0.1)))
    return {"token": token, "tokens": ctx.lock_tokens}


@handler("locks.take")
async def take(ctx: StepContext) -> dict[str, Any]:
    """Takes the lock `partner-api` (keyed by `payload.partner`) itself, for `payload.seconds`;
    returns its token and when it held it (epoch seconds)."""
    async with ctx.lock("partner-api", key=ctx.payload.get("partner"), wait_seconds=30) as token:
        assert ctx.lock_token == token
        began = time.time()
        await asyncio.sleep(float(ctx.payload.get("seconds", 0.1)))
        ended = time.time()
    return {"token": token, "began": began, "ended": ended}
