"""The `jobplane` CLI against a real API server on a real port, in process and as processes.

In-process calls run in a thread: the CLI's HTTP client is synchronous, and the server it
talks to runs on this test's event loop.
"""

import asyncio
import contextlib
import io
import json
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from jobplane.backends import Backends
from jobplane.cli import main
from jobplane.devstack import free_port
from jobplane.settings import Settings
from jobplane.templates.loader import SUFFIXES
from jobplane.worker import registry
from tests.integration.conftest import Register
from tests.integration.workers import running, settled

TEMPLATES = Path(__file__).parents[2] / "templates"
ADMIN = "test-admin-key"  # the `settings` fixture's admin key


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def lines(self) -> list[str]:
        return self.out.splitlines()


CLI = Callable[..., Awaitable[Result]]


def invoke(argv: list[str]) -> Result:
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
    return Result(code, out.getvalue(), err.getvalue())


@pytest.fixture
def cli(url: str) -> CLI:
    """`jobplane ARGS --url <the server> --key <key, the admin's by default>`, in process."""

    async def cli(*args: str, key: str = ADMIN) -> Result:
        return await asyncio.to_thread(invoke, [*args, "--url", url, "--key", key])

    return cli


async def jobplane(*args: str, env: dict[str, str]) -> Result:
    """`python -m jobplane ARGS` as a process."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jobplane",
        *args,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


def ok(result: Result) -> Result:
    assert result.code == 0, result
    assert result.err == "", result
    return result


def failed(result: Result, code: str) -> str:
    """The one stderr line of a failed command, which names `code`."""
    assert result.code != 0, result
    assert result.out == "", result
    [line] = result.err.splitlines()
    assert line.startswith(f"error: {code}: "), line
    return line


def fields(result: Result) -> dict[str, str]:
    """`label: value` lines, as `keys create` prints them."""
    pairs = (line.split(":", 1) for line in result.lines if ": " in line)
    return {label: value.strip() for label, value in pairs}


def row_ids(result: Result) -> list[str]:
    """The run ids of a `runs list` table, below its header."""
    assert result.lines[0].startswith("ID ")
    return [line.split()[0] for line in result.lines[1:]]


async def created(cli: CLI, *args: str, key: str = ADMIN) -> str:
    result = ok(await cli("runs", "create", *args, key=key))
    [run_id] = result.lines
    return run_id


async def test_templates_apply_list_show_enable_disable(
    cli: CLI, backends: Backends, tmp_path: Path
) -> None:
    # A live worker offers the shipped templates' handlers, so applying them warns of nothing.
    await backends.queue.mark_alive("w", 60, 0, ["default"], registry.offered())
    applied = ok(await cli("templates", "apply", str(TEMPLATES)))
    assert "demo_long_task.yaml: demo_long_task v1" in applied.lines
    assert len(applied.lines) == len([p for p in TEMPLATES.iterdir() if p.suffix in SUFFIXES])

    # One FILE, changed: the next version.
    changed = tmp_path / "demo.yaml"
    yaml = (TEMPLATES / "demo_long_task.yaml").read_text()
    changed.write_text(yaml.replace("graceSeconds: 30", "graceSeconds: 45"))
    assert ok(await cli("templates", "apply", str(changed))).lines == [
        "demo.yaml: demo_long_task v2"
    ]

    listed = {
        line.split()[0]: line.split()[1:] for line in ok(await cli("templates", "list")).lines
    }
    assert listed["demo_long_task"] == ["v2", "enabled"]
    assert listed["scheduled_report"] == ["v1", "enabled"]
    assert len(listed) == len(applied.lines)

    latest = json.loads(ok(await cli("templates", "show", "demo_long_task")).out)
    assert latest["version"] == 2 and latest["cancelPolicy"]["graceSeconds"] == 45
    first = json.loads(ok(await cli("templates", "show", "demo_long_task", "--version", "1")).out)
    assert first["version"] == 1 and first["cancelPolicy"]["graceSeconds"] == 30
    failed(await cli("templates", "show", "nope"), "NotFound")
    failed(await cli("templates", "show", "demo_long_task", "--version", "9"), "NotFound")

    disabled = ok(await cli("templates", "disable", "demo_long_task"))
    assert disabled.out.split() == ["demo_long_task", "v2", "disabled"]
    assert "disabled" in next(
        line for line in ok(await cli("templates", "list")).lines if "demo_long_task" in line
    )
    refused = await cli("runs", "create", "demo_long_task", "--payload", '{"target": "a"}')
    failed(refused, "TemplateDisabled")
    assert ok(await cli("templates", "enable", "demo_long_task")).out.split()[-1] == "enabled"
    assert await created(cli, "demo_long_task", "--payload", '{"target": "a"}')
    failed(await cli("templates", "enable", "nope"), "NotFound")

    # A refused file is named; the parser's multi-line complaint stays on one line.
    bad = tmp_path / "bad" / "broken.yaml"
    bad.parent.mkdir()
    bad.write_text("type: [unclosed\n")
    assert failed(await cli("templates", "apply", str(bad.parent)), "ValidationFailed") == (
        "error: ValidationFailed: broken.yaml: malformed YAML (line 2, column 1: expected ',' or "
        "']', but got '<stream end>' (while parsing a flow sequence at line 1, column 7))"
    )
    missing = await cli("templates", "apply", str(tmp_path / "missing"))
    assert missing.code == 2 and failed(missing, "InvalidArgument"), "bad arguments exit 2"
    (tmp_path / "empty").mkdir()
    failed(await cli("templates", "apply", str(tmp_path / "empty")), "InvalidArgument")


async def test_applying_a_template_no_live_worker_can_run_warns(cli: CLI, tmp_path: Path) -> None:
    lonely = tmp_path / "lonely.yaml"
    lonely.write_text("type: t_lonely\nsteps:\n  - {id: s, handler: nobody.offers}\n")
    result = await cli("templates", "apply", str(lonely))
    assert result.code == 0 and result.lines == ["lonely.yaml: t_lonely v1"]
    assert result.err.splitlines() == [
        "warning: lonely.yaml: no live worker offers handler 'nobody.offers' on queue "
        "'default': its runs wait until one does"
    ]


async def test_a_user_key_acts_only_in_its_scopes(
    cli: CLI, register: Register, backends: Backends
) -> None:
    await register("t_noop")
    elsewhere = await created(cli, "t_noop", "--scope", "user", "--scope-id", "u2")

    made = ok(
        await cli(
            "keys",
            "create",
            "alice",
            "--role",
            "user",
            "--scope",
            "user:u1",
            "--scope",
            "account:a1",
        )
    )
    shown = fields(made)
    assert shown["name"] == "alice" and shown["role"] == "user"
    assert shown["scopes"] == "user:u1 account:a1"
    assert shown["secret"].startswith("jp_") and "shown only this once" in made.out
    alice = shown["secret"]

    mine = await created(cli, "t_noop", "--scope", "user", "--scope-id", "u1", key=alice)
    theirs = await created(cli, "t_noop", "--scope", "account", "--scope-id", "a1", key=alice)
    run = json.loads(ok(await cli("runs", "get", mine, key=alice)).out)
    assert (run["scope"], run["scopeId"], run["status"]) == ("user", "u1", "queued")
    assert row_ids(ok(await cli("runs", "list", key=alice))) == [theirs, mine]
    scoped = await cli("runs", "list", "--scope", "user", "--scope-id", "u1", key=alice)
    assert row_ids(ok(scoped)) == [mine]
    # The admin sees every scope.
    assert row_ids(ok(await cli("runs", "list"))) == [theirs, mine, elsewhere]

    outside = await cli(
        "runs", "create", "t_noop", "--scope", "user", "--scope-id", "u2", key=alice
    )
    assert failed(outside, "Forbidden") == (
        "error: Forbidden: this key may not act in scope user:u2; it may in account:a1, "
        "user:u1 (pass --scope and --scope-id)"
    )
    # With two scopes a key has no default: the refusal names them, and the flags.
    assert "it may in account:a1, user:u1 (pass --scope" in failed(
        await cli("runs", "create", "t_noop", key=alice), "Forbidden"
    )
    # With one, that is the default.
    solo = fields(
        ok(await cli("keys", "create", "solo", "--role", "user", "--scope", "account:a2"))
    )
    defaulted = await created(cli, "t_noop", key=solo["secret"])
    run = json.loads(ok(await cli("runs", "get", defaulted, key=solo["secret"])).out)
    assert (run["scope"], run["scopeId"]) == ("account", "a2")
    failed(await cli("runs", "list", "--scope", "user", "--scope-id", "u2", key=alice), "Forbidden")
    failed(await cli("runs", "get", elsewhere, key=alice), "NotFound")
    failed(await cli("runs", "cancel", elsewhere, key=alice), "NotFound")
    failed(await cli("keys", "create", "mallory", "--role", "admin", key=alice), "Forbidden")
    failed(await cli("runs", "list", key="jp_wrong"), "Unauthorized")

    # The API checks what the parser cannot: scopes fit the role, names are unique.
    assert "needs at least one scope" in failed(
        await cli("keys", "create", "bob", "--role", "user"), "ValidationFailed"
    )
    failed(
        await cli("keys", "create", "audit", "--role", "auditor", "--scope", "user:u1"),
        "ValidationFailed",
    )
    failed(
        await cli("keys", "create", "alice", "--role", "user", "--scope", "user:u3"),
        "ResourceInvalidState",
    )
    auditor = fields(ok(await cli("keys", "create", "audit", "--role", "auditor")))
    assert auditor["scopes"] == "(all)"
    everyone = row_ids(ok(await cli("runs", "list", key=auditor["secret"])))
    assert set(everyone) == {mine, theirs, elsewhere, defaulted}
    failed(await cli("runs", "cancel", mine, key=auditor["secret"]), "Forbidden")


async def test_runs_list_follows_cursors_with_all(
    cli: CLI, register: Register, backends: Backends
) -> None:
    await register("t_noop")
    await register("t_other")
    ids = [await created(cli, "t_noop", "--scope-id", f"s{i}") for i in range(5)]
    other = await created(cli, "t_other", "--priority", "5", "--delay-seconds", "60")
    newest_first = [other, *reversed(ids)]

    first = await cli("runs", "list", "--limit", "2")
    assert first.code == 0 and row_ids(first) == newest_first[:2]
    assert "--all" in first.err  # more pages exist, and the hint is not in the table
    every = ok(await cli("runs", "list", "--limit", "2", "--all"))
    assert row_ids(every) == newest_first
    assert every.lines[1].split()[:3] == [other, "queued", "t_other"]

    assert row_ids(ok(await cli("runs", "list", "--template", "t_other", "--all"))) == [other]
    assert row_ids(ok(await cli("runs", "list", "--scope-id", "s3"))) == [ids[3]]
    for run_id in ids[1:3]:
        ok(await cli("runs", "cancel", run_id))
    cancelled = ok(await cli("runs", "list", "--status", "cancelled", "--limit", "1", "--all"))
    assert row_ids(cancelled) == [ids[2], ids[1]]
    assert row_ids(ok(await cli("runs", "list", "--scope", "user"))) == []
    failed(await cli("runs", "list", "--limit", "0"), "ValidationFailed")
    failed(await cli("runs", "list", "--status", "done"), "InvalidArgument")


async def test_cancel_and_rerun(
    cli: CLI, register: Register, backends: Backends, settings: Settings
) -> None:
    await register("t_noop", payloadSchema={"type": "object"})
    once = ("t_noop", "--payload", '{"n": 1}', "--idempotency-key", "k1")
    run_id = await created(cli, *once)
    assert await created(cli, *once) == run_id  # the first run
    reused = await cli("runs", "create", "t_noop", "--idempotency-key", "k1")
    assert run_id in failed(reused, "ResourceInvalidState")  # the key, for another payload

    assert ok(await cli("runs", "cancel", run_id, "--reason", "not needed")).out.split() == [
        run_id,
        "cancelled",
    ]
    run = json.loads(ok(await cli("runs", "get", run_id)).out)
    assert run["status"] == "cancelled" and run["cancelReason"] == "not needed"
    assert "cancelled" in failed(await cli("runs", "cancel", run_id), "ResourceInvalidState")

    active = await created(cli, "t_noop")
    failed(await cli("runs", "rerun", active), "ResourceInvalidState")  # not finished yet
    ok(await cli("runs", "cancel", active))  # no reason given

    async with running(backends, settings):
        rerun = ok(await cli("runs", "rerun", run_id, "--watch", "--interval", "0.1"))
    again = rerun.lines[0]
    assert again != run_id and rerun.lines[1].startswith(f"run {again}  t_noop v1  ")
    assert f"run {again}  t_noop v1  succeeded" in rerun.lines
    run = json.loads(ok(await cli("runs", "get", again)).out)
    assert (run["status"], run["rerunOf"], run["payload"]) == ("succeeded", run_id, {"n": 1})
    watched = ok(await cli("runs", "watch", again))
    assert watched.lines[0].startswith(f"run {again}  t_noop v1  succeeded")
    failed(await cli("runs", "rerun", "0" * 24), "NotFound")


async def test_watch_shows_earlier_attempts_and_an_error_only_for_a_failed_run(
    cli: CLI, register: Register, backends: Backends, settings: Settings
) -> None:
    steps = [{"id": "flaky", "handler": "builtin.fail"}]
    await register("t_flaky", steps=steps, retryPolicy={"maxAttempts": 2, "backoffSeconds": [0]})
    recovers = await created(cli, "t_flaky", "--payload", '{"failTimes": 1}')
    gives_up = await created(cli, "t_flaky", "--payload", '{"failTimes": 2}')
    async with running(backends, settings):
        succeeded = ok(await cli("runs", "watch", recovers, "--interval", "0.1"))
        spent = await cli("runs", "watch", gives_up, "--interval", "0.1")
    first = "  attempt 1 failed: retryable: "
    assert f"run {recovers}  t_flaky v1  succeeded" in succeeded.lines
    assert any(line.startswith(first) for line in succeeded.lines)
    assert not any(line.startswith("  error:") for line in succeeded.lines)
    assert spent.code == 1 and f"run {gives_up}  t_flaky v1  failed" in spent.lines
    # The attempt it failed with is its error, not an earlier attempt.
    tail = [line.split(":")[0] for line in spent.lines[-2:]]
    assert tail == ["  attempt 1 failed", "  error"]


class Wire:
    """What the in-process CLI sends, as `METHOD /path`; and runs' streams broken the next
    `breaks` times, as `how` says: as a proxy that buffers or refuses them, or an API going
    away, would."""

    def __init__(self, send: Callable[..., httpx.Response]) -> None:
        self._send = send
        self.sent: list[str] = []
        self.breaks = 0
        self.how = "refused"

    def send(self, client: httpx.Client, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        self.sent.append(f"{request.method} {request.url.path}")
        if not (request.url.path.endswith("/stream") and self.breaks):
            return self._send(client, request, **kwargs)
        self.breaks -= 1
        if self.how == "unreachable":
            raise httpx.ConnectError("connection refused", request=request)
        if self.how == "refused":
            body = {"error": {"code": "BadGateway", "message": "no streams here"}}
            return httpx.Response(502, json=body, request=request)
        # Cut short: accepted, then ended before the run did.
        sse = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=sse, content=b": ping\r\n\r\n", request=request)


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> Wire:
    made = Wire(httpx.Client.send)
    monkeypatch.setattr(httpx.Client, "send", lambda *args, **kwargs: made.send(*args, **kwargs))
    return made


async def started(backends: Backends, run_id: str) -> None:
    async with asyncio.timeout(10):
        while True:
            run = await backends.store.runs.get(run_id)
            if run is not None and run.status == "running":
                return
            await asyncio.sleep(0.02)


NAP = [{"id": "nap", "handler": "builtin.sleep"}, {"id": "after", "handler": "builtin.echo"}]


async def test_watch_follows_the_run_s_stream_to_its_end(
    cli: CLI, register: Register, backends: Backends, settings: Settings, wire: Wire
) -> None:
    await register("t_nap", steps=NAP)
    async with running(backends, settings):
        run_id = await created(cli, "t_nap", "--payload", '{"sleepSeconds": 1}')
        await started(backends, run_id)
        wire.sent.clear()
        watched = ok(await cli("runs", "watch", run_id, "--interval", "0.1"))
        # The first read draws it at once; then the stream says each change, to the end.
        assert wire.sent == [f"GET /v1/runs/{run_id}", f"GET /v1/runs/{run_id}/stream"]
        assert f"run {run_id}  t_nap v1  succeeded" in watched.lines

        # A run waiting to start is read until it starts (why it waits changes unsaid), then
        # followed by its stream.
        wire.sent.clear()
        payload = '{"sleepSeconds": 1}'
        made = ok(await cli("runs", "create", "t_nap", "--payload", payload, "--watch"))
    run_id = made.lines[0]
    assert f"run {run_id}  t_nap v1  succeeded" in made.lines
    # Without --scope the key is asked which scope is its own, first.
    assert wire.sent[:2] == ["GET /v1/api-keys/me", "POST /v1/runs"]
    assert wire.sent[-1] == f"GET /v1/runs/{run_id}/stream"
    assert set(wire.sent[2:-1]) == {f"GET /v1/runs/{run_id}"}


@pytest.mark.parametrize("how", ["unreachable", "refused", "cut short"])
async def test_watch_polls_while_the_stream_is_down_then_follows_it_again(
    cli: CLI,
    register: Register,
    backends: Backends,
    settings: Settings,
    wire: Wire,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    monkeypatch.setattr("jobplane.cli.runs.STREAM_RETRY_SECONDS", 0.5)
    await register("t_nap", steps=NAP)
    async with running(backends, settings):
        run_id = await created(cli, "t_nap", "--payload", '{"sleepSeconds": 1.5}')
        await started(backends, run_id)
        wire.sent.clear()
        wire.breaks, wire.how = 1, how
        watched = ok(await cli("runs", "watch", run_id, "--interval", "0.1"))
    assert f"run {run_id}  t_nap v1  succeeded" in watched.lines
    run, stream = f"GET /v1/runs/{run_id}", f"GET /v1/runs/{run_id}/stream"
    # Polled for half a second after the stream broke, then followed by it to the end.
    assert wire.sent[:2] == [run, stream] and wire.sent[-1] == stream
    assert wire.sent.count(stream) == 2 and wire.sent.count(run) >= 3


async def test_watch_polls_to_the_end_when_the_stream_is_always_refused(
    cli: CLI,
    register: Register,
    backends: Backends,
    settings: Settings,
    wire: Wire,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("jobplane.cli.runs.STREAM_RETRY_SECONDS", 0.3)
    steps = [{"id": "nap", "handler": "builtin.sleep"}, {"id": "boom", "handler": "builtin.fail"}]
    await register("t_nap_fail", steps=steps)
    wire.breaks = 1000
    async with running(backends, settings):
        payload = '{"sleepSeconds": 1, "fatal": true}'
        run_id = await created(cli, "t_nap_fail", "--payload", payload)
        await started(backends, run_id)
        spent = await cli("runs", "watch", run_id, "--interval", "0.1")
    # The exit code says how the run ended, as ever.
    assert spent.code == 1 and f"run {run_id}  t_nap_fail v1  failed" in spent.lines
    assert spent.err.startswith(f"error: RunNotSucceeded: run {run_id} ended failed")
    stream = f"GET /v1/runs/{run_id}/stream"
    assert wire.sent.count(stream) >= 2, "tried again"
    assert wire.sent[-1] == f"GET /v1/runs/{run_id}", "the end, read by a poll"


async def test_events_with_filters(cli: CLI, register: Register, backends: Backends) -> None:
    await register("t_noop")
    run_id = await created(cli, "t_noop", "--scope", "user", "--scope-id", "u1")
    ok(await cli("runs", "cancel", run_id, "--reason", "stop it"))
    other = await created(cli, "t_noop")

    # The audit trail gets a run's events a moment after their writes.
    async with asyncio.timeout(10):
        while True:
            trail = ok(await cli("events", "--job-id", run_id)).lines
            if len(trail) >= 2:
                break
            await asyncio.sleep(0.1)
    assert all(line.split()[1] == run_id for line in trail)
    assert [line.split()[2] for line in trail] == ["created", "status_changed"]
    assert trail[0].split()[3] == "→queued" and trail[-1].split()[3] == "queued→cancelled"
    assert trail[-1].split()[4] == "user:admin" and trail[-1].endswith("stop it")
    times = [line.split()[0] for line in trail]
    assert times == sorted(times) and all(t.endswith("+00:00") for t in times)

    created_only = ok(await cli("events", "--job-id", run_id, "--type", "created")).lines
    assert [line.split()[2] for line in created_only] == ["created"]
    in_scope = ok(await cli("events", "--scope", "user", "--scope-id", "u1")).lines
    assert in_scope == trail
    assert other not in ok(await cli("events", "--scope", "user", "--scope-id", "u1")).out
    assert ok(await cli("events", "--actor", "user:nobody")).lines == []
    assert ok(await cli("events", "--job-id", run_id, "--actor", "user:admin")).lines == trail

    # The cancel came a whole CLI call after the others, so at a later millisecond.
    since = trail[-1].split()[0]
    assert ok(await cli("events", "--job-id", run_id, "--from", since)).lines == trail[-1:]
    assert ok(await cli("events", "--job-id", run_id, "--to", since)).lines == trail[:-1]
    assert ok(await cli("events", "--from", "2999-01-01T00:00:00Z")).lines == []
    assert ok(await cli("events", "--to", "2000-01-01T00:00:00+08:00")).lines == []

    page = await cli("events", "--job-id", run_id, "--limit", "1")
    assert page.code == 0 and page.lines == trail[:1] and "--all" in page.err
    assert ok(await cli("events", "--job-id", run_id, "--limit", "1", "--all")).lines == trail

    no_offset = await cli("events", "--from", "2026-01-01T00:00:00")
    assert "ISO 8601" in failed(no_offset, "InvalidArgument")
    failed(await cli("events", "--to", "yesterday"), "InvalidArgument")


async def test_bad_input_is_one_line_and_a_failure(cli: CLI, register: Register) -> None:
    await register(
        "t_typed", payloadSchema={"type": "object", "properties": {"n": {"type": "integer"}}}
    )
    assert "not JSON" in failed(
        await cli("runs", "create", "t_typed", "--payload", "{bad"), "InvalidArgument"
    )
    assert "not a JSON object" in failed(
        await cli("runs", "create", "t_typed", "--payload", "[1]"), "InvalidArgument"
    )
    failed(await cli("runs", "create", "t_typed", "--priority", "high"), "InvalidArgument")
    schema = failed(
        await cli("runs", "create", "t_typed", "--payload", '{"n": "x"}'), "ValidationFailed"
    )
    assert "(/payload/n: 'x' is not of type 'integer')" in schema
    assert "/priority" in failed(
        await cli("runs", "create", "t_typed", "--priority", "500"), "ValidationFailed"
    )
    failed(await cli("runs", "create", "t_missing"), "NotFound")
    failed(await cli("runs", "get", "nope"), "NotFound")
    failed(await cli("runs", "get", "0" * 24), "NotFound")
    failed(await cli("runs", "cancel", "a/b?c"), "NotFound")  # an id cannot reroute the call

    nobody = f"http://127.0.0.1:{free_port()}"
    unreachable = await asyncio.to_thread(invoke, ["runs", "get", "x", "--url", nobody])
    assert nobody in failed(unreachable, "Unavailable")
    failed(
        await asyncio.to_thread(invoke, ["runs", "list", "--url", "http://[::1"]), "InvalidArgument"
    )
    failed(await asyncio.to_thread(invoke, ["runs", "frobnicate"]), "InvalidArgument")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBPLANE_")}
    env.update(extra)
    return env


async def test_as_processes_end_to_end(
    url: str, cli: CLI, backends: Backends, settings: Settings
) -> None:
    # With JOBPLANE_API_KEY unset, the key is JOBPLANE_ADMIN_KEY (which `jobplane dev` prints).
    env = clean_env(JOBPLANE_URL=url, JOBPLANE_ADMIN_KEY=ADMIN)
    applied = await jobplane("templates", "apply", str(TEMPLATES), env=env)
    assert applied.code == 0 and "demo_long_task.yaml: demo_long_task v1" in applied.out

    payload = {"target": "cli", "sleepSeconds": 0.3}
    async with running(backends, settings):
        watched = await jobplane(
            "runs", "create", "demo_long_task", "--payload", json.dumps(payload), "--watch", env=env
        )
    assert watched.code == 0, watched.err
    run_id = watched.lines[0]
    assert "succeeded" in watched.out and "100.0%" in watched.out
    assert "+ finalize" in watched.out  # a bar per step, each marked done
    again = await jobplane("runs", "watch", run_id, env=env)
    assert again.code == 0 and again.lines[0].endswith("demo_long_task v1  succeeded")

    trail = await jobplane("events", "--job-id", run_id, "--type", "status_changed", env=env)
    assert trail.code == 0 and any("running→succeeded" in line for line in trail.lines)

    # JOBPLANE_API_KEY wins over JOBPLANE_ADMIN_KEY: a user key sees only its scope.
    made = ok(await cli("keys", "create", "carol", "--role", "user", "--scope", "user:c1"))
    carol = env | {"JOBPLANE_API_KEY": fields(made)["secret"]}
    mine = await jobplane(
        "runs",
        "create",
        "demo_long_task",
        "--scope",
        "user",
        "--scope-id",
        "c1",
        "--payload",
        '{"target": "x"}',
        env=carol,
    )
    assert mine.code == 0, mine.err
    listed = await jobplane("runs", "list", env=carol)
    assert listed.code == 0 and row_ids(listed) == mine.lines
    refused = await jobplane("runs", "get", run_id, env=carol)
    assert refused.code == 1 and failed(refused, "NotFound")

    bad = await jobplane("runs", "create", "demo_long_task", "--payload", "{", env=env)
    assert bad.code == 2 and failed(bad, "InvalidArgument")
    down = await jobplane(
        "runs", "list", env=env | {"JOBPLANE_URL": f"http://127.0.0.1:{free_port()}"}
    )
    assert down.code == 1 and failed(down, "Unavailable")


async def test_schedules_create_list_get_preview_pause_trigger_delete(
    cli: CLI, register: Register
) -> None:
    await register("t_report", schedulable=True, payloadSchema={"type": "object"})
    made = ok(
        await cli(
            "schedules",
            "create",
            "t_report",
            "--cron",
            "0 9 * * *",
            "--timezone",
            "Asia/Taipei",
            "--payload-template",
            '{"for": "{{scheduledFor}}"}',
        )
    )
    [line] = made.lines
    schedule_id = line.split()[0]
    assert "enabled" in line and "0 9 * * * Asia/Taipei" in line and "T01:00:00.000+00:00" in line
    assert ok(await cli("schedules", "list")).lines == [line]
    times = ok(await cli("schedules", "preview", schedule_id, "--count", "3")).lines
    assert len(times) == 3 and all(t.split()[0].endswith("T01:00:00Z") for t in times)
    assert all(t.split()[1].endswith("T09:00:00+08:00") for t in times)
    assert "paused" in ok(await cli("schedules", "pause", schedule_id)).out
    assert "enabled" in ok(await cli("schedules", "resume", schedule_id)).out
    [run_id] = ok(await cli("schedules", "trigger", schedule_id)).lines
    run = json.loads(ok(await cli("runs", "get", run_id)).out)
    assert run["scheduleId"] == schedule_id and run["payload"]["for"].startswith("20")
    bad = await cli("schedules", "create", "t_report", "--cron", "0 9 * *")
    assert "/cron" in failed(bad, "ValidationFailed")
    failed(await cli("schedules", "pause", "0123456789abcdef01234567"), "NotFound")

    shown = json.loads(ok(await cli("schedules", "get", schedule_id)).out)
    assert shown["id"] == schedule_id and shown["timezone"] == "Asia/Taipei"
    assert ok(await cli("schedules", "delete", schedule_id)).lines == [f"deleted {schedule_id}"]
    failed(await cli("schedules", "get", schedule_id), "NotFound")
    failed(await cli("schedules", "delete", schedule_id), "NotFound")
    assert ok(await cli("schedules", "list")).lines == []


async def test_keys_list_and_revoke(cli: CLI) -> None:
    ci = fields(ok(await cli("keys", "create", "ci", "--role", "author")))
    alice = fields(ok(await cli("keys", "create", "alice", "--role", "user", "--scope", "user:u1")))
    listed = ok(await cli("keys", "list"))
    assert listed.lines[0].split() == ["ID", "NAME", "ROLE", "CREATED", "REVOKED", "SCOPES"]
    rows = [line.split() for line in listed.lines[1:]]
    assert [row[:3] for row in rows] == [[alice["id"], "alice", "user"], [ci["id"], "ci", "author"]]
    assert rows[0][4:] == ["-", "user:u1"] and rows[1][4:] == ["-", "(all)"]
    assert ci["secret"] not in listed.out and alice["secret"] not in listed.out

    [line] = ok(await cli("keys", "revoke", ci["id"])).lines
    assert line.startswith(f"revoked {ci['id']} (ci) at 20") and line.endswith(" by user:admin")
    assert ok(await cli("keys", "revoke", ci["id"])).lines == [line]  # again: as it was
    assert "was revoked" in failed(await cli("templates", "list", key=ci["secret"]), "Unauthorized")
    ok(await cli("templates", "list", key=alice["secret"]))
    after = ok(await cli("keys", "list")).lines
    assert after[2].split()[1] == "ci" and after[2].split()[4].startswith("20")

    first = await cli("keys", "list", "--limit", "1")
    assert first.code == 0 and first.lines == after[:2] and "--all" in first.err
    assert ok(await cli("keys", "list", "--limit", "1", "--all")).lines == after
    failed(await cli("keys", "revoke", "0123456789abcdef01234567"), "NotFound")
    failed(await cli("keys", "list", key=alice["secret"]), "Forbidden")
    failed(await cli("keys", "revoke", ci["id"], key=alice["secret"]), "Forbidden")


async def test_db_shard_needs_a_sharded_cluster(mongo_url: str, db_name: str, mongos: bool) -> None:
    """`jobplane db shard` against a replica set says so in one line and fails; against a
    mongos it shards each large collection (idempotently: the test database already is)."""
    env = clean_env(JOBPLANE_MONGODB_URL=mongo_url, JOBPLANE_DB=db_name)
    result = await jobplane("db", "shard", env=env)
    if mongos:
        assert ok(result).lines == [
            f"sharded {db_name}.{c}" for c in ("job_runs", "job_events", "job_runs_archive")
        ]
        return
    line = failed(result, "InvalidArgument")
    assert "not a sharded cluster" in line and db_name in line and result.code == 2
    unset = await jobplane("db", "shard", env=clean_env())
    assert (
        failed(unset, "InvalidArgument")
        == "error: InvalidArgument: JOBPLANE_MONGODB_URL is not set"
    )


async def test_refusals_say_each_thing_once_and_in_words(
    url: str, cli: CLI, register: Register
) -> None:
    await register("t_report", schedulable=True)
    cron = failed(
        await cli("schedules", "create", "t_report", "--cron", "61 * * * *"), "ValidationFailed"
    )
    assert cron.startswith("error: ValidationFailed: /cron: '61 * * * *' is not a cron expression")
    assert cron.count("61 * * * *") == 1, cron

    # A scope, or a scope id, is described rather than given as a regular expression.
    scope = await cli("keys", "create", "acme", "--role", "user", "--scope", "acme")
    assert "/scopes/0: a scope looks like account:<id>" in failed(scope, "ValidationFailed")
    spaced = await cli("runs", "create", "t_report", "--scope-id", "a b")
    assert "/scopeId: 1 to 200 characters, none of them a space" in failed(
        spaced, "ValidationFailed"
    )
    for line in (failed(scope, "ValidationFailed"), failed(spaced, "ValidationFailed")):
        assert "^" not in line and "\\" not in line, line

    # No key at all: where one goes.
    keyless = await jobplane("runs", "list", env=clean_env(JOBPLANE_URL=url))
    assert failed(keyless, "Unauthorized") == (
        "error: Unauthorized: missing bearer API key: set JOBPLANE_API_KEY or pass --key"
    )
    assert "--key" not in failed(await cli("runs", "list", key="jp_wrong"), "Unauthorized")

    # Where a run goes without --scope is said where the options are.
    usage = ok(await asyncio.to_thread(invoke, ["runs", "create", "--help"])).out
    assert "the key's only scope if it has one, else system (scope id cli)" in " ".join(
        usage.split()
    )


async def test_events_name_the_step_a_step_event_is_about(
    cli: CLI, register: Register, backends: Backends, settings: Settings
) -> None:
    await register(
        "t_two",
        steps=[
            {"id": "transform", "handler": "builtin.noop"},
            {"id": "load", "handler": "builtin.fail"},
        ],
    )
    run_id = await created(cli, "t_two", "--payload", '{"fatal": true}')
    async with running(backends, settings):
        await settled(backends.store, [run_id])
    trail = ok(await cli("events", "--job-id", run_id)).lines
    steps = [line.split()[2:6] for line in trail if " step_" in line]
    assert [s[:3] for s in steps] == [
        ["step_started", "step", "transform"],
        ["step_finished", "step", "transform"],
        ["step_started", "step", "load"],
        ["step_finished", "step", "load"],
    ], trail
    assert steps[-1][3] == "failed" and steps[1][3].startswith("worker:")


async def test_queues_list_pause_and_resume(cli: CLI, register: Register) -> None:
    await register("t_report", queue="reports")
    listed = ok(await cli("queues", "list"))
    assert listed.lines[0].split() == ["QUEUE", "READY", "DELAYED", "RUNNING", "OLDEST", "STATE"]
    assert [line.split()[0] for line in listed.lines[1:]] == ["default", "reports"]
    assert listed.lines[2].split()[1:] == ["0", "0", "0", "0s", "active"]

    paused = ok(await cli("queues", "pause", "reports", "--reason", "partner outage"))
    state = paused.lines[1].split(None, 5)[5]
    assert state.startswith("paused by user:admin since 20") and state.endswith(": partner outage")
    assert "paused by user:admin" in ok(await cli("queues", "list")).lines[2]
    resumed = ok(await cli("queues", "resume", "reports"))
    assert resumed.lines[1].split()[-1] == "active"
    events = ok(await cli("events", "--job-id", "reports"))
    assert ["queue_paused", "queue_resumed"] == [line.split()[2] for line in events.lines]

    failed(await cli("queues", "pause", "nowhere"), "NotFound")
    failed(await cli("queues", "pause", "reports", "--reason", "x" * 501), "ValidationFailed")
    ci = fields(ok(await cli("keys", "create", "ci", "--role", "author")))
    failed(await cli("queues", "list", key=ci["secret"]), "Forbidden")


def test_templates_validate_prints_the_layers_or_each_problem_without_a_server(
    tmp_path: Path,
) -> None:
    layers = ok(invoke(["templates", "validate", str(TEMPLATES / "diamond_report.yaml")]))
    assert layers.lines[1:] == ["  1. fetch", "  2. render_pdf, render_csv", "  3. publish"]
    assert layers.lines[0].endswith(": diamond_report, 4 steps in 3 layers")
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "type: bad\n"
        "steps:\n"
        "  - {id: a, handler: h, needs: [b]}\n"
        "  - {id: b, handler: h, when: 'foo > 1'}\n"
    )
    refused = invoke(["templates", "validate", str(bad)])
    assert refused.code == 1 and refused.out == ""
    assert refused.err.splitlines() == [
        f"{bad}: /steps/0/needs: the steps' needs make a cycle: a → b → a (each needs the next)",
        f"{bad}: /steps/1/when: unknown name foo (it may use outputs, payload, run)",
        f"error: ValidationFailed: {bad}: invalid template",
    ]
    failed(invoke(["templates", "validate", str(tmp_path / "none.yaml")]), "InvalidArgument")
    # Where a file stops parsing, on one line, with no pointer (the whole file is at fault).
    unclosed = tmp_path / "unclosed.yaml"
    unclosed.write_text("type: [unclosed\n")
    assert invoke(["templates", "validate", str(unclosed)]).err.splitlines() == [
        f"{unclosed}: line 2, column 1: expected ',' or ']', but got '<stream end>' "
        "(while parsing a flow sequence at line 1, column 7)",
        f"error: ValidationFailed: {unclosed}: malformed YAML",
    ]
    # A map step names the template its children run; its expressions are checked too.
    fans = ok(invoke(["templates", "validate", str(TEMPLATES / "monthly_reports.yaml")]))
    assert fans.lines[1:] == ["  1. reports (map → account_report)", "  2. summary"]
    bad.write_text(
        "type: bad\n"
        "steps:\n"
        "  - {id: a, workerType: map, map: {items: 'item', template: t}, timeoutSeconds: 5}\n"
    )
    refused = invoke(["templates", "validate", str(bad)])
    assert refused.err.splitlines()[:2] == [
        f"{bad}: /steps/0/map/items: unknown name item (it may use outputs, payload, run)",
        f"{bad}: /steps/0/timeoutSeconds: a map step has no timeoutSeconds: its children do",
    ]
