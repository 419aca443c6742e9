"""Prometheus metrics: this process's counters and the platform's state, read as it is scraped.

Not under /v1 and, like /healthz, open to anyone who can reach the API: scrapers rarely carry
keys, and the figures name templates and queues, never runs or payloads. Keep it off the
public side of the load balancer (operations.md).
"""

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from jobplane.metrics import read_state, render

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
)
async def metrics(request: Request) -> Response:
    state = request.app.state
    figures = await read_state(state.store, state.queue, state.settings.queues)
    return Response(render(figures), media_type=CONTENT_TYPE_LATEST)
