"""Creating (one or a batch), listing, reading, cancelling and rerunning runs."""

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response
from pydantic import Field, StrictStr
from sse_starlette.sse import EventSourceResponse

from jobplane.api import live, pages
from jobplane.api.auth import Caller
from jobplane.api.deps import (
    RunReader,
    RunsDep,
    RunWriter,
    SettingsDep,
    StoreDep,
    WaitingDep,
)
from jobplane.api.errors import ERROR_RESPONSES, ErrorBody
from jobplane.api.pages import Cursor, Limit
from jobplane.errors import JobplaneError
from jobplane.model import Event, Run, RunStatus
from jobplane.model.answers import Page, ResponseBody
from jobplane.model.bodies import RequestBody
from jobplane.runs import RunRequest
from jobplane.runs.request import RunCreate, run_request
from jobplane.store import RunQuery

router = APIRouter(prefix="/v1/runs", tags=["runs"], responses=ERROR_RESPONSES)

# The most runs one `POST /v1/runs/batch` takes; its body has a size cap of its own
# (`JOBPLANE_MAX_BATCH_BYTES`, applied to BATCH_PATH by the app's `BodyLimit`).
MAX_BATCH = 1000
BATCH_PATH = "/v1/runs/batch"


class RunBatch(RequestBody):
    # A malformed item (a wrong type, an unknown field) refuses the whole request with 422 and
    # pointers `/runs/<i>/...`, as any body that breaks the document does: it is a bug in the
    # client, not data. Items are refused one by one only for what the service decides.
    runs: Annotated[list[RunCreate], Field(min_length=1, max_length=MAX_BATCH)]


class BatchCreated(ResponseBody):
    """201: a new run; 200: the first run of a repeated `idempotencyKey`."""

    status: Literal[200, 201]
    run: Run


class BatchRefused(ResponseBody):
    """The status and error a `POST /v1/runs` of this item alone would have been answered with;
    the error's pointers start with the item's, `/runs/<i>`."""

    status: Annotated[int, Field(ge=400, le=599)]
    error: ErrorBody


class BatchResult(ResponseBody):
    items: list[BatchCreated | BatchRefused]


class CancelBody(RequestBody):
    reason: Annotated[StrictStr, Field(max_length=1000)] | None = None


@router.post(
    "",
    summary="Create a run",
    status_code=201,
    response_model=Run,
    response_model_by_alias=True,
    responses={200: {"model": Run, "description": "a repeated idempotencyKey: the first run"}},
)
async def create(
    body: RunCreate,
    runs: RunsDep,
    caller: RunWriter,
    settings: SettingsDep,
    response: Response,
    waiting: WaitingDep,
) -> Run:
    """Create a run; a repeated `idempotencyKey` in the same scope returns the first with 200."""
    caller.may_act_in(body.scope, body.scope_id)
    run, created = await runs.create(run_request(body, settings.max_payload_bytes), caller.actor)
    if not created:
        response.status_code = 200
    [run] = await waiting.explain([run])
    return run


@router.post(
    "/batch",
    summary="Create up to 1,000 runs",
    response_model=BatchResult,
    response_model_by_alias=True,
)
async def create_batch(
    body: RunBatch, runs: RunsDep, caller: RunWriter, settings: SettingsDep, waiting: WaitingDep
) -> BatchResult:
    """Create up to 1,000 runs; `items` answers each in request order, as `POST /v1/runs` would
    have: `{status: 201|200, run}` or `{status: 4xx, error}`. One refused item (another scope,
    a payload too large or invalid, a disabled template) does not stop the others."""
    requests = [_item_request(item, caller, settings.max_payload_bytes) for item in body.runs]
    outcomes = await waiting.explain_created(await runs.create_many(requests, caller.actor))
    return BatchResult(items=[_batch_item(i, o) for i, o in enumerate(outcomes)])


def _item_request(
    item: RunCreate, caller: Caller, max_payload_bytes: int
) -> RunRequest | JobplaneError:
    """The service's request for a batch item, or why it is refused."""
    try:
        caller.may_act_in(item.scope, item.scope_id)
        return run_request(item, max_payload_bytes)
    except JobplaneError as error:
        return error


