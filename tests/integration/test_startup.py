"""What a process says as it starts and stops: a refusal to start is one line on stderr and
exit 1 (real `python -m jobplane` processes); a worker names what it serves, each run it
finishes, and its stop."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jobplane.backends import Backends
from jobplane.runs import RunRequest, RunService
from jobplane.settings import Settings
from tests.integration.conftest import Register
from tests.integration.workers import running, settled

HINT = "(only `jobplane dev` runs without them: it starts local servers)"
# Where nothing listens: a process that got as far as connecting would fail differently.
NOWHERE = {
    "JOBPLANE_MONGODB_URL": "mongodb://127.0.0.1:9",
    "JOBPLANE_REDIS_URL": "redis://127.0.0.1:9",
}


def refused(*args: str, **env: str) -> str:
    """Run `jobplane ARGS` with only `env` of the JOBPLANE_ variables: the one stderr line
    of its refusal to start."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("JOBPLANE_")}
    done = subprocess.run(
        [sys.executable, "-m", "jobplane", *args],
        env=clean | env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done
    assert done.stdout == "", done
    [line] = done.stderr.splitlines()
    return line


@pytest.mark.parametrize("command", ["api", "worker", "scheduler"])
def test_a_process_without_the_urls_says_which_are_missing(command: str) -> None:
    assert refused(command) == (
        "error: InvalidSettings: JOBPLANE_MONGODB_URL and JOBPLANE_REDIS_URL are not set " + HINT
    )
    one = refused(command, JOBPLANE_MONGODB_URL="mongodb://127.0.0.1:9")
    assert one == f"error: InvalidSettings: JOBPLANE_REDIS_URL is not set {HINT}"


@pytest.mark.parametrize(
    "args",
    [["worker"], ["external-worker", "--handlers", "no_such_handlers"], ["dev"]],
    ids=["worker", "external-worker", "dev"],
)
def test_a_handler_module_not_found_names_it_and_pythonpath(
    args: list[str], tmp_path: Path
) -> None:
    env = NOWHERE | {
        "JOBPLANE_HANDLERS": "no_such_handlers",
        "JOBPLANE_DATA_DIR": str(tmp_path / "data"),
    }
    assert refused(*args, **env) == (
        "error: InvalidSettings: handler module 'no_such_handlers' not found: is its folder "
        "on PYTHONPATH?"
    )
    assert not (tmp_path / "data").exists(), "dev refused before starting servers"


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("import json\nraise ValueError('no config')\n", "ValueError: no config ({file}:2)"),
        (
            "import no_such_dependency\n",
            "ModuleNotFoundError: No module named 'no_such_dependency' ({file}:1)",
        ),
        ("def broken(:\n", "SyntaxError: invalid syntax (broken_handlers.py, line 1)"),
    ],
    ids=["raises", "imports-a-missing-module", "syntax-error"],
)
def test_a_handler_module_that_fails_to_import_says_why_and_where(
    source: str, says: str, tmp_path: Path
) -> None:
    module = tmp_path / "broken_handlers.py"
    module.write_text(source)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    line = refused("worker", **NOWHERE, JOBPLANE_HANDLERS="broken_handlers", PYTHONPATH=path)
    prefix = "error: InvalidSettings: handler module 'broken_handlers' failed to import: "
    assert line == prefix + says.format(file=module)


async def test_a_worker_says_what_it_serves_each_run_it_finishes_and_its_stop(
    backends: Backends, settings: Settings, register: Register, caplog: pytest.LogCaptureFixture
) -> None:
    await register("t_noop")
    await register("t_fail", steps=[{"id": "only", "handler": "builtin.fail"}])
    service = RunService(backends.store, backends.queue)
    done, _ = await service.create(RunRequest("t_noop", "user", "u", {}), "user:a")
    fails, _ = await service.create(RunRequest("t_fail", "user", "u", {"fatal": True}), "user:a")
    caplog.set_level(logging.INFO, "jobplane.worker")
    async with running(backends, settings) as [worker]:
        await settled(backends.store, [done.id, fails.id])
    said = [r.getMessage() for r in caplog.records if r.name == "jobplane.worker"]

    started = re.fullmatch(
        rf"worker {worker.id} started: queues default, concurrency 16, handlers (.*)", said[0]
    )
    assert started, said
    assert {"builtin.noop", "builtin.sleep"} <= set(started.group(1).split(", "))
    # One line for each; the two may end in either order.
    finished = sorted(line for line in said if line.startswith("run "))
    assert len(finished) == 2, said
    expected = sorted([f"run {done.id} (t_noop) succeeded", f"run {fails.id} (t_fail) failed"])
    for line, start in zip(finished, expected, strict=True):
        assert re.fullmatch(rf"{re.escape(start)} in \d+\.\d s", line), line
    assert said[-1] == f"worker {worker.id} stopped"
