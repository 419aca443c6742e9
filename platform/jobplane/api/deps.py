"""Request dependencies: the backends and the caller, per permission."""

from typing import Annotated

from fastapi import Depends, Request

from jobplane.api.auth import Caller, Permission, require
from jobplane.queue.redis import RedisQueue
from jobplane.runs import RunService
from jobplane.settings import Settings
from jobplane.store import MongoStore


def get_store(request: Request) -> MongoStore:
    store: MongoStore = request.app.state.store
    return store


def get_queue(request: Request) -> RedisQueue:
    queue: RedisQueue = request.app.state.queue
    return queue


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_runs(request: Request) -> RunService:
    return RunService(get_store(request), get_queue(request))


StoreDep = Annotated[MongoStore, Depends(get_store)]
RunsDep = Annotated[RunService, Depends(get_runs)]
SettingsDep = Annotated[Settings, Depends(get_settings)]

TemplateReader = Annotated[Caller, Depends(require(Permission.TEMPLATES_READ))]
TemplateAuthor = Annotated[Caller, Depends(require(Permission.TEMPLATES_WRITE))]
RunReader = Annotated[Caller, Depends(require(Permission.RUNS_READ))]
RunWriter = Annotated[Caller, Depends(require(Permission.RUNS_WRITE))]
EventReader = Annotated[Caller, Depends(require(Permission.EVENTS_READ))]
KeyAdmin = Annotated[Caller, Depends(require(Permission.KEYS_WRITE))]
