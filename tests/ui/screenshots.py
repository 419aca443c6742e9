"""Screenshots of the dashboard for the README: `python -m tests.ui.screenshots`.

Starts MongoDB and Redis (from the `local` extra, or the JOBPLANE_TEST_* URLs), the API, a
worker and the scheduler; feeds them a few minutes of varied work through the API (so the
overview's chart has a history); and saves PNGs of the main pages to docs/img/. Everything is
created through the public API, as a user would, and removed afterwards.
"""

import argparse
import contextlib
import os
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml
from playwright.sync_api import Page, sync_playwright

from jobplane.devstack import MongoServer, RedisServer, free_port
from tests.ui.stack import Stack, launch_chromium, running_stack

ROOT = Path(__file__).resolve().parents[2]
VIEWPORT = {"width": 1440, "height": 900}

# Expires: its deadline (2 s) passes while its step still sleeps. On a queue of its own, which
# the Queues page's picture shows paused.
EXPORTS_QUEUE = "exports"
NIGHTLY_EXPORT = {
    "type": "nightly_export",
    "name": "Nightly export",
    "description": "Exports the day's orders to the warehouse.",
    "queue": EXPORTS_QUEUE,
    "timeoutSeconds": 2,
    "payloadSchema": {"type": "object", "properties": {"sleepSeconds": {"type": "number"}}},
    "steps": [{"id": "export", "name": "Export orders", "handler": "builtin.sleep"}],
}


@contextlib.contextmanager
def servers(work: Path) -> Iterator[tuple[str, str]]:
    """MongoDB and Redis URLs: the test ones from the environment, or servers started here."""
    mongo_url = os.environ.get("JOBPLANE_TEST_MONGODB_URL")
    redis_url = os.environ.get("JOBPLANE_TEST_REDIS_URL")
    with contextlib.ExitStack() as started:
        if not mongo_url:
            mongo = MongoServer(work / "db", free_port(), work / "mongod.log")
            mongo.start()
            started.callback(mongo.stop)
            mongo_url = mongo.url
        if not redis_url:
            redis = RedisServer(work / "redis", free_port(), work / "redis.log")
            redis.start()
            started.callback(redis.stop)
            redis_url = redis.url
        yield mongo_url, redis_url


def register_templates(admin: httpx.Client) -> None:
    for path in sorted((ROOT / "templates").glob("*.yaml")):
        response = admin.post(
            "/v1/templates",
            content=path.read_bytes(),
            headers={"content-type": "application/yaml"},
        )
        response.raise_for_status()
    for path in sorted((ROOT / "templates").glob("*.json")):
        admin.post("/v1/templates", content=path.read_bytes()).raise_for_status()
    admin.post("/v1/templates", json=NIGHTLY_EXPORT).raise_for_status()
    # A second version of the demo template, for the diff between versions.
    demo = yaml.safe_load((ROOT / "templates" / "demo_long_task.yaml").read_text())
    demo["description"] = "Shows steps, progress, cancellation, rerun and scheduling (v2)."
    demo["retryPolicy"] = {"maxAttempts": 3, "backoffSeconds": [10, 60]}
    demo["steps"][1]["timeoutSeconds"] = 600
    admin.post("/v1/templates", json=demo).raise_for_status()


def create_schedules(admin: httpx.Client) -> str:
    made = []
    for scope_id, cron, zone, enabled in [
        ("acme", "0 9 * * 1-5", "Asia/Taipei", True),
        ("globex", "30 6 * * *", "Europe/Berlin", True),
        ("initech", "*/15 * * * *", "America/New_York", False),
        ("umbrella", "0 0 1 * *", "UTC", True),
    ]:
        body = {
            "templateType": "scheduled_report",
            "scope": "account",
            "scopeId": scope_id,
            "cron": cron,
            "timezone": zone,
            "enabled": enabled,
            "payloadTemplate": {"accountId": "{{scopeId}}", "scheduledFor": "{{scheduledFor}}"},
        }
        response = admin.post("/v1/schedules", json=body)
        response.raise_for_status()
        made.append(response.json()["id"])
    admin.post(f"/v1/schedules/{made[0]}/trigger").raise_for_status()
    return made[0]


def run(admin: httpx.Client, template: str, scope: str, payload: dict[str, Any]) -> str:
    kind, _, scope_id = scope.partition(":")
    body = {"templateType": template, "scope": kind, "scopeId": scope_id, "payload": payload}
    response = admin.post("/v1/runs", json=body)
    response.raise_for_status()
    return str(response.json()["id"])


