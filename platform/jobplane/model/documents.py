"""The documents of the four collections, as pydantic models with camelCase aliases.

Python code uses snake_case attributes; MongoDB and the HTTP API see the camelCase aliases.
Only the store converts between these models and BSON.
"""

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from typing import Annotated, Any, Literal

from annotated_types import Ge, Le
from jsonschema import Draft202012Validator
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    computed_field,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from jobplane.model.graph import Graph
from jobplane.model.status import RunStatus, StepStatus


def _says(shape: str) -> WrapValidator:
    """A pattern's refusal that says what a valid value looks like, rather than printing the
    pattern (which the JSON schema still shows)."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            if any(e["type"] == "string_pattern_mismatch" for e in exc.errors()):
                raise PydanticCustomError("string_pattern_mismatch", shape) from None
            raise

    return WrapValidator(check)


Scope = Literal["user", "account", "system"]
# Identifiers authors choose; kept to a safe alphabet so they are fine as key parts and in URLs.
Name = Annotated[
    str,
    Field(pattern=r"^[A-Za-z0-9_.-]{1,100}$"),
    _says("1 to 100 letters, digits, '_', '.' or '-'"),
]
# Step ids become MongoDB field names (`outputs.<id>`), so no dots.
StepId = Annotated[
    str, Field(pattern=r"^[A-Za-z0-9_-]{1,100}$"), _says("1 to 100 letters, digits, '_' or '-'")
]
# What a dedupe key is made of: the run's scope fields, or a path into its payload.
DedupePart = Annotated[str, Field(pattern=r"^(scope|scopeId|payload(\.[^.\s]+)+)$")]
Role = Literal["admin", "author", "user", "auditor"]
# A scope id is printable: no whitespace (a key's scope list could not name it) and no control
# characters such as NUL. The same alphabet in a run, a schedule and a key's scopes.
_SCOPE_ID = r"[^\s\x00-\x1f\x7f-\x9f]{1,200}"
_SCOPE_ID_SHAPE = "1 to 200 characters, none of them a space or a control character"
ScopeId = Annotated[str, Field(pattern=f"^{_SCOPE_ID}$"), _says(_SCOPE_ID_SHAPE)]
# A scope an API key may act in, as `<scope>:<scopeId>`: `user:user_123`, `account:acme`.
ScopeRef = Annotated[
    str,
    Field(pattern=f"^(user|account|system):{_SCOPE_ID}$"),
    _says("a scope looks like account:<id>, user:<id> or system:<id> (<id> without spaces)"),
]


def _json_integer(value: Any) -> Any:
    # JSON Schema's integers include 5.0, which pydantic's strict mode refuses; its lax mode
    # would take true.
    if isinstance(value, bool):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# The last of an integer's annotations (after its bounds, which the JSON schema then shows):
# an integer as JSON Schema has it, 5 or 5.0, never true; in a body never "5" either.
JSON_INTEGER = BeforeValidator(_json_integer)
# A template version a client names. Versions count registrations from 1; the bound is the
# largest integer every JSON reader holds exactly (the document's validators compare doubles).
MAX_VERSION = (1 << 53) - 1
Version = Annotated[int, Ge(1), Le(MAX_VERSION), JSON_INTEGER]


def _iso_8601(value: Any) -> Any:
    # Pydantic would also read a number, or a string of digits, as seconds since 1970.
    if isinstance(value, str) and re.match(r"\d{4}-\d\d-\d\d", value):
        return value
    raise ValueError("expected an ISO 8601 date and time, e.g. 2030-01-01T09:00:00+08:00")


def _on_the_calendar(t: datetime) -> datetime:
    try:
        return t.astimezone(UTC)
    except OverflowError:
        raise ValueError("in UTC this time is before year 1 or after year 9999") from None


# A time a client sends, in UTC once read: ISO 8601 text with an offset (a time without one
# would be read in the server's zone) whose UTC reading is a date Python and BSON can hold.
Instant = Annotated[
    AwareDatetime, Strict(False), BeforeValidator(_iso_8601), AfterValidator(_on_the_calendar)
]


class Document(BaseModel):
    # Stored documents may carry fields a newer version added; inputs forbid unknown fields.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class Spec(Document):
    """What a client sends: no unknown fields, and strict as request bodies are
    (`model.bodies.RequestBody`): 0 is not false, "5" is not a number."""

    # NaN and Infinity parse from JSON and YAML (`.inf`) but cannot be answered in JSON.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


# A year: any longer and deadlines computed from it stop being dates MongoDB can add.
MAX_SECONDS = 366 * 86400
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]
PositiveSeconds = Annotated[float, Field(gt=0, le=MAX_SECONDS)]


class LockSpec(Spec):
    """A lock a step holds while it runs: `<name>:<values of key>`, shared by every template
    that names it (`docs/contract.md`, "Locks")."""

    name: Name
    # Dedupe parts (as `dedupeKeys`) whose values tell one lock of the name from another.
    key: list[DedupePart] = Field(default_factory=list)


class RetryPolicy(Spec):
    """Either an explicit `backoffSeconds` list or exponential backoff with jitter."""

    max_attempts: Annotated[int, Field(ge=1, le=100), JSON_INTEGER] = 1
    backoff_seconds: list[Seconds] | None = None
    initial_seconds: Seconds = 1
    multiplier: Annotated[float, Field(ge=1, le=100)] = 2
    max_seconds: Seconds = 3600
    jitter: Literal["full", "equal", "none"] = "full"


# At most this many items in one map step's list (more fails the step, `MapTooLarge`).
MAX_MAP_ITEMS = 10_000


class MapSpec(Spec):
    """A map step's fan-out: a child run of `template` for each item `items` gives."""

    # A CEL expression over `payload`, `outputs` and `run` giving a list.
    items: Annotated[str, Field(min_length=1, max_length=2000)]
    # The children's template type: its latest version when the step starts.
    template: Name
    # A CEL expression over `item`, `index`, `payload` and `outputs` giving a child's
    # payload; omitted, the item itself.
    payload: Annotated[str, Field(min_length=1, max_length=2000)] | None = None
    # How many of the step's children may be active (started, not ended) at once.
    max_concurrency: Annotated[int, Field(ge=1, le=MAX_MAP_ITEMS), JSON_INTEGER] | None = None
    # A child that fails for good: `fail` fails the step and cancels the other children;
    # `continue` records it in the step's output, and the step succeeds.
    on_item_failure: Literal["fail", "continue"] = "fail"


