"""`jobplane` command line: each subcommand parses its arguments and calls one service.

The commands that start processes are here; those that call the API live in a module per
group: `runs` (and `events`), `schedules`, `templates`, and `admin` (`keys`, `queues`)."""

import argparse
import json
import os
import sys
from collections.abc import Callable, Coroutine
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from pydantic import ValidationError

from jobplane.cli import admin, runs, schedules, templates
from jobplane.cli.client import APIClient, CLIError
from jobplane.model import RunStatus
from jobplane.settings import Settings, refusal


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        args.command(args)
    except CLIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        # As argparse's own refusals: bad local input is 2, everything else 1.
        sys.exit(2 if exc.code == "InvalidArgument" else 1)
    except KeyboardInterrupt:
        sys.exit(130)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line like every other error; argparse would print the whole usage first.
        line = CLIError("InvalidArgument", f"{self.prog}: {message} (see --help)")
        self.exit(2, f"error: {line}\n")


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {
        k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None
    }
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise CLIError("InvalidSettings", refusal(exc)) from None


def _endpoint(args: argparse.Namespace) -> tuple[str, str | None]:
    """The API's URL and the key to call it with, from the options or the environment."""
    url = args.url or os.environ.get("JOBPLANE_URL", "http://127.0.0.1:8000")
    key = args.key or os.environ.get("JOBPLANE_API_KEY") or os.environ.get("JOBPLANE_ADMIN_KEY")
    return url, key


def _client(args: argparse.Namespace) -> APIClient:
    return APIClient(*_endpoint(args))


# -- services ------------------------------------------------------------------------------------


def _api(args: argparse.Namespace) -> None:
    from jobplane import api

    settings = _start_process(args, "jobplane-api")
    _run(api.serve(settings))


def _worker(args: argparse.Namespace) -> None:
    from jobplane import worker
    from jobplane.metrics import serve_metrics

    settings = _start_process(args, "jobplane-worker")
    serve_metrics(settings)
    _run(worker.serve(settings, args.drain_seconds))


def _scheduler(args: argparse.Namespace) -> None:
    from jobplane import scheduler
    from jobplane.metrics import serve_metrics

    settings = _start_process(args, "jobplane-scheduler")
    serve_metrics(settings)
    _run(scheduler.serve(settings))


def _notifier(args: argparse.Namespace) -> None:
    from jobplane.metrics import serve_metrics
    from jobplane.webhooks import notifier

    settings = _start_process(args, "jobplane-notifier")
    serve_metrics(settings)
    _run(notifier.serve(settings))


def _external_worker(args: argparse.Namespace) -> None:
    from jobplane.worker.external import serve_external
    from jobplane.worker.worker import default_worker_id

    _start_process(args, "jobplane-external-worker", needs=())
    url, key = _endpoint(args)
    worker_id = args.worker_id or default_worker_id()
    modules = [m for m in args.handlers.split(",") if m]
    _run(serve_external(url, key, args.type, worker_id, modules, args.concurrency))


T = TypeVar("T")


def _run(main: Coroutine[Any, Any, "T"]) -> "T":
    from jobplane.process import run
    from jobplane.worker.handlers import HandlerModuleError

    try:
        return run(main)
    except HandlerModuleError as exc:
        raise CLIError("InvalidSettings", str(exc)) from None


# What every process but the external worker (an API client) needs.
BACKEND_URLS = ("mongodb_url", "redis_url")


def _start_process(
    args: argparse.Namespace, service: str, needs: tuple[str, ...] = BACKEND_URLS
) -> Settings:
    """Settings for a long-running process, its logging set up (JSON lines unless told
    otherwise), and its traces exported as the OTEL_* variables ask, as `service`."""
    from jobplane import tracing
    from jobplane.process import configure_logging

    settings = _settings(args)
    if unset := settings.unset(*needs):
        hint = "only `jobplane dev` runs without them: it starts local servers"
        raise CLIError("InvalidSettings", f"{unset} ({hint})")
    configure_logging(settings.log_format)
    tracing.configure(service)
    return settings


