"""Real MongoDB and Redis for the whole test session, and per-test isolation inside them.

Set JOBPLANE_TEST_MONGODB_URL / JOBPLANE_TEST_REDIS_URL to test against servers of your own
(any form JOBPLANE_REDIS_URL takes: the whole suite then runs on that Redis); otherwise the
session starts both from the binaries of the `local` extra.

The Redis contract suite (`REDIS_TOPOLOGIES`) runs its tests once per topology: one server, a
Redis Cluster of three masters and Sentinel with a master and a replica, each started when a
test first asks for it, or named by JOBPLANE_TEST_REDIS_CLUSTER_URL /
JOBPLANE_TEST_REDIS_SENTINEL_URL.
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
from jobplane.devstack.topologies import RedisClusterNodes, SentinelGroup
from jobplane.queue.connect import parse_redis_url
from jobplane.store.indexes import SHARD_KEYS

# Mark a module `pytestmark = REDIS_TOPOLOGIES` to run each of its tests on every topology.
REDIS_TOPOLOGIES = pytest.mark.parametrize(
    "redis_url", ["single", "cluster", "sentinel"], indirect=True
)


@pytest.fixture(scope="session")
def mongo_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a MongoDB replica set shared by the session."""
    if url := os.environ.get("JOBPLANE_TEST_MONGODB_URL"):
        yield url
        return
    root = tmp_path_factory.mktemp("mongo")
    server = MongoServer(root / "db", free_port(), root / "mongod.log", test_commands=True)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> str:
    """URL of the Redis the session's tests use: one server, unless the test runs on each
    topology (`REDIS_TOPOLOGIES`)."""
    topology = getattr(request, "param", "single")
    url: str = request.getfixturevalue(f"redis_{topology}_url")
    return url


@pytest.fixture(scope="session")
def redis_single_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
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
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cluster = RedisClusterNodes(tmp_path_factory.mktemp("redis-cluster"))
    yield from _started("JOBPLANE_TEST_REDIS_CLUSTER_URL", cluster)


@pytest.fixture(scope="session")
def redis_sentinel_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    group = SentinelGroup(tmp_path_factory.mktemp("redis-sentinel"))
    yield from _started("JOBPLANE_TEST_REDIS_SENTINEL_URL", group)


def _started(variable: str, servers: RedisClusterNodes | SentinelGroup) -> Iterator[str]:
    """The URL `variable` names, or `servers`' once started (and stopped afterwards)."""
    if url := os.environ.get(variable):
        yield url
        return
    servers.start()
    try:
        yield servers.url
    finally:
        servers.stop()


def sync_redis(url: str) -> redis.Redis | redis.RedisCluster:
    """A blocking client of any JOBPLANE_REDIS_URL form, for tests' set-up and clean-up."""
    target = parse_redis_url(url)
    if target.kind == "cluster":
        nodes = [redis.cluster.ClusterNode(host, port) for host, port in target.nodes]
        return redis.RedisCluster(startup_nodes=nodes, **target.options)
    if target.kind == "sentinel":
        assert target.master is not None
        sentinel = redis.Sentinel(list(target.nodes), **target.options)
        return sentinel.master_for(target.master, db=target.db)
    return redis.Redis.from_url(url)


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
    with sync_redis(redis_url) as client:
        # SCAN rather than KEYS: a shared server may hold many other tests' keys.
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{prefix}*", count=500):
            batch.append(key)
            if len(batch) >= 500:
                client.delete(*batch)
                batch.clear()
        if batch:
            client.delete(*batch)
