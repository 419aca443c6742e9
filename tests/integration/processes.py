"""Real `jobplane` processes for tests where a process boundary matters."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from jobplane.settings import Settings


def environment(settings: Settings, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for name, value in settings.model_dump(exclude_none=True).items():
        if name in {"queues", "handlers"}:
            value = ",".join(value)
        env[f"JOBPLANE_{name.upper()}"] = str(value)
    env.update(extra)
    return env


def spawn(
    settings: Settings, command: str, log: Path, *args: str, **env: str
) -> subprocess.Popen[bytes]:
    """Start `python -m jobplane COMMAND ARGS` with `settings` in its environment."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "jobplane", command, *args],
            env=environment(settings, **env),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def terminate(proc: subprocess.Popen[bytes], timeout: float = 30) -> int:
    """SIGTERM and wait; SIGKILL if it does not exit in time. Returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()
