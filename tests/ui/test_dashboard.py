"""The dashboard in a real browser: headless Chromium against real API, worker and scheduler
processes. Every page reads and writes through the public API, as these tests check by
watching the API's answers rather than the database."""

import csv
import io
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from uuid import uuid4

import httpx
import pytest
from playwright.sync_api import Locator, Page, Request, Route, expect

from tests.ui.conftest import PAUSABLE_QUEUE, sign_in
from tests.ui.stack import Stack, another_api

pytestmark = pytest.mark.timeout(120)


def create_run(admin: httpx.Client, template: str, scope_id: str, **payload: Any) -> str:
    body = {"templateType": template, "scope": "user", "scopeId": scope_id, "payload": payload}
    response = admin.post("/v1/runs", json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def run_status(page: Page) -> Locator:
    return page.locator("#run-status [data-status]")


def waiting_note(page: Page) -> Locator:
    """The run page's note on why the run waits."""
    return page.get_by_role("region", name="Progress").get_by_role("status")


def test_sign_in_keeps_the_key_in_this_tab_only(page: Page, stack: Stack) -> None:
    page.goto(stack.dashboard)
    key = page.get_by_label("API key")
    expect(key).to_be_focused()
    key.fill("jp_nothing_like_a_key")
    key.press("Enter")
    expect(page.get_by_role("alert")).to_contain_text("This key was refused")
    expect(key).to_have_attribute("aria-invalid", "true")

    key.fill(stack.admin_key)
    page.keyboard.press("Enter")
    expect(page.get_by_role("heading", name="Overview", level=1)).to_be_visible()
    expect(page.get_by_role("navigation", name="Main")).to_contain_text("Audit")
    storage = page.evaluate("[sessionStorage.getItem('jobplane.apiKey'), localStorage.length]")
    assert storage == [stack.admin_key, 0]
    assert page.context.cookies() == []

    page.reload()  # the tab remembers the key
    expect(page.get_by_role("heading", name="Overview", level=1)).to_be_visible()
    other = page.context.new_page()  # another tab does not
    other.goto(stack.dashboard)
    expect(other.get_by_label("API key")).to_be_visible()
    other.close()
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_label("API key")).to_be_visible()
    assert page.evaluate("sessionStorage.length") == 0


def test_a_run_from_the_generated_form_with_an_invalid_field_shown_inline(
    page: Page, stack: Stack, scope_id: str
) -> None:
    sign_in(page, stack)
    page.get_by_role("link", name="Templates", exact=True).click()
    page.get_by_role("link", name="Create a run of ui_steps").click()
    expect(page.get_by_role("heading", name="Create a run")).to_be_visible()
    # One control per schema property, labelled, with the schema's bounds as a hint.
    seconds = page.get_by_role("spinbutton", name="sleepSeconds", exact=True)
    expect(seconds).to_have_attribute("type", "number")
    expect(page.get_by_role("combobox", name="mode", exact=True)).to_be_visible()
    expect(page.get_by_role("checkbox", name="notify", exact=True)).to_have_attribute(
        "type", "checkbox"
    )
    page.get_by_role("textbox", name="Scope id", exact=True).fill(scope_id)
    page.get_by_role("textbox", name="target", exact=True).fill("nightly")
    page.get_by_role("combobox", name="mode", exact=True).select_option("thorough")
    seconds.fill("99")
    page.get_by_role("button", name="Create run").click()

    error = page.locator("#payload-sleepSeconds-error")
    expect(error).to_be_visible()
    expect(error).to_contain_text("99 is greater than the maximum of 30")
    expect(seconds).to_have_attribute("aria-invalid", "true")
    expect(seconds).to_be_focused()
    expect(page.get_by_role("alert")).to_contain_text("The run was not created")

    seconds.fill("0.4")
    page.get_by_role("button", name="Create run").click()
    expect(page).to_have_url(re.compile(r"#/runs/[0-9a-f]{24}$"))
    run_id = page.url.rsplit("/", 1)[1]
    # The bars move without a reload until the run is done.
    expect(page.get_by_role("progressbar", name="Run progress")).to_have_attribute(
        "aria-valuenow", "100", timeout=20_000
    )
    expect(run_status(page)).to_have_text("succeeded")
    for step in ("Prepare", "Work", "Report"):
        expect(page.get_by_role("progressbar", name=f"Step {step}")).to_have_attribute(
            "aria-valuenow", "100"
        )
    with stack.admin() as admin:
        run = admin.get(f"/v1/runs/{run_id}").json()
    assert run["payload"] == {"sleepSeconds": 0.4, "target": "nightly", "mode": "thorough"}
    assert (run["scope"], run["scopeId"], run["status"]) == ("user", scope_id, "succeeded")