def _dev(args: argparse.Namespace) -> None:
    from jobplane import tracing
    from jobplane.devstack.dev import run_dev

    settings = _settings(args)
    tracing.configure("jobplane-dev")
    try:
        code = _run(run_dev(settings, args.templates, args.demo, args.exit_after_demo))
    except RuntimeError as exc:  # a local server that would not start says why
        raise CLIError("Unavailable", str(exc)) from exc
    sys.exit(code)


def _db_shard(args: argparse.Namespace) -> None:
    from pymongo.errors import PyMongoError

    from jobplane.store import NotSharded
    from jobplane.store.mongo import shard_database

    settings = _settings(args)
    if not settings.mongodb_url:
        raise CLIError("InvalidArgument", "JOBPLANE_MONGODB_URL is not set")
    try:
        sharded = _run(shard_database(settings.mongodb_url, settings.db))
    except NotSharded as exc:
        raise CLIError("InvalidArgument", str(exc)) from exc
    except PyMongoError as exc:
        raise CLIError("Unavailable", f"MongoDB: {exc}") from exc
    for namespace in sharded:
        print(f"sharded {namespace}")


# -- API commands (their modules: runs, schedules, templates, admin) ---------------------------

APICommand = Callable[[argparse.Namespace, APIClient], None]


def _with_client(command: APICommand, args: argparse.Namespace) -> None:
    with _client(args) as client:
        command(args, client)


# -- argument types: bad input stops here, before any request -------------------------------------


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text}")
    return value


