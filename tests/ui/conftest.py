"""The dashboard's browser tests: one jobplane (API, worker and scheduler processes) and one
headless Chromium for the whole directory; each test gets a fresh browser context (its own
sessionStorage) and its own scope ids, so tests never see each other's runs.

Without Chromium the tests are skipped, and the reason is printed at the start and in the
summary; `make test` installs Chromium first wherever apt-get can.
"""

from collections.abc import Iterator
from uuid import uuid4

import pytest
from playwright.sync_api import Browser, BrowserContext, Page, Playwright, sync_playwright

# API-level tests of GET /v1/overview run against an in-process app, with the integration
# fixtures (their own database and Redis prefix per test).
from tests.integration.conftest import (  # noqa: F401
    backends,
    client_for,
    register,
    settings,
    store,
)
from tests.ui.stack import CHROMIUM, CHROMIUM_MISSING, Stack, launch_chromium, running_stack

# The worker serves a second queue, which the tests pause without holding back the runs of
# the other tests (on `default`), even when a test fails before it resumes the queue.
PAUSABLE_QUEUE = "ui_pausable"

TEMPLATES = [
    {
        "type": "ui_steps",
        "name": "Three steps",
        "description": "Two sleeps and an echo.",
        "payloadSchema": {
            "type": "object",
            "properties": {
                "sleepSeconds": {
                    "type": "number",
                    "minimum": 0,
                    "maximum": 30,
                    "description": "per sleeping step",
                },
                "target": {"type": "string", "maxLength": 40},
                "mode": {"enum": ["fast", "thorough"]},
                "notify": {"type": "boolean"},
            },
            "required": ["sleepSeconds"],
            "additionalProperties": False,
        },
        "steps": [
            {"id": "prepare", "name": "Prepare", "handler": "builtin.sleep"},
            {"id": "work", "name": "Work", "handler": "builtin.sleep"},
            {"id": "report", "name": "Report", "handler": "builtin.echo"},
        ],
    },
    {
        # The first step cannot be cancelled, so a cancel stays `cancel_requested` until it
        # ends: long enough for the page to show it before `cancelled`.
        "type": "ui_hold",
        "name": "Hold, then wait",
        "payloadSchema": {"type": "object"},
        "cancelPolicy": {"graceSeconds": 60},
        "steps": [
            {"id": "hold", "handler": "builtin.sleep", "cancelable": False},
            {"id": "wait", "handler": "builtin.noop"},
        ],
    },
    {
        "type": "ui_fail",
        "name": "Always fails",
        "steps": [{"id": "boom", "name": "Boom", "handler": "builtin.fail"}],
    },
    {
        # No worker of the stack offers its handler: its runs wait, saying so.
        "type": "ui_unserved",
        "name": "Needs a handler no worker offers",
        "steps": [{"id": "render", "handler": "ui.nobody"}],
    },
    {
        # The templates on the queue the tests pause; no worker offers the second one's handler.
        "type": "ui_pausable",
        "name": "On a queue of its own",
        "queue": PAUSABLE_QUEUE,
        "steps": [{"id": "echo", "handler": "builtin.echo"}],
    },
    {
        "type": "ui_pausable_unserved",
        "name": "On a queue of its own, needs a handler no worker offers",
        "queue": PAUSABLE_QUEUE,
        "steps": [{"id": "render", "handler": "ui.nobody"}],
    },
    {
        # A flow beyond a line: the run page draws it in layers.
        "type": "ui_diamond",
        "name": "Diamond",
        "steps": [
            {"id": "fetch", "handler": "builtin.noop"},
            {"id": "left", "handler": "builtin.sleep", "needs": ["fetch"]},
            {"id": "right", "handler": "builtin.noop", "needs": ["fetch"]},
            {"id": "skip", "handler": "builtin.noop", "needs": ["fetch"], "when": "false"},
            {"id": "join", "handler": "builtin.noop", "needs": ["left", "right", "skip"]},
        ],
    },
    # A map step (a child run of `ui_part` per part) beside a plain step, then a summary.
    {
        "type": "ui_map",
        "name": "Map",
        "steps": [
            {
                "id": "parts",
                "workerType": "map",
                "map": {
                    "items": "payload.parts",
                    "template": "ui_part",
                    "payload": "{'sleepSeconds': payload.sleepSeconds}",
                },
            },
            {"id": "note", "handler": "builtin.noop", "needs": []},
            {"id": "sum", "handler": "builtin.noop", "needs": ["parts", "note"]},
        ],
    },
    {"type": "ui_part", "name": "Part", "steps": [{"id": "nap", "handler": "builtin.sleep"}]},
    {
        "type": "ui_report",
        "name": "Report",
        "schedulable": True,
        "payloadSchema": {"type": "object", "properties": {"period": {"type": "string"}}},
        "steps": [{"id": "collect", "handler": "builtin.noop"}],
    },
]


def pytest_report_header() -> str | None:
    """Said first when tests/ui is among the paths given (`pytest tests/ui`)."""
    if not CHROMIUM.exists():
        return f"tests/ui will be SKIPPED: {CHROMIUM_MISSING}"
    return None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Said last in every run that collected these tests, so a skip is never silent."""
    if not CHROMIUM.exists():
        terminalreporter.write_sep("=", "dashboard browser tests SKIPPED", yellow=True, bold=True)
        terminalreporter.write_line(CHROMIUM_MISSING)


# Package scope: the processes go away when the last test here has run.
@pytest.fixture(scope="package")
def stack(
    mongo_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("ui_logs")
    with running_stack(mongo_url, redis_url, logs, ["default", PAUSABLE_QUEUE]) as running:
        with running.admin() as admin:
            for template in TEMPLATES:
                response = admin.post("/v1/templates", json=template)
                assert response.status_code == 201, response.text
        yield running


# Module scope: while Playwright's sync driver is open, its event loop counts as running in
# this thread, so async tests (pytest-asyncio's) can only run once it is closed again.
@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    if not CHROMIUM.exists():
        pytest.skip(CHROMIUM_MISSING)
    with sync_playwright() as driver:
        yield driver


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    chromium = launch_chromium(playwright)
    yield chromium
    chromium.close()


@pytest.fixture
def context(browser: Browser, stack: Stack) -> Iterator[BrowserContext]:
    """A fresh browser context on a laptop-sized screen."""
    made = browser.new_context(viewport={"width": 1366, "height": 800}, accept_downloads=True)
    made.set_default_timeout(15_000)
    yield made
    made.close()


@pytest.fixture
def page(context: BrowserContext) -> Iterator[Page]:
    """A page that fails the test on an uncaught script error."""
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    yield opened
    assert not errors, f"script errors on the page: {errors}"


@pytest.fixture
def scope_id() -> str:
    """A scope id of this test's own."""
    return f"u_{uuid4().hex[:8]}"


def sign_in(page: Page, stack: Stack, key: str | None = None) -> None:
    """Open the dashboard with `key` (the admin's by default) already in sessionStorage."""
    page.add_init_script(
        f"sessionStorage.setItem('jobplane.apiKey', {(key or stack.admin_key)!r});"
    )
    page.goto(stack.dashboard)