def test_cancel_shows_cancel_requested_then_cancelled(
    page: Page, stack: Stack, scope_id: str
) -> None:
    with stack.admin() as admin:
        run_id = create_run(admin, "ui_hold", scope_id, sleepSeconds=6)
    sign_in(page, stack)
    page.goto(f"{stack.dashboard}#/runs/{run_id}")
    expect(run_status(page)).to_have_text("running", timeout=10_000)
    page.get_by_role("button", name="Cancel run").click()
    dialog = page.get_by_role("dialog", name="Cancel this run?")
    expect(dialog.get_by_label("Reason (optional)")).to_be_focused()
    page.keyboard.type("not needed")
    page.keyboard.press("Enter")  # confirms, from the keyboard alone
    # The step holding the run cannot be cancelled, so the run waits for it to end.
    expect(run_status(page)).to_have_text("cancel requested")
    expect(page.get_by_role("button", name="Cancel run")).to_have_count(0)
    expect(run_status(page)).to_have_text("cancelled", timeout=15_000)
    expect(page.get_by_role("button", name="Rerun")).to_be_visible()
    timeline = page.get_by_role("list", name="Events, oldest first")
    expect(timeline).to_contain_text("cancel_requested")
    expect(timeline).to_contain_text("not needed")


def test_rerun_a_failed_run(page: Page, stack: Stack, scope_id: str) -> None:
    with stack.admin() as admin:
        run_id = create_run(admin, "ui_fail", scope_id, fatal=True)
    sign_in(page, stack)
    page.goto(f"{stack.dashboard}#/runs/{run_id}")
    expect(run_status(page)).to_have_text("failed", timeout=10_000)
    error = page.get_by_role("region", name="Error")
    expect(error).to_contain_text("fatal")
    expect(error.get_by_label("Last line of the traceback")).to_contain_text("FatalError")
    page.get_by_role("button", name="Rerun").click()
    page.get_by_role("dialog", name="Rerun this run?").get_by_role("button", name="Rerun").click()
    expect(page).not_to_have_url(re.compile(f"{run_id}$"))
    expect(page).to_have_url(re.compile(r"#/runs/[0-9a-f]{24}$"))
    expect(page.get_by_role("link", name=f"run {run_id}")).to_be_visible()
    rerun_id = page.url.rsplit("/", 1)[1]
    with stack.admin() as admin:
        assert admin.get(f"/v1/runs/{rerun_id}").json()["rerunOf"] == run_id


def test_a_run_waiting_for_a_handler_says_so_here_and_on_the_overview(
    page: Page, stack: Stack, scope_id: str
) -> None:
    with stack.admin() as admin:
        run_id = create_run(admin, "ui_unserved", scope_id)
    sign_in(page, stack)
    page.goto(f"{stack.dashboard}#/runs/{run_id}")
    expect(run_status(page)).to_have_text("queued")
    note = waiting_note(page)
    expect(note).to_have_text(
        "No live worker on queue default offers handler ui.nobody: the run starts once one does."
    )
    page.goto(f"{stack.dashboard}#/")
    waits = page.get_by_role("region", name="Queues").locator('[data-handler="ui.nobody"]')
    expect(waits).to_have_text(
        re.compile(r"^\d+ runs? waits? for ui\.nobody; no worker offers it$")
    )


FLAKY = {
    "type": "ui_flaky",
    "name": "Fails, then maybe succeeds",
    "retryPolicy": {"maxAttempts": 3, "backoffSeconds": [0, 0]},
    "steps": [{"id": "flaky", "name": "Flaky", "handler": "builtin.fail"}],
}


def test_earlier_attempts_are_listed_and_only_a_failed_run_shows_an_error(
    page: Page, stack: Stack, scope_id: str
) -> None:
    with stack.admin() as admin:
        assert admin.post("/v1/templates", json=FLAKY).status_code in (200, 201)
        recovers = create_run(admin, "ui_flaky", scope_id, failTimes=2)
        gives_up = create_run(admin, "ui_flaky", scope_id, failTimes=3)
    sign_in(page, stack)
    page.goto(f"{stack.dashboard}#/runs/{recovers}")
    expect(run_status(page)).to_have_text("succeeded", timeout=15_000)
    attempts = page.get_by_role("region", name="Earlier attempts")
    rows = attempts.get_by_role("row")
    expect(rows).to_have_count(3)  # the header, then attempts 1 and 2
    for n in (1, 2):
        expect(rows.nth(n)).to_contain_text(f"failing attempt {n}")
        expect(rows.nth(n).get_by_role("cell").first).to_have_text(str(n))
    attempts.get_by_text("Traceback (").first.click()
    expect(attempts.locator("details pre").first).to_contain_text("RetryableError")
    expect(page.get_by_role("region", name="Error", exact=True)).to_have_count(0)
    expect(page.locator(".step-error")).to_have_count(0)

    # Failed for good: the last attempt's error is the run's, the others are earlier attempts.
    page.goto(f"{stack.dashboard}#/runs/{gives_up}")
    expect(run_status(page)).to_have_text("failed", timeout=15_000)
    error = page.get_by_role("region", name="Error", exact=True)
    expect(error).to_contain_text("failing attempt 3")
    rows = page.get_by_role("region", name="Earlier attempts").get_by_role("row")
    expect(rows).to_have_count(3)
    expect(rows.nth(2)).to_contain_text("failing attempt 2")