class StepSpec(Spec):
    id: StepId
    name: str = ""
    # Every step has one but a map step, whose work is its children's.
    handler: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    worker_type: Literal["inline", "external", "map"] = "inline"
    map: MapSpec | None = None
    timeout_seconds: PositiveSeconds | None = None
    cancelable: bool = True
    locks: list[LockSpec] = Field(default_factory=list)
    # The steps that must end (succeeded or skipped) before this one starts; omitted, the
    # step before it in the list (`model/graph.py`).
    needs: Annotated[list[StepId], Field(max_length=100)] | None = None
    # A CEL expression over `payload`, `outputs` and `run`: false skips the step.
    when: Annotated[str, Field(min_length=1, max_length=2000)] | None = None
    # When the step fails for good: end the run (`fail_run`), or skip what depends on it and
    # go on with the rest (`continue`).
    on_failure: Literal["fail_run", "continue"] = "fail_run"
    # Overrides the template's `retryPolicy` for this step.
    retry_policy: RetryPolicy | None = None

    @model_validator(mode="after")
    def _work(self) -> "StepSpec":
        """A map step has `map` and no handler; every other step a handler and no `map`."""
        if self.worker_type == "map":
            if self.map is None:
                raise ValueError("a step of workerType map needs `map`")
            if self.handler is not None:
                raise ValueError("a map step has no handler: its children do its work")
        else:
            if self.handler is None:
                raise ValueError(f"a step of workerType {self.worker_type} needs a handler")
            if self.map is not None:
                raise ValueError("only a step of workerType map has `map`")
        return self


