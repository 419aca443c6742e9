"""`python -m tests.chaos [SCENARIO ...] [--short]`: run the chaos scenarios at full length
against MongoDB and Redis servers of their own, and print a table of the results."""

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from jobplane.devstack import MongoServer, free_port
from tests.chaos.scenarios import FULL, SCENARIOS, SHORT, Outcome, Where

COLUMNS = "| scenario | runs | faults injected | invariant violations | longest stall (s) "
COLUMNS += "| drain after the last fault (s) | took (s) |"


def row(result: Outcome) -> str:
    cells = [
        result.scenario,
        f"{result.runs:,}",
        str(result.faults),
        str(len(result.violations)),
        f"{result.stall:.1f}",
        f"{result.drain:.1f}",
        f"{result.seconds:.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


async def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos")
    parser.add_argument("scenarios", nargs="*", choices=[[], *SCENARIOS], default=[])
    parser.add_argument("--short", action="store_true", help="the shortened runs of make test")
    args = parser.parse_args()
    scale = SHORT if args.short else FULL
    root = Path(tempfile.mkdtemp(prefix="jobplane-chaos-"))
    mongo = MongoServer(root / "mongo", free_port(), root / "mongod.log")
    mongo.start()
    results: list[Outcome] = []
    try:
        for name in args.scenarios or SCENARIOS:
            print(f"{time.strftime('%H:%M:%S')} {name} ...", flush=True)
            where = Where(root / name, mongo.url, f"chaos_{name}")
            result = await SCENARIOS[name](where, scale)
            results.append(result)
            for line in [*result.notes, *result.violations[:20]]:
                print(f"    {line}", flush=True)
    finally:
        mongo.stop()
    print(f"\n{COLUMNS}\n|{'---|' * 7}")
    for result in results:
        print(row(result))
    print(f"\nlogs and data: {root}")
    return 1 if any(r.violations for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
