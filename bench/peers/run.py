"""jobplane side by side with Celery, SAQ and procrastinate: the same workloads, interleaved.

One local Redis and one local MongoDB (jobplane's devstack servers: a one-node replica set and a
Redis without persistence) serve every system, and a private PostgreSQL cluster serves
procrastinate. Each round runs every system once, in order (jobplane, celery-mongo,
celery-redis, saq, procrastinate by default), each workload as its own subprocess, with Redis
flushed, every non-system MongoDB database dropped and PostgreSQL's database made anew before
each one. The table shows per system the median and min-max over the rounds, and jobplane's
median divided by each peer's; then the ratios the goals are stated in.

    drain    N jobs enqueued first, then P worker processes start: first job started (jobplane:
             first claim) to last job done, jobs/s
    e2e      P workers started and idle, then one producer enqueues N while they work: first
             enqueue to last job done, jobs/s
    enqueue  one producer process, no workers: N single enqueues, jobs/s
    latency  P workers idle, then arrivals on a fixed clock (200/s for 10 s after 2 s of warm-up):
             enqueue call to task body started, p50 and p99 ms

jobplane's figures come from its own benchmarks, as subprocesses: `bench/throughput.py --json`
(drain, e2e and create, its in-process producer) and `bench/latency.py --json`. The peers run in
their own virtual environments under `.bench-venvs/` (created on first use from the pinned
`requirements-*.txt` here) through `celery_jobs.py`, `saq_jobs.py` and `procrastinate_jobs.py`.
See README.md here.

    .venv/bin/python bench/peers/run.py [--rounds K] [--runs N] [--workers 1,2,4] [--systems ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import pwd
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pymongo
import redis

# bench/peers is the script's own folder, first on sys.path; bench/ holds the CPU readers.
from common import WORKLOADS, median_range

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from jobplane.devstack.servers import MongoServer, RedisServer, free_port
from throughput import CLOCK_TICK, cpu_seconds, machine_cpu_seconds

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
ROOT = BENCH.parent
VENVS = ROOT / ".bench-venvs"
DEFAULT_SYSTEMS = (
    "jobplane",
    "jobplane-users",
    "celery-mongo",
    "celery-redis",
    "saq",
    "procrastinate",
)
# jobplane's set-ups: the tuned one (its own benchmarks' defaults) and as users run it.
JOBPLANES = ("jobplane", "jobplane-users")
# Other processes busier than this (in cores) make a run wait a little (`--settle`).
QUIET_CORES = 0.15
RUN_TIMEOUT = 1800  # seconds for one subprocess; a stall is caught sooner inside each driver
# The figures each workload yields, in table order, with the table's headings.
COLUMNS = {
    "drain": "drain jobs/s",
    "e2e": "end-to-end jobs/s",
    "enqueue": "enqueue jobs/s",
    "latency_p50_ms": "latency p50 ms",
    "latency_p99_ms": "latency p99 ms",
}
LOWER_IS_BETTER = {"latency_p50_ms", "latency_p99_ms"}
DASH = "\u2013"  # an en dash, as in docs/benchmarks.md's ranges


# -- systems -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Servers:
    mongodb_url: str
    redis_url: str
    pids: tuple[int, ...]  # for the CPU they use, when this runner started them
    postgres: PostgresServer | None = None  # when procrastinate is compared

    def database_url(self, name: str) -> str:
        """The MongoDB URL with a default database, as Celery's result backend wants it."""
        parts = urlsplit(self.mongodb_url)
        return urlunsplit(parts._replace(path=f"/{name}"))


@dataclass(frozen=True)
class Run:
    """One subprocess: a system's workloads, which print their figures as a last JSON line."""

    argv: list[str]
    workloads: tuple[str, ...]


class System:
    name: str

    def runs(self, args: argparse.Namespace, workers: int, servers: Servers) -> list[Run]:
        raise NotImplementedError

    def describe(self, args: argparse.Namespace) -> str:
        raise NotImplementedError


