"""The invariant checker: after a scenario, audit what MongoDB holds.

It reads every run with its trail (a run's events live in its `trail` as durably as the run;
`job_events` holds copies, plus the `stale_write_rejected` events that change no run) and
returns one line per violation. An empty list means the promise held: no run lost, none
finished twice, none stuck, and no flow-control limit ever exceeded.

The limits are checked over time, on the times the events record (`createAt`, each from its
writer's clock: one machine's in these tests, kept to the millisecond by MongoDB). A span
recorded from one event to another is open from its start up to, not including, its end: a
holder's end and the start it made room for may fall in one millisecond, and no tolerance
beyond that is needed, because each start below is stamped after the ends it relied on (each
check says why).

The notifier's promise is checked against what a webhook receiver got (`webhook_deliveries`):
every run's end in a subscribed scope reached its webhook at least once, and nothing else did.
"""

import json
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from pymongo.asynchronous.database import AsyncDatabase

from jobplane.model import ALLOWED, LEASED, TERMINAL, RunStatus
from jobplane.model.graph import Graph
from jobplane.runs.admission.keys import lock_named

Doc = dict[str, Any]
# A run and its trail, in the order MongoDB wrote it.
Trailed = tuple[Doc, list[Doc]]
Templates = dict[tuple[str, int], Doc]
# From when to when a fault was taking locks away from their holders (naive UTC, as MongoDB's
# times are read).
Window = tuple[datetime, datetime]
# A step event must be written under the lease of the run's holder at that point, or, for a
# lent step, under the step's own lease (from its `step_claimed` until it was given back,
# taken back or ended).
STEP_EVENTS = frozenset({"step_started", "step_finished", "step_skipped"})
STEP_LEASE_ENDS = frozenset({"step_given_back", "step_taken_back", "step_finished"})
# How long after its locks were taken a step may read its start: the take's answer comes
# back through group commit to a worker under load. A fault that wiped the locks in between
# may let another run take them before the step's recorded start.
TAKE_TO_START = timedelta(seconds=1)
ENDED = frozenset(s.value for s in TERMINAL)
STARTED = frozenset(s.value for s in LEASED)
# What a map step's `maxConcurrency` counts: children started and not ended.
ACTIVE_CHILD = STARTED | {RunStatus.WAITING_CHILDREN.value}


@dataclass
class Audit:
    """What the checker read, and what it found wrong."""

    runs: int = 0
    events: int = 0
    stale_writes: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    # The most runs of each template with `maxRunning` started at once.
    started_peak: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)


async def audit(
    db: AsyncDatabase[Doc],
    accepted: Iterable[str] = (),
    now: datetime | None = None,
    locks_lost: Sequence[Window] = (),
) -> Audit:
    """Check every run in `db`; `accepted` are run ids the API acknowledged to a caller,
    `locks_lost` the windows of the faults that took locks from their holders (see
    `lock_overlaps`)."""
    now = now or datetime.now(UTC)
    found = Audit()
    templates = {(t["type"], t["version"]): t async for t in db.job_templates.find({})}
    copies: defaultdict[str, list[Doc]] = defaultdict(list)
    async for event in db.job_events.find({}):
        # A webhook's life is written to `job_events` alone, under the webhook's id.
        if not event["type"].startswith("webhook_"):
            copies[event["jobId"]].append(event)
    runs: dict[str, Doc] = {}
    for collection in (db.job_runs, db.job_runs_archive):
        async for run in collection.find({}):
            runs[str(run["_id"])] = run

    trailed: list[Trailed] = []
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
        trailed.append((run, events))
        template = templates.get((run["templateType"], run["templateVersion"]))
        steps = [s["id"] for s in template["steps"]] if template else None
        needs = _needs(template) if template else None
        found.violations += [
            f"run {run_id}: {v}" for v in check_run(run, events, steps, now, needs)
        ]
    found.violations += [f"events of a run that does not exist: {run_id}" for run_id in copies]
    found.violations += _shared_keys(runs.values())
    found.violations += over_concurrency_limit(trailed, templates)
    found.violations += over_max_running(trailed)
    found.started_peak = {t: peak(spans) for t, spans in started_spans(trailed).items()}
    found.violations += lock_overlaps(trailed, templates, locks_lost)
    found.violations += map_families(trailed, templates)
    return found