class CancelPolicy(Spec):
    supported: bool = True
    mode: Literal["cooperative"] = "cooperative"
    grace_seconds: Seconds = 30


class RateLimit(Spec):
    """At most `limit` starts in any `periodSeconds`: per template, or per value of `key`
    (dedupe parts, as `dedupeKeys`)."""

    limit: Annotated[int, Field(ge=1, le=1_000_000), JSON_INTEGER]
    period_seconds: PositiveSeconds
    key: list[DedupePart] | None = None


ConcurrencyPolicy = Literal["allow", "reject_same_scope", "queue_same_scope", "cancel_previous"]


class TemplateSpec(Spec):
    """What a template author registers."""

    type: Name
    name: str = ""
    description: str = ""
    enabled: bool = True
    payload_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    repeatable: bool = True
    concurrency_policy: ConcurrencyPolicy = "allow"
    dedupe_keys: list[DedupePart] = Field(default_factory=list)
    # How many runs of one dedupe key may be active at once (with a policy other than allow).
    concurrency_limit: Annotated[int, Field(ge=1, le=1000), JSON_INTEGER] = 1
    # How many runs of the template (all versions, all scopes) may be started at once. Its
    # gate lists a place for every started run (`store/gates.py`), so the list stays far below
    # 16 MB.
    max_running: Annotated[int, Field(ge=1, le=100_000), JSON_INTEGER] | None = None
    rate_limit: RateLimit | None = None
    # `round_robin`: a lane's ready runs are taken in turns across their scopes.
    fairness: Literal["none", "round_robin"] = "none"
    timeout_seconds: PositiveSeconds | None = None
    cancel_policy: CancelPolicy = Field(default_factory=CancelPolicy)
    retry_policy: RetryPolicy = Field(default_factory=RetryPolicy)
    steps: Annotated[list[StepSpec], Field(min_length=1)]
    schedulable: bool = False
    priority: Annotated[int, Field(ge=-100, le=100), JSON_INTEGER] = 0
    queue: Name = "default"


class Template(TemplateSpec):
    """A registered, immutable version of a template."""

    # Read from MongoDB and from API answers (times as text), not sent by a client.
    model_config = ConfigDict(extra="ignore", strict=False)

    version: int
    create_at: datetime
    update_at: datetime

    @cached_property
    def payload_validator(self) -> Draft202012Validator:
        """Built once per loaded template (the store caches them): building it cost more than
        validating a small payload."""
        return Draft202012Validator(self.payload_schema)

    @cached_property
    def graph(self) -> Graph:
        """The steps' graph; registration refused any template whose needs make none."""
        return Graph.of([(s.id, s.needs) for s in self.steps])

    @cached_property
    def maps(self) -> bool:
        """It has map steps: its runs may have children."""
        return any(s.worker_type == "map" for s in self.steps)

    def step_index(self, step_id: str) -> int:
        return next(i for i, s in enumerate(self.steps) if s.id == step_id)

    def next_handler(self, statuses: Sequence[StepStatus]) -> str | None:
        """The handler a worker needs to go on with a run whose steps are in `statuses`: that
        of its first ready step (None: none, or an external one)."""
        ready = self.graph.ready(statuses)
        return self.handler_at(ready[0]) if ready else None

    def handler_at(self, index: int) -> str | None:
        """The handler a worker needs to run step `index`; None for an external step, which
        any worker hands to an external one."""
        step = self.steps[index]
        return step.handler if step.worker_type == "inline" else None


class RunError(Document):
    code: str
    message: str
    step: str | None = None
    # Set by the store, from the attempt the error ended.
    attempt: int = 0
    # The last frames of the exception, for the person reading a dead letter.
    traceback: str | None = None


class StepOutcome(Document):
    """How a lent step ended, as the worker it was lent to reports it: the run's holder
    writes the step's end from it, as it would for a step of its own."""

    status: Literal[StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.CANCELLED]
    output: Any = None
    error: RunError | None = None
    # A failure the step's retry policy may try again (not a `FatalError`).
    retryable: bool = False
    started_at: datetime
    # The borrower wrote the step's start (it ran for more than a moment).
    start_written: bool = False


