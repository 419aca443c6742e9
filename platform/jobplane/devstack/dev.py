"""`jobplane dev`: local servers unless URLs are set; then API, worker, scheduler and notifier
together."""

import asyncio
import logging
import math
import secrets
import shlex
import sys
from pathlib import Path

import uvicorn

from jobplane.api import create_app
from jobplane.backends import Backends, open_backends
from jobplane.cli.render import LiveView
from jobplane.devstack.servers import LocalStack
from jobplane.model import TERMINAL
from jobplane.process import (
    HTTPServer,
    Stopped,
    configure_logging,
    serve_http,
    stop_on_signals,
    unless_stopped,
)
from jobplane.runs import RunRequest, RunService
from jobplane.scheduler import Scheduler
from jobplane.settings import Settings
from jobplane.templates import load_path
from jobplane.webhooks.notifier import Notifier
from jobplane.worker import Worker
from jobplane.worker.handlers import load_modules

DEMO_PAYLOAD = {"target": "demo", "sleepSeconds": 3}
# The worker's drain: a laptop's runs are handed back soon rather than waited for.
DRAIN_SECONDS = 5.0
# How long each local server gets to shut down cleanly before it is killed.
SERVER_STOP_SECONDS = 10.0


async def run_dev(settings: Settings, templates: Path, demo: bool, exit_after_demo: bool) -> int:
    """Returns the exit code: 0, or 1 when the demo run did not succeed."""
    # For a person unless told otherwise: the worker says what it loaded and each run it ends.
    configure_logging(settings.log_format or "text")
    load_modules(settings.handlers)
    stop = asyncio.Event()
    # The parts' drain and close budgets, then stopping the servers it started.
    stop_on_signals(stop, DRAIN_SECONDS + 2 * settings.close_seconds + 2 * SERVER_STOP_SECONDS)
    stack = None
    if not settings.mongodb_url or not settings.redis_url:
        stack = LocalStack(settings.data_dir)
        await asyncio.to_thread(stack.start)
        settings = settings.model_copy(
            update={
                "mongodb_url": settings.mongodb_url or stack.mongo_url,
                "redis_url": settings.redis_url or stack.redis_url,
            }
        )
    settings = settings.model_copy(update={"admin_key": settings.admin_key or _admin_key(settings)})
    try:
        async with open_backends(settings, stop=stop) as backends:
            return await _serve(
                settings, backends, stop, templates if demo else None, exit_after_demo
            )
    except Stopped:  # before it was up: a stop as asked for
        return 0
    finally:
        if stack is not None:
            await asyncio.to_thread(stack.stop, SERVER_STOP_SECONDS)


async def _serve(
    settings: Settings,
    backends: Backends,
    stop: asyncio.Event,
    demo_templates: Path | None,
    exit_after_demo: bool,
) -> int:
    config = uvicorn.Config(
        create_app(settings, backends, stop),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        timeout_graceful_shutdown=math.ceil(settings.close_seconds),
    )
    server = HTTPServer(config)
    worker = Worker(backends.store, backends.queue, settings)
    scheduler = Scheduler(backends.store, backends.queue, settings)
    notifier = Notifier(backends.store, backends.queue, settings)
    parts = [
        asyncio.create_task(serve_http(server, stop)),
        asyncio.create_task(worker.run(stop, DRAIN_SECONDS)),
        asyncio.create_task(scheduler.run(stop)),
        asyncio.create_task(notifier.run(stop)),
    ]
    # uvicorn exposes readiness only as a flag.
    while not server.started and not parts[0].done():  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    if parts[0].done():  # the port was taken, say; the error was logged
        stop.set()
        await asyncio.gather(*parts, return_exceptions=True)
        return 1
    url = f"http://{settings.host}:{settings.port}"
    print(f"jobplane is up at {url}  (dashboard: {url}/ui/, docs: {url}/docs)")
    print(f"  admin API key: {settings.admin_key}")
    print(f"  MongoDB: {settings.mongodb_url}")
    print(f"  Redis:   {settings.redis_url}")
    print(f"  data:    {settings.data_dir.resolve()}")
    print(f"  shell:   . {_write_env(settings, url)}  (these, for a worker or the CLI elsewhere)")
    code = 0
    if demo_templates is not None:
        try:
            code = await unless_stopped(_demo(backends, demo_templates, stop), stop)
        except Stopped:  # a stop while MongoDB does not answer must not wait for it
            code = 1
        if exit_after_demo:
            stop.set()
    if not stop.is_set():
        print("Ctrl-C stops jobplane and the servers it started.", flush=True)
    await stop.wait()
    await asyncio.gather(*parts)
    return code


async def _demo(backends: Backends, templates: Path, stop: asyncio.Event) -> int:
    """Register the shipped templates, create a `demo_long_task` run and watch it finish."""
    for spec in load_path(templates):
        template, created = await backends.store.templates.register(spec)
        print(f"template {template.type} v{template.version}{' (new)' if created else ''}")
    service = RunService(backends.store, backends.queue)
    request = RunRequest("demo_long_task", "system", "demo", dict(DEMO_PAYLOAD))
    run, _ = await service.create(request, "user:demo")
    print(f"demo run {run.id} created; watching it:")
    view = LiveView(sys.stdout.isatty())
    # A log line lands below the drawing, which redrawing in place would overwrite: the view
    # draws afresh under it instead.
    for handler in logging.getLogger().handlers:
        handler.addFilter(view.moved_on)
    while not stop.is_set():
        run = await service.get(run.id)
        view.show(run)
        if run.status in TERMINAL:
            return 0 if run.status == "succeeded" else 1
        await asyncio.sleep(0.2)
    return 1


def _write_env(settings: Settings, url: str) -> Path:
    """What a second shell needs to reach this stack, as `export` lines to source: a worker
    of one's own handlers (the README's first hour) and the CLI. The ports of the local
    servers are chosen at their first start, so they cannot be written down in advance."""
    values = {
        "JOBPLANE_URL": url,
        "JOBPLANE_API_KEY": settings.admin_key or "",
        "JOBPLANE_MONGODB_URL": settings.mongodb_url or "",
        "JOBPLANE_REDIS_URL": settings.redis_url or "",
        "JOBPLANE_DB": settings.db,
        "JOBPLANE_REDIS_PREFIX": settings.redis_prefix,
    }
    path = settings.data_dir / "env"
    path.parent.mkdir(parents=True, exist_ok=True)
    # It holds the admin key: readable by its owner only, like `admin_key`.
    path.touch(mode=0o600)
    path.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in values.items()))
    return path


def _admin_key(settings: Settings) -> str:
    """A bootstrap admin key kept in the data directory, so restarts print the same one."""
    path = settings.data_dir / "admin_key"
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    key = "jp_admin_" + secrets.token_urlsafe(24)
    path.write_text(key + "\n")
    path.chmod(0o600)
    return key
