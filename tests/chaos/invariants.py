"""The invariant checker: after a scenario, audit what MongoDB holds.

It reads every run with its trail (a run's events live in its `trail` as durably as the run;
`job_events` holds copies, plus the `stale_write_rejected` events that change no run) and
returns one line per violation. An empty list means the promise held: no run lost, none
finished twice, none stuck.
"""

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pymongo.asynchronous.database import AsyncDatabase

from jobplane.model import ALLOWED, TERMINAL, RunStatus

Doc = dict[str, Any]
# A step event must be written under the lease of the run's holder at that point.
STEP_EVENTS = frozenset({"step_started", "step_finished"})


@dataclass
class Audit:
    """What the checker read, and what it found wrong."""

    runs: int = 0
    events: int = 0
    stale_writes: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)


async def audit(
    db: AsyncDatabase[Doc],
    accepted: Iterable[str] = (),
    now: datetime | None = None,
) -> Audit:
    """Check every run in `db`; `accepted` are run ids the API acknowledged to a caller."""
    now = now or datetime.now(UTC)
    found = Audit()
    steps_of = {
        (t["type"], t["version"]): [s["id"] for s in t["steps"]]
        async for t in db.job_templates.find({}, {"type": 1, "version": 1, "steps.id": 1})
    }
    copies: defaultdict[str, list[Doc]] = defaultdict(list)
    async for event in db.job_events.find({}):
        copies[event["jobId"]].append(event)
    runs: dict[str, Doc] = {}
    for collection in (db.job_runs, db.job_runs_archive):
        async for run in collection.find({}):
            runs[str(run["_id"])] = run

    for run_id in accepted:
        if run_id not in runs:
            found.violations.append(f"run {run_id} was accepted by the API and is not stored")
    for run_id, run in runs.items():
        found.runs += 1
        found.by_status[run["status"]] += 1
        trail = {e["_id"]: e for e in run.get("trail", [])}
        extra = [e for e in copies.pop(run_id, []) if e["_id"] not in trail]
        stale = [e for e in extra if e["type"] == "stale_write_rejected"]
        found.stale_writes += len(stale)
        found.events += len(trail) + len(stale)
        found.violations += [
            f"run {run_id}: event {e['_id']} ({e['type']}) is in job_events, not in its trail"
            for e in extra
            if e["type"] != "stale_write_rejected"
        ]
        events = sorted(trail.values(), key=lambda e: (e["runVersion"], e["_id"]))
        steps = steps_of.get((run["templateType"], run["templateVersion"]))
        found.violations += [f"run {run_id}: {v}" for v in check_run(run, events, steps, now)]
    found.violations += [f"events of a run that does not exist: {run_id}" for run_id in copies]
    found.violations += _shared_keys(runs.values())
    return found


def check_run(run: Doc, events: list[Doc], steps: list[str] | None, now: datetime) -> list[str]:
    """The violations of one run, given its trail in the order MongoDB wrote it."""
    status = RunStatus(run["status"])
    bad: list[str] = []
    if status not in TERMINAL and not _scheduled_later(run, now):
        bad.append(f"is {status.value}, not terminal")
    if steps is None:
        return [*bad, "its template version is not stored"]

    state: RunStatus | None = None
    holder: str | None = None
    version = 0
    succeeded = 0
    # Per step: where in the trail its last start and its last success are, and under which
    # lease (the index of the claim that began it).
    lease = -1
    started: dict[str, tuple[int, int]] = {}
    finished: dict[str, tuple[int, int, int]] = {}
    for at, event in enumerate(events):
        if event["runVersion"] < version:
            bad.append(f"event {event['_id']} goes back to version {event['runVersion']}")
        version = event["runVersion"]
        if (to := event.get("to")) is not None:
            target = RunStatus(to)
            source = RunStatus(event["from"]) if "from" in event else None
            if source != state:
                bad.append(f"moves from {source} but was {state}")
            elif state is None and target not in (RunStatus.PENDING, RunStatus.QUEUED):
                bad.append(f"begins as {target.value}, not pending or queued")
            elif state is not None and target not in ALLOWED[state]:
                bad.append(f"moves {state.value} -> {target.value}, not in SPEC's table")
            state = target
            succeeded += target == RunStatus.SUCCEEDED
            if target == RunStatus.RUNNING:
                holder, lease = event["actor"], at
            elif target != RunStatus.CANCEL_REQUESTED:
                holder = None
        elif event["type"] in STEP_EVENTS:
            step = event["metadata"].get("step")
            if holder is None or event["actor"] != holder:
                bad.append(f"{event['type']} {step} by {event['actor']}, lease held by {holder}")
            if event["type"] == "step_started":
                started[step] = (at, lease)
            elif event["metadata"].get("status") is None and step in started:
                finished[step] = (*started[step], at)
    if state != status:
        bad.append(f"its trail ends {state} but the run is {status.value}")
    if version > run["version"]:
        bad.append(f"its trail reaches version {version}, the run is at {run['version']}")
    if succeeded > 1:
        bad.append(f"succeeded {succeeded} times")
    # `error` is the outcome's: the last attempt's error of a run that failed or expired.
    if status in (RunStatus.FAILED, RunStatus.EXPIRED):
        if not run.get("attempts") or run.get("error") != run["attempts"][-1]["error"]:
            bad.append(f"is {status.value} without its last attempt's error")
    elif run.get("error") is not None:
        bad.append(f"is {status.value} with an error")
    if status == RunStatus.SUCCEEDED:
        bad += _steps_in_order(steps, finished)
    return bad


def _steps_in_order(steps: list[str], finished: dict[str, tuple[int, int, int]]) -> list[str]:
    """Each step's successful run began after the previous step's ended, and began and ended
    under one lease."""
    bad: list[str] = []
    previous_end = -1
    for step in steps:
        if step not in finished:
            bad.append(f"succeeded without a recorded run of step {step}")
            continue
        start, lease, end = finished[step]
        if start < previous_end:
            bad.append(f"step {step} started before the step ahead of it finished")
        if lease < 0:
            bad.append(f"step {step} ran outside any lease")
        previous_end = end
    return bad


def _scheduled_later(run: Doc, now: datetime) -> bool:
    not_before = run.get("notBefore")
    claimable = run["status"] in (RunStatus.PENDING, RunStatus.QUEUED)
    return claimable and not_before is not None and not_before.replace(tzinfo=UTC) > now


def _shared_keys(runs: Iterable[Doc]) -> list[str]:
    """No dedupe key with two active runs, no schedule fire time with two runs, and no
    idempotency key with two runs."""
    groups: dict[str, defaultdict[Any, list[str]]] = {
        "active dedupe key": defaultdict(list),
        "schedule fire": defaultdict(list),
        "idempotency key": defaultdict(list),
    }
    for run in runs:
        if (key := run.get("dedupeKey")) and run["status"] not in TERMINAL:
            groups["active dedupe key"][key].append(str(run["_id"]))
        if run.get("scheduleId") and run.get("scheduledFor"):
            fire = (run["scheduleId"], run["scheduledFor"])
            groups["schedule fire"][fire].append(str(run["_id"]))
        if key := run.get("idempotencyKey"):
            idempotent = (run["scope"], run["scopeId"], key)
            groups["idempotency key"][idempotent].append(str(run["_id"]))
    return [
        f"{what} {key!r} is shared by runs {ids}"
        for what, group in groups.items()
        for key, ids in group.items()
        if len(ids) > 1
    ]