def check_run(
    run: Doc,
    events: list[Doc],
    steps: list[str] | None,
    now: datetime,
    needs: dict[str, list[str]] | None = None,
) -> list[str]:
    """The violations of one run, given its trail in the order MongoDB wrote it, its
    template's steps and what each needs (None: a line, each step needing the one before)."""
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
    # Each lent step's borrower, while it holds the step's lease.
    borrowers: dict[str, str] = {}
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
        elif event["type"] == "step_claimed":
            borrowers[event["metadata"]["step"]] = event["actor"]
        if event["type"] in STEP_EVENTS:
            step = event["metadata"].get("step")
            if holder is None or event["actor"] not in (holder, borrowers.get(step)):
                bad.append(f"{event['type']} {step} by {event['actor']}, lease held by {holder}")
            if event["type"] == "step_started":
                started[step] = (at, lease)
            elif event["metadata"].get("status") is None and step in started:
                finished[step] = (*started[step], at)
        if event["type"] in STEP_LEASE_ENDS:
            borrowers.pop(event["metadata"].get("step"), None)
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
        line = {step: steps[i - 1 : i] for i, step in enumerate(steps)}
        bad += _steps_in_order(steps, finished, needs or line, _not_run(run))
    return bad


def _needs(template: Doc) -> dict[str, list[str]]:
    """What each step of a stored template needs, resolved (`model/graph.py`)."""
    graph = Graph.of([(s["id"], s.get("needs")) for s in template["steps"]])
    return {step: [graph.ids[n] for n in graph.needs[i]] for i, step in enumerate(graph.ids)}


def _not_run(run: Doc) -> set[str]:
    """The steps of a succeeded run that ended without a success: skipped, or failed for good
    under `onFailure: continue`."""
    return {
        s["id"]
        for s in run.get("progress", {}).get("steps", [])
        if s["status"] == "skipped" or (s["status"] == "failed" and s.get("final"))
    }


def _steps_in_order(
    steps: list[str],
    finished: dict[str, tuple[int, int, int]],
    needs: dict[str, list[str]],
    not_run: set[str],
) -> list[str]:
    """Each step's successful run began after the runs of the steps it needs had ended, and
    began and ended under one lease."""
    bad: list[str] = []
    for step in steps:
        if step in not_run:
            continue
        if step not in finished:
            bad.append(f"succeeded without a recorded run of step {step}")
            continue
        start, lease, _ = finished[step]
        for need in needs[step]:
            if need in finished and start < finished[need][2]:
                bad.append(f"step {step} started before the step ahead of it ({need}) finished")
        if lease < 0:
            bad.append(f"step {step} ran outside any lease")
    return bad


def _scheduled_later(run: Doc, now: datetime) -> bool:
    not_before = run.get("notBefore")
    claimable = run["status"] in (RunStatus.PENDING, RunStatus.QUEUED)
    return claimable and not_before is not None and not_before.replace(tzinfo=UTC) > now


def _shared_keys(runs: Iterable[Doc]) -> list[str]:
    """No place of a dedupe key with two active runs, no schedule fire time with two runs, and
    no idempotency key with two runs."""
    groups: dict[str, defaultdict[Any, list[str]]] = {
        "active dedupe key": defaultdict(list),
        "schedule fire": defaultdict(list),
        "idempotency key": defaultdict(list),
    }
    for run in runs:
        if (key := run.get("dedupeKey")) and run["status"] not in TERMINAL:
            place = (key, run.get("dedupeSlot") or 0)
            groups["active dedupe key"][place].append(str(run["_id"]))
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


@dataclass(frozen=True)
class Span:
    """A stretch of a run's trail during which it held something: a place of a dedupe key, a
    start under `maxRunning`, a lock. `end` None: it still holds it."""

    run: str
    start: datetime
    end: datetime | None
    # How many spans, this one included, may be open as it starts.
    limit: int


def crowded(spans: Iterable[Span]) -> Iterator[tuple[Span, list[Span]]]:
    """Each span that started with more spans open than its limit, with the open spans.

    Open means from the start up to, not including, the end; at one instant, ends come before
    starts. A span that ends where it starts (a step whose start was written with its end)
    is a point: it counts against the spans open around it, not against one that ends or
    starts at that instant. Checking at starts is enough: only a start adds an open span.
    """
    edges: list[tuple[datetime, int, Span]] = []
    for span in spans:
        point = span.end is not None and span.end <= span.start
        edges.append((span.start, 1 if point else 2, span))
        if span.end is not None and not point:
            edges.append((span.end, 0, span))
    open_: list[Span] = []
    for _, kind, span in sorted(edges, key=lambda edge: edge[:2]):
        if kind == 0:
            open_.remove(span)
            continue
        open_.append(span)
        if len(open_) > span.limit:
            yield span, list(open_)
        if kind == 1:
            open_.remove(span)


