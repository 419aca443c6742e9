"""The run service: template lookup, payload validation, durable insert, then enqueue."""

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Literal

from opentelemetry.trace import Span

from jobplane import metrics, tracing
from jobplane.clock import as_stored
from jobplane.errors import (
    ConcurrencyConflict,
    JobplaneError,
    NotFound,
    ResourceInvalidState,
    TemplateDisabled,
    ValidationFailed,
)
from jobplane.model import TERMINAL, Run, RunStatus, Template
from jobplane.model.storable import unstorable
from jobplane.queue.redis import RedisQueue
from jobplane.runs import children
from jobplane.runs.admission.concurrency import displaced, displaced_reason, places, when_full
from jobplane.runs.admission.keys import dedupe_key, rate_key, start_locks
from jobplane.runs.lifecycle import Lifecycle
from jobplane.store import ChildOf, DuplicateRun, KeyHeld, Moved, NewRun, Store


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
    rerun_of: str | None = None
    schedule_id: str | None = None
    scheduled_for: datetime | None = None
    # A schedule's `overlapPolicy: queue`: the run waits for the schedule's previous run, as
    # `queue_same_scope` makes runs wait for their dedupe key's holder.
    queue_behind: str | None = None
    # A map step's child.
    child: ChildOf | None = None


class RunService:
    def __init__(self, store: Store, queue: RedisQueue, lifecycle: Lifecycle | None = None) -> None:
        self.store = store
        self.lifecycle = lifecycle or Lifecycle(store, queue)

    async def create(self, request: RunRequest, actor: str) -> tuple[Run, bool]:
        """Validate, write the run to MongoDB, then queue it in Redis.

        Returns the run and whether it is new: a repeated `idempotency_key` in the same scope
        returns the run it created first. The run is written `queued` and then pushed to
        Redis; if Redis is unreachable it is durable in MongoDB all the same, and the reconciler
        pushes it once Redis is back: an accepted run is never lost. Concurrent creates share
        their MongoDB and Redis writes (group commit).

        The template's dedupe key is taken through MongoDB's unique index, so of many
        concurrent creates for one key exactly one becomes active. The others are refused
        (`reject_same_scope`) or wait (`queue_same_scope`): a waiting run stays `pending` and
        out of Redis until the active run ends and `Lifecycle.admit_next` hands it the key.
        """
        template, new = await self._prepare(request)
        new, span = _sending(new)
        try:
            run = await self._insert(new, template, actor, request.queue_behind is not None)
        except DuplicateRun as duplicate:
            tracing.sent(span, duplicate.run.id)
            return _repeated(duplicate, template, request), False
        except BaseException as exc:
            tracing.sent(span, None, exc)
            raise
        tracing.sent(span, run.id)
        metrics.RUNS_CREATED.labels(template.type).inc()
        return run, True

    async def create_many(
        self, requests: Sequence[RunRequest | JobplaneError], actor: str
    ) -> list[tuple[Run, bool] | JobplaneError]:
        """Create many runs at once; each item gets what `create` would return, or the error
        `create` would raise, and one bad item does not stop the others. An item its caller
        refused already (an error) stays refused, in its place.

        Runs without a dedupe key are written in one bulk insert and queued in one Redis round
        trip; runs with one go through `create`.
        """
        outcomes: list[tuple[Run, bool] | JobplaneError | None] = [None] * len(requests)
        plain: list[tuple[int, RunRequest, Template, NewRun, Span | None]] = []
        keyed: list[tuple[int, RunRequest]] = []
        for i, request in enumerate(requests):
            if isinstance(request, JobplaneError):
                outcomes[i] = request
                continue
            try:
                template, new = await self._prepare(request)
            except JobplaneError as error:
                outcomes[i] = error
                continue
            if new.dedupe_key is None:
                plain.append((i, request, template, *_sending(new)))
            else:
                keyed.append((i, request))
        try:
            inserted = await self.store.runs.insert_many([p[3] for p in plain], actor)
        except BaseException as exc:
            for *_, span in plain:
                tracing.sent(span, None, exc)
            raise
        fresh: list[Run] = []
        for (i, request, template, _, span), result in zip(plain, inserted, strict=True):
            if isinstance(result, DuplicateRun):
                tracing.sent(span, result.run.id)
                try:
                    outcomes[i] = _repeated(result, template, request), False
                except JobplaneError as error:
                    outcomes[i] = error
            elif isinstance(result, Exception):
                tracing.sent(span, None, result)
                # The run it collided with was removed before it could be read (archived, say).
                outcomes[i] = ResourceInvalidState(f"{result}; try again")
            else:
                tracing.sent(span, result.id)
                fresh.append(result)
                outcomes[i] = result, True
                metrics.RUNS_CREATED.labels(template.type).inc()
        # A child waiting for a place among its map's children is not queued yet.
        await self.lifecycle.push([run for run in fresh if run.status == RunStatus.QUEUED])

        async def one(i: int, request: RunRequest) -> None:
            try:
                outcomes[i] = await self.create(request, actor)
            except JobplaneError as error:
                outcomes[i] = error

        await asyncio.gather(*(one(i, r) for i, r in keyed))
        return [o for o in outcomes if o is not None]

    async def _prepare(self, request: RunRequest) -> tuple[Template, NewRun]:
        """The template a request names and the run it asks for, or the error refusing it."""
        template = await self.store.templates.cached(
            request.template_type, request.template_version
        )
        if template is None:
            raise NotFound(f"template {request.template_type!r} not found")
        if not template.enabled:
            raise TemplateDisabled(f"template {template.type!r} is disabled")
        validate_payload(template, request.payload)
        not_before = as_stored(request.not_before) if request.not_before else None
        if request.delay_seconds:
            not_before = self.store.clock.now() + timedelta(seconds=request.delay_seconds)
        scope, scope_id, payload = request.scope, request.scope_id, request.payload
        queue_behind = request.queue_behind is not None
        new = NewRun(
            template=template,
            scope=scope,
            scope_id=scope_id,
            payload=payload,
            priority=request.priority,
            not_before=not_before,
            dedupe_key=request.queue_behind or dedupe_key(template, scope, scope_id, payload),
            key_places=places(template, queue_behind),
            rate_key=rate_key(template, scope, scope_id, payload),
            start_locks=start_locks(template, scope, scope_id, payload),
            idempotency_key=request.idempotency_key,
            rerun_of=request.rerun_of,
            schedule_id=request.schedule_id,
            scheduled_for=request.scheduled_for,
            child=request.child,
        )
        return template, new

    async def _insert(self, new: NewRun, template: Template, actor: str, queue_behind: bool) -> Run:
        full = when_full(template, queue_behind)
        # A key whose holder ended between our insert and the read of the holder is free now.
        for _ in range(3):
            try:
                run = await self.store.runs.insert(new, actor)
            except KeyHeld as held:
                if held.holder is None:
                    continue
                if full == "refuse" or held.spent:
                    raise _refusal(held) from None
                waiting = replace(new, dedupe_key=None, dedupe_wait=held.key)
                run = await self.store.runs.insert(waiting, actor)
                if full == "displace":
                    await self._displace(held.key, run, actor)
                # The holders may have ended before this run was written: nobody would admit
                # it.
                await self.lifecycle.admit_next(held.key, actor)
                return await self.get(run.id)
            if run.status == RunStatus.QUEUED:  # not a child waiting for a place
                await self.lifecycle.push([run])
            return run
        raise ResourceInvalidState("the run's dedupe key kept changing hands; try again")

    async def _displace(self, key: str, newcomer: Run, actor: str) -> None:
        """Latest wins: cancel the key's active runs beyond its limit, oldest first, each
        naming the run that displaced it. Every create does this after its insert, so of
        two concurrent ones at least one sees the other, and the newest survive."""
        active = await self.store.runs.with_key(key, newcomer.scope, newcomer.scope_id)
        newest = active[-1].id if active else newcomer.id
        reason = displaced_reason(newest)
        for run in displaced(active, newcomer.concurrency_limit or 1):
            with contextlib.suppress(ResourceInvalidState):  # it ended meanwhile
                await self.cancel(run.id, actor, reason, displaced_by=newest)

    async def create_children(
        self,
        parent: Run,
        step_id: str,
        template: Template,
        payloads: Sequence[dict[str, Any]],
        limit: int | None,
        actor: str,
    ) -> list[JobplaneError]:
        """Make a map step's children in one batch: a run of `template` per payload, in the
        parent's scope, the first `limit` holding the step's places and the rest waiting for
        one. Each child's idempotency key names its parent, step and item, so making them
        again (after a crash) makes none twice. Returns what refused any of them."""
        root = parent.root_run_id or parent.id
        requests = [
            RunRequest(
                template_type=template.type,
                template_version=template.version,
                scope=parent.scope,
                scope_id=parent.scope_id,
                payload=payload,
                idempotency_key=children.idempotency_key(parent, step_id, index),
                child=ChildOf(
                    parent.id,
                    step_id,
                    root,
                    index,
                    limit,
                    index if limit is not None and index < limit else None,
                ),
            )
            for index, payload in enumerate(payloads)
        ]
        made = await self.create_many(requests, actor)
        return [outcome for outcome in made if isinstance(outcome, JobplaneError)]

    async def rerun(self, run_id: str, actor: str) -> Run:
        """A new run of a finished one: same template version, scope, payload and priority."""
        run = await self.get(run_id)
        if run.status not in TERMINAL:
            raise ResourceInvalidState(f"run {run_id} is {run.status.value}; rerun a finished run")
        request = RunRequest(
            template_type=run.template_type,
            template_version=run.template_version,
            scope=run.scope,
            scope_id=run.scope_id,
            payload=run.payload,
            priority=run.priority,
            rerun_of=run.id,
        )
        new, _ = await self.create(request, actor)
        return new

    async def cancel(
        self, run_id: str, actor: str, reason: str | None, displaced_by: str | None = None
    ) -> Run:
        """Cancel the run as the policy says (`policy.cancel_of`); a finished one is refused,
        and cancelling a run whose cancel was already requested changes nothing.
        `displaced_by` names the newer run a `cancel_previous` template put in its place."""
        # A run that moves between the read and the guarded write (claimed, say) is looked at
        # again; each retry means another writer made progress, so a few tries are plenty.
        for _ in range(5):
            run = await self.get(run_id)
            moved = await self.lifecycle.cancel(run, actor, reason, displaced_by)
            if moved is None:
                return run
            if isinstance(moved, Moved):
                return await self.get(run_id)
        raise ResourceInvalidState(f"run {run_id} kept changing; try again")

    async def get(self, run_id: str) -> Run:
        run = await self.store.runs.get(run_id)
        if run is None:
            raise NotFound(f"run {run_id!r} not found")
        return run


