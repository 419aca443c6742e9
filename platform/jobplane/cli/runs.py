"""`jobplane runs` and `jobplane events`: create, list, watch, cancel and rerun runs, and read
the audit trail."""

import argparse
import json
import sys
import time
from collections.abc import Iterator

from jobplane.cli.client import (
    APIClient,
    CLIError,
    made_in_scope,
    present,
    print_pages,
    scope_of,
    segment,
)
from jobplane.cli.render import RUN_HEADER, LiveView, event_line, run_row
from jobplane.model import CLAIMABLE, TERMINAL, Event, Run, RunStatus


def create(args: argparse.Namespace, client: APIClient) -> None:
    scope, scope_id = scope_of(args, client)
    body = present(
        templateType=args.template,
        scope=scope,
        scopeId=scope_id,
        payload=args.payload,
        priority=args.priority,
        delaySeconds=args.delay_seconds,
        idempotencyKey=args.idempotency_key,
    )
    run = made_in_scope(client, "/v1/runs", body)
    print(run["id"])
    if args.watch:
        _watch(client, run["id"], args.interval)


def get(args: argparse.Namespace, client: APIClient) -> None:
    print(json.dumps(client.call("GET", f"/v1/runs/{segment(args.run_id)}"), indent=2))


def list_runs(args: argparse.Namespace, client: APIClient) -> None:
    params = present(
        status=args.status,
        templateType=args.template,
        scope=args.scope,
        scopeId=args.scope_id,
        scheduleId=args.schedule_id,
        parentRunId=args.parent,
        limit=args.limit,
    )
    print_pages(client, "/v1/runs", params, args.all, Run, run_row, header=RUN_HEADER)


def cancel(args: argparse.Namespace, client: APIClient) -> None:
    path = f"/v1/runs/{segment(args.run_id)}/cancel"
    run = client.call("POST", path, json=present(reason=args.reason))
    print(f"{run['id']} {run['status']}")


def rerun(args: argparse.Namespace, client: APIClient) -> None:
    run = client.call("POST", f"/v1/runs/{segment(args.run_id)}/rerun")
    print(run["id"])
    if args.watch:
        _watch(client, run["id"], args.interval)


def watch(args: argparse.Namespace, client: APIClient) -> None:
    _watch(client, args.run_id, args.interval)


# How long after a run's stream broke `runs watch` opens it again; it polls meanwhile.
STREAM_RETRY_SECONDS = 5.0


def _watch(client: APIClient, run_id: str, interval: float) -> None:
    view = LiveView(sys.stdout.isatty())
    for run in _followed(client, run_id, interval):
        view.show(run)
        if run.status == RunStatus.SUCCEEDED:
            return
        if run.status in TERMINAL:  # a script waiting on the run learns it from the exit code
            raise CLIError("RunNotSucceeded", f"run {run.id} ended {run.status.value}")


def _followed(client: APIClient, run_id: str, interval: float) -> Iterator[Run]:
    """The run now, then each time it changes, for as long as the caller reads.

    Its stream says each change as it happens. While the run waits to start, it is read every
    `interval` seconds instead: why it waits (`waitingFor`) changes without the run (a queue
    paused, a worker gone), which its stream looks at only once a second. A stream that broke,
    or ended before the run did, is polled for too, and opened again STREAM_RETRY_SECONDS
    later, so that a long watch outlives a restart of the API without polling to the end."""
    path = f"/v1/runs/{segment(run_id)}"
    retry_at = 0.0
    while True:
        run = Run.model_validate(client.call("GET", path))
        yield run
        if run.status not in CLAIMABLE and time.monotonic() >= retry_at:
            try:
                for data in client.messages(f"{path}/stream"):
                    run = Run.model_validate_json(data)
                    yield run
                    if run.status in CLAIMABLE:
                        break
                else:  # it ended before the run did
                    retry_at = time.monotonic() + STREAM_RETRY_SECONDS
            except CLIError:  # it broke, or was refused; a poll says if the run is gone
                retry_at = time.monotonic() + STREAM_RETRY_SECONDS
        time.sleep(interval)


def events(args: argparse.Namespace, client: APIClient) -> None:
    params = present(
        jobId=args.job_id,
        type=args.type,
        scope=args.scope,
        scopeId=args.scope_id,
        actor=args.actor,
        limit=args.limit,
        **{"from": args.since, "to": args.until},
    )
    print_pages(client, "/v1/events", params, args.all, Event, event_line)