def over_concurrency_limit(trailed: Iterable[Trailed], templates: Templates) -> list[str]:
    """No dedupe key ever had more runs holding a place of it than its `concurrencyLimit`.

    A run holds a place from its `created` event (created `queued`, with a key) or its
    `dedupe_key_taken` event until the status change that ends it; the succeeded run of a
    template that is not `repeatable` keeps it for good.

    A key's place is taken by an insert or an update whose `now` was read before MongoDB's
    unique index decided. For a key of several places the taker first reads which are free
    (`store/runs.py`, `_free_place`), then its clock: its stamp follows the end of the holder
    it replaced. A key of one place is taken by the write alone, which may have been in flight
    while that holder ended, so its stamp may come first by as long as the write took; for
    such a key the place counts from the run's next event, written by a process that read the
    run, so after the place was taken.
    """
    keys: defaultdict[str, list[tuple[str, datetime, datetime | None]]] = defaultdict(list)
    limits: defaultdict[str, int] = defaultdict(lambda: 1)
    for run, events in trailed:
        template = templates.get((run["templateType"], run["templateVersion"]))
        if template is None or (key := _dedupe_key(run, template)) is None:
            continue
        limit = template.get("concurrencyLimit", 1)
        held = _place_held(events, not template.get("repeatable", True), limit == 1)
        if held is not None:
            keys[key].append((str(run["_id"]), *held))
            # A key's runs share its places whatever their version: each create looks among
            # its own version's, so the largest limit bounds them all.
            limits[key] = max(limits[key], limit)
    bad = []
    for key, held in keys.items():
        if found := next(crowded(Span(*h, limit=limits[key]) for h in held), None):
            span, open_ = found
            holders = sorted(s.run for s in open_)
            bad.append(
                f"dedupe key {key}: {len(open_)} runs held a place at {span.start} "
                f"(concurrencyLimit {limits[key]}): {holders}"
            )
    return bad


def _place_held(
    events: list[Doc], spent_on_success: bool, from_next: bool
) -> tuple[datetime, datetime | None] | None:
    """When the run held a place of its key, by its trail: None if it never took one."""
    taken: int | None = None
    for at, event in enumerate(events):
        takes = event["type"] == "dedupe_key_taken"
        takes |= event["type"] == "created" and event.get("to") == RunStatus.QUEUED
        if taken is None and takes:
            taken = at
        elif taken is not None and event.get("to") in ENDED:
            if event["to"] == RunStatus.SUCCEEDED and spent_on_success:
                break
            start = events[taken + 1] if from_next else events[taken]
            return start["createAt"], event["createAt"]
    if taken is None:
        return None
    if from_next and taken + 1 < len(events):
        return events[taken + 1]["createAt"], None
    return events[taken]["createAt"], None


def _dedupe_key(run: Doc, template: Doc) -> str | None:
    """The run's dedupe key, made as `runs/admission/keys.py` makes it; None if it has none."""
    if template.get("concurrencyPolicy", "allow") == "allow" and template.get("repeatable", True):
        return None
    parts = [_value(run, part) for part in template.get("dedupeKeys", [])]
    values = [run["templateType"], run["scope"], run["scopeId"], *parts]
    return json.dumps(values, sort_keys=True, separators=(",", ":"))


def over_max_running(trailed: Iterable[Trailed]) -> list[str]:
    """No run of a template with `maxRunning` started while as many of its runs, or more, were
    started (`running`, `waiting_worker`, `cancel_requested`).

    Each run is held to its own `maxRunning`, copied from its version, rather than to the
    smallest of the template's versions: the gate grants a run a place while the started runs
    of every capped version, itself included, are within the run's own cap, and while a spare
    place is out no grant goes past the spare's cap (`store/gates.py`), so a version that
    raised the cap may start runs past an older version's. A claim reads its clock after its
    place was granted, so after every end whose place it took was written (an end is stamped
    before it is written, and gives its place back after).
    """
    bad = []
    for template_type, spans in started_spans(trailed).items():
        if found := next(crowded(spans), None):
            span, open_ = found
            bad.append(
                f"template {template_type}: {len(open_)} runs started at {span.start} "
                f"(maxRunning {span.limit}): {sorted(s.run for s in open_)}"
            )
    return bad


