"""Creating (one or a batch), listing, reading, cancelling and rerunning runs."""

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Response
from pydantic import AfterValidator, Field, StrictInt, StrictStr

from jobplane.api import pages
from jobplane.api.deps import (
    RunReader,
    RunsDep,
    RunWriter,
    SettingsDep,
    StoreDep,
    WaitingDep,
)
from jobplane.api.errors import ERROR_RESPONSES, ErrorBody
from jobplane.api.pages import Cursor, Limit, Page
from jobplane.api.schema import RequestBody, ResponseBody
from jobplane.errors import JobplaneError, PayloadTooLarge
from jobplane.model import Event, Instant, Run, RunStatus, ScopeId, Version
from jobplane.model.storable import storable
from jobplane.runs import RunRequest
from jobplane.store import RunQuery

router = APIRouter(prefix="/v1/runs", tags=["runs"], responses=ERROR_RESPONSES)

# The most runs one `POST /v1/runs/batch` takes; its body has a size cap of its own
# (`JOBPLANE_MAX_BATCH_BYTES`, applied to BATCH_PATH by the app's `BodyLimit`).
MAX_BATCH = 1000
BATCH_PATH = "/v1/runs/batch"


class RunCreate(RequestBody):
    # Not a `Name`: a type no template has is looked up and not found (404). Only a string
    # that cannot even be sent to MongoDB (a lone surrogate) is refused.
    template_type: Annotated[StrictStr, AfterValidator(storable)]
    template_version: Version | None = None
    scope: Literal["user", "account", "system"]
    scope_id: ScopeId
    payload: dict[str, Any] = Field(default_factory=dict)
    priority: Annotated[StrictInt, Field(ge=-100, le=100)] | None = None
    delay_seconds: Annotated[float, Field(ge=0, le=366 * 86400)] | None = None
    not_before: Instant | None = None
    idempotency_key: Annotated[StrictStr, Field(min_length=1, max_length=200)] | None = None


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
    outcomes: list[tuple[Run, bool] | JobplaneError | None] = [None] * len(body.runs)
    accepted: list[int] = []
    requests: list[RunRequest] = []
    for i, item in enumerate(body.runs):
        try:
            caller.may_act_in(item.scope, item.scope_id)
            requests.append(run_request(item, settings.max_payload_bytes))
        except JobplaneError as error:
            outcomes[i] = error
            continue
        accepted.append(i)
    created = await runs.create_many(requests, caller.actor) if requests else []
    explained = iter(await waiting.explain([o[0] for o in created if isinstance(o, tuple)]))
    for i, outcome in zip(accepted, created, strict=True):
        outcomes[i] = (next(explained), outcome[1]) if isinstance(outcome, tuple) else outcome
    return BatchResult(items=[_batch_item(i, o) for i, o in enumerate(outcomes) if o is not None])


def run_request(body: RunCreate, max_payload_bytes: int) -> RunRequest:
    """The service's request for a valid body, unless its payload is over the size limit."""
    # `surrogatepass`: a string UTF-8 cannot encode is measured here and refused by the service.
    compact = json.dumps(body.payload, ensure_ascii=False, separators=(",", ":"))
    size = len(compact.encode(errors="surrogatepass"))
    if size > max_payload_bytes:
        raise PayloadTooLarge(
            f"payload is {size} bytes; the limit is {max_payload_bytes}",
            {"limit": max_payload_bytes, "size": size},
        )
    return RunRequest(**body.model_dump())


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
    limit: Limit = 50,
    cursor: Cursor = None,
) -> Page[Run]:
    """Runs, newest first. A user key lists only its own scopes."""
    if scope is not None and scope_id is not None:
        caller.may_act_in(scope, scope_id)
    before = pages.after_run(cursor) if cursor else None
    query = RunQuery(status, template_type, scope, scope_id, schedule_id, before)
    found = await store.list_runs(query, caller.within, limit + 1)
    more = len(found) > limit
    items = await waiting.explain(found[:limit])
    return Page(items=items, next_cursor=pages.run_cursor(items[-1].id) if more else None)


@router.get("/{run_id}", summary="Get a run", response_model=Run, response_model_by_alias=True)
async def get(run_id: str, runs: RunsDep, caller: RunReader, waiting: WaitingDep) -> Run:
    """The run; `waitingFor` says why, if it could start but does not."""
    [run] = await waiting.explain([caller.visible(await runs.get(run_id))])
    return run


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
    return await store.events_of(run.id)
