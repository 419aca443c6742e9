"""Real `jobplane` processes for tests where a process boundary matters."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobplane.settings import Settings


def environment(settings: Settings, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for name, value in settings.model_dump(exclude_none=True).items():
        if isinstance(value, list):  # comma-separated in the environment
            value = ",".join(map(str, value))
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


def handles_sigterm(pid: int) -> bool:
    """Whether the process has its SIGTERM handler installed (its event loop is up): before
    that, a SIGTERM kills it outright and tells nothing about its shutdown."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


def stop_within(
    proc: subprocess.Popen[bytes], bound: float, log: Path, after: float = 0
) -> tuple[int, float]:
    """SIGTERM `after` seconds past the moment the process handles it; returns its exit code
    and the seconds it took to exit. Fails the test (after a SIGKILL) when it is still running
    `bound` seconds after the signal."""
    deadline = time.monotonic() + 60
    while not handles_sigterm(proc.pid):
        if proc.poll() is not None:
            pytest.fail(f"exited with {proc.returncode} before the signal:\n{log.read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no SIGTERM handler after 60 s:\n{log.read_text()}")
        time.sleep(0.05)
    time.sleep(after)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(bound)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"still running {bound} s after SIGTERM:\n{log.read_text()}")
    return code, time.monotonic() - signalled
