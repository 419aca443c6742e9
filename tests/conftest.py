"""Real MongoDB and Redis for the whole test session, and per-test isolation inside them.

Set JOBPLANE_TEST_MONGODB_URL / JOBPLANE_TEST_REDIS_URL to test against servers of your own;
otherwise the session starts both from the binaries of the `local` extra.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any
from uuid import uuid4

import pytest
import redis
from pymongo import MongoClient

from jobplane.devstack import MongoServer, RedisServer, free_port
from jobplane.store.mongo import SHARD_KEYS


@pytest.fixture(scope="session")
def mongo_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a MongoDB replica set shared by the session."""
    if url := os.environ.get("JOBPLANE_TEST_MONGODB_URL"):
        yield url
        return
    root = tmp_path_factory.mktemp("mongo")
    server = MongoServer(root / "db", free_port(), root / "mongod.log")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a Redis server shared by the session."""
    if url := os.environ.get("JOBPLANE_TEST_REDIS_URL"):
        yield url
        return
    root = tmp_path_factory.mktemp("redis")
    server = RedisServer(root / "data", free_port(), root / "redis.log")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mongos(mongo_url: str) -> bool:
    """Whether the session's MongoDB is a sharded cluster's mongos (the local one never is)."""
    client: MongoClient[dict[str, Any]] = MongoClient(mongo_url)
    with client:
        return client.admin.command("hello").get("msg") == "isdbgrid"


@pytest.fixture
def db_name(mongo_url: str, mongos: bool) -> Iterator[str]:
    """A database name of this test's own, dropped afterwards; on a mongos, its large
    collections are sharded as `jobplane db shard` shards them, before any test writes."""
    name = f"t_{uuid4().hex[:12]}"
    client: MongoClient[dict[str, Any]] = MongoClient(mongo_url)
    with client:
        if mongos:
            client.admin.command("enableSharding", name)
            for collection, key in SHARD_KEYS.items():
                # Empty: MongoDB creates the collection and its shard key index itself.
                client.admin.command("shardCollection", f"{name}.{collection}", key=dict(key))
        yield name
        client.drop_database(name)


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    prefix = f"t{uuid4().hex[:8]}:"
    yield prefix
    with redis.Redis.from_url(redis_url) as client:
        # SCAN rather than KEYS: a shared server may hold many other tests' keys.
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{prefix}*", count=500):
            batch.append(key)
            if len(batch) >= 500:
                client.delete(*batch)
                batch.clear()
        if batch:
            client.delete(*batch)
