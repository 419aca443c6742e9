"""`jobplane dev` and the CLI as a user runs them: real processes, a real port, own servers."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from jobplane.devstack import free_port

ROOT = Path(__file__).parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBPLANE_")}
    env.update(extra)
    return env


def jobplane(
    *args: str, env: dict[str, str], timeout: float = 60, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jobplane", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def recorded_pids(data_dir: Path) -> list[int]:
    record = json.loads((data_dir / "stack.json").read_text())
    return [record["mongo"]["pid"], record["redis"]["pid"]]


@pytest.mark.slow
def test_dev_demo_runs_to_completion_and_stops_its_servers(tmp_path: Path) -> None:
    # As `make demo` runs it: the default, relative data directory in the working directory.
    data = tmp_path / ".jobplane"
    args = ["dev", "--demo", "--exit-after-demo", "--port", str(free_port())]
    args += ["--templates", str(ROOT / "templates")]
    first = jobplane(*args, env=clean_env(), timeout=120, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "admin API key: jp_admin_" in first.stdout
    assert "demo_long_task v1 (new)" in first.stdout
    assert "succeeded" in first.stdout
    assert not any(pid_alive(p) for p in recorded_pids(data)), "servers it started are stopped"
    # The worker's lines, as text: what it serves, the demo run it finished, its stop.
    worker = r"\S+ INFO jobplane\.worker "
    started = rf"{worker}worker \S+ started: queues default, concurrency \d+, handlers .*builtin"
    assert re.search(started, first.stderr), first.stderr
    finished = rf"{worker}run \w+ \(demo_long_task\) succeeded in \d+\.\d s \["
    assert re.search(finished, first.stderr), first.stderr
    assert re.search(rf"{worker}worker \S+ stopped", first.stderr), first.stderr

    # Starting again reuses the data: same key, templates unchanged, a second demo run.
    second = jobplane(*args, env=clean_env(), timeout=120, cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    key = (data / "admin_key").read_text().strip()
    assert f"admin API key: {key}" in first.stdout and f"admin API key: {key}" in second.stdout
    assert "demo_long_task v1\n" in second.stdout and "(new)" not in second.stdout


@pytest.mark.slow
def test_cli_against_a_running_dev_stack(tmp_path: Path) -> None:
    data, port = tmp_path / "data", free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "dev.log"
    with log.open("w") as out:
        dev = subprocess.Popen(
            [sys.executable, "-m", "jobplane", "dev", "--port", str(port), "--data-dir", str(data)],
            env=clean_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert dev.poll() is None, log.read_text()
            try:
                # Up as its banner says: the API answers, and the env for a second shell is
                # written (just after the API starts answering).
                if httpx.get(f"{url}/readyz").status_code == 200 and "Ctrl-C" in log.read_text():
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "dev stack did not become ready"
            time.sleep(0.2)
        # What it wrote for a second shell (the README's first hour sources it) reaches it.
        sourced = subprocess.run(
            ["bash", "-c", f". {data / 'env'} && env -0"],
            env=clean_env(),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        written = dict(v.split("=", 1) for v in sourced.split("\0") if v.startswith("JOBPLANE_"))
        ports = json.loads((data / "stack.json").read_text())
        assert written == {
            "JOBPLANE_URL": url,
            "JOBPLANE_API_KEY": (data / "admin_key").read_text().strip(),
            "JOBPLANE_MONGODB_URL": f"mongodb://127.0.0.1:{ports['mongo']['port']}/?replicaSet=rs0",
            "JOBPLANE_REDIS_URL": f"redis://127.0.0.1:{ports['redis']['port']}/0",
            "JOBPLANE_DB": "jobplane",
            "JOBPLANE_REDIS_PREFIX": "",
        }
        assert (data / "env").stat().st_mode & 0o077 == 0, "it holds the admin key"
        env = clean_env(**written)

        applied = jobplane("templates", "apply", str(ROOT / "templates"), env=env)
        assert applied.returncode == 0, applied.stderr
        assert "demo_long_task.yaml: demo_long_task v1" in applied.stdout

        payload = json.dumps({"target": "cli", "sleepSeconds": 0.3})
        created = jobplane(
            "runs", "create", "demo_long_task", "--payload", payload, "--watch", env=env
        )
        assert created.returncode == 0, created.stderr
        run_id = created.stdout.splitlines()[0]
        assert "succeeded" in created.stdout and "100.0%" in created.stdout
        shown = json.loads(jobplane("runs", "get", run_id, env=env).stdout)
        assert shown["status"] == "succeeded" and shown["result"] == json.loads(payload)

        bad = jobplane("runs", "create", "demo_long_task", "--payload", '{"target": 1}', env=env)
        assert bad.returncode == 1
        assert bad.stderr.strip().splitlines() == [
            "error: ValidationFailed: payload does not match the template's payloadSchema"
            " (/payload/target: 1 is not of type 'string')"
        ]
        unknown = jobplane("runs", "get", "nope", env=env)
        assert unknown.returncode == 1 and "NotFound" in unknown.stderr
        no_key = jobplane("runs", "get", run_id, env={**env, "JOBPLANE_API_KEY": "wrong"})
        assert no_key.returncode == 1 and "Unauthorized" in no_key.stderr
    finally:
        dev.send_signal(signal.SIGTERM)
        code = dev.wait(60)
    assert code == 0, log.read_text()
    assert "Ctrl-C stops jobplane" in log.read_text()
    assert not any(pid_alive(p) for p in recorded_pids(data))


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["cluster", "sentinel"])
def test_dev_demo_on_a_redis_cluster_and_behind_sentinel(
    topology: str, mongo_url: str, db_name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    redis_url: str = request.getfixturevalue(f"redis_{topology}_url")
    args = ["dev", "--demo", "--exit-after-demo", "--port", str(free_port())]
    args += ["--templates", str(ROOT / "templates"), "--data-dir", str(tmp_path / "data")]
    env = clean_env(
        JOBPLANE_MONGODB_URL=mongo_url,
        JOBPLANE_REDIS_URL=redis_url,
        JOBPLANE_DB=db_name,
        JOBPLANE_REDIS_PREFIX=f"dev{os.getpid()}:",
    )
    done = jobplane(*args, env=env, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Redis:   {redis_url}" in done.stdout
    assert "succeeded" in done.stdout
