"""A template defined in code (`examples/reports.py`), applied with the CLI as a process, and
run by the example producer (`examples/report_producer.py`) and a real `jobplane worker` that
loads the same module."""

import asyncio
import os
import sys
from pathlib import Path

import httpx

from jobplane.backends import Backends
from jobplane.settings import Settings
from jobplane.store import RunQuery
from tests.integration.processes import spawn, terminate
from tests.integration.test_cli import ADMIN, clean_env, jobplane

EXAMPLES = Path(__file__).parents[2] / "examples"


async def test_a_template_in_code_is_applied_once_and_run_by_a_worker_loading_its_module(
    url: str, api: httpx.AsyncClient, backends: Backends, settings: Settings, tmp_path: Path
) -> None:
    env = clean_env(JOBPLANE_URL=url, JOBPLANE_ADMIN_KEY=ADMIN, PYTHONPATH=str(EXAMPLES))
    applied = await jobplane("templates", "apply", "reports:report", env=env)
    assert (applied.code, applied.lines) == (0, ["reports:report: report v1"]), applied.err
    again = await jobplane("templates", "apply", "reports:report", env=env)
    assert again.lines == ["reports:report: report v1 (unchanged)"]

    # Exported, the same template as a file: applying it changes nothing either.
    exported = await jobplane("templates", "export", "reports:report", env=env)
    assert exported.code == 0 and exported.out.startswith("type: report\n")
    (tmp_path / "report.yaml").write_text(exported.out)
    as_file = await jobplane("templates", "apply", str(tmp_path / "report.yaml"), env=env)
    assert as_file.lines == ["report.yaml: report v1 (unchanged)"]

    missing = await jobplane("templates", "apply", "reports:nothing", env=env)
    assert missing.code == 2 and "InvalidArgument" in missing.err
    unknown = await jobplane("templates", "export", "no_such_module:x", env=env)
    assert unknown.code == 2 and "PYTHONPATH" in unknown.err

    body = {"templateType": "report", "scope": "account", "scopeId": "acme"}
    refused = await api.post("/v1/runs", json=body | {"payload": {"pages": 2}})
    assert refused.status_code == 422  # the model's schema: `account` is required

    log = tmp_path / "worker.log"
    worker = spawn(
        settings,
        "worker",
        log,
        JOBPLANE_HANDLERS="reports",
        PYTHONPATH=os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")]),
    )
    try:
        producer = await asyncio.create_subprocess_exec(
            sys.executable,
            str(EXAMPLES / "report_producer.py"),
            "acme",
            "3",
            env=env | {"JOBPLANE_API_KEY": ADMIN},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        async with asyncio.timeout(120):
            said, _ = await producer.communicate()
    finally:
        terminate(worker)
    assert said.decode().splitlines() == [
        "report v1 unchanged",
        "succeeded sent 3 pages to acme",
    ], log.read_text()
    [run] = await backends.store.runs.page(RunQuery(), None, 10)
    assert run.outputs["render"] == {"account": "acme", "pages": 3}
    assert run.progress.steps[0].percentage == 100