def test_a_user_key_sees_only_its_own_scopes(page: Page, stack: Stack, scope_id: str) -> None:
    with stack.admin() as admin:
        mine = create_run(admin, "ui_fail", scope_id, fatal=True)
        theirs = create_run(admin, "ui_fail", f"{scope_id}_other", fatal=True)
        body = {"name": f"key-{scope_id}", "role": "user", "scopes": [f"user:{scope_id}"]}
        key = admin.post("/v1/api-keys", json=body).json()["key"]
    sign_in(page, stack, key)
    expect(page.get_by_role("complementary")).to_contain_text(f"user:{scope_id}")
    page.get_by_role("link", name="Runs", exact=True).click()
    runs = page.get_by_role("region", name="Runs")
    expect(runs.get_by_role("link", name=f"run {mine}")).to_be_visible()
    expect(runs.get_by_role("link", name=f"run {theirs}")).to_have_count(0)
    # Not even by its address: the API answers 404, as for a run that does not exist.
    page.goto(f"{stack.dashboard}#/runs/{theirs}")
    expect(page.get_by_role("alert")).to_contain_text("NotFound")
    page.goto(f"{stack.dashboard}#/failed")
    failed = page.get_by_role("region", name="Dead letters")
    expect(failed).to_contain_text("ui_fail")
    expect(failed.get_by_role("link", name=f"run {theirs}")).to_have_count(0)
    # A user key may not read the whole audit trail's other scopes either.
    page.goto(f"{stack.dashboard}#/audit?jobId={theirs}")
    expect(page.get_by_role("region", name="Events")).to_contain_text("No event matches")


def test_create_and_pause_a_schedule(page: Page, stack: Stack, scope_id: str) -> None:
    sign_in(page, stack)
    page.get_by_role("link", name="Schedules", exact=True).click()
    page.get_by_role("link", name="New schedule").click()
    page.get_by_label("Template", exact=True).select_option("ui_report")
    page.get_by_role("textbox", name="Scope id", exact=True).fill(scope_id)
    cron = page.get_by_label("Cron", exact=True)
    cron.fill("every tuesday")
    page.get_by_label("Time zone").fill("Asia/Taipei")
    page.get_by_label("Payload template (JSON)").fill('{"period": "{{scheduledFor}}"}')
    page.get_by_role("button", name="Create schedule").click()
    expect(page.locator("#schedule-cron-error")).to_be_visible()
    expect(cron).to_have_attribute("aria-invalid", "true")

    cron.fill("30 9 * * 2")
    page.get_by_role("button", name="Create schedule").click()
    expect(page).to_have_url(re.compile(r"#/schedules/[0-9a-f]{24}$"))
    schedule_id = page.url.rsplit("/", 1)[1]
    state = page.locator("#schedule-state")
    expect(state).to_have_text("enabled")
    fires = page.get_by_role("region", name="Next 10 fires")
    expect(fires.locator("tbody tr")).to_have_count(10)
    # 09:30 on a Tuesday in Taipei is 01:30 UTC the same day.
    expect(fires.locator("tbody tr").first).to_contain_text("09:30:00")
    expect(fires.locator("tbody tr").first).to_contain_text("01:30:00")

    page.get_by_role("button", name=f"Pause schedule {schedule_id}").click()
    expect(state).to_have_text("paused")
    with stack.admin() as admin:
        assert admin.get(f"/v1/schedules/{schedule_id}").json()["enabled"] is False
    page.get_by_role("link", name="Schedules", exact=True).click()
    row = page.get_by_role("row").filter(has=page.get_by_text(f"user:{scope_id}"))
    expect(row).to_contain_text("paused")
    expect(row.get_by_role("button", name=f"Resume schedule {schedule_id}")).to_be_visible()


def test_bulk_rerun_of_dead_letters(page: Page, stack: Stack, scope_id: str) -> None:
    body = {"name": f"bulk-{scope_id}", "role": "user", "scopes": [f"user:{scope_id}"]}
    with stack.admin() as admin:
        dead = [create_run(admin, "ui_fail", scope_id, fatal=True) for _ in range(3)]
        key = admin.post("/v1/api-keys", json=body).json()["key"]
        for run_id in dead:
            while admin.get(f"/v1/runs/{run_id}").json()["status"] != "failed":
                time.sleep(0.05)
    sign_in(page, stack, key)
    page.get_by_role("link", name="Failed", exact=True).click()
    group = page.get_by_label("Select 3 ui_fail runs with fatal")
    group.check()
    page.get_by_role("button", name="Rerun 3 selected runs").click()
    page.get_by_role("dialog", name="Rerun 3 runs?").get_by_role("button", name="Rerun 3").click()
    expect(page.locator("#failed-status")).to_contain_text("3 reruns created")
    with stack.admin() as admin:
        runs = admin.get("/v1/runs", params={"scopeId": scope_id, "limit": 10}).json()["items"]
    assert sorted(r["rerunOf"] for r in runs if r["rerunOf"]) == sorted(dead)


