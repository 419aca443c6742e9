"""Who is calling and what they may do: API keys, roles and scopes.

A key is `jp_<keyId>_<secret>`. MongoDB keeps the key's role, scopes and the SHA-256 of the
secret; the id finds the record and a constant-time comparison checks the secret. Every
request reads the record, with no cache: a revoked key is refused by every API process from its
next request on.
"""

import hashlib
import hmac
import secrets
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

from bson import ObjectId
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from jobplane.errors import Forbidden, NotFound, Unauthorized
from jobplane.model import ApiKey, Role, Run, Schedule
from jobplane.settings import Settings
from jobplane.store import Store


class Permission(StrEnum):
    TEMPLATES_READ = "templates:read"
    TEMPLATES_WRITE = "templates:write"
    RUNS_READ = "runs:read"
    RUNS_WRITE = "runs:write"
    EVENTS_READ = "events:read"
    SCHEDULES_READ = "schedules:read"
    SCHEDULES_WRITE = "schedules:write"
    KEYS_READ = "keys:read"
    KEYS_WRITE = "keys:write"
    # Claiming and finishing external steps: the work of any scope, so admin keys only.
    EXTERNAL_WORK = "external:work"
    # Queues' figures, and pausing and resuming them: every account's work, so admin only.
    QUEUES_READ = "queues:read"
    QUEUES_WRITE = "queues:write"
    WEBHOOKS_READ = "webhooks:read"
    WEBHOOKS_WRITE = "webhooks:write"


P = Permission
PERMISSIONS: dict[Role, frozenset[Permission]] = {
    "admin": frozenset(Permission),
    "author": frozenset({P.TEMPLATES_READ, P.TEMPLATES_WRITE}),
    # Users need to read templates to build payloads; runs and events only in their scopes.
    "user": frozenset(
        {
            P.TEMPLATES_READ,
            P.RUNS_READ,
            P.RUNS_WRITE,
            P.EVENTS_READ,
            P.SCHEDULES_READ,
            P.SCHEDULES_WRITE,
            P.WEBHOOKS_READ,
            P.WEBHOOKS_WRITE,
        }
    ),
    "auditor": frozenset(
        {P.TEMPLATES_READ, P.RUNS_READ, P.EVENTS_READ, P.SCHEDULES_READ, P.WEBHOOKS_READ}
    ),
}
# Roles that see every scope; the others see only the scopes on their key.
ALL_SCOPES: frozenset[Role] = frozenset({"admin", "auditor"})


@dataclass(frozen=True)
class Caller:
    name: str
    role: Role
    scopes: frozenset[tuple[str, str]] = frozenset()
    # What the trail calls it: a key is `user:<its name>`; a direct `Client` names itself.
    acting_as: str | None = None

    @property
    def actor(self) -> str:
        return self.acting_as or f"user:{self.name}"

    @property
    def within(self) -> list[tuple[str, str]] | None:
        """The scopes a query must be limited to, or None for all."""
        return None if self.role in ALL_SCOPES else sorted(self.scopes)

    def sees(self, scope: str, scope_id: str) -> bool:
        return self.role in ALL_SCOPES or (scope, scope_id) in self.scopes

    def may(self, permission: Permission) -> None:
        if permission not in PERMISSIONS[self.role]:
            raise Forbidden(f"a {self.role} key may not use {permission.value}")

    def may_act_in(self, scope: str, scope_id: str) -> None:
        if not self.sees(scope, scope_id):
            mine = sorted(f"{s}:{i}" for s, i in self.scopes)
            raise Forbidden(
                f"this key may not act in scope {scope}:{scope_id}; it may in {', '.join(mine)}"
            )

    def visible(self, run: Run) -> Run:
        """The run, if this caller may see it; otherwise it does not exist for them."""
        if not self.sees(run.scope, run.scope_id):
            raise NotFound(f"run {run.id!r} not found")
        return run

    def sees_schedule(self, schedule: Schedule) -> Schedule:
        if not self.sees(schedule.scope, schedule.scope_id):
            raise NotFound(f"schedule {schedule.id!r} not found")
        return schedule


def parse_scope(ref: str) -> tuple[str, str]:
    scope, _, scope_id = ref.partition(":")
    return scope, scope_id


def mint_key(
    name: str, role: Role, scopes: list[str], created_by: str, now: datetime
) -> tuple[str, ApiKey]:
    """A new key: the secret to hand out once, and the record to store."""
    key_id = str(ObjectId())
    secret = secrets.token_urlsafe(32)
    record = ApiKey(
        id=key_id,
        name=name,
        role=role,
        scopes=scopes,
        secret_hash=_digest(secret),
        created_by=created_by,
        create_at=now,
    )
    return f"jp_{key_id}_{secret}", record


# Puts the bearer key in the OpenAPI document; a missing one is refused below, in the
# contract's error shape.
_BEARER = HTTPBearer(auto_error=False)


async def authenticate(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
) -> Caller:
    # An app a direct `Client` serves in its own process acts for it, with no key to show.
    trusted: Caller | None = request.app.state.trusted
    if trusted is not None:
        return trusted
    if credentials is None:
        raise Unauthorized("missing bearer API key")
    presented = credentials.credentials
    settings: Settings = request.app.state.settings
    if settings.admin_key and hmac.compare_digest(presented.encode(), settings.admin_key.encode()):
        return Caller("admin", "admin")
    prefix, _, rest = presented.partition("_")
    key_id, _, secret = rest.partition("_")
    store: Store = request.app.state.store
    record = await store.keys.get(key_id) if prefix == "jp" and secret else None
    if record is None or not hmac.compare_digest(record.secret_hash, _digest(secret)):
        raise Unauthorized("unknown API key")
    # Said only to whoever holds the secret: a guesser learns nothing from it.
    if record.revoked_at is not None:
        raise Unauthorized(f"API key {record.name!r} was revoked")
    return Caller(record.name, record.role, frozenset(map(parse_scope, record.scopes)))


def require(permission: Permission) -> Callable[[Caller], Coroutine[Any, Any, Caller]]:
    """A dependency: the authenticated caller, if their role grants `permission`."""

    async def caller(who: Annotated[Caller, Depends(authenticate)]) -> Caller:
        who.may(permission)
        return who

    return caller


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()
