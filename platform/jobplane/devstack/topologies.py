"""Redis as users grow into it, run from the `local` extra's binaries: a Redis Cluster of three
masters, and Sentinel watching a master and its replica. The tests and benchmarks start them
to run jobplane against the real thing; `jobplane dev` does not.
"""

from __future__ import annotations

import random
import subprocess
import time
from pathlib import Path

import redis

from jobplane.devstack.servers import (
    LOWEST_PORT,
    RedisServer,
    ephemeral_floor,
    free_port,
    port_is_free,
    redis_binary,
)

_HOST = "127.0.0.1"
# Redis 6.2 puts a cluster node's bus this far above its port, with no setting to move it.
_BUS_OFFSET = 10_000
_POLL_INTERVAL = 0.05


class RedisClusterNodes:
    """Three cluster-enabled masters on 127.0.0.1, their slots assigned by `redis-cli --cluster
    create`. Without replicas: a node that is down takes its slots with it until it is back."""

    def __init__(self, root: Path, masters: int = 3) -> None:
        self.root = root
        self.nodes = [self._node(i, _cluster_port()) for i in range(masters)]

    def _node(self, index: int, port: int) -> RedisServer:
        folder = self.root / f"node{index}"
        args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(folder / "nodes.conf"),
            # A node that stops answering is marked failed after this; a short one keeps tests
            # and the chaos scenario quick.
            "--cluster-node-timeout",
            "2000",
        ]
        return RedisServer(folder, port, folder / "redis.log", args)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{_HOST}:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 60) -> None:
        """Start every node, assign the slots, and return once each node sees the cluster ok."""
        try:
            self._start_nodes()
            addresses = [f"{_HOST}:{n.port}" for n in self.nodes]
            create = ["--cluster", "create", *addresses, "--cluster-replicas", "0"]
            created = subprocess.run(
                [str(redis_binary("redis-cli")), *create, "--cluster-yes"],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            if created.returncode:
                said = (created.stdout + created.stderr).strip().splitlines()[-3:]
                raise RuntimeError(f"redis-cli --cluster create failed: {' / '.join(said)}")
            self.wait_ok(timeout)
        except BaseException:
            self.stop()
            raise

    def _start_nodes(self, attempts: int = 3) -> None:
        """Start every node. Ports found free can be taken before a node binds them (by the
        servers of a test run in parallel): nodes that met one start again on new ports."""
        for attempt in range(attempts):
            try:
                for node in self.nodes:
                    # A new cluster: a node that finds an earlier cluster's config joins no other.
                    (node.dir / "nodes.conf").unlink(missing_ok=True)
                    node.start()
                return
            except RuntimeError as exc:
                # The node's log, which the error quotes, names the bind that failed.
                if "Address already in use" not in str(exc) or attempt == attempts - 1:
                    raise
                self.stop()
                self.nodes = [self._node(i, _cluster_port()) for i in range(len(self.nodes))]

    def wait_ok(self, timeout: float = 60) -> None:
        """Return once every node reports `cluster_state:ok`."""
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            while not _cluster_ok(node.port):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Redis Cluster node {node.port} did not report ok in time")
                time.sleep(_POLL_INTERVAL)

    def restart(self, index: int, down_seconds: float = 0) -> None:
        """Stop one node and start it again: it rejoins under its own identity (nodes.conf),
        without the data it held (no persistence, as jobplane's Redis needs none)."""
        node = self.nodes[index]
        node.kill()
        time.sleep(down_seconds)
        node.start()
        self.wait_ok()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop(timeout=5)


class SentinelGroup:
    """A master, one replica and three Sentinels (quorum two) on 127.0.0.1."""

    MASTER_NAME = "mymaster"

    def __init__(self, root: Path, sentinels: int = 3) -> None:
        self.root = root
        self.master = RedisServer(root / "master", free_port(), root / "master" / "redis.log")
        replica_args = ["--replicaof", _HOST, str(self.master.port)]
        self.replica = RedisServer(
            root / "replica", free_port(), root / "replica" / "redis.log", replica_args
        )
        self.sentinels = [self._sentinel(i, free_port()) for i in range(sentinels)]

    def _sentinel(self, index: int, port: int) -> RedisServer:
        folder = self.root / f"sentinel{index}"
        folder.mkdir(parents=True, exist_ok=True)
        # A Sentinel rewrites its config file as it learns the topology, so each has its own.
        config = folder / "sentinel.conf"
        config.write_text(
            f"sentinel monitor {self.MASTER_NAME} {_HOST} {self.master.port} 2\n"
            f"sentinel down-after-milliseconds {self.MASTER_NAME} 1000\n"
            f"sentinel failover-timeout {self.MASTER_NAME} 5000\n"
            f"sentinel parallel-syncs {self.MASTER_NAME} 1\n"
        )
        return RedisServer(folder, port, folder / "sentinel.log", ["--sentinel"], config)

    @property
    def url(self) -> str:
        hosts = ",".join(f"{_HOST}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.MASTER_NAME}/0"

    def start(self, timeout: float = 60) -> None:
        """Start them all; return once a failover can happen (`wait_ready`)."""
        try:
            self.master.start()
            self.replica.start()
            for sentinel in self.sentinels:
                sentinel.start()
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float = 60) -> None:
        """Return once a replica is in sync with the master and every Sentinel knows the others
        and the replica: then a failover can happen."""
        deadline = time.monotonic() + timeout
        while not self._ready():
            if time.monotonic() > deadline:
                raise RuntimeError("the Sentinel setup did not become ready in time")
            time.sleep(_POLL_INTERVAL)

    def _ready(self) -> bool:
        try:
            master = self.current_master()
            replica = self.replica if master is self.master else self.master
            with redis.Redis(_HOST, replica.port, socket_timeout=1) as client:
                if client.info("replication").get("master_link_status") != "up":
                    return False
            for sentinel in self.sentinels:
                with redis.Redis(_HOST, sentinel.port, socket_timeout=1) as client:
                    state = client.sentinel_master(self.MASTER_NAME)
                    others = len(self.sentinels) - 1
                    if state["num-other-sentinels"] < others or state["num-slaves"] < 1:
                        return False
        except redis.RedisError:
            return False
        return True

    def current_master(self) -> RedisServer:
        """The server the Sentinels name as master now."""
        with redis.Redis(_HOST, self.sentinels[0].port, socket_timeout=1) as client:
            _, port = client.sentinel_get_master_addr_by_name(self.MASTER_NAME)
        return self.master if int(port) == self.master.port else self.replica

    def stop(self) -> None:
        for server in [*self.sentinels, self.replica, self.master]:
            server.stop(timeout=5)


def _cluster_port() -> int:
    """A free port whose cluster bus port (10000 above it, fixed in Redis 6.2) is free too:
    both below the kernel's ephemeral range where there is room, where no outgoing connection
    takes them (see `free_port`)."""
    top = ephemeral_floor() - _BUS_OFFSET
    top = top if top - LOWEST_PORT >= 1000 else 50_000
    for _ in range(1000):
        port = random.randrange(LOWEST_PORT, top)
        if all(port_is_free(p) for p in (port, port + _BUS_OFFSET)):
            return port
    raise RuntimeError("found no free pair of ports for a Redis Cluster node")


def _cluster_ok(port: int) -> bool:
    try:
        with redis.Redis(_HOST, port, socket_timeout=1) as client:
            info = client.cluster("INFO")
    except redis.RedisError:
        return False
    return bool(info.get("cluster_state") == "ok")