class Jobplane(System):
    name = "jobplane"

    def __init__(self) -> None:
        help_text = subprocess.run(
            [sys.executable, str(BENCH / "throughput.py"), "--help"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        # bench/throughput.py gains --json separately; until then only latency is measured.
        self.has_json = "--json" in help_text

    def runs(self, args: argparse.Namespace, workers: int, servers: Servers) -> list[Run]:
        common = ["--workers", str(workers), "--mongodb-url", servers.mongodb_url]
        common += ["--redis-url", servers.redis_url]
        if args.concurrency:
            common += ["--concurrency", str(args.concurrency)]
        runs = []
        names = {"drain": "drain", "e2e": "e2e", "enqueue": "create"}
        asked = [w for w in args.workloads if w in names]
        if asked and self.has_json:
            argv = [sys.executable, str(BENCH / "throughput.py"), "--json", "--runs"]
            argv += [str(args.runs), "--workloads", ",".join(names[w] for w in asked), *common]
            runs.append(Run(argv, tuple(asked)))
        if "latency" in args.workloads:
            argv = [sys.executable, str(BENCH / "latency.py"), "--json", "--rate", str(args.rate)]
            argv += ["--seconds", str(args.seconds), "--warmup", str(args.warmup), *common]
            runs.append(Run(argv, ("latency",)))
        return runs

    def describe(self, args: argparse.Namespace) -> str:
        git = ["git", "-C", str(ROOT)]
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True)
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "platform", "bench"], capture_output=True
        )
        state = commit.stdout.decode().strip() + (" + uncommitted changes" if dirty.stdout else "")
        missing = "" if self.has_json else "; bench/throughput.py has no --json yet: latency only"
        return (
            f"jobplane at {state}: concurrency {args.concurrency or 32} per worker process, "
            f"32 producer callers (in process), write concern majority{missing}"
        )


class JobplaneAsUsers(System):
    """jobplane as a user runs it: `jobplane.Client` in direct mode from a process of its own
    (32 concurrent `create` calls, plain `asyncio.run`), workers at their default concurrency
    (`bench/as_users.py`'s `users-direct`). End to end and latency only."""

    name = "jobplane-users"

    def runs(self, args: argparse.Namespace, workers: int, servers: Servers) -> list[Run]:
        asked = tuple(w for w in args.workloads if w in ("e2e", "latency"))
        if not asked:
            return []
        argv = [sys.executable, str(BENCH / "as_users.py"), "--json", "--repeat", "1"]
        argv += ["--setups", "users-direct", "--workloads", ",".join(asked)]
        argv += ["--runs", str(args.runs), "--rate", str(args.rate), "--seconds"]
        argv += [str(args.seconds), "--warmup", str(args.warmup), "--workers", str(workers)]
        argv += ["--mongodb-url", servers.mongodb_url, "--redis-url", servers.redis_url]
        return [Run(argv, asked)]

    def describe(self, args: argparse.Namespace) -> str:
        return (
            "jobplane-users: as users run it, jobplane.Client (direct) in a process of its own "
            "with 32 concurrent creates, workers at their default concurrency; e2e and "
            "latency only"
        )


