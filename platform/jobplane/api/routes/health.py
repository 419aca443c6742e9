"""Liveness and readiness."""

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from jobplane.model.answers import ResponseBody

router = APIRouter(tags=["health"])


class Health(ResponseBody):
    status: Literal["ok"]


class Readiness(ResponseBody):
    """`ok` per backend, or `error: <why>` for one that did not answer."""

    status: Literal["ok", "unavailable"]
    mongodb: str
    redis: str


@router.get("/healthz", summary="Liveness: the API process is up", response_model=Health)
async def healthz() -> Health:
    return Health(status="ok")


@router.get(
    "/readyz",
    summary="Readiness: MongoDB and Redis answer",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "MongoDB or Redis did not answer"}},
)
async def readyz(request: Request) -> JSONResponse:
    """Ready when both MongoDB and Redis answer."""
    checks: dict[str, str] = {}
    try:
        await request.app.state.store.ping()
        checks["mongodb"] = "ok"
    except Exception as exc:
        checks["mongodb"] = f"error: {exc}"
    try:
        await request.app.state.queue.ping()
        checks["redis"] = "ok"
    except Exception as exc:
        checks["redis"] = f"error: {exc}"
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse({"status": "ok" if ok else "unavailable", **checks}, 200 if ok else 503)
