"""Backends and helpers for tests against the real MongoDB and Redis of the session."""

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from jobplane.backends import Backends, open_backends
from jobplane.model import Template, TemplateSpec
from jobplane.queue.redis import RedisQueue
from jobplane.settings import Settings
from jobplane.store import MongoStore

Register = Callable[..., Awaitable[Template]]


@pytest.fixture
def settings(mongo_url: str, redis_url: str, db_name: str, redis_prefix: str) -> Settings:
    return Settings(
        mongodb_url=mongo_url,
        redis_url=redis_url,
        db=db_name,
        redis_prefix=redis_prefix,
        admin_key="test-admin-key",
        lease_seconds=5,
        heartbeat_seconds=1,
        poll_seconds=0.2,
        reconcile_seconds=0.5,
    )


@pytest.fixture
async def backends(settings: Settings) -> AsyncIterator[Backends]:
    async with open_backends(settings) as opened:
        yield opened


@pytest.fixture
def store(backends: Backends) -> MongoStore:
    return backends.store


@pytest.fixture
def queue(backends: Backends) -> RedisQueue:
    return backends.queue


def template_spec(type_: str = "t_noop", **fields: Any) -> TemplateSpec:
    """A template spec with one `builtin.noop` step unless `steps` is given."""
    doc: dict[str, Any] = {"type": type_, "steps": [{"id": "only", "handler": "builtin.noop"}]}
    doc.update(fields)
    return TemplateSpec.model_validate(doc)


@pytest.fixture
def register(store: MongoStore) -> Register:
    async def register(type_: str = "t_noop", **fields: Any) -> Template:
        template, _ = await store.register_template(template_spec(type_, **fields))
        return template

    return register
