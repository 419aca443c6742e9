"""SIGTERM ends every process within its bounds whatever the engines do (docs/operations.md,
"Stopping"): real `python -m jobplane` processes, with MongoDB or Redis at a port where nothing
listens from the start, or killed while the process runs.

The bounds are for correctness, not speed: each is the process's drain plus its two close
budgets, and SLACK for a slow machine. Without them a process waited out PyMongo's 30 s server
selection once or more.
"""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from jobplane.backends import open_backends
from jobplane.devstack import MongoServer, RedisServer, free_port
from jobplane.model import RunStatus, StepStatus
from jobplane.runs import RunRequest, RunService
from jobplane.settings import Settings
from tests.integration.conftest import template_spec
from tests.integration.processes import spawn, stop_within, terminate

# The worker's --drain-seconds here, and `jobplane dev`'s own drain.
DRAIN = 2.0
DEV_DRAIN = 5.0
CLOSE = 2.0
SLACK = 10.0
# `jobplane dev` also stops the servers it started (a clean mongod shutdown takes a moment).
SERVERS_STOP = 10.0
# How long a process runs before the signal: past its start-up's first calls to the engines.
RUNNING = 1.5


def bound(drain: float) -> float:
    return drain + 2 * CLOSE + SLACK


def unreachable(engine: str, settings: Settings) -> Settings:
    """`settings` with one engine at a free port of 127.0.0.1, where nothing listens."""
    port = free_port()
    if engine == "mongo":
        url = f"mongodb://127.0.0.1:{port}/?replicaSet=rs0"
        return settings.model_copy(update={"mongodb_url": url, "close_seconds": CLOSE})
    url = f"redis://127.0.0.1:{port}/0"
    return settings.model_copy(update={"redis_url": url, "close_seconds": CLOSE})


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["mongo", "redis"])
@pytest.mark.parametrize("command", ["api", "worker", "scheduler", "dev"])
def test_a_process_stops_in_time_with_an_engine_unreachable(
    command: str, engine: str, settings: Settings, tmp_path: Path
) -> None:
    """MongoDB unreachable, a process is still starting (its indexes); Redis unreachable, it
    runs, its loops failing and retrying."""
    args = {
        "api": ["--port", str(free_port())],
        "worker": ["--drain-seconds", str(DRAIN)],
        "scheduler": [],
        "dev": ["--port", str(free_port()), "--data-dir", str(tmp_path / "dev")],
    }[command]
    drain = {"worker": DRAIN, "dev": DEV_DRAIN}.get(command, 0.0)
    log = tmp_path / f"{command}.log"
    proc = spawn(unreachable(engine, settings), command, log, *args)
    try:
        code, took = stop_within(proc, bound(drain), log, after=RUNNING)
    finally:
        terminate(proc)
    assert code == 0, log.read_text()
    assert took < bound(drain)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["mongo", "redis"])
async def test_a_worker_stops_in_time_when_an_engine_goes_away_mid_run(
    engine: str, settings: Settings, tmp_path: Path
) -> None:
    """The worker holds a run in a long step; the engine dies; SIGTERM. The step outlasts the
    drain, and the run's release cannot be written (MongoDB gone) or pushed (Redis gone): the
    close budget gives up on it, and the run's lease expires as after a crash."""
    mongo = MongoServer(tmp_path / "db", free_port(), tmp_path / "mongod.log")
    redis = RedisServer(tmp_path / "redis", free_port(), tmp_path / "redis.log")
    await asyncio.to_thread(mongo.start)
    await asyncio.to_thread(redis.start)
    own = settings.model_copy(
        update={"mongodb_url": mongo.url, "redis_url": redis.url, "close_seconds": CLOSE}
    )
    log = tmp_path / "worker.log"
    worker = None
    try:
        async with open_backends(own) as backends:
            sleepy = [{"id": "nap", "handler": "builtin.sleep"}]
            await backends.store.templates.register(template_spec(steps=sleepy))
            request = RunRequest("t_noop", "user", "u", {"sleepSeconds": 120})
            run, _ = await RunService(backends.store, backends.queue).create(request, "user:a")
            worker = spawn(own, "worker", log, "--drain-seconds", str(DRAIN))
            async with asyncio.timeout(60):
                while True:
                    assert worker.poll() is None, log.read_text()
                    got = await backends.store.runs.get(run.id)
                    steps = [] if got is None else got.progress.steps
                    if any(s.status == StepStatus.RUNNING for s in steps):
                        assert got is not None and got.status == RunStatus.RUNNING
                        break
                    await asyncio.sleep(0.05)
        (mongo if engine == "mongo" else redis).kill()
        await asyncio.sleep(1)  # the worker's heartbeat and loops meet the loss
        code, took = await asyncio.to_thread(stop_within, worker, bound(DRAIN), log)
        assert code == 0, log.read_text()
        assert took < bound(DRAIN)
    finally:
        if worker is not None:
            terminate(worker)
        await asyncio.to_thread(redis.stop)
        await asyncio.to_thread(mongo.stop)


def wait_ready(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"dev stack did not become ready:\n{log.read_text()}"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["mongo", "redis"])
def test_dev_stops_in_time_and_stops_its_other_server_when_one_goes_away(
    engine: str, tmp_path: Path
) -> None:
    """`jobplane dev` with servers of its own (as in issue 19, whose data directory was
    removed); one is killed; SIGTERM. It stops in time, and still stops the one left."""
    data, port = tmp_path / "data", free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBPLANE_")}
    env["JOBPLANE_CLOSE_SECONDS"] = str(CLOSE)
    log = tmp_path / "dev.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jobplane", "dev", "--port", str(port), "--data-dir", str(data)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        wait_ready(proc, port, log)
        record = json.loads((data / "stack.json").read_text())
        gone, left = ("mongo", "redis") if engine == "mongo" else ("redis", "mongo")
        os.kill(record[gone]["pid"], signal.SIGKILL)
        if engine == "mongo":
            shutil.rmtree(data / "mongo")
        time.sleep(1)  # the parts meet the loss
        limit = bound(DEV_DRAIN) + SERVERS_STOP
        code, took = stop_within(proc, limit, log)
    finally:
        terminate(proc)
    assert code == 0, log.read_text()
    assert took < limit
    assert not pid_alive(record[left]["pid"]), f"dev left its {left} server running"


@pytest.mark.slow
async def test_an_idle_external_worker_abandons_its_long_poll_on_sigterm(
    url: str, settings: Settings, tmp_path: Path
) -> None:
    """Nothing to claim: its claim is a long poll of 20 s, which a stop does not wait out."""
    log = tmp_path / "external.log"
    key = str(settings.admin_key)
    proc = spawn(settings, "external-worker", log, "--url", url, "--key", key)
    try:
        code, took = await asyncio.to_thread(stop_within, proc, SLACK, log, after=RUNNING)
    finally:
        terminate(proc)
    assert code == 0, log.read_text()
    # Measured 0.07 s (18.7 s while a stop waited the poll out).
    assert took < SLACK / 2, log.read_text()