def load(admin: httpx.Client, minutes: int) -> None:
    """A wave of varied runs each minute for `minutes` minutes."""
    pick = random.Random(7)
    scopes = ["user:alice", "user:bob", "account:acme", "account:globex"]
    for wave in range(minutes):
        started = time.monotonic()
        for n in range(pick.randint(4, 9)):
            payload = {"target": f"batch-{wave}-{n}", "sleepSeconds": pick.uniform(0.3, 2.5)}
            run(admin, "demo_long_task", pick.choice(scopes), payload)
        for _ in range(pick.randint(1, 3)):
            payload = {"source": "s3://orders", "failTimes": 1, "sleepSeconds": 0.5}
            run(admin, "multi_step_pipeline", pick.choice(scopes), payload)
        if wave % 2 == 0:
            payload = {"source": "ftp://legacy", "fatal": True}
            run(admin, "multi_step_pipeline", "account:acme", payload)
        if wave % 3 == 1:
            run(admin, "nightly_export", "account:globex", {"sleepSeconds": 10})
        payload = {"target": f"stale-{wave}", "sleepSeconds": 30}
        doomed = run(admin, "demo_long_task", "user:bob", payload)
        time.sleep(1.5)
        admin.post(f"/v1/runs/{doomed}/cancel", json={"reason": "superseded"}).raise_for_status()
        time.sleep(max(0.0, 60 - (time.monotonic() - started)))


def shoot(page: Page, name: str, out: Path, full: bool = True) -> None:
    page.wait_for_load_state("networkidle")
    page.wait_for_timeout(400)  # bars finish their width transition
    page.screenshot(path=str(out / f"{name}.png"), full_page=full)
    print(f"wrote {out / name}.png")  # noqa: T201  # a script's output


def screenshots(stack: Stack, out: Path, minutes: int) -> None:
    with stack.admin() as admin:
        register_templates(admin)
        schedule = create_schedules(admin)
        load(admin, minutes)
        # One run in progress for its page, one waiting for an external worker.
        showcase = run(
            admin, "demo_long_task", "user:alice", {"target": "q3-report", "sleepSeconds": 8}
        )
        started = time.monotonic()
        run(admin, "external_worker_task", "account:acme", {"document": "contract.pdf"})
        # A flow beyond a line, its two renders side by side while the pictures are taken.
        flow = run(admin, "diamond_report", "account:acme", {"csv": True, "sleepSeconds": 40})
        failed = admin.get("/v1/runs", params={"status": "failed", "limit": 1}).json()["items"]
    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as driver:
        browser = launch_chromium(driver)
        context = browser.new_context(viewport=VIEWPORT)
        page = context.new_page()
        page.add_init_script(f"sessionStorage.setItem('jobplane.apiKey', {stack.admin_key!r});")
        page.goto(stack.dashboard + f"#/runs/{showcase}")
        page.get_by_text("Execute task").wait_for()
        # Its first step (8 s) done, the second under way.
        time.sleep(max(0.0, started + 11.5 - time.monotonic()))
        shoot(page, "run", out)
        page.goto(stack.dashboard + f"#/runs/{flow}")
        page.get_by_role("group", name="Steps by what they need").wait_for()
        shoot(page, "run-graph", out)
        page.goto(stack.dashboard + "#/")
        page.get_by_role("heading", name="Runs per minute").wait_for()
        shoot(page, "overview", out)
        page.goto(stack.dashboard + "#/runs")
        shoot(page, "runs", out, full=False)
        if failed:
            page.goto(stack.dashboard + f"#/runs/{failed[0]['id']}")
            page.get_by_text("Traceback summary").wait_for()
            shoot(page, "run-failed", out)
        page.goto(stack.dashboard + "#/failed")
        shoot(page, "failed", out)
        page.goto(stack.dashboard + "#/templates/demo_long_task?from=1&to=2")
        shoot(page, "templates", out)
        page.goto(stack.dashboard + "#/templates/demo_long_task/run")
        page.get_by_role("textbox", name="Scope id", exact=True).fill("alice")
        page.get_by_role("textbox", name="target", exact=True).fill("q4-report")
        page.get_by_role("spinbutton", name="sleepSeconds").fill("-1")
        page.get_by_role("button", name="Create run").click()
        page.get_by_text("less than the minimum", exact=False).wait_for()
        shoot(page, "create-run", out)
        page.goto(stack.dashboard + "#/schedules")
        shoot(page, "schedules", out)
        page.goto(stack.dashboard + f"#/schedules/{schedule}")
        shoot(page, "schedule", out)
        with stack.admin() as admin:
            reason = {"reason": "warehouse maintenance until 18:00"}
            admin.post(f"/v1/queues/{EXPORTS_QUEUE}/pause", json=reason).raise_for_status()
            for scope in ("account:globex", "account:acme"):
                run(admin, "nightly_export", scope, {"sleepSeconds": 1})
        page.goto(stack.dashboard + "#/queues")
        exports = page.get_by_role("row").filter(
            has=page.get_by_role("cell", name=EXPORTS_QUEUE, exact=True)
        )
        exports.get_by_role("cell", name="2", exact=True).wait_for()  # both runs held
        shoot(page, "queues", out, full=False)
        page.goto(stack.dashboard + "#/audit")
        page.get_by_role("button", name="Load more").wait_for(state="attached")
        shoot(page, "audit", out, full=False)
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument(
        "--minutes", type=int, default=10, help="minutes of load before the pictures are taken"
    )
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="jobplane-shots-") as work,
        servers(Path(work)) as (mongo_url, redis_url),
        running_stack(
            mongo_url, redis_url, Path(work) / "logs", ["default", EXPORTS_QUEUE]
        ) as stack,
    ):
        screenshots(stack, args.out.resolve(), args.minutes)


if __name__ == "__main__":
    main()