@dataclass
class Peer(System):
    name: str
    venv: str  # .bench-venvs/<venv>, from requirements-<venv>.txt
    script: str
    note: str
    options: list[str] = field(default_factory=list)

    def python(self) -> Path:
        return VENVS / self.venv / "bin" / "python"

    def runs(self, args: argparse.Namespace, workers: int, servers: Servers) -> list[Run]:
        argv = [str(self.python()), str(HERE / self.script), *self.options]
        argv += ["--redis-url", servers.redis_url, "--mongodb-url", servers.database_url("peers")]
        argv += ["--runs", str(args.runs), "--workers", str(workers), "--rate", str(args.rate)]
        argv += ["--seconds", str(args.seconds), "--warmup", str(args.warmup)]
        if args.concurrency:
            argv += ["--concurrency", str(args.concurrency)]
        if self.venv == "celery":
            argv += ["--pool", args.celery_pool]
        if self.venv == "procrastinate" and servers.postgres is not None:
            argv += ["--postgres-url", servers.postgres.url]
        if args.callers:
            argv += ["--callers", str(args.callers)]
        return [Run([*argv, "--workload", w], (w,)) for w in args.workloads]

    def describe(self, args: argparse.Namespace) -> str:
        python = self.python()
        versions = subprocess.run(
            [str(python), "-m", "pip", "freeze"], capture_output=True, text=True, check=True
        ).stdout.split()
        wanted = ("celery==", "kombu==", "saq==", "redis==", "pymongo==", "hiredis==")
        wanted += ("procrastinate==", "psycopg==", "psycopg-pool==")
        pins = ", ".join(v for v in versions if v.startswith(wanted))
        if self.venv == "celery":
            pool = args.celery_pool
            shape = {"prefork": "one worker, P prefork children", "solo": "P solo workers"}.get(
                pool, f"P workers of {args.concurrency or 1} threads"
            )
            callers = args.callers or 1
        elif self.venv == "procrastinate":
            shape = f"P workers of concurrency {args.concurrency or 1}"
            callers = args.callers or 32
        else:
            shape = f"P workers of concurrency {args.concurrency or 10}"
            callers = args.callers or 32
        return f"{self.name}: {self.note}; {shape}; {callers} producer callers ({pins})"


SYSTEMS: dict[str, Peer] = {
    "celery-mongo": Peer(
        "celery-mongo",
        "celery",
        "celery_jobs.py",
        "Redis broker, MongoDB result backend",
        ["--backend", "mongodb"],
    ),
    "celery-redis": Peer(
        "celery-redis",
        "celery",
        "celery_jobs.py",
        "Redis broker, no result backend",
        ["--backend", "none"],
    ),
    # Not in the default set: Celery storing its results in Redis as well.
    "celery-redis-results": Peer(
        "celery-redis-results",
        "celery",
        "celery_jobs.py",
        "Redis broker, Redis result backend",
        ["--backend", "redis"],
    ),
    "saq": Peer("saq", "saq", "saq_jobs.py", "Redis only (jobs and results in Redis)"),
    "procrastinate": Peer(
        "procrastinate",
        "procrastinate",
        "procrastinate_jobs.py",
        "PostgreSQL only (jobs, their status and events in PostgreSQL, fsync and "
        "synchronous_commit on)",
    ),
}


