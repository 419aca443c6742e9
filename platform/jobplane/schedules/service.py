"""Creating, changing and triggering schedules.

Everything a fire needs is checked when a schedule is written: the cron and its time zone, a
template that exists and is `schedulable`, and a payload template that renders to a payload
the template's schema accepts. A fire then has nothing left to fail on but the template being
disabled, which it records and skips.
"""

import asyncio
import logging
import re
from datetime import UTC, datetime, timedelta
from typing import Any

from bson import ObjectId
from pydantic import ValidationError

from jobplane import metrics, tracing
from jobplane.errors import NotFound, ResourceInvalidState, TemplateDisabled, ValidationFailed
from jobplane.model import Run, Schedule, ScheduleSpec, Template
from jobplane.queue.redis import RedisQueue
from jobplane.runs import RunRequest, RunService
from jobplane.runs.service import validate_payload
from jobplane.schedules.cron import Cron, CronError
from jobplane.store import Store
from jobplane.templates.loader import pydantic_errors

# Fire times the tick works out for one schedule at most (after a long outage, say); beyond
# them the schedule jumps to its next future time.
MAX_MISSED = 1000
ACTOR = "scheduler"

log = logging.getLogger("jobplane.scheduler")

# `{{name}}` in a payload template's strings.
_PLACEHOLDER = re.compile(r"\{\{\s*(\w*)\s*\}\}")
PLACEHOLDERS = ("scheduledFor", "scheduleId", "scopeId")