def queue_row(page: Page, queue: str) -> Locator:
    """The Queues page's row of `queue`, found anew at each look (the page redraws it)."""
    rows = page.get_by_role("region", name="Queues").get_by_role("row")
    return rows.filter(has=page.get_by_role("cell", name=queue, exact=True))


def queue_cell(page: Page, queue: str, column: str) -> Locator:
    columns = ["Queue", "Ready", "Delayed", "Running", "Oldest ready", "State"]
    return queue_row(page, queue).get_by_role("cell").nth(columns.index(column))


def queues_by_name(admin: httpx.Client) -> dict[str, dict[str, Any]]:
    response = admin.get("/v1/queues")
    assert response.status_code == 200, response.text
    return {q["queue"]: q for q in response.json()["items"]}


def test_pausing_a_queue_holds_its_runs_until_it_is_resumed(
    page: Page, stack: Stack, scope_id: str
) -> None:
    sign_in(page, stack)
    page.get_by_role("link", name="Queues", exact=True).click()
    expect(page.get_by_role("heading", name="Queues", level=1)).to_be_visible()
    # Every queue the stack's templates name; the pausable one holds nothing yet.
    for name in ("default", PAUSABLE_QUEUE):
        expect(queue_cell(page, name, "State")).to_have_text("active")
    for column in ("Ready", "Delayed", "Running"):
        expect(queue_cell(page, PAUSABLE_QUEUE, column)).to_have_text("0")
    expect(queue_cell(page, PAUSABLE_QUEUE, "Oldest ready")).to_have_text("—")

    queue_row(page, PAUSABLE_QUEUE).get_by_role(
        "button", name=f"Pause queue {PAUSABLE_QUEUE}"
    ).click()
    dialog = page.get_by_role("dialog", name=f"Pause queue {PAUSABLE_QUEUE}?")
    reason = dialog.get_by_label("Reason (optional)")
    expect(reason).to_be_focused()
    expect(reason).to_have_attribute("maxlength", "500")
    reason.fill("incident 42: the warehouse is down")
    dialog.get_by_role("button", name="Pause queue").click()
    state = queue_cell(page, PAUSABLE_QUEUE, "State")
    expect(state.locator("[data-status]")).to_have_text("paused")
    expect(state).to_contain_text("by user:admin")
    expect(state).to_contain_text("Reason: incident 42: the warehouse is down")
    expect(page.locator("#queues-status")).to_have_text(
        f"Queue {PAUSABLE_QUEUE} paused (incident 42: the warehouse is down): "
        "none of its runs starts until it is resumed."
    )
    resume = queue_row(page, PAUSABLE_QUEUE).get_by_role(
        "button", name=f"Resume queue {PAUSABLE_QUEUE}"
    )
    expect(resume).to_be_focused()
    with stack.admin() as admin:
        listed = queues_by_name(admin)
        paused = listed[PAUSABLE_QUEUE]
        assert (paused["paused"], paused["pausedBy"]) == (True, "user:admin")
        assert paused["pauseReason"] == "incident 42: the warehouse is down"
        assert paused["pausedAt"] is not None
        assert listed["default"]["paused"] is False
        run_id = create_run(admin, "ui_pausable", scope_id, note="held")
    # The page refreshes itself: the new run shows as ready, and how long it has waited.
    expect(queue_cell(page, PAUSABLE_QUEUE, "Ready")).to_have_text("1", timeout=15_000)
    expect(queue_cell(page, PAUSABLE_QUEUE, "Oldest ready")).to_have_text(
        re.compile(r"^\d+(\.\d)? (ms|s)$")
    )

    page.goto(f"{stack.dashboard}#/runs/{run_id}")
    expect(run_status(page)).to_have_text("queued")
    note = waiting_note(page)
    expect(note).to_have_attribute("data-reason", "queue_paused")
    expect(note).to_have_text(
        f"Its queue {PAUSABLE_QUEUE} is paused: the run starts once the queue is resumed. "
        "See the queues."
    )
    note.get_by_role("link", name="See the queues.").click()
    queue_row(page, PAUSABLE_QUEUE).get_by_role(
        "button", name=f"Resume queue {PAUSABLE_QUEUE}"
    ).click()
    expect(queue_cell(page, PAUSABLE_QUEUE, "State")).to_have_text("active")
    expect(page.locator("#queues-status")).to_have_text(
        f"Queue {PAUSABLE_QUEUE} resumed: its runs start again."
    )
    with stack.admin() as admin:
        resumed = queues_by_name(admin)[PAUSABLE_QUEUE]
    assert (resumed["paused"], resumed["pausedBy"], resumed["pauseReason"]) == (False, None, None)

    page.goto(f"{stack.dashboard}#/runs/{run_id}")
    expect(run_status(page)).to_have_text("succeeded", timeout=15_000)
    expect(waiting_note(page)).to_have_count(0)

    # The audit trail has both, by queue name, each linking to the Queues page.
    page.goto(f"{stack.dashboard}#/audit?jobId={PAUSABLE_QUEUE}")
    events = page.get_by_role("region", name="Events")
    rows = events.get_by_role("row")
    paused_row = rows.filter(has_text="queue_paused").filter(has_text="incident 42")
    expect(paused_row).to_contain_text("user:admin")
    expect(paused_row.get_by_role("link", name=PAUSABLE_QUEUE)).to_have_attribute(
        "href", "#/queues"
    )
    expect(rows.filter(has_text="queue_resumed").first).to_be_visible()