def _batch_item(
    index: int, outcome: tuple[Run, bool] | JobplaneError
) -> BatchCreated | BatchRefused:
    if not isinstance(outcome, JobplaneError):
        run, new = outcome
        return BatchCreated(status=201 if new else 200, run=run)
    details = dict(outcome.details)
    if isinstance(problems := details.get("errors"), list):
        # The service points into one run (`/payload/x`); the caller sent many.
        details["errors"] = [{**p, "pointer": f"/runs/{index}{p['pointer']}"} for p in problems]
    error = ErrorBody(code=outcome.code, message=outcome.message, details=details)
    return BatchRefused(status=outcome.status, error=error)


@router.get("", summary="List runs", response_model=Page[Run], response_model_by_alias=True)
async def list_runs(
    store: StoreDep,
    caller: RunReader,
    waiting: WaitingDep,
    status: RunStatus | None = None,
    template_type: Annotated[str | None, Query(alias="templateType")] = None,
    scope: Literal["user", "account", "system"] | None = None,
    scope_id: Annotated[str | None, Query(alias="scopeId")] = None,
    schedule_id: Annotated[str | None, Query(alias="scheduleId")] = None,
    parent_run_id: Annotated[str | None, Query(alias="parentRunId")] = None,
    limit: Limit = 50,
    cursor: Cursor = None,
) -> Page[Run]:
    """Runs, newest first. A user key lists only its own scopes."""
    if scope is not None and scope_id is not None:
        caller.may_act_in(scope, scope_id)
    query = RunQuery(status, template_type, scope, scope_id, schedule_id, parent_run_id, cursor)
    found = await store.runs.page(query, caller.within, limit + 1)
    explained = await waiting.explain(found[:limit])
    return pages.newest_first([*explained, *found[limit:]], limit)


@router.get("/{run_id}", summary="Get a run", response_model=Run, response_model_by_alias=True)
async def get(run_id: str, runs: RunsDep, caller: RunReader, waiting: WaitingDep) -> Run:
    """The run; `waitingFor` says why, if it could start but does not."""
    [run] = await waiting.explain([caller.visible(await runs.get(run_id))])
    return run


@router.get(
    "/{run_id}/stream",
    summary="Stream a run's changes (Server-Sent Events)",
    response_class=EventSourceResponse,
    responses={
        200: {"content": {"text/event-stream": live.SSE_SCHEMA}, "description": "an SSE stream"}
    },
)
async def stream(
    run_id: str, runs: RunsDep, caller: RunReader, store: StoreDep, request: Request
) -> EventSourceResponse:
    """The run as `GET /v1/runs/{id}` shows it (event `run`, `id` its version), now and after
    each change (status, step, progress); the stream ends after a terminal status. Comments
    keep it alive."""
    run = caller.visible(await runs.get(run_id))
    state = request.app.state
    changes = live.run_changes(run, store, state.run_changes, state.waiting, state.stop)
    return EventSourceResponse(changes, ping=live.KEEP_ALIVE_SECONDS)


@router.post(
    "/{run_id}/cancel", summary="Cancel a run", response_model=Run, response_model_by_alias=True
)
async def cancel(
    run_id: str, runs: RunsDep, caller: RunWriter, body: CancelBody | None = None
) -> Run:
    """A pending or queued run is `cancelled` at once; a running one goes `cancel_requested`
    and its worker stops at its next checkpoint; a finished one is a 409."""
    caller.visible(await runs.get(run_id))
    return await runs.cancel(run_id, caller.actor, body.reason if body else None)


@router.post(
    "/{run_id}/rerun",
    summary="Rerun a finished run",
    status_code=201,
    response_model=Run,
    response_model_by_alias=True,
)
async def rerun(run_id: str, runs: RunsDep, caller: RunWriter, waiting: WaitingDep) -> Run:
    """A new run with the finished run's template version, scope and payload (`rerunOf`)."""
    caller.visible(await runs.get(run_id))
    [run] = await waiting.explain([await runs.rerun(run_id, caller.actor)])
    return run


@router.get(
    "/{run_id}/events",
    summary="A run's events",
    response_model=list[Event],
    response_model_by_alias=True,
)
async def events(run_id: str, runs: RunsDep, store: StoreDep, caller: RunReader) -> list[Event]:
    """The run's whole trail, in the order MongoDB applied its writes."""
    run = caller.visible(await runs.get(run_id))
    return await store.trail.events_of(run.id)