def ensure_venv(name: str) -> None:
    """Create `.bench-venvs/NAME` from requirements-NAME.txt unless it has exactly those pins."""
    venv = VENVS / name
    wanted = (HERE / f"requirements-{name}.txt").read_text()
    stamp = venv / "requirements.txt"
    if stamp.exists() and stamp.read_text() == wanted:
        return
    # The interpreter behind jobplane's .venv, so every system runs on the same Python.
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    print(f"creating {venv} with {base}", flush=True)
    subprocess.run([str(base), "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "-r", str(HERE / f"requirements-{name}.txt")], check=True)
    stamp.write_text(wanted)


# -- servers and measuring -----------------------------------------------------------------------

# Where Debian's `postgresql` package puts each major version's server binaries.
POSTGRES_ROOT = Path("/usr/lib/postgresql")
POSTGRES_DATABASE = "peers"
POSTGRES_USER = "postgres"  # initdb refuses root: as root, the cluster runs as this account


def postgres_binaries() -> Path:
    """The newest PostgreSQL server installed, or a message saying how to install one."""
    found = [p.parent for p in POSTGRES_ROOT.glob("*/bin/postgres")]
    found = [p for p in found if (p / "initdb").exists() and (p / "psql").exists()]
    if not found:
        raise SystemExit(
            f"procrastinate runs on PostgreSQL, whose server is not installed (no "
            f"{POSTGRES_ROOT}/*/bin/postgres): `make bench` installs Debian's `postgresql` "
            f"package when run as root, or run `apt-get install postgresql`; or leave "
            f"procrastinate out of --systems"
        )
    return max(found, key=lambda p: [int(v) for v in p.parent.name.split(".") if v.isdigit()])


class PostgresServer:
    """A private PostgreSQL cluster in a temporary directory, on a free loopback port.

    Made by `initdb` and served by `postgres` with the durability defaults written out (fsync and
    synchronous_commit on: a commit returns once its WAL is flushed to disk). initdb and postgres
    refuse to run as root, so a root runner starts both as the `postgres` account, which Debian's
    package creates. Only TCP on 127.0.0.1 (no Unix socket), trust authentication."""

    def __init__(self, log_path: Path) -> None:
        self.bin = postgres_binaries()
        self.port = free_port()
        self.log_path = log_path
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/{POSTGRES_DATABASE}"
        self.user: dict[str, Any] = {}
        if os.geteuid() == 0:
            try:
                account = pwd.getpwnam(POSTGRES_USER)
            except KeyError:
                raise SystemExit(
                    f"PostgreSQL refuses to run as root and there is no `{POSTGRES_USER}` "
                    f"account to run it as (Debian's `postgresql` package creates it)"
                ) from None
            self.user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
        # Not under the runner's own temporary directory: that one is private to its owner.
        self.root = Path(tempfile.mkdtemp(prefix="peers-bench-postgres-"))
        if self.user:
            os.chown(self.root, self.user["user"], self.user["group"])
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        return 0 if self.process is None else self.process.pid

    def start(self, timeout: float = 60) -> None:
        data = self.root / "data"
        with self.log_path.open("ab") as log:
            initdb = [str(self.bin / "initdb"), "-D", str(data), "-U", "postgres"]
            initdb += ["--auth=trust", "--no-locale", "--encoding=UTF8"]
            run = subprocess.run(
                initdb, stdout=log, stderr=subprocess.STDOUT, cwd=self.root, **self.user
            )
            if run.returncode != 0:
                raise RuntimeError(f"initdb exited with {run.returncode}; see {self.log_path}")
            settings = {
                "listen_addresses": "127.0.0.1",
                "unix_socket_directories": "",
                "fsync": "on",
                "synchronous_commit": "on",
                "max_connections": "300",  # each peer process keeps a pool of connections
            }
            argv = [str(self.bin / "postgres"), "-D", str(data), "-p", str(self.port)]
            for name, value in settings.items():
                argv += ["-c", f"{name}={value}"]
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                start_new_session=True,
                **self.user,
            )
        deadline = time.monotonic() + timeout
        ready = [str(self.bin / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)]
        while subprocess.run(ready).returncode != 0:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"postgres did not start; see {self.log_path}")
            time.sleep(0.05)

    def psql(self, sql: str, database: str = "postgres") -> str:
        argv = [str(self.bin / "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"]
        argv += ["-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", database]
        done = subprocess.run([*argv, "-c", sql], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"psql {sql!r}: {done.stderr.strip()}")
        return done.stdout.strip()

    def recreate(self) -> None:
        """An empty database for the next run; procrastinate's driver applies its schema."""
        self.psql(f"DROP DATABASE IF EXISTS {POSTGRES_DATABASE} WITH (FORCE)")
        self.psql(f"CREATE DATABASE {POSTGRES_DATABASE}")

    def stop(self, timeout: float = 30) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGINT)  # fast shutdown: clients are not waited for
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
        shutil.rmtree(self.root, ignore_errors=True)


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU time of a process and its descendants, live or ended, from /proc.

    PostgreSQL's postmaster forks a backend for each connection, which ends with it; a reaped
    backend's time is in its parent's cutime and cstime, so those are counted too."""
    if root <= 0:
        return 0.0
    stats: dict[int, tuple[int, int]] = {}  # pid: (parent, ticks)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        stats[int(entry.name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]))
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (parent, _) in stats.items():
        children[parent].append(pid)
    ticks, todo = 0, [root] if root in stats else []
    while todo:
        pid = todo.pop()
        ticks += stats[pid][1]
        todo.extend(children[pid])
    return ticks / CLOCK_TICK


@contextlib.contextmanager
def servers(args: argparse.Namespace, root: Path) -> Iterator[Servers]:
    postgres = PostgresServer(root / "postgres.log") if "procrastinate" in args.systems else None
    try:
        if postgres is not None:
            postgres.start()
        if args.mongodb_url and args.redis_url:
            yield Servers(args.mongodb_url, args.redis_url, (), postgres)
            return
        mongo = MongoServer(root / "mongo", free_port(), root / "mongod.log")
        rds = RedisServer(root / "redis", free_port(), root / "redis.log")
        try:
            mongo.start()
            rds.start()
            yield Servers(mongo.url, rds.url, (mongo.pid or 0, rds.pid or 0), postgres)
        finally:
            rds.stop()
            mongo.stop()
    finally:
        if postgres is not None:
            postgres.stop()


def flush(servers: Servers) -> None:
    """Nothing left from the run before: every key, every database but MongoDB's own, and
    PostgreSQL's database made anew."""
    redis.Redis.from_url(servers.redis_url).flushall()
    client: pymongo.MongoClient[dict[str, Any]]
    with pymongo.MongoClient(servers.mongodb_url) as client:
        for name in client.list_database_names():
            if name not in {"admin", "config", "local"}:
                client.drop_database(name)
    if servers.postgres is not None:
        servers.postgres.recreate()