class ScheduleService:
    def __init__(self, store: Store, queue: RedisQueue) -> None:
        self.store = store
        self.queue = queue

    async def create(self, spec: ScheduleSpec, actor: str) -> Schedule:
        now = self.store.clock.now()
        schedule_id = str(ObjectId())
        cron = await self._check(spec, schedule_id)
        schedule = Schedule(
            **spec.model_dump(),
            id=schedule_id,
            next_run_at=cron.next_after(now),
            created_by=actor,
            trace_context=tracing.carrier(),
            create_at=now,
            update_at=now,
        )
        await self.store.schedules.insert(schedule)
        return schedule

    async def update(self, schedule_id: str, changes: dict[str, Any]) -> Schedule:
        """Apply `changes` (camelCase fields of the spec) and recompute `nextRunAt` from now.

        Two changes at once: the second re-reads and applies itself to the first's result.
        The scope cannot change (`_check_scope`).
        """
        for _ in range(5):
            current = await self.get(schedule_id)
            fields = current.model_dump(by_alias=True, include=set(ScheduleSpec.model_fields))
            try:
                spec = ScheduleSpec.model_validate({**fields, **changes})
            except ValidationError as exc:
                raise ValidationFailed("invalid schedule", pydantic_errors(exc)) from exc
            _check_scope(current, fields, spec)
            cron = await self._check(spec, schedule_id)
            changed = current.model_copy(
                update={**spec.model_dump(), "next_run_at": cron.next_after(self.store.clock.now())}
            )
            if (stored := await self.store.schedules.replace(changed)) is not None:
                if not current.enabled and stored.enabled:
                    await self._skip_paused(current)
                return stored
        raise ResourceInvalidState(f"schedule {schedule_id} kept changing; try again")

    async def get(self, schedule_id: str) -> Schedule:
        schedule = await self.store.schedules.get(schedule_id)
        if schedule is None:
            raise NotFound(f"schedule {schedule_id!r} not found")
        return schedule

    async def delete(self, schedule_id: str) -> None:
        if not await self.store.schedules.delete(schedule_id):
            raise NotFound(f"schedule {schedule_id!r} not found")

    async def trigger(self, schedule_id: str, actor: str) -> Run:
        """A run now, as if the schedule fired (its `scheduledFor` is now), and the schedule's
        last run from then on; its `nextRunAt` stays."""
        schedule = await self.get(schedule_id)
        at = self.store.clock.now()
        run, _ = await RunService(self.store, self.queue).create(_request(schedule, at), actor)
        await self.store.schedules.note_run(schedule.id, at, run.id)
        return run

    async def fire_due(self, now: datetime, limit: int, grace_seconds: float) -> int:
        """Fire every schedule whose time has come, all at once (schedules due in the same
        second must not wait for each other); returns how many runs were created."""
        grace = timedelta(seconds=grace_seconds)
        due = await self.store.schedules.due(now, limit)
        fired = await asyncio.gather(
            *(self._fire(s, now, grace) for s in due), return_exceptions=True
        )
        for schedule, outcome in zip(due, fired, strict=True):
            if isinstance(outcome, BaseException):
                # One schedule's trouble must not hold up the others; it stays due and is
                # tried again at the next tick.
                log.error("firing schedule %s failed", schedule.id, exc_info=outcome)
        return sum(n for n in fired if isinstance(n, int))

    async def _fire(self, schedule: Schedule, now: datetime, grace: timedelta) -> int:
        """Create the runs of one schedule's due fire times, as its policies say, and move it
        to its next future time.

        A fire time reached more than `grace` late was missed: `skip` drops it, `run_once`
        makes one run (for the latest missed time), `catch_up` one run per missed time (the
        latest `catchUpLimit`). Two schedulers firing at once create one run per fire time:
        (scheduleId, scheduledFor) is unique, and only one of them advances the schedule.
        """
        assert schedule.next_run_at is not None
        cron = Cron.parse(schedule.cron, schedule.timezone)
        due = _due_times(cron, schedule.next_run_at, now)
        missed = [t for t in due if now - t > grace]
        fire = [t for t in due if now - t <= grace]
        if missed and schedule.misfire_policy == "run_once":
            fire = fire or missed[-1:]
        elif missed and schedule.misfire_policy == "catch_up":
            fire = (missed + fire)[-schedule.catch_up_limit :]
        skipped = [t for t in due if t not in fire]
        if missed:
            metrics.SCHEDULE_MISFIRES.labels(schedule.misfire_policy).inc(len(missed))
        if skipped:
            policy = f"missed fire times skipped ({schedule.misfire_policy})"
            await self._skip_many(schedule, skipped, "misfire", policy)
        runs = [(at, await self._fire_once(schedule, at)) for at in fire]
        made = [(at, run.id) for at, run in runs if run is not None]
        await self.store.schedules.advance(
            schedule, cron.next_after(now), made[-1] if made else None
        )
        return len(made)

    async def _fire_once(self, schedule: Schedule, at: datetime) -> Run | None:
        """The run for one fire time, unless the template is disabled or (`overlapPolicy:
        skip`) the schedule's previous run is still active; each skip is an event."""
        if schedule.overlap_policy == "skip" and (
            active := await self.store.runs.active_of(schedule)
        ):
            metrics.SCHEDULE_FIRES.labels("overlap").inc()
            await self._skip(schedule, at, f"overlap: run {active.id} is {active.status}")
            return None
        try:
            with tracing.fire(schedule.id, schedule.trace_context, at.isoformat()):
                run, new = await RunService(self.store, self.queue).create(
                    _request(schedule, at), ACTOR
                )
        except (NotFound, TemplateDisabled):
            metrics.SCHEDULE_FIRES.labels("template_disabled").inc()
            await self._skip(schedule, at, "template_disabled")
            return None
        # Not new: another scheduler fired this time already (the unique index said so).
        metrics.SCHEDULE_FIRES.labels("created" if new else "duplicate").inc()
        return run

    async def _skip_paused(self, paused: Schedule) -> None:
        """As a disabled schedule is enabled again, record the fire times it passed (one event:
        a schedule paused for a month should not write one per minute while it sleeps)."""
        now = self.store.clock.now()
        if paused.next_run_at is None or paused.next_run_at > now:
            return
        skipped = _due_times(Cron.parse(paused.cron, paused.timezone), paused.next_run_at, now)
        why = "fire times skipped while the schedule was disabled"
        await self._skip_many(paused, skipped, "schedule_disabled", why)

    async def _skip_many(
        self, schedule: Schedule, skipped: list[datetime], reason: str, what: str
    ) -> None:
        """One `fire_skipped` event for a stretch of fire times, however long."""
        metadata = {"reason": reason, "first": skipped[0].isoformat(), "count": len(skipped)}
        await self.store.trail.schedule_event(
            schedule, "fire_skipped", f"{len(skipped)} {what}", metadata, ACTOR
        )

    async def _skip(self, schedule: Schedule, at: datetime, reason: str) -> None:
        metadata = {"reason": reason, "scheduledFor": at.isoformat()}
        message = f"fire at {at.isoformat()} skipped"
        await self.store.trail.schedule_event(schedule, "fire_skipped", message, metadata, ACTOR)

    async def _check(self, spec: ScheduleSpec, schedule_id: str) -> Cron:
        try:
            cron = Cron.parse(spec.cron, spec.timezone)
        except CronError as exc:
            problem = [{"pointer": f"/{exc.field}", "message": str(exc)}]
            raise ValidationFailed(str(exc), problem) from exc
        template = await self.store.templates.get(spec.template_type)
        if template is None:  # as a run of it would be answered
            raise NotFound(f"template {spec.template_type!r} not found")
        if not template.schedulable:
            why = "the template is not schedulable"
            raise ValidationFailed(why, [{"pointer": "/templateType", "message": why}])
        if spec.overlap_policy == "queue" and not template.repeatable:
            # Queued fires wait on the run's dedupe key, which a non-repeatable template keeps.
            why = "overlapPolicy queue needs a repeatable template"
            raise ValidationFailed(why, [{"pointer": "/overlapPolicy", "message": why}])
        _check_payload(spec, schedule_id, template)
        return cron


