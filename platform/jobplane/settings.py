"""Settings from `JOBPLANE_*` environment variables; every one is listed in the README."""

from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BeforeValidator, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from jobplane.queue.connect import parse_redis_url
from jobplane.queue.keys import Keys


def _split(value: object) -> object:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


# Comma-separated in the environment: JOBPLANE_QUEUES=default,reports
CommaList = Annotated[list[str], NoDecode, BeforeValidator(_split)]
# JOBPLANE_WEBHOOK_RETRY_SECONDS=0,5,300: at least one wait, none negative.
SecondsList = Annotated[
    list[Annotated[float, Field(ge=0, le=86400)]],
    NoDecode,
    BeforeValidator(_split),
    Field(min_length=1, max_length=50),
]


class Settings(BaseSettings):
    # Inputs stay out of error messages: a URL may hold a password.
    model_config = SettingsConfigDict(
        env_prefix="JOBPLANE_", extra="ignore", hide_input_in_errors=True
    )

    # Unset URLs make `jobplane dev` start local servers from the `local` extra.
    mongodb_url: str | None = None
    redis_url: str | None = None
    db: str = "jobplane"
    # Prefix for every Redis key, so several deployments (or tests) can share one Redis.
    redis_prefix: str = ""
    # "majority" keeps an acknowledged write through a failover; "1" trades that for speed.
    write_concern: str = "majority"
    # How long opening a connection to MongoDB or Redis may take, and a Redis reply (beyond a
    # blocking pop's own wait): a server that stopped answering fails a call instead of
    # holding it. MongoDB's server selection keeps its 30 s, long enough to ride out an election.
    connect_timeout_seconds: Annotated[float, Field(gt=0)] = 5
    # A stopping process gives its last writes (leases released, the scheduler lock let go,
    # requests in flight) this long after its drain, and as long again to copy its events and
    # close its connections; an engine that does not answer is given up on (docs/operations.md).
    close_seconds: Annotated[float, Field(gt=0)] = 5
    admin_key: str | None = None
    # A run's payload, as compact JSON, may not be larger (413 `PayloadTooLarge`).
    max_payload_bytes: Annotated[int, Field(ge=1)] = 256 * 1024
    # A `POST /v1/runs/batch` body may not be larger (413); the other routes' cap stays small.
    max_batch_bytes: Annotated[int, Field(ge=1)] = 16 * 1024 * 1024
    data_dir: Path = Path(".jobplane")
    host: str = "127.0.0.1"
    port: int = 8000
    # Where a worker or scheduler process serves its own metrics (on `host`); 0: it does not.
    # The API serves them at /metrics on its own port.
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 0
    # Unset: text on a terminal and JSON lines elsewhere for the process commands; text for
    # `jobplane dev`.
    log_format: Literal["json", "text"] | None = None

    worker_id: str | None = None
    worker_concurrency: Annotated[int, Field(ge=1)] = 16
    queues: CommaList = Field(default_factory=lambda: ["default"])
    handlers: CommaList = Field(default_factory=list)
    lease_seconds: Annotated[float, Field(gt=0)] = 30
    heartbeat_seconds: Annotated[float, Field(gt=0)] = 10
    # How long a worker blocks on an empty queue before looking again (also bounds delayed runs).
    poll_seconds: Annotated[float, Field(gt=0)] = 1.0

    reconcile_seconds: Annotated[float, Field(gt=0)] = 10
    # A fire time the tick reaches later than this was missed (the scheduler was down): the
    # schedule's `misfirePolicy` decides what happens to it.
    misfire_grace_seconds: Annotated[float, Field(ge=0)] = 60
    reap_batch: Annotated[int, Field(ge=1)] = 500
    # Terminal runs older than this move to `job_runs_archive` (still found by id).
    run_retention_days: Annotated[float, Field(gt=0)] = 30
    scheduler_lock_seconds: Annotated[float, Field(gt=0)] = 15

    # Webhooks (docs/contract.md, "Webhooks"). Deliveries to loopback, private, link-local and
    # metadata addresses are refused unless this is true: for development and tests only.
    webhook_allow_private: bool = False
    # A try that has no answer within this long failed.
    webhook_timeout_seconds: Annotated[float, Field(gt=0, le=300)] = 15
    # The wait before each try of a delivery: the first at once, then Svix's schedule (each
    # wait ±20%). A delivery that fails every try is marked failed.
    webhook_retry_seconds: SecondsList = Field(
        default_factory=lambda: [0.0, 5, 300, 1800, 7200, 18000, 36000, 36000]
    )
    # Tries in flight at once in one notifier (each webhook has at most 16 of them).
    webhook_concurrency: Annotated[int, Field(ge=1, le=10_000)] = 64

    # Where the dashboard links a run's trace: `{traceId}` is replaced by the run's trace id.
    # Unset (or empty): the trace id is shown as text.
    trace_url: str | None = None

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, url: str | None) -> str | None:
        if url is not None:
            parse_redis_url(url)  # raises, saying what is wrong
        return url

    @field_validator("redis_prefix")
    @classmethod
    def _redis_prefix(cls, prefix: str) -> str:
        Keys(prefix)  # raises, saying what is wrong
        return prefix

    @field_validator("trace_url")
    @classmethod
    def _trace_url(cls, url: str | None) -> str | None:
        if not url:
            return None
        try:
            parts = urlsplit(url)
            # `port` raises unless the port is absent or a number up to 65535.
            web = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
        except ValueError:  # that, or an unclosed `[`
            web = False
        if not web:
            raise ValueError("JOBPLANE_TRACE_URL must be an http:// or https:// URL with a host")
        # Every key's dashboard reads it (GET /v1/overview), so it may not carry a password.
        if parts.username is not None or parts.password is not None:
            raise ValueError("JOBPLANE_TRACE_URL may not hold a user name or password")
        if "{traceId}" not in url:
            raise ValueError("JOBPLANE_TRACE_URL must hold {traceId}, where the trace id goes")
        return url

    def unset(self, *fields: str) -> str | None:
        """Which of `fields` a process needs but lacks, naming each variable; None when all
        are set."""
        names = [f"JOBPLANE_{field.upper()}" for field in fields if not getattr(self, field)]
        if not names:
            return None
        return f"{' and '.join(names)} {'is' if len(names) == 1 else 'are'} not set"


def refusal(exc: ValidationError) -> str:
    """What is wrong with the settings, in one line naming each variable."""
    return "; ".join(_refusal(error) for error in exc.errors())


def _refusal(error: ErrorDetails) -> str:
    # A validator's own message names its variable already; pydantic's own ones do not.
    if cause := error.get("ctx", {}).get("error"):
        return str(cause)
    name = "_".join(str(part) for part in error["loc"]).upper()
    return f"JOBPLANE_{name}: {error['msg']}"