def ours(servers: Servers) -> float:
    """CPU seconds of this runner, its finished subprocesses (and theirs), and the servers
    (PostgreSQL's: the postmaster and every backend it forked)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    postgres = tree_cpu_seconds(servers.postgres.pid) if servers.postgres is not None else 0.0
    return own + sum(cpu_seconds(pid) for pid in servers.pids) + postgres


@dataclass
class Outcome:
    figures: dict[str, float]
    seconds: float
    others: float  # cores busy with processes that are not ours, on average over the run


def others_busy(servers: Servers, seconds: float) -> float:
    """Cores the machine spends on processes not ours, over the next `seconds`."""
    machine, mine = machine_cpu_seconds(), ours(servers)
    time.sleep(seconds)
    return max(0.0, machine_cpu_seconds() - machine - (ours(servers) - mine)) / seconds


def settle(servers: Servers, patience: float) -> None:
    """Wait up to `patience` seconds for other processes to leave the cores nearly idle, so a
    neighbour's burst disturbs fewer runs; then go on regardless (the table shows "others")."""
    if patience <= 0:
        return
    began = time.monotonic()
    while (busy := others_busy(servers, 2.0)) > QUIET_CORES:
        if time.monotonic() - began > patience:
            print(f"  (others still busy, {busy:.2f} cores, after {patience:.0f} s)", flush=True)
            return
    if time.monotonic() - began > 2.5:
        print(f"  (waited {time.monotonic() - began:.0f} s for others to calm down)", flush=True)