def map_families(trailed: Sequence[Trailed], templates: Templates) -> list[str]:
    """Every map step made each item's child once, in its own scope; a map step that
    succeeded under `onItemFailure: fail` has only succeeded children; and no map step ever had
    more children active (started, not ended) than its `maxConcurrency`.

    A child takes its place after the end of the child it replaced was written (it reads the
    places held first, `store/children.py`), and is claimed after it took it, so its start is
    stamped after that end."""
    runs = {str(run["_id"]): run for run, _ in trailed}
    made: defaultdict[tuple[str, str], list[Doc]] = defaultdict(list)
    spans: defaultdict[tuple[str, str], list[Span]] = defaultdict(list)
    bad: list[str] = []
    for run, events in trailed:
        if (parent_id := run.get("parentRunId")) is None:
            continue
        step = (parent_id, run["parentStepId"])
        made[step].append(run)
        parent = runs.get(parent_id)
        if parent is None:
            bad.append(f"child {run['_id']}: its parent {parent_id} is not stored")
        elif (parent["scope"], parent["scopeId"]) != (run["scope"], run["scopeId"]):
            bad.append(f"child {run['_id']}: not in its parent's scope")
        if (limit := run.get("mapLimit")) is not None:
            spans[step] += _spans_in(str(run["_id"]), events, ACTIVE_CHILD, limit)
    for (parent_id, step_id), children in made.items():
        items = sorted(c["mapIndex"] for c in children)
        if len(set(items)) != len(items):
            bad.append(f"map step {step_id} of {parent_id}: an item has two children")
        parent = runs.get(parent_id)
        if parent is None:
            continue
        [progress] = [s for s in parent["progress"]["steps"] if s["id"] == step_id]
        total = (progress.get("map") or {}).get("total")
        if total is not None and items != list(range(total)):
            bad.append(f"map step {step_id} of {parent_id}: made {len(items)} of {total}")
        template = templates.get((parent["templateType"], parent["templateVersion"]))
        [spec] = [s for s in (template or {}).get("steps", []) if s["id"] == step_id] or [{}]
        fails = spec.get("map", {}).get("onItemFailure", "fail") == "fail"
        ended_badly = [c["_id"] for c in children if c["status"] != RunStatus.SUCCEEDED]
        if progress["status"] == "succeeded" and fails and ended_badly:
            bad.append(f"map step {step_id} of {parent_id} succeeded; {ended_badly} did not")
    for (parent_id, step_id), active in spans.items():
        if found := next(crowded(active), None):
            span, open_ = found
            bad.append(
                f"map step {step_id} of {parent_id}: {len(open_)} children active at "
                f"{span.start} (maxConcurrency {span.limit}): {sorted(s.run for s in open_)}"
            )
    return bad


def started_spans(trailed: Iterable[Trailed]) -> dict[str, list[Span]]:
    """By template, each stretch of its capped runs' trails from a move into the started
    statuses to the move out of them, each limited by its run's `maxRunning`."""
    templates: defaultdict[str, list[Span]] = defaultdict(list)
    for run, events in trailed:
        if (cap := run.get("maxRunning")) is not None:
            templates[run["templateType"]] += _spans_in(str(run["_id"]), events, STARTED, cap)
    return templates


def _spans_in(run_id: str, events: list[Doc], statuses: frozenset[str], limit: int) -> list[Span]:
    """The stretches of a run's trail from a move into `statuses` to the move out of them."""
    found: list[Span] = []
    start: datetime | None = None
    for event in events:
        if "to" not in event:
            continue
        if event["to"] in statuses and start is None:
            start = event["createAt"]
        elif event["to"] not in statuses and start is not None:
            found.append(Span(run_id, start, event["createAt"], limit))
            start = None
    if start is not None:
        found.append(Span(run_id, start, None, limit))
    return found


def peak(spans: list[Span]) -> int:
    """The most spans open at one instant."""
    most = 0
    while next(crowded(replace(s, limit=most) for s in spans), None):
        most += 1
    return most


def lock_overlaps(
    trailed: Iterable[Trailed], templates: Templates, lost: Sequence[Window] = ()
) -> list[str]:
    """No two runs' steps ever held one lock at once: while a step whose `locks` name it
    runs, no other step naming it does.

    A step's run is recorded from when it began (below) to its `step_finished` event, whose
    `now` is read after the handler returned and its holder confirmed the locks were its own
    still (`StepLocks.confirm`), and which is written before the step's locks are let go
    (with the walk's failure, for a step that ended once the walk had failed); the next holder
    takes the lock after that and reads its start after it took it. A run of a step cut short
    (its lease lost, its worker killed, a cancel acknowledged, a lock lost or lapsed) has no
    recorded end: it lets its locks go, or they expire, at a time MongoDB does not know, and
    it is left out.

    A lock lives in Redis under a lease its holder renews (`runs/admission/locks.py`): a fault
    that wipes Redis, or keeps a holder from renewing for a lease length (a pause, a MongoDB
    it cannot reach), gives the lock to the next taker while the holder may still run, by
    design; fencing tokens protect what the lock guards then. `lost` are the windows of such
    faults: a step that began after a window opened may overlap one that took its locks
    before it closed. (A FLUSHALL between a take and the start it reads after found that.)
    """
    locks: defaultdict[str, list[Span]] = defaultdict(list)
    for run, events in trailed:
        template = templates.get((run["templateType"], run["templateVersion"]))
        named = {s["id"]: s["locks"] for s in (template or {}).get("steps", []) if s.get("locks")}
        for step, start, end in _step_spans(run, events):
            for lock in named.get(step, []):
                values = [_value(run, part) for part in lock.get("key", [])]
                locks[lock_named(lock["name"], values)].append(Span(str(run["_id"]), start, end, 1))
    bad = []
    for lock, spans in locks.items():
        for span, open_ in crowded(spans):
            if all(_taken_away(s, span, lost) for s in open_ if s is not span):
                continue
            bad.append(
                f"lock {lock}: runs {sorted({s.run for s in open_})} held it at once "
                f"at {span.start}"
            )
            break
    return bad


