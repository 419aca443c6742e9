"""Creating and reading runs."""

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Response
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from jobplane.api.deps import CallerDep, RunsDep, StoreDep
from jobplane.api.errors import ERROR_RESPONSES
from jobplane.model import Event, Run
from jobplane.runs import RunRequest

router = APIRouter(prefix="/v1/runs", tags=["runs"], responses=ERROR_RESPONSES)


class RunCreate(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    template_type: str
    template_version: Annotated[int, Field(ge=1)] | None = None
    scope: Literal["user", "account", "system"]
    scope_id: Annotated[str, Field(min_length=1, max_length=200)]
    payload: dict[str, Any] = Field(default_factory=dict)
    priority: Annotated[int, Field(ge=-100, le=100)] | None = None
    delay_seconds: Annotated[float, Field(ge=0)] | None = None
    not_before: datetime | None = None
    idempotency_key: Annotated[str, Field(max_length=200)] | None = None


@router.post("", status_code=201, response_model=Run, response_model_by_alias=True)
async def create(body: RunCreate, runs: RunsDep, caller: CallerDep, response: Response) -> Run:
    """Create a run; a repeated `idempotencyKey` in the same scope returns the first with 200."""
    run, created = await runs.create(RunRequest(**body.model_dump()), caller.actor)
    if not created:
        response.status_code = 200
    return run


@router.get("/{run_id}", response_model=Run, response_model_by_alias=True)
async def get(run_id: str, runs: RunsDep, caller: CallerDep) -> Run:
    return await runs.get(run_id)


@router.get("/{run_id}/events", response_model=list[Event], response_model_by_alias=True)
async def events(run_id: str, runs: RunsDep, store: StoreDep, caller: CallerDep) -> list[Event]:
    run = await runs.get(run_id)
    return await store.events_of(run.id)