def test_an_open_run_page_says_when_its_queue_is_paused_and_resumed(
    page: Page, stack: Stack, scope_id: str
) -> None:
    # Why a run waits is not stored, so the run's version does not move when its queue is
    # paused: the open page must notice all the same.
    with stack.admin() as admin:
        run_id = create_run(admin, "ui_pausable_unserved", scope_id)
    sign_in(page, stack)
    page.goto(f"{stack.dashboard}#/runs/{run_id}")
    note = waiting_note(page)
    expect(note).to_have_attribute("data-reason", "handler")
    try:
        with stack.admin() as admin:
            paused = admin.post(f"/v1/queues/{PAUSABLE_QUEUE}/pause", json={"reason": "test"})
            assert paused.status_code == 200, paused.text
        expect(note).to_have_attribute("data-reason", "queue_paused", timeout=10_000)
        expect(note).to_contain_text(f"Its queue {PAUSABLE_QUEUE} is paused")
        with stack.admin() as admin:
            assert admin.post(f"/v1/queues/{PAUSABLE_QUEUE}/resume").status_code == 200
        expect(note).to_have_attribute("data-reason", "handler", timeout=10_000)
        expect(run_status(page)).to_have_text("queued")
    finally:
        # The queue as the other tests expect it: active and empty.
        with stack.admin() as admin:
            admin.post(f"/v1/queues/{PAUSABLE_QUEUE}/resume")
            admin.post(f"/v1/runs/{run_id}/cancel", json={})


def test_a_key_that_may_not_read_queues_has_no_queues_page(
    page: Page, stack: Stack, scope_id: str
) -> None:
    with stack.admin() as admin:
        body = {"name": f"auditor-{scope_id}", "role": "auditor"}
        key = admin.post("/v1/api-keys", json=body).json()["key"]
    sign_in(page, stack, key)
    nav = page.get_by_role("navigation", name="Main")
    expect(nav.get_by_role("link", name="Audit", exact=True)).to_be_visible()
    expect(nav.get_by_role("link", name="Queues", exact=True)).to_have_count(0)
    # By its address, the page says what the API answered.
    page.goto(f"{stack.dashboard}#/queues")
    refusal = page.get_by_role("alert")
    expect(refusal).to_contain_text("Forbidden")
    expect(refusal).to_contain_text("may not use queues:read")
    expect(page.get_by_role("button", name=re.compile("^(Pause|Resume) queue"))).to_have_count(0)


def test_every_page_renders_and_the_audit_exports_csv(
    page: Page, stack: Stack, scope_id: str
) -> None:
    with stack.admin() as admin:
        run_id = create_run(admin, "ui_steps", scope_id, sleepSeconds=0)
        changed = {"type": "ui_report", "schedulable": True, "description": "version 2"}
        changed["steps"] = [{"id": "collect", "handler": "builtin.noop"}]
        assert admin.post("/v1/templates", json=changed).status_code == 201
        key = {"name": f"k-{scope_id}", "role": "auditor"}
        key_id = admin.post("/v1/api-keys", json=key).json()["id"]
    sign_in(page, stack)
    overview = page.get_by_role("region", name="Runs by status")
    expect(overview.get_by_role("link", name=re.compile(r"^\d+ succeeded$"))).to_be_visible()
    expect(page.get_by_role("img", name=re.compile("Runs per minute"))).to_be_visible()
    expect(page.get_by_role("region", name="Scheduler")).to_contain_text("leader")
    expect(page.get_by_role("region", name="Workers")).to_contain_text("1 alive")

    page.goto(f"{stack.dashboard}#/templates/ui_report?from=1&to=2")
    diff = page.get_by_role("region", name="Changes from v1 to v2")
    expect(diff.locator(".add", has_text='"description": "version 2"')).to_have_count(1)

    page.goto(f"{stack.dashboard}#/runs?templateType=ui_steps&scopeId={scope_id}")
    expect(page.get_by_role("link", name=f"run {run_id}")).to_be_visible()

    page.goto(f"{stack.dashboard}#/audit?jobId={run_id}")
    events = page.get_by_role("region", name="Events")
    expect(events).to_contain_text("created")
    with page.expect_download() as download:
        events.get_by_role("button", name="Export CSV").click()
    rows = list(csv.DictReader(io.StringIO(download.value.path().read_text())))
    assert rows and {r["jobId"] for r in rows} == {run_id}
    assert rows[0]["type"] == "created" and rows[0]["actor"] == "user:admin"

    # A key's events name the key, which has no page to link to.
    page.goto(f"{stack.dashboard}#/audit?jobId={key_id}")
    expect(events).to_contain_text("api_key_created")
    expect(events).to_contain_text(key_id)
    expect(events.get_by_role("link", name=f"run {key_id}")).to_have_count(0)


