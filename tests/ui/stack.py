"""A whole jobplane for the dashboard's browser tests and screenshots: real `jobplane api`,
`worker` and `scheduler` processes on a database and Redis prefix of their own, and Debian's
Chromium driven by Playwright.
"""

import secrets
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
from playwright.sync_api import Browser, Playwright
from pymongo import MongoClient

from jobplane.devstack import free_port
from jobplane.settings import Settings
from tests.integration.processes import spawn, terminate

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_MISSING = (
    f"the dashboard's browser tests need Debian's Chromium at {CHROMIUM}, which is missing "
    "(`make test` installs it with apt-get where it can: apt-get install chromium)"
)
# Headless, and quiet: no first-run pages, no calls home, no component updates.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@dataclass
class Stack:
    settings: Settings
    url: str
    admin_key: str
    logs: Path

    def admin(self) -> httpx.Client:
        headers = {"authorization": f"Bearer {self.admin_key}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    @property
    def dashboard(self) -> str:
        return f"{self.url}/ui/"


@contextmanager
def running_stack(
    mongo_url: str, redis_url: str, logs: Path, queues: Sequence[str] = ("default",)
) -> Iterator[Stack]:
    """API, worker and scheduler processes until the block ends; their data is removed after.
    The worker serves `queues`."""
    tag = secrets.token_hex(4)
    settings = Settings(
        mongodb_url=mongo_url,
        redis_url=redis_url,
        db=f"ui_{tag}",
        redis_prefix=f"ui{tag}:",
        admin_key=secrets.token_urlsafe(24),
        host="127.0.0.1",
        port=free_port(),
        queues=list(queues),
        log_format="text",
        lease_seconds=5,
        heartbeat_seconds=1,
        poll_seconds=0.2,
        reconcile_seconds=1,
        scheduler_lock_seconds=6,
    )
    assert settings.admin_key is not None
    logs.mkdir(parents=True, exist_ok=True)
    processes = [
        spawn(settings, command, logs / f"{command}.log")
        for command in ("api", "worker", "scheduler")
    ]
    stack = Stack(settings, f"http://127.0.0.1:{settings.port}", settings.admin_key, logs)
    try:
        _wait_ready(stack, processes)
        yield stack
    finally:
        for process in processes:
            terminate(process)
        with MongoClient[dict[str, Any]](mongo_url) as client:
            client.drop_database(settings.db)
        with redis.Redis.from_url(redis_url) as client:
            keys = list(client.scan_iter(match=f"{settings.redis_prefix}*", count=500))
            if keys:
                client.delete(*keys)


@contextmanager
def another_api(stack: Stack, logs: Path, **settings: Any) -> Iterator[Stack]:
    """One more API process on the stack's database and Redis, on a port of its own, with
    `settings` changed: a setting only the API reads, tested beside the stack's own API."""
    changed = stack.settings.model_copy(update={**settings, "port": free_port()})
    logs.mkdir(parents=True, exist_ok=True)
    process = spawn(changed, "api", logs / "another_api.log")
    other = Stack(changed, f"http://127.0.0.1:{changed.port}", stack.admin_key, logs)
    try:
        _wait_ready(other, [process])
        yield other
    finally:
        terminate(process)


def _wait_ready(stack: Stack, processes: list[Any], within: float = 60) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"a jobplane process exited at start; logs in {stack.logs}")
        try:
            if httpx.get(f"{stack.url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the API was not ready within {within} s; logs in {stack.logs}")


def launch_chromium(playwright: Playwright) -> Browser:
    if not CHROMIUM.exists() or shutil.which(str(CHROMIUM)) is None:
        raise FileNotFoundError(CHROMIUM_MISSING)
    return playwright.chromium.launch(
        executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
    )
