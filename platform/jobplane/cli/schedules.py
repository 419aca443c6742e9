"""`jobplane schedules`: cron schedules in a time zone, made, listed, paused, resumed,
triggered, previewed and deleted."""

import argparse
import json

from jobplane.cli.client import APIClient, made_in_scope, present, print_pages, scope_of, segment
from jobplane.cli.render import schedule_line
from jobplane.model import Schedule


def create(args: argparse.Namespace, client: APIClient) -> None:
    scope, scope_id = scope_of(args, client)
    body = present(
        templateType=args.template,
        scope=scope,
        scopeId=scope_id,
        cron=args.cron,
        timezone=args.timezone,
        payloadTemplate=args.payload_template,
        misfirePolicy=args.misfire,
        overlapPolicy=args.overlap,
        enabled=False if args.paused else None,
    )
    made = made_in_scope(client, "/v1/schedules", body)
    print(schedule_line(Schedule.model_validate(made)))


def list_schedules(args: argparse.Namespace, client: APIClient) -> None:
    params = present(
        templateType=args.template, scope=args.scope, scopeId=args.scope_id, limit=args.limit
    )
    print_pages(client, "/v1/schedules", params, args.all, Schedule, schedule_line)


def get(args: argparse.Namespace, client: APIClient) -> None:
    print(json.dumps(client.call("GET", f"/v1/schedules/{segment(args.schedule_id)}"), indent=2))


def delete(args: argparse.Namespace, client: APIClient) -> None:
    client.call("DELETE", f"/v1/schedules/{segment(args.schedule_id)}")
    print(f"deleted {args.schedule_id}")


def act(args: argparse.Namespace, client: APIClient) -> None:
    """pause, resume, trigger: a POST to the schedule's action."""
    answer = client.call("POST", f"/v1/schedules/{segment(args.schedule_id)}/{args.action}")
    if args.action == "trigger":
        print(answer["id"])  # the run it created
    else:
        print(schedule_line(Schedule.model_validate(answer)))


def preview(args: argparse.Namespace, client: APIClient) -> None:
    path = f"/v1/schedules/{segment(args.schedule_id)}/preview"
    for t in client.call("GET", path, params={"count": args.count})["times"]:
        print(f"{t['utc']}  {t['local']}")