def measure(run: Run, servers: Servers, log: Path, patience: float) -> Outcome:
    flush(servers)
    settle(servers, patience)
    machine, mine, began = machine_cpu_seconds(), ours(servers), time.perf_counter()
    with log.open("w") as out:
        out.write(" ".join(run.argv) + "\n\n")
        out.flush()
        proc = subprocess.Popen(run.argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            returncode = proc.wait(RUN_TIMEOUT)
        finally:
            # On a timeout or Ctrl-C: SIGTERM lets the driver stop the workers it started.
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    seconds = time.perf_counter() - began
    busy = machine_cpu_seconds() - machine - (ours(servers) - mine)
    lines = log.read_text().splitlines()
    if returncode != 0 or len(lines) < 3:
        tail = "\n".join(lines[-30:])
        raise RuntimeError(f"exit {returncode}; last lines of {log}:\n{tail}")
    return Outcome(json.loads(lines[-1]), seconds, max(0.0, busy) / seconds)


# -- the report ----------------------------------------------------------------------------------

# figures[workers][system][figure] = one value per round
Figures = dict[int, dict[str, dict[str, list[float]]]]


def cell(values: list[float], lower_is_better: bool) -> str:
    if not values:
        return DASH
    mid, low, high = median_range(values)
    spec = "{:,.1f}" if lower_is_better else "{:,.0f}"
    if len(values) == 1:
        return spec.format(mid)
    return f"**{spec.format(mid)}** ({spec.format(low)}{DASH}{spec.format(high)})"


def ratio(ours_: list[float], theirs: list[float]) -> str:
    if not ours_ or not theirs or median_range(theirs)[0] <= 0:
        return DASH
    return f"{median_range(ours_)[0] / median_range(theirs)[0]:.2f}"


def table(figures: dict[str, dict[str, list[float]]], systems: list[str]) -> list[str]:
    columns = [c for c in COLUMNS if any(figures[s].get(c) for s in systems)]
    out = [
        "| system | " + " | ".join(COLUMNS[c] for c in columns) + " | others (cores) |",
        "|---|" + "---:|" * (len(columns) + 1),
    ]
    for system in systems:
        values = figures[system]
        cells = [cell(values.get(c, []), c in LOWER_IS_BETTER) for c in columns]
        others = values.get("others", [])
        busy = f"{min(others):.2f}{DASH}{max(others):.2f}" if others else DASH
        out.append(f"| {system} | " + " | ".join(cells) + f" | {busy} |")
    peers = [s for s in systems if s not in JOBPLANES]
    for ours_ in (s for s in JOBPLANES if s in systems):
        base = figures.get(ours_, {})
        if not base or not peers:
            continue
        headings = " | ".join(COLUMNS[c] for c in columns)
        out += ["", f"| {ours_} ÷ peer (medians) | {headings} |"]
        out.append("|---|" + "---:|" * len(columns))
        for peer in peers:
            ratios = [ratio(base.get(c, []), figures[peer].get(c, [])) for c in columns]
            out.append(f"| {peer} | " + " | ".join(ratios) + " |")
    return out


def scaling(figures: Figures, systems: list[str]) -> list[str]:
    """Medians by worker processes: one row per system and figure."""
    counts = sorted(figures)
    out = ["| system | figure | " + " | ".join(f"P={p}" for p in counts) + " |"]
    out.append("|---|---|" + "---:|" * len(counts))
    for system in systems:
        for c, heading in COLUMNS.items():
            rows = [figures[p][system].get(c, []) for p in counts]
            if any(rows):
                spec = "{:,.1f}" if c in LOWER_IS_BETTER else "{:,.0f}"
                cells = [spec.format(median_range(r)[0]) if r else DASH for r in rows]
                out.append(f"| {system} | {heading} | " + " | ".join(cells) + " |")
    return out


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if "model name" in ln), "?")
    meminfo = Path("/proc/meminfo").read_text().split()
    mem_gib = int(meminfo[meminfo.index("MemTotal:") + 1]) / 2**20
    return (
        f"{os.cpu_count()} cpus ({len(os.sched_getaffinity(0))} usable), {model}, "
        f"{mem_gib:.1f} GiB, {platform.platform()}, python {platform.python_version()}"
    )


def server_versions(servers: Servers) -> str:
    client: pymongo.MongoClient[dict[str, Any]]
    with pymongo.MongoClient(servers.mongodb_url) as client:
        mongod = client.admin.command("buildInfo")["version"]
    rds = redis.Redis.from_url(servers.redis_url).info("server")["redis_version"]
    versions = f"mongod {mongod} (one-node replica set), redis-server {rds}"
    if servers.postgres is not None:
        show = "SELECT current_setting('server_version') || ', fsync ' || current_setting('fsync')"
        show += " || ', synchronous_commit ' || current_setting('synchronous_commit')"
        versions += f", postgres {servers.postgres.psql(show)}"
    return versions