def _check_scope(current: Schedule, fields: dict[str, Any], spec: ScheduleSpec) -> None:
    """A schedule keeps the scope it was created in.

    Its runs carry its scope, and MongoDB keeps one run per fire time with a unique index that
    starts with the run's scope (the shard key): a scope change racing with a fire could make
    a second run for the same fire time in the new scope. One change is let through: the repair
    of a scope id stored before scope ids were checked, which no valid schedule can need.
    """
    moved = [
        name
        for name, old, new in (
            ("scope", current.scope, spec.scope),
            ("scopeId", current.scope_id, spec.scope_id),
        )
        if old != new
    ]
    if not moved:
        return
    try:
        ScheduleSpec.model_validate(fields)
    except ValidationError:
        return  # stored before its scope id was checked: this change repairs it
    why = "a schedule's scope cannot change; create a schedule in the other scope"
    raise ValidationFailed(why, [{"pointer": f"/{name}", "message": why} for name in moved])


def render_payload(template: Any, values: dict[str, str]) -> Any:
    """`template` with each `{{name}}` in its strings replaced by `values[name]`."""
    if isinstance(template, str):
        return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)
    if isinstance(template, dict):
        return {k: render_payload(v, values) for k, v in template.items()}
    if isinstance(template, list):
        return [render_payload(v, values) for v in template]
    return template


def _due_times(cron: Cron, first: datetime, now: datetime) -> list[datetime]:
    """`first` and the fire times after it up to `now` (at most MAX_MISSED)."""
    due = [first]
    while len(due) < MAX_MISSED and (later := cron.next_after(due[-1])) <= now:
        due.append(later)
    return due


def _request(schedule: Schedule, at: datetime) -> RunRequest:
    """The run of one fire time (`overlapPolicy: queue` makes it wait for the previous one)."""
    return RunRequest(
        template_type=schedule.template_type,
        scope=schedule.scope,
        scope_id=schedule.scope_id,
        payload=render_payload(schedule.payload_template, _values(schedule, at)),
        schedule_id=schedule.id,
        scheduled_for=at,
        queue_behind=f"schedule:{schedule.id}" if schedule.overlap_policy == "queue" else None,
    )


def _values(
    schedule: Schedule | ScheduleSpec, at: datetime, schedule_id: str = ""
) -> dict[str, str]:
    sid = schedule.id if isinstance(schedule, Schedule) else schedule_id
    return {"scheduledFor": at.isoformat(), "scheduleId": sid, "scopeId": schedule.scope_id}


def _check_payload(spec: ScheduleSpec, schedule_id: str, template: Template) -> None:
    """The payload template uses known placeholders only, and renders (with sample values) to
    a payload the template's schema accepts."""
    unknown = sorted(
        {m.group(1) for m in _PLACEHOLDER.finditer(str(spec.payload_template))} - set(PLACEHOLDERS)
    )
    if unknown:
        message = f"unknown placeholders {unknown}; known: {list(PLACEHOLDERS)}"
        raise ValidationFailed(message, [{"pointer": "/payloadTemplate", "message": message}])
    sample = render_payload(spec.payload_template, _values(spec, datetime.now(UTC), schedule_id))
    try:
        validate_payload(template, sample)
    except ValidationFailed as exc:
        errors = [
            {**e, "pointer": "/payloadTemplate" + e["pointer"].removeprefix("/payload")}
            for e in exc.details["errors"]
        ]
        raise ValidationFailed(
            "payloadTemplate does not render to a valid payload", errors
        ) from exc