# A laptop's screen, as wide as the one the Audit table and the timeline were cut off on.
LAPTOP = {"width": 1400, "height": 900}


def test_the_audit_table_s_last_column_is_within_the_page(
    page: Page, stack: Stack, scope_id: str
) -> None:
    # A scope id as a UUID makes one: ids have up to 200 characters and no space to wrap at.
    long_scope_id = f"{scope_id}-{uuid4()}"
    with stack.admin() as admin:
        run_id = create_run(admin, "ui_steps", long_scope_id, sleepSeconds=0)
    page.set_viewport_size(LAPTOP)
    sign_in(page, stack)
    page.goto(f"{stack.dashboard}#/runs/{run_id}")
    expect(run_status(page)).to_have_text("succeeded", timeout=15_000)
    page.goto(f"{stack.dashboard}#/audit?jobId={run_id}")
    table = page.get_by_role("region", name="Events").get_by_role("table")
    expect(table).to_contain_text("running → succeeded")
    # The right edges of the last column's cells, of the box that would clip them (it scrolls
    # sideways) and of the viewport.
    last, box, viewport = table.evaluate(
        """table => [
            Math.max(...Array.from(
                table.rows, (row) => row.lastElementChild.getBoundingClientRect().right)),
            table.parentElement.getBoundingClientRect().right,
            document.documentElement.clientWidth,
        ]"""
    )
    assert last <= box <= viewport


def test_a_run_s_timeline_shows_its_last_event_without_a_scroll_box_of_its_own(
    page: Page, stack: Stack, scope_id: str
) -> None:
    with stack.admin() as admin:
        run_id = create_run(admin, "ui_steps", scope_id, sleepSeconds=0)
    page.set_viewport_size(LAPTOP)
    sign_in(page, stack)
    page.goto(f"{stack.dashboard}#/runs/{run_id}")
    expect(run_status(page)).to_have_text("succeeded", timeout=15_000)
    timeline = page.get_by_role("list", name="Events, oldest first")
    last = timeline.get_by_role("listitem").last
    expect(last).to_contain_text("running → succeeded")
    # The list is as tall as its events: nothing in it to scroll to.
    assert timeline.evaluate("list => list.scrollHeight - list.clientHeight") == 0
    # Scrolling the page alone brings the last event into view, whole.
    page.evaluate("window.scrollTo(0, document.documentElement.scrollHeight)")
    expect(last).to_be_in_viewport(ratio=1)


def test_a_flow_is_drawn_in_layers_and_a_line_is_not(
    page: Page, stack: Stack, scope_id: str
) -> None:
    with stack.admin() as admin:
        run_id = create_run(admin, "ui_diamond", scope_id, sleepSeconds=3)
        line_id = create_run(admin, "ui_fail", scope_id, fatal=True)
    sign_in(page, stack)
    page.goto(f"{stack.dashboard}#/runs/{run_id}")
    graph = page.get_by_role("group", name="Steps by what they need")
    layers = graph.locator("[data-layer]")
    expect(layers).to_have_count(3)
    expect(layers.nth(1).locator("[data-node]")).to_have_count(3)
    left = graph.locator('[data-node="left"]')
    expect(left).to_have_attribute("title", "needs fetch")
    expect(left.locator("[data-status]")).to_have_text("running", timeout=10_000)
    expect(graph.locator('[data-node="skip"] [data-status]')).to_have_text("skipped")
    expect(run_status(page)).to_have_text("succeeded", timeout=15_000)
    expect(graph.locator('[data-node="join"] [data-status]')).to_have_text("succeeded")
    page.goto(f"{stack.dashboard}#/runs/{line_id}")
    expect(run_status(page)).to_have_text("failed", timeout=10_000)
    expect(page.get_by_role("group", name="Steps by what they need")).to_have_count(0)


def test_a_map_step_counts_its_children_and_links_to_their_list(
    page: Page, stack: Stack, scope_id: str
) -> None:
    with stack.admin() as admin:
        run_id = create_run(admin, "ui_map", scope_id, parts=[1, 2, 3], sleepSeconds=2)
    sign_in(page, stack)
    page.goto(f"{stack.dashboard}#/runs/{run_id}")
    expect(run_status(page)).to_have_text("waiting children", timeout=10_000)
    graph = page.get_by_role("group", name="Steps by what they need")
    expect(graph.locator('[data-node="parts"] [data-status]')).to_have_text("waiting")
    children = page.locator('[data-children="parts"]')
    expect(children).to_contain_text("children 0/3")
    expect(run_status(page)).to_have_text("succeeded", timeout=20_000)
    expect(children).to_contain_text("children 3/3: 3 succeeded, 0 failed, 0 active")
    children.get_by_role("link", name="list them").click()
    expect(page).to_have_url(re.compile(f"parentRunId={run_id}"))
    listed = page.get_by_role("region", name="Runs")
    expect(listed.get_by_role("link", name=re.compile(r"^run "))).to_have_count(3)