# The goals the comparison is read against: (what, jobplane's figure, the peer's or None for
# jobplane's own figure, at least or at most, the bound).
GOALS = (
    ("e2e jobplane/saq", "e2e", "saq", ">=", 0.75),
    ("latency p50 jobplane/procrastinate", "latency_p50_ms", "procrastinate", "<=", 1.0),
    ("latency p99 jobplane", "latency_p99_ms", None, "<=", 10.0),
)


def goals(figures: dict[str, dict[str, list[float]]]) -> list[str]:
    """One line per goal and jobplane set-up whose figures were measured, from the medians."""
    out = []
    for system in JOBPLANES:
        out += goals_of(system, figures)
    return out


def goals_of(system: str, figures: dict[str, dict[str, list[float]]]) -> list[str]:
    out = []
    base = figures.get(system, {})
    for goal, figure, peer, sense, bound in GOALS:
        what = goal.replace("jobplane", system, 1)
        ours_ = base.get(figure, [])
        theirs = figures.get(peer, {}).get(figure, []) if peer else [1.0]
        if not ours_ or not theirs or median_range(theirs)[0] <= 0:
            continue
        value = median_range(ours_)[0] / median_range(theirs)[0]
        met = value >= bound if sense == ">=" else value <= bound
        unit = "" if peer else " ms"
        sign = "\u2265" if sense == ">=" else "\u2264"
        out.append(
            f"{what} = {value:.2f}{unit} (goal {sign} {bound:g}{unit}): "
            + ("met" if met else "not met")
        )
    return out


def report(figures: Figures, systems: list[str]) -> None:
    for workers, by_system in figures.items():
        rounds = max(len(v) for f in by_system.values() for k, v in f.items() if k in COLUMNS)
        print(f"\nP = {workers} worker processes, {rounds} rounds:\n")
        print("\n".join(table(by_system, systems)))
        if lines := goals(by_system):
            print("\ngoals (medians):\n")
            print("\n".join(lines))
    if len(figures) > 1:
        print("\nmedians by worker processes:\n")
        print("\n".join(scaling(figures, systems)))


def record(
    run: Run,
    servers: Servers,
    log: Path,
    label: str,
    into: dict[str, list[float]],
    args: argparse.Namespace,
) -> bool:
    """Measure `run` and add its figures to `into`; False (and the log's tail) if it failed.

    A run during which other processes kept more than `--max-others` cores busy is measured
    again, up to `--redo` times; the last attempt counts whatever its neighbours did."""
    for attempt in range(args.redo + 1):
        try:
            outcome = measure(run, servers, log, args.settle)
        except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
            print(f"{label}: FAILED: {exc}", flush=True)
            return False
        if outcome.others <= args.max_others or attempt == args.redo:
            break
        print(f"  ({label} disturbed: others {outcome.others:.2f} cores; again)", flush=True)
    for key, value in outcome.figures.items():
        into[key].append(value)
    into["others"].append(outcome.others)
    shown = ", ".join(f"{k} {v:,.1f}" for k, v in outcome.figures.items() if k in COLUMNS)
    print(
        f"{label}: {shown} ({outcome.seconds:.0f} s, others {outcome.others:.2f} cores)",
        flush=True,
    )
    return True