def validate_payload(template: Template, payload: dict[str, Any]) -> None:
    if problems := unstorable(payload, "/payload"):
        raise ValidationFailed("payload cannot be stored as sent", problems)
    errors = sorted(
        template.payload_validator.iter_errors(payload), key=lambda e: list(e.absolute_path)
    )
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


def _sending(new: NewRun) -> tuple[NewRun, Span | None]:
    """The run's `send` span begun, and the run with the context it stores."""
    t = new.template
    span, context = tracing.send(t.queue, t.type, t.version, new.scope, new.scope_id)
    return (new if context is None else replace(new, trace_context=context)), span


def _repeated(duplicate: DuplicateRun, template: Template, request: RunRequest) -> Run:
    """The first run of a repeated idempotency key, if the repeat asked for the same thing."""
    first = duplicate.run
    if (first.template_type, first.payload) != (template.type, request.payload):
        # A key reused for another request is a client bug; answering with the first run
        # would hide that the second request was never carried out.
        raise ResourceInvalidState(
            "this idempotencyKey was used for a different request", {"runId": first.id}
        )
    return first


def _refusal(held: KeyHeld) -> ConcurrencyConflict | ResourceInvalidState:
    if held.spent:
        assert held.holder is not None
        return ResourceInvalidState(
            f"template is not repeatable and run {held.holder.id} already succeeded for this key",
            {"succeededRunId": held.holder.id},
        )
    return ConcurrencyConflict(held.holder.id if held.holder else None)