# -- traces: a run created in a caller's trace shows its trace id, linked when the server says
# where traces are shown (JOBPLANE_TRACE_URL).

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


def create_traced_run(admin: httpx.Client, scope_id: str) -> str:
    """A run of `ui_steps` created with a `traceparent`: it keeps that trace."""
    payload = {"sleepSeconds": 0}
    body = {"templateType": "ui_steps", "scope": "user", "scopeId": scope_id, "payload": payload}
    response = admin.post("/v1/runs", json=body, headers={"traceparent": TRACEPARENT})
    assert response.status_code == 201, response.text
    assert response.json()["traceId"] == TRACE_ID
    return str(response.json()["id"])


def fact(page: Page, term: str) -> Locator:
    """The value the run page's facts give for `term` (its <dd>)."""
    return page.locator(f"dl.facts dt:text-is('{term}') + dd")


def test_a_run_s_trace_id_is_shown_as_text_without_a_trace_url(
    page: Page, stack: Stack, scope_id: str
) -> None:
    with stack.admin() as admin:
        traced = create_traced_run(admin, scope_id)
        untraced = create_run(admin, "ui_steps", scope_id, sleepSeconds=0)
        assert admin.get(f"/v1/runs/{untraced}").json()["traceId"] is None
    sign_in(page, stack)
    page.goto(f"{stack.dashboard}#/runs/{traced}")
    expect(run_status(page)).to_have_text("succeeded", timeout=15_000)
    trace = fact(page, "Trace")
    expect(trace).to_have_text(TRACE_ID)
    expect(trace.locator(".mono")).to_have_text(TRACE_ID)
    expect(trace.get_by_role("link")).to_have_count(0)

    page.goto(f"{stack.dashboard}#/runs/{untraced}")
    expect(run_status(page)).to_have_text("succeeded", timeout=15_000)
    expect(fact(page, "Created")).to_be_visible()
    expect(page.locator("dl.facts dt:text-is('Trace')")).to_have_count(0)


def test_a_run_s_trace_id_links_to_the_trace_url(
    page: Page, stack: Stack, scope_id: str, tmp_path: Path
) -> None:
    template = "https://jaeger.example/trace/{traceId}?from=jobplane"
    with another_api(stack, tmp_path, trace_url=template) as linked, stack.admin() as admin:
        traced = create_traced_run(admin, scope_id)
        untraced = create_run(admin, "ui_steps", scope_id, sleepSeconds=0)
        sign_in(page, linked)
        page.goto(f"{linked.dashboard}#/runs/{traced}")
        expect(run_status(page)).to_have_text("succeeded", timeout=15_000)
        link = fact(page, "Trace").get_by_role("link", name=TRACE_ID, exact=True)
        expect(link).to_have_attribute(
            "href", f"https://jaeger.example/trace/{TRACE_ID}?from=jobplane"
        )
        expect(link).to_have_attribute("target", "_blank")
        expect(link).to_have_attribute("rel", "noopener")
        expect(link).to_have_class("mono")

        page.goto(f"{linked.dashboard}#/runs/{untraced}")
        expect(run_status(page)).to_have_text("succeeded", timeout=15_000)
        expect(fact(page, "Created")).to_be_visible()
        expect(page.locator("dl.facts dt:text-is('Trace')")).to_have_count(0)


# -- live streams: the run page and the overview follow the API's streams, and poll while a
# stream is down.


def live_note(page: Page, name: str) -> Locator:
    """How a page says it follows changes: `data-live` is "live" or "polling"."""
    return page.locator(f"#{name}-live")


def paths(requests: list[Request], path: str) -> list[Request]:
    return [r for r in requests if urlparse(r.url).path == path]


def started(admin: httpx.Client, run_id: str) -> None:
    """Once `run_id` runs: from then on, only the stream says how it moves."""
    for _ in range(200):
        if admin.get(f"/v1/runs/{run_id}").json()["status"] == "running":
            return
        time.sleep(0.05)
    pytest.fail(f"run {run_id} did not start")