def _taken_away(holder: Span, taker: Span, lost: Sequence[Window]) -> bool:
    """Whether a fault may have taken the lock from `holder` before `taker` took it: the
    holder took it before the fault ended (its start is read up to `TAKE_TO_START` after)."""
    return any(holder.start < end + TAKE_TO_START and taker.start >= begin for begin, end in lost)


def _step_spans(run: Doc, events: list[Doc]) -> list[tuple[str, datetime, datetime]]:
    """Each run of a step that ended on the record: its step id, when it began, and when it
    ended (its `step_started` and the `step_finished` after it, under one lease).

    The event of a start is written once the step has run 50 ms, or with its end, so it may
    come late; the run's progress has the start of the step's last run to the millisecond the
    handler began. That start comes at or before the last run's event and after every earlier
    run's end, so the earlier of the two is each run's start: exact for the last run, from its
    event for an earlier one.
    """
    began = {s["id"]: s.get("startedAt") for s in run.get("progress", {}).get("steps", [])}
    opened: dict[str, datetime] = {}
    spans = []
    for event in events:
        step = event.get("metadata", {}).get("step")
        if "to" in event and event["to"] != RunStatus.CANCEL_REQUESTED:
            # A new lease, or none: a step started before it has no end to come.
            opened.clear()
        elif event["type"] == "step_started":
            opened[step] = min(filter(None, [event["createAt"], began.get(step)]))
        elif event["type"] == "step_finished" and step in opened:
            spans.append((step, opened.pop(step), event["createAt"]))
    return spans


def _value(run: Doc, part: str) -> Any:
    """A dedupe part's value for `run` (`scope`, `scopeId`, `payload.<path>`), as keys.py reads
    it."""
    if not part.startswith("payload."):
        return run[part]
    value: Any = run.get("payload", {})
    for name in part.split(".")[1:]:
        value = value.get(name) if isinstance(value, dict) else None
    return value


# A webhook's scope: (scope, scope id).
Subscribed = tuple[str, str]


def ends_to_deliver(events: Iterable[Doc], subscribed: Collection[Subscribed]) -> dict[str, Doc]:
    """By the message id it is delivered under (`msg_<event id>`), each run's end (a
    `status_changed` event to a terminal status) in a scope a webhook subscribed to."""
    return {
        f"msg_{event['_id']}": event
        for event in events
        if event["type"] == "status_changed"
        and event.get("to") in ENDED
        and (event["scope"], event["scopeId"]) in subscribed
    }


def webhook_deliveries(
    events: Iterable[Doc],
    subscribed: Collection[Subscribed],
    received: Iterable[tuple[Subscribed, str]],
) -> list[str]:
    """Every run's end in a subscribed scope reached that scope's webhook, and nothing else
    did: `events` are trail events (`job_events`), `received` the webhook (its scope) and the
    `webhook-id` of each verified request the receiver got. At least once: a message received
    more than once is no violation."""
    expected = ends_to_deliver(events, subscribed)
    got = set(received)
    bad = []
    for where, message in sorted(got):
        if (ended := expected.get(message)) is None:
            what = "not the end of a run of a subscribed scope"
        elif (ended["scope"], ended["scopeId"]) != where:
            what = f"the end of a run of {ended['scope']} {ended['scopeId']}"
        else:
            continue
        bad.append(f"the webhook of {where[0]} {where[1]} received {message}, {what}")
    bad += [
        f"run {event['jobId']}: its end ({event['to']}, event {event['_id']}) never reached the "
        f"webhook of {event['scope']} {event['scopeId']}"
        for message, event in expected.items()
        if ((event["scope"], event["scopeId"]), message) not in got
    ]
    return bad
