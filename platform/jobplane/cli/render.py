"""Drawing runs, templates and events in a terminal: progress bars, table rows, log lines."""

import logging
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from jobplane.model import ApiKeyPublic, Event, Run, Schedule, StepStatus, Template

_MARK = {
    StepStatus.PENDING: " ",
    StepStatus.RUNNING: ">",
    StepStatus.WAITING: "~",
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
    # The bars line up, two spaces after the longest label: "overall" or a mark and a step id.
    width = max([len("overall") - 2, *(len(step.id) for step in run.progress.steps)])
    overall = bar(run.progress.percentage)
    lines.append(f"  {'overall':<{width + 2}}  {overall}  {run.progress.summary}")
    if run.waiting_for:
        lines.append(f"  waiting for {run.waiting_for.reason}: {run.waiting_for.detail}")
    for step in run.progress.steps:
        note = step.message or step.error or ""
        label = f"{_MARK[step.status]} {step.id:<{width}}"
        done = step.percentage
        if (made := step.map) is not None and made.succeeded is not None:
            # A map step: a bar of its children's ends, and a count of each kind.
            ended = made.succeeded + (made.failed or 0)
            done = 100 * ended / made.total if step.status == StepStatus.WAITING else done
            counts = f"{made.succeeded} succeeded, {made.failed} failed, {made.active} active"
            note = "; ".join(filter(None, [f"children {ended}/{made.total}: {counts}", note]))
        lines.append(f"  {label}  {bar(done)}  {note}")
    # The attempt the run ended with, if it ended in an error, is its `error`, last.
    for attempt in run.attempts:
        if run.error is None or attempt.attempt != run.error.attempt:
            error = attempt.error
            lines.append(f"  attempt {attempt.attempt} failed: {error.code}: {error.message}")
    if run.error:
        lines.append(f"  error: {run.error.code}: {run.error.message}")
    return lines


# Fixed widths, so rows line up across pages printed as they arrive.
RUN_HEADER = f"{'ID':<24}  {'STATUS':<16}  {'TEMPLATE':<28}  {'SCOPE':<24}  {'DONE':>6}  CREATED"


def run_row(run: Run) -> str:
    template = f"{run.template_type} v{run.template_version}"
    scope = f"{run.scope}:{run.scope_id}"
    done = f"{run.progress.percentage:.0f}%"
    created = _time(run.create_at)
    return f"{run.id:<24}  {run.status:<16}  {template:<28}  {scope:<24}  {done:>6}  {created}"


def template_line(template: Template) -> str:
    state = "enabled" if template.enabled else "disabled"
    return f"{template.type:<32}  v{template.version:<4}  {state}"


def schedule_line(schedule: Schedule) -> str:
    state = "enabled" if schedule.enabled else "paused"
    when = f"{schedule.cron} {schedule.timezone}"
    upcoming = "-"
    if schedule.next_run_at is not None:
        local = schedule.next_run_at.astimezone(ZoneInfo(schedule.timezone))
        upcoming = f"next {_time(schedule.next_run_at)} ({local.isoformat(timespec='minutes')})"
    return f"{schedule.id}  {state:<7}  {schedule.template_type:<24}  {when:<36}  {upcoming}"


KEY_HEADER = f"{'ID':<24}  {'NAME':<24}  {'ROLE':<7}  {'CREATED':<29}  {'REVOKED':<29}  SCOPES"


def key_row(key: ApiKeyPublic) -> str:
    created = _time(key.create_at)
    revoked = _time(key.revoked_at) if key.revoked_at else "-"
    scopes = " ".join(key.scopes) or "(all)"
    return f"{key.id:<24}  {key.name:<24}  {key.role:<7}  {created}  {revoked:<29}  {scopes}"


QUEUE_HEADER = f"{'QUEUE':<24}  {'READY':>7}  {'DELAYED':>7}  {'RUNNING':>7}  {'OLDEST':>8}  STATE"


def queue_row(queue: dict[str, Any]) -> str:
    """A row of `GET /v1/queues`: counts Redis could not give show as `?`."""

    def count(field: str) -> str:
        value = queue.get(field)
        return "?" if value is None else str(value)

    age = queue.get("oldestReadyAgeSeconds")
    oldest = "?" if age is None else f"{age:.0f}s"
    state = "active"
    if queue["paused"]:
        state = f"paused by {queue['pausedBy']} since {queue['pausedAt']}"
        if queue.get("pauseReason"):
            state += f": {queue['pauseReason']}"
    counts = f"{count('ready'):>7}  {count('delayed'):>7}  {count('running'):>7}"
    return f"{queue['queue']:<24}  {counts}  {oldest:>8}  {state}"


def event_line(event: Event) -> str:
    if event.from_ or event.to:
        moved = f"{event.from_ or ''}→{event.to or ''}"
    elif step := event.metadata.get("step"):  # step_started, step_finished (a failed one says so)
        moved = f"step {step} {event.metadata.get('status', '')}".rstrip()
    else:
        moved = "-"
    line = f"{_time(event.create_at)}  {event.job_id}  {event.type:<20}  {moved:<32}  "
    return (line + f"{event.actor:<20}  {event.message or ''}").rstrip()


def _time(at: datetime) -> str:
    return at.isoformat(timespec="milliseconds")


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

    def moved_on(self, record: logging.LogRecord) -> bool:
        """A logging filter letting every record through: a log line was written below the
        drawing, so the next one starts under it rather than in its place."""
        self._last = []
        return True
