"""`SyncClient`: `Client`'s calls, blocking, for scripts and sync web apps.

One private event loop, in a daemon thread, runs every call: a SyncClient may be shared by
many threads, and their concurrent calls share connections (and, direct, MongoDB writes).
Each async namespace has its blocking twin here, with the same names and arguments; a list
the async one iterates over is iterated here too, a page read as the loop reaches it.
"""

import asyncio
import builtins
import contextlib
import os
import sys
import threading
from collections.abc import AsyncIterator, Coroutine, Iterable, Iterator, Mapping
from datetime import datetime
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

from jobplane.client.request import CreateRequest
from jobplane.client.resources import Defined, Events, Keys, Schedules, Templates
from jobplane.client.runs import Runs
from jobplane.errors import JobplaneError
from jobplane.model import ApiKeyPublic, Event, Role, Run, RunStatus, Schedule, Scope, Template
from jobplane.model.answers import KeyCreated, Preview, Registered

T = TypeVar("T")
# How long a list left early may take to let go of its page (its generator's `aclose`).
CLOSE_SECONDS = 5.0


class _Loop:
    """The private loop and its thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="jobplane-client", daemon=True
        )
        self._thread.start()

    def call(self, call: Coroutine[Any, Any, T]) -> T:
        if self.loop.is_closed():
            call.close()  # never started: without this Python warns it was never awaited
            raise RuntimeError("this SyncClient is closed")
        future = asyncio.run_coroutine_threadsafe(call, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted (Ctrl-C): do not leave the call running
            raise

    def iterate(self, items: AsyncIterator[T]) -> Iterator[T]:
        async def following() -> T:
            return await anext(items)

        try:
            while True:
                try:
                    yield self.call(following())
                except StopAsyncIteration:
                    return
        finally:  # left early: the async iterator lets go of what it holds
            closing = getattr(items, "aclose", None)
            # Not at the interpreter's exit (the loop's thread is stopped then), nor for long.
            if closing is not None and not self.loop.is_closed() and not sys.is_finalizing():
                done = asyncio.run_coroutine_threadsafe(closing(), self.loop)
                with contextlib.suppress(Exception):
                    done.result(CLOSE_SECONDS)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class SyncRuns:
    def __init__(self, runs: Runs, loop: _Loop) -> None:
        self._runs, self._loop = runs, loop

    def create(
        self,
        template_type: str,
        *,
        scope: Scope,
        scope_id: str,
        payload: dict[str, Any] | None = None,
        template_version: int | None = None,
        priority: int | None = None,
        delay_seconds: float | None = None,
        not_before: datetime | None = None,
        idempotency_key: str | None = None,
    ) -> Run:
        """See `Client.runs.create`."""
        return self._loop.call(
            self._runs.create(
                template_type,
                scope=scope,
                scope_id=scope_id,
                payload=payload,
                template_version=template_version,
                priority=priority,
                delay_seconds=delay_seconds,
                not_before=not_before,
                idempotency_key=idempotency_key,
            )
        )

    def create_many(
        self, requests: Iterable[CreateRequest | Mapping[str, Any]]
    ) -> builtins.list[Run | JobplaneError]:
        """See `Client.runs.create_many`."""
        return self._loop.call(self._runs.create_many(builtins.list(requests)))

    def get(self, run_id: str) -> Run:
        return self._loop.call(self._runs.get(run_id))

    def cancel(self, run_id: str, reason: str | None = None) -> Run:
        return self._loop.call(self._runs.cancel(run_id, reason))

    def wait(self, run_id: str, timeout: float | None = None, poll: float = 0.02) -> Run:
        return self._loop.call(self._runs.wait(run_id, timeout, poll))

    def wait_many(
        self, run_ids: Iterable[str], timeout: float | None = None, poll: float = 0.02
    ) -> builtins.list[Run]:
        return self._loop.call(self._runs.wait_many(builtins.list(run_ids), timeout, poll))

    def list(
        self,
        *,
        status: RunStatus | str | None = None,
        template_type: str | None = None,
        scope: Scope | None = None,
        scope_id: str | None = None,
        schedule_id: str | None = None,
        parent_run_id: str | None = None,
    ) -> Iterator[Run]:
        return self._loop.iterate(
            self._runs.list(
                status=status,
                template_type=template_type,
                scope=scope,
                scope_id=scope_id,
                schedule_id=schedule_id,
                parent_run_id=parent_run_id,
            )
        )


class SyncTemplates:
    def __init__(self, templates: Templates, loop: _Loop) -> None:
        self._templates, self._loop = templates, loop

    def apply(self, template: Defined | Mapping[str, Any] | str | os.PathLike[str]) -> Registered:
        return self._loop.call(self._templates.apply(template))

    def get(self, type_: str, version: int | None = None) -> Template:
        return self._loop.call(self._templates.get(type_, version))

    def list(self) -> builtins.list[Template]:
        return self._loop.call(self._templates.list())


class SyncSchedules:
    def __init__(self, schedules: Schedules, loop: _Loop) -> None:
        self._schedules, self._loop = schedules, loop

    def create(
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
        return self._loop.call(
            self._schedules.create(
                template_type,
                cron=cron,
                scope=scope,
                scope_id=scope_id,
                timezone=timezone,
                payload_template=payload_template,
                enabled=enabled,
                misfire_policy=misfire_policy,
                catch_up_limit=catch_up_limit,
                overlap_policy=overlap_policy,
            )
        )

    def get(self, schedule_id: str) -> Schedule:
        return self._loop.call(self._schedules.get(schedule_id))

    def update(self, schedule_id: str, **changes: Any) -> Schedule:
        return self._loop.call(self._schedules.update(schedule_id, **changes))

    def delete(self, schedule_id: str) -> None:
        self._loop.call(self._schedules.delete(schedule_id))

    def preview(self, schedule_id: str, count: int = 10, after: datetime | None = None) -> Preview:
        return self._loop.call(self._schedules.preview(schedule_id, count, after))

    def trigger(self, schedule_id: str) -> Run:
        return self._loop.call(self._schedules.trigger(schedule_id))

    def list(
        self,
        *,
        template_type: str | None = None,
        scope: Scope | None = None,
        scope_id: str | None = None,
        enabled: bool | None = None,
    ) -> Iterator[Schedule]:
        return self._loop.iterate(
            self._schedules.list(
                template_type=template_type, scope=scope, scope_id=scope_id, enabled=enabled
            )
        )


class SyncEvents:
    def __init__(self, events: Events, loop: _Loop) -> None:
        self._events, self._loop = events, loop

    def list(
        self,
        *,
        job_id: str | None = None,
        type: str | None = None,
        scope: Scope | None = None,
        scope_id: str | None = None,
        actor: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> Iterator[Event]:
        return self._loop.iterate(
            self._events.list(
                job_id=job_id,
                type=type,
                scope=scope,
                scope_id=scope_id,
                actor=actor,
                since=since,
                until=until,
            )
        )


class SyncKeys:
    def __init__(self, keys: Keys, loop: _Loop) -> None:
        self._keys, self._loop = keys, loop

    def create(self, name: str, *, role: Role, scopes: Iterable[str] = ()) -> KeyCreated:
        return self._loop.call(self._keys.create(name, role=role, scopes=builtins.list(scopes)))

    def revoke(self, key_id: str) -> ApiKeyPublic:
        return self._loop.call(self._keys.revoke(key_id))

    def list(self) -> Iterator[ApiKeyPublic]:
        return self._loop.iterate(self._keys.list())


class SyncClient:
    """`Client`'s namespaces and calls, blocking; takes `Client`'s arguments."""

    def __init__(self, url: str | None = None, **options: Any) -> None:
        from jobplane.client import Client

        self._client: Client = Client(url, **options)
        self._loop = _Loop()
        self._closing = threading.Lock()
        self.runs = SyncRuns(self._client.runs, self._loop)
        self.templates = SyncTemplates(self._client.templates, self._loop)
        self.schedules = SyncSchedules(self._client.schedules, self._loop)
        self.events = SyncEvents(self._client.events, self._loop)
        self.keys = SyncKeys(self._client.keys, self._loop)
        # The calls of the first `SyncClient`, kept: the same as `runs`'.
        self.create = self.runs.create
        self.create_many = self.runs.create_many
        self.get = self.runs.get
        self.cancel = self.runs.cancel
        self.wait = self.runs.wait

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections and stop the loop's thread; calling it again does nothing."""
        with self._closing:
            if self._loop.loop.is_closed():
                return
            try:
                self._loop.call(self._client.close())
            finally:
                self._loop.stop()
