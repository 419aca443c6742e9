"""Drawing a run's progress in a terminal: one bar per step."""

from jobplane.model import Run, StepStatus

_MARK = {
    StepStatus.PENDING: " ",
    StepStatus.RUNNING: ">",
    StepStatus.SUCCEEDED: "+",
    StepStatus.FAILED: "x",
    StepStatus.SKIPPED: "-",
    StepStatus.CANCELLED: "!",
}


def bar(percentage: float, width: int = 30) -> str:
    filled = round(width * percentage / 100)
    return "[" + "#" * filled + "." * (width - filled) + f"] {percentage:5.1f}%"


def render(run: Run) -> list[str]:
    lines = [f"run {run.id}  {run.template_type} v{run.template_version}  {run.status.value}"]
    lines.append(f"  overall    {bar(run.progress.percentage)}  {run.progress.summary}")
    for step in run.progress.steps:
        note = step.message or step.error or ""
        lines.append(f"  {_MARK[step.status]} {step.id:<9}{bar(step.percentage)}  {note}")
    if run.error:
        lines.append(f"  error: {run.error.code}: {run.error.message}")
    return lines


class LiveView:
    """Redraws in place on a terminal; on a pipe, prints only when something changed."""

    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self._last: list[str] = []

    def show(self, run: Run) -> None:
        lines = render(run)
        if lines == self._last:
            return
        if self.tty and self._last:
            print(f"\x1b[{len(self._last)}F\x1b[J", end="")
        print("\n".join(lines), flush=True)
        self._last = lines