class StepLease(Document):
    """A step its run's holder lent to a worker offering the handler it lacks
    (docs/contract.md, "Lent steps"): the step's own lease, fenced like the run's. Claimed,
    it names the worker, its token and when it runs out."""

    handler: str
    # The step's try it was lent for (`progress.steps[i].attempt` once it starts).
    attempt: int
    lent_at: datetime
    worker_id: str | None = None
    token: str | None = None
    until: datetime | None = None
    # The holder asked the borrower to stop (a step beside it failed the run).
    stop: bool | None = None
    outcome: StepOutcome | None = None


class MapProgress(Document):
    """A map step's children: how many it made (the rest is counted from them when read)."""

    total: int
    succeeded: int | None = None
    failed: int | None = None
    # Started and not ended: what `maxConcurrency` caps.
    active: int | None = None


class StepProgress(Document):
    id: str
    status: StepStatus = StepStatus.PENDING
    # The steps it needs (`needs`, resolved: a step of a line needs the one before it); None
    # on runs created before steps formed graphs.
    needs: list[str] | None = None
    # How many times the step started, this time included.
    attempt: int = 0
    # A step that failed for good with `onFailure: continue`: it is not run again (a failed
    # step without it is retried with its run).
    final: bool | None = None
    started_at: datetime | None = None
    completed_at: datetime | None = None
    percentage: float = 0
    message: str | None = None
    error: str | None = None
    # A map step, once its children were made.
    map: MapProgress | None = None
    # While the step is lent to another worker.
    lease: StepLease | None = None


class Progress(Document):
    summary: str = ""
    percentage: float = 0
    steps: list[StepProgress] = Field(default_factory=list)
    # When a step last reported progress; None until one does.
    reported_at: datetime | None = None


WaitingReason = Literal[
    "queue_paused", "concurrency", "handler", "max_running", "lock", "rate_limit", "children"
]


class WaitingFor(Document):
    """Why a run that could start does not, and a short human `detail`:
    - `queue_paused`: an operator paused its queue;
    - `concurrency`: its dedupe key has `concurrencyLimit` active runs (the key);
    - `handler`: no live worker on its queue offers its current step's handler (the handler);
    - `max_running`: its template has `maxRunning` runs started;
    - `lock`: another run holds a lock its step needs (the lock);
    - `rate_limit`: its `rateLimit` window is full (when it opens);
    - `children`: only map steps are left, and their child runs run (`<ended>/<total>`).
    """

    reason: WaitingReason
    detail: str


class RunRate(Document):
    """A run's share of its template's `rateLimit`: the window it counts in (`key`: the
    template type and the values of the limit's key parts) and the limit."""

    key: str
    limit: int
    period_seconds: float


@dataclass(frozen=True)
class StartLimits:
    """What a run must pass as it starts, beyond its status: its template's `maxRunning`, its
    rate window, and the locks its first steps take. The queue entry of a run carries them, so
    that a worker that pops it can check them, and take the locks beside its claim, without
    reading the run."""

    template_type: str
    max_running: int | None = None
    rate: RunRate | None = None
    locks: tuple[str, ...] = ()

    @property
    def gated(self) -> bool:
        """It must be admitted before its claim (`claim_limited`); a run with locks alone is
        claimed as any other, and its worker takes them beside the claim."""
        return self.max_running is not None or self.rate is not None

    def as_list(self) -> list[Any]:
        rate = self.rate
        window = [rate.key, rate.limit, rate.period_seconds] if rate else [None, None, None]
        values = [self.template_type, self.max_running, *window]
        if self.locks:  # only then: a member without locks reads as it always has
            values.append(list(self.locks))
        return values

    @classmethod
    def from_list(cls, values: list[Any]) -> "StartLimits":
        template_type, max_running, key, limit, period, *locks = values
        rate = None if key is None else RunRate(key=key, limit=limit, period_seconds=period)
        return cls(template_type, max_running, rate, tuple(locks[0]) if locks else ())


