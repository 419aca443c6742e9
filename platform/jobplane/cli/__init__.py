"""`jobplane` command line: each subcommand parses its arguments and calls one service."""

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from jobplane.cli.client import APIClient, CLIError
from jobplane.cli.render import LiveView
from jobplane.model import TERMINAL, Run
from jobplane.settings import Settings


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        args.command(args)
    except CLIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {
        k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None
    }
    return Settings(**overrides)


def _client(args: argparse.Namespace) -> APIClient:
    url = args.url or os.environ.get("JOBPLANE_URL", "http://127.0.0.1:8000")
    key = args.key or os.environ.get("JOBPLANE_API_KEY") or os.environ.get("JOBPLANE_ADMIN_KEY")
    return APIClient(url, key)


# -- services ------------------------------------------------------------------------------------


def _api(args: argparse.Namespace) -> None:
    from jobplane import api

    asyncio.run(api.serve(_settings(args)))


def _worker(args: argparse.Namespace) -> None:
    from jobplane import worker
    from jobplane.process import configure_logging

    configure_logging()
    asyncio.run(worker.serve(_settings(args), args.drain_seconds))


def _scheduler(args: argparse.Namespace) -> None:
    from jobplane import scheduler
    from jobplane.process import configure_logging

    configure_logging()
    asyncio.run(scheduler.serve(_settings(args)))


def _dev(args: argparse.Namespace) -> None:
    from jobplane.devstack.dev import run_dev

    settings = _settings(args)
    try:
        code = asyncio.run(run_dev(settings, args.templates, args.demo, args.exit_after_demo))
    except RuntimeError as exc:  # a local server that would not start says why
        raise CLIError(str(exc)) from exc
    sys.exit(code)


# -- API commands --------------------------------------------------------------------------------


def _templates_apply(args: argparse.Namespace) -> None:
    path = Path(args.path)
    files = sorted(p for p in path.iterdir() if p.suffix in {".yaml", ".yml", ".json"})
    client = _client(args)
    for file in files if path.is_dir() else [path]:
        kind = "application/json" if file.suffix == ".json" else "application/yaml"
        t = client.call(
            "POST", "/v1/templates", content=file.read_bytes(), headers={"content-type": kind}
        )
        print(f"{file.name}: {t['type']} v{t['version']}")


def _runs_create(args: argparse.Namespace) -> None:
    try:
        payload = json.loads(args.payload)
    except ValueError as exc:
        raise CLIError(f"--payload is not JSON: {exc}") from exc
    body: dict[str, Any] = {
        "templateType": args.template,
        "scope": args.scope,
        "scopeId": args.scope_id,
        "payload": payload,
    }
    run = _client(args).call("POST", "/v1/runs", json=body)
    print(run["id"])
    if args.watch:
        _watch(_client(args), run["id"], args.interval)


def _runs_get(args: argparse.Namespace) -> None:
    print(json.dumps(_client(args).call("GET", f"/v1/runs/{args.run_id}"), indent=2))


def _runs_watch(args: argparse.Namespace) -> None:
    _watch(_client(args), args.run_id, args.interval)


def _watch(client: APIClient, run_id: str, interval: float) -> None:
    view = LiveView(sys.stdout.isatty())
    while True:
        run = Run.model_validate(client.call("GET", f"/v1/runs/{run_id}"))
        view.show(run)
        if run.status in TERMINAL:
            return
        time.sleep(interval)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jobplane", description=__doc__)
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    api = sub.add_parser("api", help="serve the HTTP API")
    api.add_argument("--host")
    api.add_argument("--port", type=int)
    api.set_defaults(command=_api)

    worker = sub.add_parser("worker", help="run a worker")
    worker.add_argument("--worker-concurrency", type=int, dest="worker_concurrency")
    worker.add_argument("--drain-seconds", type=float, default=30)
    worker.set_defaults(command=_worker)

    scheduler = sub.add_parser("scheduler", help="run the scheduler (reaper, reconciler)")
    scheduler.set_defaults(command=_scheduler)

    dev = sub.add_parser("dev", help="local MongoDB + Redis, then API, worker and scheduler")
    dev.add_argument("--host")
    dev.add_argument("--port", type=int)
    dev.add_argument("--data-dir", dest="data_dir", type=Path)
    dev.add_argument("--templates", type=Path, default=Path("templates"))
    dev.add_argument("--demo", action="store_true", help="register templates and watch a demo run")
    dev.add_argument("--exit-after-demo", action="store_true", help=argparse.SUPPRESS)
    dev.set_defaults(command=_dev)

    def client_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", help="API base URL (JOBPLANE_URL)")
        p.add_argument("--key", help="API key (JOBPLANE_API_KEY)")

    templates = sub.add_parser("templates", help="template files").add_subparsers(required=True)
    apply = templates.add_parser("apply", help="register every template in DIR, or one FILE")
    apply.add_argument("path")
    client_args(apply)
    apply.set_defaults(command=_templates_apply)

    runs = sub.add_parser("runs", help="create, read and watch runs").add_subparsers(required=True)
    create = runs.add_parser("create", help="create a run")
    create.add_argument("template")
    create.add_argument("--scope", default="system", choices=["user", "account", "system"])
    create.add_argument("--scope-id", default="cli")
    create.add_argument("--payload", default="{}", help="JSON object")
    create.add_argument("--watch", action="store_true")
    create.add_argument("--interval", type=float, default=0.5)
    client_args(create)
    create.set_defaults(command=_runs_create)
    get = runs.add_parser("get", help="show a run as JSON")
    get.add_argument("run_id")
    client_args(get)
    get.set_defaults(command=_runs_get)
    watch = runs.add_parser("watch", help="progress bars until the run ends")
    watch.add_argument("run_id")
    watch.add_argument("--interval", type=float, default=0.5)
    client_args(watch)
    watch.set_defaults(command=_runs_watch)
    return parser
