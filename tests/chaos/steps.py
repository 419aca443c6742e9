"""The chaos scenarios' step handler, loaded by their worker processes via JOBPLANE_HANDLERS.

`chaos.nap` naps like `builtin.sleep`, honouring cancel at each slice, and appends when it
began and ended, in this process, to `$CHAOS_TRACE/<pid>.jsonl`: evidence of when a step was
really running, independent of what the worker wrote to MongoDB.
"""

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from jobplane.worker import StepContext, handler

SLICE = 0.05


@handler("chaos.nap")
async def nap(ctx: StepContext) -> dict[str, Any]:
    began, how = time.time(), "raised"
    try:
        total = float(ctx.payload.get("napSeconds", 0.1))
        deadline = time.monotonic() + total
        while (left := deadline - time.monotonic()) > 0:
            ctx.checkpoint()
            await asyncio.sleep(min(SLICE, left))
        how = "returned"
        return {"napped": total}
    except asyncio.CancelledError:
        how = "cancelled"
        raise
    finally:
        _trace(ctx, began, how)


def _trace(ctx: StepContext, began: float, how: str) -> None:
    folder = os.environ.get("CHAOS_TRACE")
    if not folder:
        return
    line = {
        "run": ctx.run.id,
        "step": ctx.step.id,
        "attempt": ctx.attempt,
        "pid": os.getpid(),
        "began": began,
        "ended": time.time(),
        "how": how,
    }
    with (Path(folder) / f"{os.getpid()}.jsonl").open("a") as out:
        out.write(json.dumps(line) + "\n")


def traces(folder: Path) -> list[dict[str, Any]]:
    """Every nap of every worker process that wrote to `folder`."""
    lines = [path.read_text().splitlines() for path in folder.glob("*.jsonl")]
    return [json.loads(line) for each in lines for line in each]