def test_the_run_page_follows_the_run_s_stream_without_polling(
    page: Page, stack: Stack, scope_id: str
) -> None:
    with stack.admin() as admin:
        run_id = create_run(admin, "ui_steps", scope_id, sleepSeconds=1)
        started(admin, run_id)
    sign_in(page, stack)
    # Signed in first: a page asked for while the dashboard starts is drawn twice.
    expect(page.get_by_role("heading", name="Overview")).to_be_visible()
    asked: list[Request] = []
    page.on("request", lambda request: asked.append(request))
    page.goto(f"{stack.dashboard}#/runs/{run_id}")
    expect(live_note(page, "run")).to_have_attribute("data-live", "live")
    expect(live_note(page, "run")).to_have_text(" · live")
    expect(run_status(page)).to_have_text("succeeded", timeout=15_000)
    expect(page.get_by_role("progressbar", name="Run progress")).to_have_attribute(
        "aria-valuenow", "100"
    )
    timeline = page.get_by_role("list", name="Events, oldest first")
    expect(timeline).to_contain_text("running → succeeded")
    expect(live_note(page, "run")).to_have_count(0)  # a finished run is followed no more
    page.wait_for_timeout(1_500)  # longer than a poll's interval
    # The page's first read; the stream said the rest.
    assert len(paths(asked, f"/v1/runs/{run_id}")) == 1
    assert len(paths(asked, f"/v1/runs/{run_id}/stream")) == 1


BREAKS: dict[str, Callable[[Route], None]] = {
    "unreachable": lambda route: route.abort(),
    "refused": lambda route: route.fulfill(status=500, json={"error": {"code": "Internal"}}),
    # Accepted, then ended before the run did.
    "cut short": lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body=": ping\r\n\r\n"
    ),
}


@pytest.mark.parametrize("how", BREAKS)
def test_the_run_page_polls_while_its_stream_is_down_then_follows_it_again(
    page: Page, stack: Stack, scope_id: str, how: str
) -> None:
    tries: list[str] = []

    def once(route: Route) -> None:
        tries.append(route.request.url)
        if len(tries) == 1:
            BREAKS[how](route)
        else:
            route.continue_()

    page.route("**/v1/runs/*/stream", once)
    with stack.admin() as admin:
        # Long enough for the stream to be opened again (5 s after it broke) before the end.
        run_id = create_run(admin, "ui_steps", scope_id, sleepSeconds=4)
    sign_in(page, stack)
    expect(page.get_by_role("heading", name="Overview")).to_be_visible()
    asked: list[Request] = []
    page.on("request", lambda request: asked.append(request))
    page.goto(f"{stack.dashboard}#/runs/{run_id}")
    note = live_note(page, "run")
    expect(note).to_have_attribute("data-live", "polling")
    expect(note).to_have_text(" · refreshes every 1 s")
    expect(note).to_have_attribute("data-live", "live", timeout=10_000)
    polled = len(paths(asked, f"/v1/runs/{run_id}"))
    assert polled >= 3, "the page polled while the stream was down"
    expect(run_status(page)).to_have_text("succeeded", timeout=15_000)
    page.wait_for_timeout(1_500)  # longer than a poll's interval
    assert len(tries) == 2
    # Once the stream was open again, no more polls, bar one under way as it opened.
    assert len(paths(asked, f"/v1/runs/{run_id}")) <= polled + 1


def test_the_overview_refreshes_when_the_trail_s_stream_says_something_happened(
    page: Page, stack: Stack, scope_id: str
) -> None:
    # A key of this test's scope, whose overview and trail nothing else touches.
    body = {"name": f"live-{scope_id}", "role": "user", "scopes": [f"user:{scope_id}"]}
    with stack.admin() as admin:
        key = admin.post("/v1/api-keys", json=body).json()["key"]
    asked: list[Request] = []
    page.on("request", lambda request: asked.append(request))
    sign_in(page, stack, key)
    expect(live_note(page, "overview")).to_have_attribute("data-live", "live")
    queued = page.locator("#tile-queued")
    expect(queued).to_have_attribute("aria-label", "0 queued")
    before = len(paths(asked, "/v1/overview"))
    with stack.admin() as admin:
        run_id = create_run(admin, "ui_unserved", scope_id)  # stays queued
    expect(queued).to_have_attribute("aria-label", "1 queued")
    page.wait_for_timeout(5_500)  # longer than a poll's interval
    # One refresh for the run's entries, which come in a burst; no poll.
    assert len(paths(asked, "/v1/overview")) - before in (1, 2)
    assert len(paths(asked, "/v1/events/stream")) == 1
    with stack.admin() as admin:
        admin.post(f"/v1/runs/{run_id}/cancel", json={})


def test_the_overview_polls_while_the_trail_s_stream_is_down(
    page: Page, stack: Stack, scope_id: str
) -> None:
    page.route("**/v1/events/stream*", lambda route: route.abort())
    body = {"name": f"poll-{scope_id}", "role": "user", "scopes": [f"user:{scope_id}"]}
    with stack.admin() as admin:
        key = admin.post("/v1/api-keys", json=body).json()["key"]
    sign_in(page, stack, key)
    note = live_note(page, "overview")
    expect(note).to_have_attribute("data-live", "polling")
    expect(note).to_have_text(" · refreshes every 5 s")
    queued = page.locator("#tile-queued")
    expect(queued).to_have_attribute("aria-label", "0 queued")
    with stack.admin() as admin:
        run_id = create_run(admin, "ui_unserved", scope_id)
        expect(queued).to_have_attribute("aria-label", "1 queued", timeout=12_000)
        admin.post(f"/v1/runs/{run_id}/cancel", json={})
