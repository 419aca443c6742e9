"""Request dependencies: the backends and the caller, per permission.

All `async def`, though none waits on anything: FastAPI runs a plain `def` dependency in a
thread, which costs more than the dependency itself on every request.
"""

from typing import Annotated

from fastapi import Depends, Request

from jobplane.api.auth import Caller, Permission, authenticate, require
from jobplane.queue.redis import RedisQueue
from jobplane.runs import RunService
from jobplane.runs.waiting import Waiting
from jobplane.settings import Settings
from jobplane.store import Store


async def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


async def get_queue(request: Request) -> RedisQueue:
    queue: RedisQueue = request.app.state.queue
    return queue


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_runs(request: Request) -> RunService:
    return RunService(request.app.state.store, request.app.state.queue)


async def get_waiting(request: Request) -> Waiting:
    waiting: Waiting = request.app.state.waiting
    return waiting


StoreDep = Annotated[Store, Depends(get_store)]
WaitingDep = Annotated[Waiting, Depends(get_waiting)]
RunsDep = Annotated[RunService, Depends(get_runs)]
SettingsDep = Annotated[Settings, Depends(get_settings)]

TemplateReader = Annotated[Caller, Depends(require(Permission.TEMPLATES_READ))]
TemplateAuthor = Annotated[Caller, Depends(require(Permission.TEMPLATES_WRITE))]
RunReader = Annotated[Caller, Depends(require(Permission.RUNS_READ))]
RunWriter = Annotated[Caller, Depends(require(Permission.RUNS_WRITE))]
EventReader = Annotated[Caller, Depends(require(Permission.EVENTS_READ))]
# Any valid key, whatever its role.
Anyone = Annotated[Caller, Depends(authenticate)]
KeyReader = Annotated[Caller, Depends(require(Permission.KEYS_READ))]
KeyAdmin = Annotated[Caller, Depends(require(Permission.KEYS_WRITE))]
ExternalWorker = Annotated[Caller, Depends(require(Permission.EXTERNAL_WORK))]
ScheduleReader = Annotated[Caller, Depends(require(Permission.SCHEDULES_READ))]
ScheduleWriter = Annotated[Caller, Depends(require(Permission.SCHEDULES_WRITE))]
QueueReader = Annotated[Caller, Depends(require(Permission.QUEUES_READ))]
QueueAdmin = Annotated[Caller, Depends(require(Permission.QUEUES_WRITE))]
WebhookReader = Annotated[Caller, Depends(require(Permission.WEBHOOKS_READ))]
WebhookWriter = Annotated[Caller, Depends(require(Permission.WEBHOOKS_WRITE))]
