"""The README's first hour, as written: its handler module and template saved under the names it
gives them, its commands run by bash in that directory, its worker started as it says, and the
run it creates succeeding, against real MongoDB, Redis and API servers.

The README marks each block with an HTML comment before its fence: `<!-- first-hour: NAME -->`
a file to save as NAME, `<!-- first-hour: run -->` commands to run, `<!-- first-hour: worker -->`
the worker to leave running. The one substitution: the environment that `. .jobplane/env` gives
a reader beside `jobplane dev` (`test_dev.py` checks that file) comes from the fixtures here.
"""

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from jobplane.backends import Backends
from jobplane.settings import Settings
from tests.integration.workers import running

README = Path(__file__).parents[2] / "README.md"
BLOCK = re.compile(r"<!-- ([a-z-]+): (\S+) -->\n```[a-z]*\n(.*?)```", re.S)
# What `jobplane dev` writes into `.jobplane/env`, which the first hour sources.
DEV_ENV = (
    "JOBPLANE_URL",
    "JOBPLANE_API_KEY",
    "JOBPLANE_MONGODB_URL",
    "JOBPLANE_REDIS_URL",
    "JOBPLANE_DB",
    "JOBPLANE_REDIS_PREFIX",
)

pytestmark = pytest.mark.slow


def blocks(kind: str) -> list[tuple[str, str]]:
    """The README's `(name, text)` blocks of one kind, in order."""
    return [(name, text) for k, name, text in BLOCK.findall(README.read_text()) if k == kind]


def environment(url: str, settings: Settings) -> dict[str, str]:
    """A reader's shell after the first hour's set-up lines: the venv's `jobplane` on PATH
    (`. .venv/bin/activate`) and the dev stack's variables (`. .jobplane/env`), nothing else."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBPLANE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    values = {
        "JOBPLANE_URL": url,
        "JOBPLANE_API_KEY": settings.admin_key,
        "JOBPLANE_MONGODB_URL": settings.mongodb_url,
        "JOBPLANE_REDIS_URL": settings.redis_url,
        "JOBPLANE_DB": settings.db,
        "JOBPLANE_REDIS_PREFIX": settings.redis_prefix,
    }
    assert tuple(values) == DEV_ENV
    env.update({k: str(v) for k, v in values.items()})
    return env


async def bash(script: str, cwd: Path, env: dict[str, str]) -> str:
    proc = await asyncio.create_subprocess_exec(
        "bash",
        "-euo",
        "pipefail",
        "-c",
        script,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(120):
        out, err = await proc.communicate()
    assert proc.returncode == 0, f"{script}\nexit {proc.returncode}\n{out.decode()}{err.decode()}"
    return out.decode()


def test_the_first_hour_starts_where_jobplane_dev_leaves_its_variables() -> None:
    text = README.read_text()
    first_hour = text[text.index("## The first hour") :]
    setup = first_hour[: first_hour.index("<!-- first-hour:")]
    assert ". .venv/bin/activate" in setup and ". .jobplane/env" in setup
    kinds = [k for k, _, _ in BLOCK.findall(first_hour) if k == "first-hour"]
    assert len(kinds) >= 4, "the handler, the template, a worker and commands"


@pytest.mark.parametrize("path", ["first-hour", "code-first"])
async def test_the_first_hour_runs_as_written(
    path: str, url: str, settings: Settings, backends: Backends, tmp_path: Path
) -> None:
    """Each path of the first hour: the YAML one with the CLI, and the one in code with
    `Client`. Beside a worker with the built-in handlers only, as `jobplane dev` runs one: it
    must leave the first hour's runs to the worker that offers their handler."""
    env = environment(url, settings)
    worker_log = tmp_path / "worker.log"
    worker = None
    out = ""
    async with running(backends, settings):
        try:
            for name, text in blocks(path):
                if name == "run":
                    out = await bash(text, tmp_path, env)
                elif name == "worker":
                    with worker_log.open("wb") as log:
                        # Its own process group: bash and the worker it starts stop together.
                        worker = await asyncio.create_subprocess_exec(
                            "bash",
                            "-c",
                            text,
                            cwd=tmp_path,
                            env=env,
                            stdin=asyncio.subprocess.DEVNULL,
                            stdout=log,
                            stderr=log,
                            start_new_session=True,
                        )
                else:
                    (tmp_path / name).write_text(text)
        finally:
            if worker is not None and worker.returncode is None:
                os.killpg(worker.pid, signal.SIGTERM)
                async with asyncio.timeout(60):
                    await worker.wait()
    # The last block ends with the run as JSON (`jobplane runs get`, or the application's).
    shown = json.loads(out[out.index("{") :])
    assert shown["status"] == "succeeded", worker_log.read_text()
    assert shown["result"] == {"greeting": "HELLO, ADA!"}
    assert [s["status"] for s in shown["progress"]["steps"]] == ["succeeded", "succeeded"]
    assert shown["attempt"] == 1 and shown["attempts"] == []


def test_the_worker_image_adds_the_first_hours_handlers() -> None:
    """The Dockerfile the README shows copies the module the first hour wrote, puts it on the
    path and names it, so the image's worker offers its handlers (no Docker here to build it)."""
    files = {name for name, _ in blocks("first-hour")} - {"run", "worker"}
    [(name, dockerfile)] = blocks("worker-image")
    assert name == "Dockerfile"
    instructions = [
        line.split(None, 1) for line in dockerfile.splitlines() if line and line[0] != "#"
    ]
    assert instructions[0] == ["FROM", "jobplane"]
    [copy] = [args.split() for op, args in instructions if op == "COPY"]
    *sources, destination = copy
    assert set(sources) <= files
    env = dict(
        item.split("=", 1) for op, args in instructions if op == "ENV" for item in args.split()
    )
    assert env["PYTHONPATH"].rstrip("/") == destination.rstrip("/")
    assert {f"{m}.py" for m in env["JOBPLANE_HANDLERS"].split(",")} <= set(sources)
    assert ["CMD", '["worker"]'] in instructions
