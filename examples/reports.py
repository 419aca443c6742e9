"""A template defined beside its handlers: the workers load this module
(`JOBPLANE_HANDLERS=reports`), and `jobplane templates apply reports:report` registers it."""

from typing import Any

from pydantic import BaseModel

from jobplane import Step, Template
from jobplane.worker import StepContext, handler


class Report(BaseModel):
    account: str
    pages: int = 1


@handler("reports.render")
async def render(ctx: StepContext) -> dict[str, Any]:
    report = ctx.payload_as(Report)
    for page in range(report.pages):
        ctx.checkpoint()  # a cancel stops it between pages
        ctx.progress(100 * (page + 1) / report.pages, f"page {page + 1}")
    return {"account": report.account, "pages": report.pages}


def deliver(ctx: StepContext) -> str:
    """Offered as `reports:deliver` by a worker that loads this module."""
    rendered = ctx.outputs["render"]
    return f"sent {rendered['pages']} pages to {rendered['account']}"


report = Template(
    "report",
    payload=Report,
    steps=[Step("render", render, timeout_seconds=60), Step("deliver", deliver)],
    retry_policy={"max_attempts": 3},
)
