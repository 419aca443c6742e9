"""Creating, listing, reading, cancelling and rerunning runs."""

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Response
from pydantic import AfterValidator, Field, StrictInt, StrictStr

from jobplane.api import pages
from jobplane.api.deps import RunReader, RunsDep, RunWriter, SettingsDep, StoreDep
from jobplane.api.errors import ERROR_RESPONSES
from jobplane.api.pages import Cursor, Limit, Page
from jobplane.api.schema import RequestBody
from jobplane.errors import PayloadTooLarge
from jobplane.model import Event, Instant, Run, RunStatus, ScopeId, Version
from jobplane.model.storable import storable
from jobplane.runs import RunRequest
from jobplane.store import RunQuery

router = APIRouter(prefix="/v1/runs", tags=["runs"], responses=ERROR_RESPONSES)


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


class CancelBody(RequestBody):
    reason: Annotated[StrictStr, Field(max_length=1000)] | None = None


@router.post(
    "",
    status_code=201,
    response_model=Run,
    response_model_by_alias=True,
    responses={200: {"model": Run, "description": "a repeated idempotencyKey: the first run"}},
)
async def create(
    body: RunCreate, runs: RunsDep, caller: RunWriter, settings: SettingsDep, response: Response
) -> Run:
    """Create a run; a repeated `idempotencyKey` in the same scope returns the first with 200."""
    caller.may_act_in(body.scope, body.scope_id)
    # `surrogatepass`: a string UTF-8 cannot encode is measured here and refused by the service.
    compact = json.dumps(body.payload, ensure_ascii=False, separators=(",", ":"))
    size = len(compact.encode(errors="surrogatepass"))
    if size > settings.max_payload_bytes:
        raise PayloadTooLarge(
            f"payload is {size} bytes; the limit is {settings.max_payload_bytes}",
            {"limit": settings.max_payload_bytes, "size": size},
        )
    run, created = await runs.create(RunRequest(**body.model_dump()), caller.actor)
    if not created:
        response.status_code = 200
    return run


@router.get("", response_model=Page[Run], response_model_by_alias=True)
async def list_runs(
    store: StoreDep,
    caller: RunReader,
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
    items = found[:limit]
    return Page(items=items, next_cursor=pages.run_cursor(items[-1].id) if more else None)


@router.get("/{run_id}", response_model=Run, response_model_by_alias=True)
async def get(run_id: str, runs: RunsDep, caller: RunReader) -> Run:
    return caller.visible(await runs.get(run_id))


@router.post("/{run_id}/cancel", response_model=Run, response_model_by_alias=True)
async def cancel(
    run_id: str, runs: RunsDep, caller: RunWriter, body: CancelBody | None = None
) -> Run:
    """A pending or queued run is `cancelled` at once; a running one goes `cancel_requested`
    and its worker stops at its next checkpoint; a finished one is a 409."""
    caller.visible(await runs.get(run_id))
    return await runs.cancel(run_id, caller.actor, body.reason if body else None)


@router.post("/{run_id}/rerun", status_code=201, response_model=Run, response_model_by_alias=True)
async def rerun(run_id: str, runs: RunsDep, caller: RunWriter) -> Run:
    """A new run with the finished run's template version, scope and payload (`rerunOf`)."""
    caller.visible(await runs.get(run_id))
    return await runs.rerun(run_id, caller.actor)


@router.get("/{run_id}/events", response_model=list[Event], response_model_by_alias=True)
async def events(run_id: str, runs: RunsDep, store: StoreDep, caller: RunReader) -> list[Event]:
    """The run's whole trail, in the order MongoDB applied its writes."""
    run = caller.visible(await runs.get(run_id))
    return await store.events_of(run.id)