def _instant(text: str) -> str:
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        at = None
    if at is None or at.tzinfo is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an ISO 8601 time with an offset, e.g. 2026-01-01T00:00:00Z"
        )
    return at.isoformat()


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jobplane", description=__doc__)
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

    notifier = sub.add_parser("notifier", help="deliver run events to webhooks")
    notifier.set_defaults(command=_notifier)

    external = sub.add_parser("external-worker", help="run external steps over the HTTP API")
    external.add_argument("--type", default="external", help="the steps' workerType")
    external.add_argument("--handlers", default="", help="comma-separated handler modules")
    external.add_argument("--worker-id")
    external.add_argument("--concurrency", type=int, default=1, help="steps at a time")
    external.add_argument("--url", help="API base URL (JOBPLANE_URL)")
    external.add_argument("--key", help="an admin API key (JOBPLANE_API_KEY)")
    external.set_defaults(command=_external_worker)

    dev = sub.add_parser(
        "dev", help="local MongoDB + Redis, then API, worker, scheduler and notifier"
    )
    dev.add_argument("--host")
    dev.add_argument("--port", type=int)
    dev.add_argument("--data-dir", dest="data_dir", type=Path)
    dev.add_argument("--templates", type=Path, default=Path("templates"))
    dev.add_argument("--demo", action="store_true", help="register templates and watch a demo run")
    dev.add_argument("--exit-after-demo", action="store_true", help=argparse.SUPPRESS)
    dev.set_defaults(command=_dev)

    db = sub.add_parser("db", help="the MongoDB database (JOBPLANE_MONGODB_URL, JOBPLANE_DB)")
    dbsub = db.add_subparsers(required=True, metavar="ACTION")
    shard = dbsub.add_parser("shard", help="shard the large collections (a mongos only)")
    shard.set_defaults(command=_db_shard)

    def client_command(
        group: "argparse._SubParsersAction[_Parser]", name: str, command: APICommand, help: str
    ) -> _Parser:
        p = group.add_parser(name, help=help)
        p.add_argument("--url", help="API base URL (JOBPLANE_URL)")
        p.add_argument("--key", help="API key (JOBPLANE_API_KEY, else JOBPLANE_ADMIN_KEY)")
        p.set_defaults(command=partial(_with_client, command))
        return p

    def watchable(p: argparse.ArgumentParser, default: bool = False) -> None:
        if not default:
            p.add_argument("--watch", action="store_true", help="then progress bars until it ends")
        p.add_argument("--interval", type=float, default=0.5, help="seconds between polls")

    scopes = ["user", "account", "system"]
    # Where a run or schedule goes unless told; a user key may act only in its own scopes.
    default_scope = "default: the key's only scope if it has one, else system (scope id cli)"
    tsub = sub.add_parser("templates", help="register and manage templates").add_subparsers(
        required=True, metavar="ACTION"
    )
    apply = client_command(
        tsub, "apply", templates.apply, "register templates from DIR, FILE or MODULE:ATTRIBUTE"
    )
    apply.add_argument("source", metavar="DIR|FILE|MODULE:ATTRIBUTE")
    export = tsub.add_parser("export", help="print the templates MODULE:ATTRIBUTE defines as YAML")
    export.add_argument("ref", metavar="MODULE:ATTRIBUTE")
    export.set_defaults(command=templates.export)
    validate = tsub.add_parser(
        "validate", help="check a template FILE here: its steps' layers, or each problem"
    )
    validate.add_argument("file", metavar="FILE")
    validate.set_defaults(command=templates.validate)
    client_command(tsub, "list", templates.list_latest, "the latest version of each template")
    show = client_command(tsub, "show", templates.show, "a template as JSON")
    show.add_argument("type", metavar="TYPE")
    show.add_argument("--version", type=int, help="this version instead of the latest")
    for action in ("enable", "disable"):
        toggle = client_command(tsub, action, templates.toggle, f"{action} new runs of TYPE")
        toggle.add_argument("type", metavar="TYPE")
        toggle.set_defaults(action=action)

    rsub = sub.add_parser("runs", help="create, list, watch, cancel and rerun runs").add_subparsers(
        required=True, metavar="ACTION"
    )
    create = client_command(rsub, "create", runs.create, "create a run of TEMPLATE")
    create.add_argument("template", metavar="TEMPLATE")
    create.add_argument("--scope", choices=scopes, help=default_scope)
    create.add_argument("--scope-id", help="default cli, or the key's only scope's id")
    create.add_argument("--payload", type=_json_object, default={}, help="a JSON object")
    create.add_argument("--priority", type=int, help="-100 to 100; higher runs first")
    create.add_argument("--delay-seconds", type=float, help="not before this many seconds")
    create.add_argument("--idempotency-key", help="a repeat returns the first run")
    watchable(create)
    get = client_command(rsub, "get", runs.get, "a run as JSON")
    get.add_argument("run_id", metavar="ID")
    listing = client_command(rsub, "list", runs.list_runs, "runs, newest first")
    listing.add_argument("--status", choices=[s.value for s in RunStatus])
    listing.add_argument("--template", help="template type")
    listing.add_argument("--scope", choices=scopes)
    listing.add_argument("--scope-id")
    listing.add_argument("--schedule-id")
    listing.add_argument("--parent", metavar="RUN_ID", help="a map step's children of this run")
    listing.add_argument("--limit", type=int, help="runs per page")
    listing.add_argument("--all", action="store_true", help="every page, not just the first")
    cancel = client_command(rsub, "cancel", runs.cancel, "cancel a run")
    cancel.add_argument("run_id", metavar="ID")
    cancel.add_argument("--reason")
    rerun = client_command(rsub, "rerun", runs.rerun, "a new run like a finished one")
    rerun.add_argument("run_id", metavar="ID")
    watchable(rerun)
    watch = client_command(rsub, "watch", runs.watch, "progress bars until the run ends")
    watch.add_argument("run_id", metavar="ID")
    watchable(watch, default=True)

    events = client_command(sub, "events", runs.events, "the audit trail, oldest first")
    events.add_argument("--job-id", help="one run's events")
    events.add_argument("--type", help="e.g. status_changed, cancel_requested")
    events.add_argument("--scope", choices=scopes)
    events.add_argument("--scope-id")
    events.add_argument("--actor", help="e.g. user:admin, scheduler, worker:<id>")
    events.add_argument("--from", dest="since", type=_instant, help="ISO 8601, inclusive")
    events.add_argument("--to", dest="until", type=_instant, help="ISO 8601, exclusive")
    events.add_argument("--limit", type=int, help="events per page")
    events.add_argument("--all", action="store_true", help="every page, not just the first")

    ssub = sub.add_parser("schedules", help="cron schedules in a time zone").add_subparsers(
        required=True, metavar="ACTION"
    )
    screate = client_command(ssub, "create", schedules.create, "run TEMPLATE on a cron")
    screate.add_argument("template", metavar="TEMPLATE")
    screate.add_argument("--cron", required=True, help="e.g. '30 2 * * *' or @daily")
    screate.add_argument("--timezone", help="IANA zone, e.g. Asia/Taipei (default UTC)")
    screate.add_argument("--scope", choices=scopes, help=default_scope)
    screate.add_argument("--scope-id", help="default cli, or the key's only scope's id")
    screate.add_argument(
        "--payload-template", type=_json_object, help="JSON object; {{scheduledFor}} etc."
    )
    screate.add_argument("--misfire", choices=["skip", "run_once", "catch_up"])
    screate.add_argument("--overlap", choices=["allow", "skip", "queue"])
    screate.add_argument("--paused", action="store_true", help="create it disabled")
    slist = client_command(ssub, "list", schedules.list_schedules, "schedules, newest first")
    slist.add_argument("--template", help="template type")
    slist.add_argument("--scope", choices=scopes)
    slist.add_argument("--scope-id")
    slist.add_argument("--limit", type=int, help="schedules per page")
    slist.add_argument("--all", action="store_true", help="every page, not just the first")
    sget = client_command(ssub, "get", schedules.get, "a schedule as JSON")
    sget.add_argument("schedule_id", metavar="ID")
    sdelete = client_command(ssub, "delete", schedules.delete, "delete a schedule")
    sdelete.add_argument("schedule_id", metavar="ID")
    for action, what in (
        ("pause", "stop firing"),
        ("resume", "fire again"),
        ("trigger", "a run now; prints its id"),
    ):
        act = client_command(ssub, action, schedules.act, what)
        act.add_argument("schedule_id", metavar="ID")
        act.set_defaults(action=action)
    spreview = client_command(ssub, "preview", schedules.preview, "the next fire times")
    spreview.add_argument("schedule_id", metavar="ID")
    spreview.add_argument("--count", type=int, default=10)

    queues = sub.add_parser("queues", help="queues: what they hold; pause and resume (admin)")
    qsub = queues.add_subparsers(required=True, metavar="ACTION")
    client_command(qsub, "list", admin.queues_list, "each queue's runs, and whether it is paused")
    for action, what in (
        ("pause", "start none of the queue's runs; it still accepts them"),
        ("resume", "start the queue's runs again"),
    ):
        act = client_command(qsub, action, admin.queues_act, what)
        act.add_argument("queue", metavar="QUEUE")
        act.add_argument("--reason", help="why, for the audit trail (at most 500 characters)")
        act.set_defaults(action=action)

    keys = sub.add_parser("keys", help="API keys")
    ksub = keys.add_subparsers(required=True, metavar="ACTION")
    key = client_command(
        ksub, "create", admin.keys_create, "create a key; its secret is shown once"
    )
    key.add_argument("name", metavar="NAME")
    key.add_argument("--role", required=True, choices=["admin", "author", "user", "auditor"])
    key.add_argument(
        "--scope", action="append", default=[], help="for a user key: user:u1 (repeatable)"
    )
    klist = client_command(ksub, "list", admin.keys_list, "keys, newest first, revoked ones too")
    klist.add_argument("--limit", type=int, help="keys per page")
    klist.add_argument("--all", action="store_true", help="every page, not just the first")
    revoke = client_command(ksub, "revoke", admin.keys_revoke, "refuse a key from now on")
    revoke.add_argument("key_id", metavar="ID")
    return parser