class LockWait(Document):
    """The lock a run was handed back for, while it waits to take it again."""

    lock: str
    # The run that held it then.
    holder: str | None = None
    # How many times in a row the run found it held: its wait backs off with each.
    count: int = 1


class Attempt(Document):
    """An attempt that ended in an error, kept after the run moved on (its `error` is only
    the outcome's)."""

    attempt: int
    error: RunError
    # None for an attempt claimed before attempts' starts were recorded.
    started_at: datetime | None = None
    ended_at: datetime


class Run(Document):
    id: str
    template_type: str
    template_version: int
    scope: Scope
    scope_id: str
    status: RunStatus
    phase: str | None = None
    payload: dict[str, Any] = Field(default_factory=dict)
    priority: int = 0
    queue: str = "default"
    progress: Progress = Field(default_factory=Progress)
    # Each finished step's return value, so a retried run resumes instead of restarting.
    outputs: dict[str, Any] = Field(default_factory=dict)
    result: Any = None
    # The error the run ended with: only a `failed` or `expired` run has one. Every attempt that
    # ended in an error, that last one included, is in `attempts`, oldest first.
    error: RunError | None = None
    attempts: list[Attempt] = Field(default_factory=list)
    attempt: int = 0
    # When the attempt in progress began, set by the claim that starts it: an attempt handed
    # back on shutdown keeps it for the claim that goes on with it, a run waiting to retry has
    # none, and an ended run keeps its last attempt's.
    attempt_started_at: datetime | None = None
    max_attempts: int = 1
    not_before: datetime | None = None
    # Copied from the template at creation: the whole-run limit counted from the first start
    # (`deadline` is set then), and how long a requested cancel may take (`cancelDeadline`).
    timeout_seconds: float | None = None
    cancel_grace_seconds: float = 30
    deadline: datetime | None = None
    cancel_deadline: datetime | None = None
    # The handler of the current step (the first one not succeeded), which only workers that
    # offer it claim; None while that step is external.
    handler: str | None = None
    # While `waiting_worker`: the kind of external worker the current step waits for.
    external_type: str | None = None
    locked_by: str | None = None
    lease_token: str | None = None
    locked_until: datetime | None = None
    heartbeat_at: datetime | None = None
    cancel_requested_at: datetime | None = None
    cancel_reason: str | None = None
    cancel_requested_by: str | None = None
    dedupe_key: str | None = None
    # Which of the key's `concurrencyLimit` places the run holds (unset: the first).
    dedupe_slot: int | None = None
    # Set while a run waits for a place of this key to free up (`queue_same_scope`,
    # `cancel_previous`).
    dedupe_wait: str | None = None
    # Copied from the template version at creation, where they limit starts: how many runs
    # of a key may be active (unset: 1), how many of the template may be started, its rate
    # window, and whether its lane takes runs in turns across scopes.
    concurrency_limit: int | None = None
    max_running: int | None = None
    rate: RunRate | None = None
    fairness: Literal["round_robin"] | None = None
    # While the run waits for a lock its step needs (`docs/contract.md`, "Locks").
    lock_wait: LockWait | None = None
    # The locks its first steps take, named at creation: its worker takes them beside its
    # claim while no step has started.
    start_locks: list[str] | None = None
    idempotency_key: str | None = None
    schedule_id: str | None = None
    scheduled_for: datetime | None = None
    rerun_of: str | None = None
    # The W3C context (`traceparent`, `tracestate`) its creation ran in: every attempt and
    # step continues that trace (`jobplane/tracing.py`).
    trace_context: dict[str, str] | None = None
    # A map step's child: its parent run and step, the first run of its family, and which of
    # the step's items it is.
    parent_run_id: str | None = None
    parent_step_id: str | None = None
    root_run_id: str | None = None
    map_index: int | None = None
    # Its place among the map step's active children, under `maxConcurrency` (`mapLimit`);
    # `mapWait` while it waits for one, `pending`.
    map_place: int | None = None
    map_wait: bool | None = None
    map_limit: int | None = None
    started_at: datetime | None = None
    completed_at: datetime | None = None
    create_at: datetime
    update_at: datetime
    version: int = 1
    # Not stored: the run service says it when it answers (`runs/waiting.py`).
    waiting_for: WaitingFor | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def trace_id(self) -> str | None:
        """Not stored: the id of the trace `trace_context` names (32 hex digits)."""
        if self.trace_context is None or "traceparent" not in self.trace_context:
            return None
        # A stored context is one an SDK wrote: `00-<trace id>-<span id>-<flags>`.
        return self.trace_context["traceparent"][3:35]

    @property
    def start_limits(self) -> StartLimits | None:
        """The limits the run passes as it starts, or None without any. Its first steps'
        locks count while none of its steps has started: a later attempt may start elsewhere,
        and takes its locks as its steps start."""
        locks: tuple[str, ...] = ()
        if self.start_locks and all(s.status == StepStatus.PENDING for s in self.progress.steps):
            locks = tuple(self.start_locks)
        if self.max_running is None and self.rate is None and not locks:
            return None
        return StartLimits(self.template_type, self.max_running, self.rate, locks)


