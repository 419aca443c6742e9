"""A producer: registers `reports.report` (once: an unchanged template makes no new version),
creates a run of it and waits for it. `JOBPLANE_URL` and `JOBPLANE_API_KEY` say where to."""

import asyncio
import sys

from jobplane import Client
from reports import Report, report


async def main(account: str, pages: int) -> None:
    async with Client() as client:
        applied = await client.templates.apply(report)
        print(f"{applied.type} v{applied.version}", "created" if applied.created else "unchanged")
        payload = Report(account=account, pages=pages).model_dump()
        run = await client.runs.create("report", scope="account", scope_id=account, payload=payload)
        done = await client.runs.wait(run.id, timeout=120)
        print(done.status.value, done.outputs["deliver"])


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
