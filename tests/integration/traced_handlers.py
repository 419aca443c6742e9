"""Handlers of the trace test's worker processes (`JOBPLANE_HANDLERS` of a worker process): a
step that makes an HTTP call of its own, traced by OpenTelemetry's httpx instrumentation, and
a step whose first attempt lasts until the test kills its worker."""

import asyncio
from typing import Any

import httpx
from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

from jobplane.worker import StepContext, handler


@handler("traced.call")
async def call(ctx: StepContext) -> dict[str, Any]:
    """GETs `payload.url` with an instrumented client: its CLIENT span is the handler's own,
    which should nest under the step's span."""
    async with httpx.AsyncClient() as client:
        # This client only, not httpx everywhere: the worker's own calls are none of the test's.
        HTTPXClientInstrumentor.instrument_client(client)
        answer = await client.get(ctx.payload["url"])
    return {"status": answer.status_code}


@handler("traced.hang_first")
async def hang_first(ctx: StepContext) -> dict[str, Any]:
    """The first attempt never ends by itself: the test kills the worker running it, and a
    later attempt, on another worker, succeeds."""
    if ctx.attempt == 1:
        await asyncio.sleep(3600)
    return {"attempt": ctx.attempt}
