"""The run service: template lookup, payload validation, durable insert, then enqueue."""

import contextlib
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from jsonschema import Draft202012Validator
from redis.exceptions import RedisError

from jobplane.errors import NotFound, ResourceInvalidState, TemplateDisabled, ValidationFailed
from jobplane.model import CLAIMABLE, TERMINAL, Run, RunStatus, Template
from jobplane.queue.redis import QueueEntry, RedisQueue
from jobplane.store import DuplicateRun, Known, Lost, MongoStore, NewRun

log = logging.getLogger("jobplane.runs")


@dataclass(frozen=True)
class RunRequest:
    template_type: str
    scope: Literal["user", "account", "system"]
    scope_id: str
    payload: dict[str, Any] = field(default_factory=dict)
    template_version: int | None = None
    priority: int | None = None
    delay_seconds: float | None = None
    not_before: datetime | None = None
    idempotency_key: str | None = None


class RunService:
    def __init__(self, store: MongoStore, queue: RedisQueue) -> None:
        self.store = store
        self.queue = queue

    async def create(self, request: RunRequest, actor: str) -> tuple[Run, bool]:
        """Validate, write the run to MongoDB, then queue it in Redis.

        Returns the run and whether it is new: a repeated `idempotency_key` in the same scope
        returns the run it created first. If Redis is unreachable the run stays `pending` in
        MongoDB, durable, and the reconciler queues it once Redis is back: an accepted run is
        never lost.
        """
        template = await self.store.get_template(request.template_type, request.template_version)
        if template is None:
            raise NotFound(f"template {request.template_type!r} not found")
        if not template.enabled:
            raise TemplateDisabled(f"template {template.type!r} is disabled")
        validate_payload(template, request.payload)
        not_before = request.not_before
        if request.delay_seconds:
            not_before = self.store.clock.now() + timedelta(seconds=request.delay_seconds)
        new = NewRun(
            template=template,
            scope=request.scope,
            scope_id=request.scope_id,
            payload=request.payload,
            priority=request.priority,
            not_before=not_before,
            idempotency_key=request.idempotency_key,
        )
        try:
            run = await self.store.insert_run(new, actor)
        except DuplicateRun as duplicate:
            return duplicate.run, False
        await self.enqueue(run, actor)
        return run, True

    async def enqueue(self, run: Run, actor: str) -> bool:
        """Push a pending run to Redis and mark it `queued`; False leaves it to the reconciler."""
        try:
            await self.queue.push(
                [QueueEntry(run.id, run.queue, run.priority, run.not_before)],
                self.store.clock.now(),
            )
        except (RedisError, OSError) as exc:
            log.warning("run %s stays pending, Redis push failed: %s", run.id, exc)
            return False
        # A worker may already have claimed it (pending is claimable); then this move is lost.
        known = Known(run.status, run.version, run.scope, run.scope_id)
        return not isinstance(await self.store.enqueue(run.id, actor, known), Lost)

    async def cancel(self, run_id: str, actor: str, reason: str | None) -> Run:
        """SPEC rule 4: a run no worker holds ends `cancelled` at once and leaves the queue; a
        held one goes `cancel_requested` and its worker is signalled; a finished one is refused.
        Cancelling a run whose cancel was already requested changes nothing.
        """
        # A run that moves between the read and the guarded write (claimed, say) is looked at
        # again; each retry means another writer made progress, so a few tries are plenty.
        for _ in range(5):
            run = await self.get(run_id)
            if run.status in TERMINAL:
                raise ResourceInvalidState(f"run {run_id} is {run.status.value}")
            if run.status == RunStatus.CANCEL_REQUESTED:
                return run
            if run.status in CLAIMABLE:
                if not isinstance(await self.store.cancel(run.id, actor, reason), Lost):
                    with contextlib.suppress(RedisError, OSError):  # a popped id is skipped
                        await self.queue.remove(run.id, run.queue, run.priority)
                    return await self.get(run_id)
            elif not isinstance(await self.store.request_cancel(run.id, actor, reason), Lost):
                # Heartbeats bring the cancel from MongoDB too, should the signal be lost.
                with contextlib.suppress(RedisError, OSError):
                    await self.queue.signal_cancel(run.id)
                return await self.get(run_id)
        raise ResourceInvalidState(f"run {run_id} kept changing; try again")

    async def get(self, run_id: str) -> Run:
        run = await self.store.get_run(run_id)
        if run is None:
            raise NotFound(f"run {run_id!r} not found")
        return run


def validate_payload(template: Template, payload: dict[str, Any]) -> None:
    validator = Draft202012Validator(template.payload_schema)
    errors = sorted(validator.iter_errors(payload), key=lambda e: list(e.absolute_path))
    if errors:
        raise ValidationFailed(
            "payload does not match the template's payloadSchema",
            [
                {
                    "pointer": "/payload" + "".join(f"/{p}" for p in e.absolute_path),
                    "message": e.message,
                }
                for e in errors
            ],
        )
