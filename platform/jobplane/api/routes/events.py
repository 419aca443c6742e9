"""The audit trail: events across runs, by run, scope, type, actor and time."""

from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Request
from sse_starlette.sse import EventSourceResponse

from jobplane.api import live, pages
from jobplane.api.deps import EventReader, StoreDep
from jobplane.api.errors import ERROR_RESPONSES
from jobplane.api.pages import EventCursor, Limit
from jobplane.model import Event, Instant
from jobplane.model.answers import Page
from jobplane.store import EventQuery

router = APIRouter(prefix="/v1/events", tags=["events"], responses=ERROR_RESPONSES)


@router.get(
    "", summary="Search the audit trail", response_model=Page[Event], response_model_by_alias=True
)
async def search(
    store: StoreDep,
    caller: EventReader,
    job_id: Annotated[str | None, Query(alias="jobId")] = None,
    type_: Annotated[str | None, Query(alias="type")] = None,
    scope: Literal["user", "account", "system"] | None = None,
    scope_id: Annotated[str | None, Query(alias="scopeId")] = None,
    actor: str | None = None,
    since: Annotated[Instant | None, Query(alias="from")] = None,
    until: Annotated[Instant | None, Query(alias="to")] = None,
    limit: Limit = 100,
    cursor: EventCursor = None,
) -> Page[Event]:
    """Events in time order (`from` inclusive, `to` exclusive). A user key sees only events
    of its own scopes. Events reach this trail within milliseconds of their write (a run's
    own trail, `GET /v1/runs/{id}/events`, has them at once)."""
    if scope is not None and scope_id is not None:
        caller.may_act_in(scope, scope_id)
    after = pages.after_event(cursor) if cursor else None
    query = EventQuery(job_id, type_, scope, scope_id, actor, since, until, after)
    found = await store.trail.page(query, caller.within, limit + 1)
    more = len(found) > limit
    items = found[:limit]
    last = items[-1] if more else None
    next_cursor = pages.event_cursor(last.create_at, last.id) if last else None
    return Page(items=items, next_cursor=next_cursor)


@router.get(
    "/stream",
    summary="Stream new trail entries (Server-Sent Events)",
    response_class=EventSourceResponse,
    responses={
        200: {"content": {"text/event-stream": live.SSE_SCHEMA}, "description": "an SSE stream"}
    },
)
async def stream(
    store: StoreDep,
    caller: EventReader,
    request: Request,
    job_id: Annotated[str | None, Query(alias="jobId")] = None,
    type_: Annotated[str | None, Query(alias="type")] = None,
    scope: Literal["user", "account", "system"] | None = None,
    scope_id: Annotated[str | None, Query(alias="scopeId")] = None,
    actor: str | None = None,
    last_event_id: Annotated[str | None, Header(max_length=2000, pattern="^[0-9A-Fa-f]+$")] = None,
) -> EventSourceResponse:
    """Entries as they reach the trail (event `event`), under the filters and scope rules of
    `GET /v1/events`. Each `id` is a position in the trail: reconnecting with it as
    `Last-Event-ID` sends every entry after it, those written meanwhile included, as far back
    as MongoDB's oplog reaches (409 beyond). Comments keep it alive."""
    if scope is not None and scope_id is not None:
        caller.may_act_in(scope, scope_id)
    query = EventQuery(job_id, type_, scope, scope_id, actor)
    opened = await live.open_trail(store, query, caller.within, last_event_id)
    entries = live.trail_changes(store, query, caller.within, opened, request.app.state.stop)
    return EventSourceResponse(entries, ping=live.KEEP_ALIVE_SECONDS)
