"""Queues: what each holds, and pausing and resuming them (admin keys only).

A paused queue accepts and keeps runs but starts none; runs already started go on. The pause
is MongoDB's, so it outlives restarts and a Redis loss, and each pause and resume is an
audited event (`queue_paused`, `queue_resumed`) in `GET /v1/events`.
"""

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import StringConstraints

from jobplane.api.deps import QueueAdmin, QueueReader, SettingsDep, StoreDep
from jobplane.api.errors import ERROR_RESPONSES
from jobplane.errors import NotFound, Unavailable
from jobplane.metrics import gauges, read_state
from jobplane.model import QueueState
from jobplane.model.answers import ResponseBody
from jobplane.model.bodies import RequestBody
from jobplane.model.documents import Name
from jobplane.runs.admission.pause import Pauses
from jobplane.store import Store

router = APIRouter(prefix="/v1/queues", tags=["queues"], responses=ERROR_RESPONSES)


class QueueItem(ResponseBody):
    """`ready`: runs that may start now (due delayed ones included); `delayed`: runs waiting
    for their `notBefore` or a rate limit's window; `running`: runs started and not ended
    (running, waiting for an external worker, asked to cancel); `oldestReadyAgeSeconds`:
    since the oldest ready run was created or fell due (0 when none). `ready`, `delayed` and
    the age are null while Redis does not answer."""

    queue: str
    ready: int | None
    delayed: int | None
    running: int
    oldest_ready_age_seconds: float | None
    paused: bool
    paused_by: str | None
    pause_reason: str | None
    paused_at: datetime | None


class QueueList(ResponseBody):
    items: list[QueueItem]


class PauseBody(RequestBody):
    reason: Annotated[str, StringConstraints(max_length=500)] | None = None


@router.get("", summary="List queues", response_model=QueueList, response_model_by_alias=True)
async def list_queues(
    request: Request, store: StoreDep, settings: SettingsDep, caller: QueueReader
) -> QueueList:
    """One item per queue a template names or an operator paused, by name."""
    return QueueList(items=await _items(request, store, settings.queues))


@router.post(
    "/{queue}/pause",
    summary="Pause a queue",
    response_model=QueueItem,
    response_model_by_alias=True,
)
async def pause(
    queue: Name,
    request: Request,
    store: StoreDep,
    settings: SettingsDep,
    caller: QueueAdmin,
    body: PauseBody | None = None,
) -> QueueItem:
    """Start none of the queue's runs until it is resumed; it still accepts and keeps runs,
    and runs already started go on. Pausing a paused queue changes nothing."""
    return await _set_paused(request, store, settings.queues, queue, True, caller.actor, body)


@router.post(
    "/{queue}/resume",
    summary="Resume a queue",
    response_model=QueueItem,
    response_model_by_alias=True,
)
async def resume(
    queue: Name,
    request: Request,
    store: StoreDep,
    settings: SettingsDep,
    caller: QueueAdmin,
    body: PauseBody | None = None,
) -> QueueItem:
    """Start the queue's runs again. Resuming a queue that is not paused changes nothing."""
    return await _set_paused(request, store, settings.queues, queue, False, caller.actor, body)


async def _set_paused(
    request: Request,
    store: Store,
    told: list[str],
    queue: str,
    paused: bool,
    actor: str,
    body: PauseBody | None,
) -> QueueItem:
    known = {*await store.templates.queues(), *(s.queue for s in await store.queues.states())}
    if queue not in known:
        raise NotFound(f"queue {queue!r} not found: no template names it")
    pauses = Pauses(store, request.app.state.queue)
    await pauses.set_paused(queue, paused, actor, body.reason if body else None)
    [item] = [i for i in await _items(request, store, told) if i.queue == queue]
    return item


async def _items(request: Request, store: Store, told: list[str]) -> list[QueueItem]:
    read = gauges(await read_state(store, request.app.state.queue, told))
    if read.get(("jobplane_backend_up", ("mongodb",))) != 1:
        raise Unavailable("MongoDB did not answer")
    redis_up = read.get(("jobplane_backend_up", ("redis",))) == 1
    states = {s.queue: s for s in await store.queues.states()}
    names = sorted(labels[0] for name, labels in read if name == "jobplane_queue_paused")
    return [_item(q, read, states.get(q, QueueState(queue=q)), redis_up) for q in names]


def _item(
    queue: str, read: dict[tuple[str, tuple[str, ...]], float], state: QueueState, redis_up: bool
) -> QueueItem:
    def redis(name: str, *labels: str) -> float | None:
        return read.get((name, (queue, *labels)), 0.0) if redis_up else None

    ready, delayed = (
        redis("jobplane_queue_depth", "ready"),
        redis("jobplane_queue_depth", "delayed"),
    )
    return QueueItem(
        queue=queue,
        ready=None if ready is None else int(ready),
        delayed=None if delayed is None else int(delayed),
        running=int(read.get(("jobplane_queue_started", (queue,)), 0)),
        oldest_ready_age_seconds=redis("jobplane_queue_oldest_ready_age_seconds"),
        paused=state.paused,
        paused_by=state.paused_by if state.paused else None,
        pause_reason=state.pause_reason if state.paused else None,
        paused_at=state.paused_at if state.paused else None,
    )