# -- main ----------------------------------------------------------------------------------------


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--runs", type=int, default=10_000, help="jobs for drain, e2e, enqueue")
    parser.add_argument(
        "--workers",
        type=lambda s: [int(p) for p in s.split(",")],
        default=[2],
        help="worker processes; a list (1,2,4) measures each in turn",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        help="jobs at once per worker process for jobplane, SAQ, procrastinate and Celery's "
        "threads pool (default: each one's own, 32 for jobplane's benchmarks, 10 for SAQ, 1 for "
        "procrastinate)",
    )
    parser.add_argument(
        "--systems",
        type=lambda s: s.split(","),
        default=list(DEFAULT_SYSTEMS),
        help=f"comma-separated, in round order, of: {', '.join([*JOBPLANES, *SYSTEMS])}",
    )
    parser.add_argument(
        "--workloads",
        type=lambda s: s.split(","),
        default=list(WORKLOADS),
        help=f"comma-separated subset of: {', '.join(WORKLOADS)}",
    )
    parser.add_argument("--rate", type=float, default=200, help="latency: jobs a second")
    parser.add_argument("--seconds", type=float, default=10, help="latency: measured seconds")
    parser.add_argument("--warmup", type=float, default=2, help="latency: seconds not measured")
    parser.add_argument("--celery-pool", choices=["prefork", "solo", "threads"], default="prefork")
    parser.add_argument(
        "--callers",
        type=int,
        help="concurrent producer callers for the peers (default: 32 for SAQ and procrastinate, "
        "as jobplane's benchmarks; 1 for Celery, its fastest)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=60,
        help="seconds a run may wait for other processes to leave the cores idle (0: never)",
    )
    parser.add_argument(
        "--max-others",
        type=float,
        default=0.3,
        help="a run during which other processes used more cores than this is measured again",
    )
    parser.add_argument("--redo", type=int, default=2, help="at most this many times")
    parser.add_argument("--report", type=Path, help="print the tables of a figures.json again")
    parser.add_argument(
        "--mongodb-url",
        help="with --redis-url: existing servers, all flushed! (PostgreSQL is always the "
        "runner's own)",
    )
    parser.add_argument("--redis-url")
    args = parser.parse_args(argv)
    if unknown := set(args.systems) - {*JOBPLANES, *SYSTEMS}:
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    if unknown := set(args.workloads) - set(WORKLOADS):
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    return args


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so that the servers and the running driver are stopped."""
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGTERM, interrupt)
    args = parse()
    if args.report:
        saved = json.loads(args.report.read_text())
        figures: Figures = {int(p): by_system for p, by_system in saved.items()}
        report(figures, list(next(iter(figures.values()))))
        return
    try:
        compare(args)
    except KeyboardInterrupt:
        sys.exit(130)


def compare(args: argparse.Namespace) -> None:
    systems: dict[str, System] = {}
    if "procrastinate" in args.systems:
        postgres_binaries()  # before any set-up, a clear message when PostgreSQL is missing
    for name in args.systems:
        if name == "jobplane":
            systems[name] = Jobplane()
        elif name == "jobplane-users":
            systems[name] = JobplaneAsUsers()
        else:
            ensure_venv(SYSTEMS[name].venv)
            systems[name] = SYSTEMS[name]
    figures: Figures = {p: defaultdict(lambda: defaultdict(list)) for p in args.workers}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="peers-bench-") as tmp, servers(args, Path(tmp)) as srv:
        logs = Path(tempfile.mkdtemp(prefix="peers-bench-logs-"))
        print(f"machine: {machine()}")
        print(f"servers: {server_versions(srv)}")
        for system in systems.values():
            print(system.describe(args))
        print(f"runs {args.runs}, rounds {args.rounds}, workers {args.workers}, logs in {logs}\n")
        for workers in args.workers:
            for k in range(1, args.rounds + 1):
                for name, system in systems.items():
                    for run in system.runs(args, workers, srv):
                        what = f"{name} {'+'.join(run.workloads)}"
                        label = f"P={workers} round {k}/{args.rounds} {what}"
                        log = logs / f"p{workers}-r{k}-{what.replace(' ', '-')}.log"
                        into = figures[workers][name]
                        if not record(run, srv, log, label, into, args):
                            failures.append(label)
        flush(srv)
    report(figures, list(systems))
    raw = logs / "figures.json"
    raw.write_text(json.dumps(figures, indent=1))
    print(f"\nevery figure: {raw} (`--report {raw}` prints the tables again)")
    if failures:
        print(f"\nFAILED ({len(failures)}): " + "; ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
