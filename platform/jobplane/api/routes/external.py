"""External workers: claim a step waiting for them, heartbeat, complete or fail it."""

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Request, Response
from pydantic import Field, StrictBool, StrictStr

from jobplane.api.deps import ExternalWorker, SettingsDep
from jobplane.api.errors import ERROR_RESPONSES
from jobplane.model import Run, RunStatus, Template
from jobplane.model.answers import ResponseBody
from jobplane.model.bodies import RequestBody
from jobplane.model.documents import Name
from jobplane.model.storable import Storable
from jobplane.runs.external import ExternalSteps
from jobplane.store import Lease

router = APIRouter(tags=["external workers"], responses=ERROR_RESPONSES)


class ClaimBody(RequestBody):
    worker_id: Name
    # Long poll: how long to wait for a step when none is waiting now.
    wait_seconds: Annotated[float, Field(ge=0, le=60)] = 20


class Claimed(ResponseBody):
    run_id: str
    step_id: str
    lease_token: str
    locked_until: datetime
    # Everything the step needs: the run (payload, earlier outputs, attempt) and its template.
    run: Run
    template: Template


class LeaseBody(RequestBody):
    worker_id: Name
    lease_token: Annotated[StrictStr, Field(min_length=1, max_length=100)]


class HeartbeatBody(LeaseBody):
    percentage: Annotated[float, Field(ge=0, le=100)] | None = None
    message: Annotated[StrictStr, Field(max_length=1000)] | None = None


class Beat(ResponseBody):
    cancel_requested: bool
    locked_until: datetime | None


class CompleteBody(LeaseBody):
    output: Storable = None


class FailBody(LeaseBody):
    message: Annotated[StrictStr, Field(min_length=1, max_length=10_000)]
    code: Name = "external_error"
    retryable: StrictBool = True


def _steps(request: Request, settings: SettingsDep) -> ExternalSteps:
    app = request.app.state
    return ExternalSteps(app.store, app.queue, settings.lease_seconds)


@router.post(
    "/v1/external/{worker_type}/claim",
    summary="Claim a step waiting for an external worker",
    response_model=Claimed,
    response_model_by_alias=True,
    responses={204: {"description": "no step was waiting within `waitSeconds`"}},
)
async def claim(
    worker_type: str,
    body: ClaimBody,
    request: Request,
    settings: SettingsDep,
    caller: ExternalWorker,
) -> Claimed | Response:
    """Claim the oldest step waiting for a `worker_type` worker, under a new lease; waits up
    to `waitSeconds` for one. Keep the lease with heartbeats (every third of the lease)."""
    steps = _steps(request, settings)
    found = await steps.claim(
        worker_type, body.worker_id, body.wait_seconds, request.is_disconnected
    )
    if found is None:
        return Response(status_code=204)
    return Claimed(
        run_id=found.run.id,
        step_id=found.template.steps[found.step_index].id,
        lease_token=found.lease.token,
        locked_until=found.locked_until,
        run=found.run,
        template=found.template,
    )


@router.post(
    "/v1/runs/{run_id}/steps/{step_id}/heartbeat",
    summary="Renew an external step's lease and report progress",
    response_model=Beat,
)
async def heartbeat(
    run_id: str,
    step_id: str,
    body: HeartbeatBody,
    request: Request,
    settings: SettingsDep,
    caller: ExternalWorker,
) -> Beat:
    """Renew the lease and report progress. `cancelRequested: true` asks the worker to stop
    and report with `fail` (or `complete`): either is then answered 409 and the run ends
    `cancelled`."""
    lease = Lease(run_id, body.worker_id, body.lease_token)
    run = await _steps(request, settings).heartbeat(lease, step_id, body.percentage, body.message)
    cancel = run.status == RunStatus.CANCEL_REQUESTED
    return Beat(cancel_requested=cancel, locked_until=run.locked_until)


@router.post(
    "/v1/runs/{run_id}/steps/{step_id}/complete",
    summary="Complete an external step",
    response_model=Run,
    response_model_by_alias=True,
)
async def complete(
    run_id: str,
    step_id: str,
    body: CompleteBody,
    request: Request,
    settings: SettingsDep,
    caller: ExternalWorker,
) -> Run:
    """The step succeeded with `output`. The run goes on with its next step on an inline
    worker, or ends `succeeded` if this was the last."""
    lease = Lease(run_id, body.worker_id, body.lease_token)
    return await _steps(request, settings).complete(lease, step_id, body.output)


@router.post(
    "/v1/runs/{run_id}/steps/{step_id}/fail",
    summary="Fail an external step",
    response_model=Run,
    response_model_by_alias=True,
)
async def fail(
    run_id: str,
    step_id: str,
    body: FailBody,
    request: Request,
    settings: SettingsDep,
    caller: ExternalWorker,
) -> Run:
    """The step failed: retried after backoff while `retryable` and attempts remain."""
    lease = Lease(run_id, body.worker_id, body.lease_token)
    steps = _steps(request, settings)
    return await steps.fail(lease, step_id, body.code, body.message, body.retryable)
