"""API keys: an admin creates them; the secret is shown once."""

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter
from pydantic import Field, model_validator

from jobplane.api.auth import mint_key
from jobplane.api.deps import KeyAdmin, StoreDep
from jobplane.api.errors import ERROR_RESPONSES
from jobplane.api.schema import RequestBody, ResponseBody
from jobplane.errors import ResourceInvalidState
from jobplane.model import Role, ScopeRef
from jobplane.model.documents import Name

router = APIRouter(prefix="/v1/api-keys", tags=["api keys"], responses=ERROR_RESPONSES)


class KeyCreate(RequestBody):
    name: Name
    role: Role
    scopes: Annotated[list[ScopeRef], Field(max_length=100)] = Field(default_factory=list)

    @model_validator(mode="after")
    def _scopes_fit_role(self) -> "KeyCreate":
        if self.role == "user" and not self.scopes:
            raise ValueError("a user key needs at least one scope, e.g. user:user_123")
        if self.role != "user" and self.scopes:
            raise ValueError(f"an {self.role} key is not bound to scopes; leave scopes empty")
        return self


class KeyCreated(ResponseBody):
    id: str
    name: str
    role: Role
    scopes: list[str]
    # The secret: shown here once, stored only as a hash.
    key: str
    create_at: datetime


@router.post(
    "",
    summary="Create an API key",
    status_code=201,
    response_model=KeyCreated,
    response_model_by_alias=True,
)
async def create(body: KeyCreate, store: StoreDep, caller: KeyAdmin) -> KeyCreated:
    secret, record = mint_key(body.name, body.role, body.scopes, caller.actor, store.clock.now())
    if not await store.insert_api_key(record):
        raise ResourceInvalidState(f"an API key named {body.name!r} exists")
    return KeyCreated(
        id=record.id,
        name=record.name,
        role=record.role,
        scopes=record.scopes,
        key=secret,
        create_at=record.create_at,
    )
