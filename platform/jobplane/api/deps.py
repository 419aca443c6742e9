"""Request dependencies: the backends, the caller's identity."""

import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from jobplane.errors import Unauthorized
from jobplane.queue.redis import RedisQueue
from jobplane.runs import RunService
from jobplane.settings import Settings
from jobplane.store import MongoStore


@dataclass(frozen=True)
class Caller:
    name: str
    role: str

    @property
    def actor(self) -> str:
        return f"user:{self.name}"


def get_store(request: Request) -> MongoStore:
    store: MongoStore = request.app.state.store
    return store


def get_queue(request: Request) -> RedisQueue:
    queue: RedisQueue = request.app.state.queue
    return queue


def get_runs(request: Request) -> RunService:
    return RunService(get_store(request), get_queue(request))


def get_caller(request: Request) -> Caller:
    """The bootstrap admin key; scoped API keys stored hashed in MongoDB come next."""
    settings: Settings = request.app.state.settings
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized("missing bearer API key")
    if settings.admin_key and hmac.compare_digest(key, settings.admin_key):
        return Caller("admin", "admin")
    raise Unauthorized("unknown API key")


StoreDep = Annotated[MongoStore, Depends(get_store)]
RunsDep = Annotated[RunService, Depends(get_runs)]
CallerDep = Annotated[Caller, Depends(get_caller)]
