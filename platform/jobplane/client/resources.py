"""`client.templates`, `client.schedules`, `client.events` and `client.keys`: the rest of the
HTTP API, as `docs/contract.md` describes each call."""

import asyncio
import builtins
import os
from collections.abc import AsyncIterator, Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import quote

from pydantic import TypeAdapter
from pydantic.alias_generators import to_camel

from jobplane.client.http import read
from jobplane.client.transport import Opened, every
from jobplane.model import ApiKeyPublic, Event, Role, Run, Schedule, Scope, Template
from jobplane.model.answers import KeyCreated, Preview, Registered


class Defined(Protocol):
    """A template defined in code (`jobplane.Template`)."""

    def body(self) -> dict[str, Any]: ...


_TEMPLATES = TypeAdapter(builtins.list[Template])


class Templates:
    def __init__(self, opened: Opened) -> None:
        self._opened = opened

    async def apply(
        self, template: Defined | Mapping[str, Any] | str | os.PathLike[str]
    ) -> Registered:
        """Register a template: a `jobplane.Template`, a dict as the file form has it, or a
        YAML/JSON file. A definition equal to the latest version makes none (`created` is
        False and that version is answered); `warnings` names each handler no live worker
        offers."""
        kwargs: dict[str, Any]
        if isinstance(template, Mapping):
            kwargs = {"json": dict(template)}
        elif isinstance(template, str | os.PathLike):
            path = Path(template)
            kind = "application/json" if path.suffix == ".json" else "application/yaml"
            content = await asyncio.to_thread(path.read_bytes)
            kwargs = {"content": content, "headers": {"content-type": kind}}
        else:
            kwargs = {"json": template.body()}
        transport = await self._opened()
        return read(Registered, await transport.call("POST", "/v1/templates", **kwargs))

    async def get(self, type_: str, version: int | None = None) -> Template:
        """The template's latest version, or the one given; `NotFound` if none."""
        path = f"/v1/templates/{quote(type_, safe='')}"
        if version is not None:
            path += f"/versions/{version}"
        return read(Template, await (await self._opened()).call("GET", path))

    async def list(self) -> builtins.list[Template]:
        """The latest version of every template."""
        response = await (await self._opened()).call("GET", "/v1/templates")
        return _TEMPLATES.validate_json(response.content)


class Schedules:
    def __init__(self, opened: Opened) -> None:
        self._opened = opened

    async def create(
        self,
        template_type: str,
        *,
        cron: str,
        scope: Scope,
        scope_id: str,
        timezone: str | None = None,
        payload_template: dict[str, Any] | None = None,
        enabled: bool | None = None,
        misfire_policy: Literal["skip", "run_once", "catch_up"] | None = None,
        catch_up_limit: int | None = None,
        overlap_policy: Literal["allow", "skip", "queue"] | None = None,
    ) -> Schedule:
        """A schedule of `template_type` on `cron`, in `timezone` (IANA, default UTC);
        everything a fire needs is checked now (`ValidationFailed`, `NotFound`)."""
        body = _camel(
            templateType=template_type,
            cron=cron,
            scope=scope,
            scopeId=scope_id,
            timezone=timezone,
            payloadTemplate=payload_template,
            enabled=enabled,
            misfirePolicy=misfire_policy,
            catchUpLimit=catch_up_limit,
            overlapPolicy=overlap_policy,
        )
        return await self._schedule("POST", "/v1/schedules", json=body)

    async def get(self, schedule_id: str) -> Schedule:
        return await self._schedule("GET", _path(schedule_id))

    async def update(self, schedule_id: str, **changes: Any) -> Schedule:
        """Change fields, named as `create` names them (`enabled=False` pauses it); its next
        fire time is computed again from now."""
        return await self._schedule("PATCH", _path(schedule_id), json=_camel(**changes))

    async def delete(self, schedule_id: str) -> None:
        await (await self._opened()).call("DELETE", _path(schedule_id))

    async def preview(
        self, schedule_id: str, count: int = 10, after: datetime | None = None
    ) -> Preview:
        """The next `count` fire times after `after` (default now), in UTC and in its zone."""
        params = _camel(count=count, after=after)
        response = await (await self._opened()).call(
            "GET", f"{_path(schedule_id)}/preview", params=params
        )
        return read(Preview, response)

    async def trigger(self, schedule_id: str) -> Run:
        """A run now, with the schedule's payload template."""
        response = await (await self._opened()).call("POST", f"{_path(schedule_id)}/trigger")
        return read(Run, response)

    async def list(
        self,
        *,
        template_type: str | None = None,
        scope: Scope | None = None,
        scope_id: str | None = None,
        enabled: bool | None = None,
    ) -> AsyncIterator[Schedule]:
        """Every schedule under the filters, newest first (a user key's: its own scopes)."""
        params = _camel(templateType=template_type, scope=scope, scopeId=scope_id, enabled=enabled)
        async for schedule in every(self._opened, "/v1/schedules", params, Schedule):
            yield schedule

    async def _schedule(self, method: str, path: str, **kwargs: Any) -> Schedule:
        return read(Schedule, await (await self._opened()).call(method, path, **kwargs))


class Events:
    def __init__(self, opened: Opened) -> None:
        self._opened = opened

    async def list(
        self,
        *,
        job_id: str | None = None,
        type: str | None = None,
        scope: Scope | None = None,
        scope_id: str | None = None,
        actor: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> AsyncIterator[Event]:
        """The audit trail under the filters, oldest first (`since` inclusive, `until`
        exclusive; a user key's: its own scopes)."""
        params = _camel(jobId=job_id, type=type, scope=scope, scopeId=scope_id, actor=actor)
        params |= _camel(**{"from": since, "to": until})
        async for event in every(self._opened, "/v1/events", params, Event):
            yield event


class Keys:
    """API keys; an admin's calls."""

    def __init__(self, opened: Opened) -> None:
        self._opened = opened

    async def create(self, name: str, *, role: Role, scopes: Iterable[str] = ()) -> KeyCreated:
        """A new key; its secret, `key`, is answered this once. A user key needs scopes
        (`user:alice`, `account:acme`), the other roles none."""
        body = {"name": name, "role": role, "scopes": builtins.list(scopes)}
        return read(
            KeyCreated, await (await self._opened()).call("POST", "/v1/api-keys", json=body)
        )

    async def revoke(self, key_id: str) -> ApiKeyPublic:
        """Every API process refuses the key from its next request on."""
        path = f"/v1/api-keys/{quote(key_id, safe='')}"
        return read(ApiKeyPublic, await (await self._opened()).call("DELETE", path))

    async def list(self) -> AsyncIterator[ApiKeyPublic]:
        """Every stored key, newest first, revoked ones too; never a secret."""
        async for key in every(self._opened, "/v1/api-keys", {}, ApiKeyPublic):
            yield key


def _path(schedule_id: str) -> str:
    return f"/v1/schedules/{quote(schedule_id, safe='')}"


def _camel(**fields: Any) -> dict[str, Any]:
    """The fields given (None is not given), camelCase, times as ISO 8601."""
    return {
        to_camel(name): value.isoformat() if isinstance(value, datetime) else value
        for name, value in fields.items()
        if value is not None
    }
