"""Schedules: create, read, change, delete, pause, resume, trigger and preview."""

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Query, Request, Response

from jobplane.api import pages
from jobplane.api.deps import ScheduleReader, ScheduleWriter, StoreDep
from jobplane.api.errors import ERROR_RESPONSES
from jobplane.api.pages import Cursor, Limit
from jobplane.api.schema import inline_schema
from jobplane.model import Instant, Run, Schedule, ScheduleSpec
from jobplane.model.answers import FireTime, Page, Preview
from jobplane.schedules import ScheduleService
from jobplane.schedules.cron import Cron
from jobplane.store import ScheduleQuery

router = APIRouter(prefix="/v1/schedules", tags=["schedules"], responses=ERROR_RESPONSES)


def _service(request: Request) -> ScheduleService:
    return ScheduleService(request.app.state.store, request.app.state.queue)


@router.post(
    "",
    summary="Create a schedule",
    status_code=201,
    response_model=Schedule,
    response_model_by_alias=True,
)
async def create(body: ScheduleSpec, request: Request, caller: ScheduleWriter) -> Schedule:
    """Cron (5 fields, 6 with seconds last, or `@daily`-style) in the schedule's IANA
    `timezone`. Everything a fire needs is checked now (422), never at fire time."""
    caller.may_act_in(body.scope, body.scope_id)
    return await _service(request).create(body, caller.actor)


@router.get(
    "", summary="List schedules", response_model=Page[Schedule], response_model_by_alias=True
)
async def list_schedules(
    store: StoreDep,
    caller: ScheduleReader,
    template_type: Annotated[str | None, Query(alias="templateType")] = None,
    scope: Literal["user", "account", "system"] | None = None,
    scope_id: Annotated[str | None, Query(alias="scopeId")] = None,
    enabled: bool | None = None,
    limit: Limit = 50,
    cursor: Cursor = None,
) -> Page[Schedule]:
    if scope is not None and scope_id is not None:
        caller.may_act_in(scope, scope_id)
    query = ScheduleQuery(template_type, scope, scope_id, enabled, cursor)
    return pages.newest_first(await store.schedules.page(query, caller.within, limit + 1), limit)


@router.get(
    "/{schedule_id}",
    summary="Get a schedule",
    response_model=Schedule,
    response_model_by_alias=True,
)
async def get(schedule_id: str, request: Request, caller: ScheduleReader) -> Schedule:
    return caller.sees_schedule(await _service(request).get(schedule_id))


# The fields of a create, each optional: the service checks the schedule they make.
_CHANGE = {k: v for k, v in inline_schema(ScheduleSpec).items() if k != "required"}


@router.patch(
    "/{schedule_id}",
    summary="Change a schedule",
    response_model=Schedule,
    response_model_by_alias=True,
    openapi_extra={"requestBody": {"content": {"application/json": {"schema": _CHANGE}}}},
)
async def change(
    schedule_id: str,
    request: Request,
    caller: ScheduleWriter,
    changes: Annotated[dict[str, Any], Body()],
) -> Schedule:
    """Change any field of the schedule (camelCase, as at create) but its scope (422: one run
    per fire time is kept within a scope); `nextRunAt` is computed again from now."""
    service = _service(request)
    caller.sees_schedule(await service.get(schedule_id))
    if "scope" in changes or "scopeId" in changes:
        current = await service.get(schedule_id)
        caller.may_act_in(
            str(changes.get("scope", current.scope)), str(changes.get("scopeId", current.scope_id))
        )
    return await service.update(schedule_id, changes)


@router.delete("/{schedule_id}", summary="Delete a schedule", status_code=204)
async def delete(schedule_id: str, request: Request, caller: ScheduleWriter) -> Response:
    service = _service(request)
    caller.sees_schedule(await service.get(schedule_id))
    await service.delete(schedule_id)
    return Response(status_code=204)


@router.post(
    "/{schedule_id}/pause",
    summary="Pause a schedule",
    response_model=Schedule,
    response_model_by_alias=True,
)
async def pause(schedule_id: str, request: Request, caller: ScheduleWriter) -> Schedule:
    service = _service(request)
    caller.sees_schedule(await service.get(schedule_id))
    return await service.update(schedule_id, {"enabled": False})


@router.post(
    "/{schedule_id}/resume",
    summary="Resume a schedule",
    response_model=Schedule,
    response_model_by_alias=True,
)
async def resume(schedule_id: str, request: Request, caller: ScheduleWriter) -> Schedule:
    service = _service(request)
    caller.sees_schedule(await service.get(schedule_id))
    return await service.update(schedule_id, {"enabled": True})


@router.post(
    "/{schedule_id}/trigger",
    summary="Trigger a schedule now",
    status_code=201,
    response_model=Run,
    response_model_by_alias=True,
)
async def trigger(schedule_id: str, request: Request, caller: ScheduleWriter) -> Run:
    """A run now, with the schedule's payload template (`scheduledFor` is now)."""
    service = _service(request)
    caller.sees_schedule(await service.get(schedule_id))
    return await service.trigger(schedule_id, caller.actor)


@router.get(
    "/{schedule_id}/preview",
    summary="Preview a schedule's next fire times",
    response_model=Preview,
    response_model_by_alias=True,
)
async def preview(
    schedule_id: str,
    request: Request,
    caller: ScheduleReader,
    count: Annotated[int, Query(ge=1, le=100)] = 10,
    after: Instant | None = None,
) -> Preview:
    """The next `count` fire times (after `after`, default now), in UTC and in the
    schedule's zone."""
    service = _service(request)
    schedule = caller.sees_schedule(await service.get(schedule_id))
    cron = Cron.parse(schedule.cron, schedule.timezone)
    times = cron.upcoming(after or service.store.clock.now(), count)
    return Preview(
        timezone=schedule.timezone,
        times=[FireTime(utc=t, local=t.astimezone(cron.zone)) for t in times],
    )
