"""API keys: an admin creates them (the secret is shown once), lists and revokes them."""

from typing import Annotated

from fastapi import APIRouter
from pydantic import ConfigDict, Field, model_validator

from jobplane.api import pages
from jobplane.api.auth import mint_key
from jobplane.api.deps import Anyone, KeyAdmin, KeyReader, StoreDep
from jobplane.api.errors import ERROR_RESPONSES
from jobplane.api.pages import Cursor, Limit
from jobplane.errors import NotFound, ResourceInvalidState
from jobplane.model import ApiKeyPublic, Role, ScopeRef
from jobplane.model.answers import KeyCreated, Page, ResponseBody
from jobplane.model.bodies import RequestBody
from jobplane.model.documents import Name

router = APIRouter(prefix="/v1/api-keys", tags=["api keys"], responses=ERROR_RESPONSES)


class KeyCreate(RequestBody):
    # `_scopes_fit_role`, as the document says it.
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"role": {"const": "user"}}},
            "then": {"required": ["scopes"], "properties": {"scopes": {"minItems": 1}}},
            "else": {"properties": {"scopes": {"maxItems": 0}}},
        }
    )

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


@router.post(
    "",
    summary="Create an API key",
    status_code=201,
    response_model=KeyCreated,
    response_model_by_alias=True,
)
async def create(body: KeyCreate, store: StoreDep, caller: KeyAdmin) -> KeyCreated:
    """A new key, with an `api_key_created` event; `key` is its secret, shown only here."""
    secret, record = mint_key(body.name, body.role, body.scopes, caller.actor, store.clock.now())
    if not await store.keys.insert(record):
        raise ResourceInvalidState(f"an API key named {body.name!r} exists")
    return KeyCreated(**record.model_dump(exclude={"secret_hash"}), key=secret)


class Identity(ResponseBody):
    """The key a request was made with: its name, role and, for a user key, its scopes."""

    name: str
    role: Role
    scopes: list[str]


@router.get("/me", summary="The calling key", response_model=Identity, response_model_by_alias=True)
async def me(caller: Anyone) -> Identity:
    """Who the request's key is, for any key: a client picks its default scope from it (the
    CLI takes a user key's only scope)."""
    scopes = sorted(f"{scope}:{scope_id}" for scope, scope_id in caller.scopes)
    return Identity(name=caller.name, role=caller.role, scopes=scopes)


@router.get(
    "", summary="List API keys", response_model=Page[ApiKeyPublic], response_model_by_alias=True
)
async def list_keys(
    store: StoreDep, caller: KeyReader, limit: Limit = 100, cursor: Cursor = None
) -> Page[ApiKeyPublic]:
    """Every stored key, newest first, revoked ones too (`revokedAt`, `revokedBy`); never a
    secret. The bootstrap key (`JOBPLANE_ADMIN_KEY`) is not stored, so not listed."""
    return pages.newest_first(await store.keys.page(cursor, limit + 1), limit)


@router.delete(
    "/{key_id}",
    summary="Revoke an API key",
    response_model=ApiKeyPublic,
    response_model_by_alias=True,
)
async def revoke(key_id: str, store: StoreDep, caller: KeyAdmin) -> ApiKeyPublic:
    """Revoke a key: every API process refuses it (401) from its next request on. The record
    stays, with `revokedAt` and `revokedBy`, and an `api_key_revoked` event is written. A key
    revoked already is answered as it is, unchanged. Any key may be revoked, even the caller's
    own or the last admin one: a leaked key must always be revocable, and the bootstrap key
    (`JOBPLANE_ADMIN_KEY`, which no request can revoke) is the way back in."""
    revoked = await store.keys.revoke(key_id, caller.actor)
    if revoked is None:
        raise NotFound(f"API key {key_id!r} not found")
    return revoked