class Event(Document):
    id: str
    job_id: str
    type: str
    from_: RunStatus | None = Field(default=None, alias="from")
    to: RunStatus | None = None
    message: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    actor: str
    scope: Scope | None = None
    scope_id: str | None = None
    # The run's `version` after the write this event records; orders a run's trail.
    run_version: int
    create_at: datetime


class ApiKeyPublic(Document):
    """An API key as the API shows it: everything but the secret."""

    id: str
    name: Name
    role: Role
    # As stored (`KeyCreate` checks them): a key made before scope ids were checked still works.
    scopes: list[str] = Field(default_factory=list)
    created_by: str
    create_at: datetime
    # A revoked key is refused, but its record stays: the list and the audit trail still name it.
    revoked_at: datetime | None = None
    revoked_by: str | None = None


class ApiKey(ApiKeyPublic):
    """An API key as stored: the secret only as its SHA-256 (a random 256-bit secret needs no
    slow hash: there is nothing to guess)."""

    secret_hash: str


class QueueState(Document):
    """A queue's pause, as MongoDB holds it: workers start none of a paused queue's runs.

    Only queues an operator ever paused have one; `version` orders its changes, so a stale
    copy in Redis never overwrites a newer one."""

    queue: str
    paused: bool = False
    paused_by: str | None = None
    pause_reason: str | None = None
    paused_at: datetime | None = None
    resumed_by: str | None = None
    resumed_at: datetime | None = None
    version: int = 0


class ScheduleSpec(Spec):
    """What an account asks for: run a template on a cron, in its own time zone."""

    template_type: Name
    scope: Scope
    scope_id: ScopeId
    cron: Annotated[str, Field(min_length=1, max_length=200)]
    timezone: Annotated[str, Field(min_length=1, max_length=100)] = "UTC"
    # The payload of each fired run; strings may use {{scheduledFor}}, {{scheduleId}} and
    # {{scopeId}}.
    payload_template: dict[str, Any] = Field(default_factory=dict)
    enabled: bool = True
    misfire_policy: Literal["skip", "run_once", "catch_up"] = "run_once"
    # With `catch_up`: at most this many runs for the fire times missed while it was down.
    catch_up_limit: Annotated[int, Field(ge=1, le=1000), JSON_INTEGER] = 10
    overlap_policy: Literal["allow", "skip", "queue"] = "allow"


class Schedule(ScheduleSpec):
    # Read from MongoDB and from API answers (times as text), not sent by a client.
    model_config = ConfigDict(extra="ignore", strict=False)

    # As stored: one written before scope ids were checked must still load (and fire); a
    # change to it is checked as a spec, and must fix it.
    scope_id: str
    id: str
    next_run_at: datetime | None = None
    last_run_at: datetime | None = None
    last_run_id: str | None = None
    # The W3C context it was created in: each fire's trace links to it (`jobplane/tracing.py`).
    trace_context: dict[str, str] | None = None
    created_by: str
    create_at: datetime
    update_at: datetime
    version: int = 1
