"""The keys a run's limits count it under: its dedupe key, its rate window and its locks.

Each is made of values the template names as dedupe parts (`scope`, `scopeId`, or a path into
the payload, `payload.partner`), written as canonical JSON so that equal values make equal
keys whatever their order or spacing in the request.
"""

import json
from collections.abc import Sequence
from typing import Any

from jobplane.model import LockSpec, Run, Template


def dedupe_key(
    template: Template, scope: str, scope_id: str, payload: dict[str, Any]
) -> str | None:
    """The key that keeps runs of one template apart, or None if any number may be active.

    Made of the template type, the run's scope and the values named by `dedupeKeys`. The scope
    is always part of it: the policies are per scope (`*_same_scope`), a conflict names a run
    holding the key, which must be one the caller may see, and the unique index that decides
    is per scope (it starts with the shard key). A template that is not `repeatable` always
    has one: its key must be held from creation to success, so two runs of it cannot both
    succeed.
    """
    if template.concurrency_policy == "allow" and template.repeatable:
        return None
    values = _values(template.dedupe_keys, scope, scope_id, payload)
    return _canonical([template.type, scope, scope_id, *values])


def rate_key(template: Template, scope: str, scope_id: str, payload: dict[str, Any]) -> str | None:
    """The window the run's starts count in: the template type, and the values of the rate
    limit's key parts when it names some (one window per value), or None without a limit."""
    limit = template.rate_limit
    if limit is None:
        return None
    return _canonical([template.type, *_values(limit.key or [], scope, scope_id, payload)])


def lock_id(lock: LockSpec, run: Run) -> str:
    """The lock a step's `locks` entry names for `run`."""
    return _lock_of(lock, run.scope, run.scope_id, run.payload)


def start_locks(
    template: Template, scope: str, scope_id: str, payload: dict[str, Any]
) -> list[str]:
    """The locks a new run's first steps take (the inline steps that need none), each once:
    its worker takes them beside its claim."""
    first = [s for s, needs in zip(template.steps, template.graph.needs, strict=True) if not needs]
    locks = [lock for s in first if s.worker_type == "inline" for lock in s.locks]
    return list(dict.fromkeys(_lock_of(lock, scope, scope_id, payload) for lock in locks))


def _lock_of(lock: LockSpec, scope: str, scope_id: str, payload: dict[str, Any]) -> str:
    """See `lock_named`."""
    return lock_named(lock.name, _values(lock.key, scope, scope_id, payload))


def lock_named(name: str, values: Sequence[Any]) -> str:
    """`<name>:<values of its key>`, or the name alone without a key. The name is the author's,
    so two templates (or a step and a handler's `ctx.lock`) naming one lock share it."""
    return f"{name}:{_canonical(list(values))}" if values else name


def _values(parts: Sequence[str], scope: str, scope_id: str, payload: dict[str, Any]) -> list[Any]:
    fields: dict[str, Any] = {"scope": scope, "scopeId": scope_id}
    return [_lookup(part, fields, payload) for part in parts]


def _lookup(part: str, fields: dict[str, Any], payload: dict[str, Any]) -> Any:
    if not part.startswith("payload."):
        return fields[part]
    value: Any = payload
    for name in part.split(".")[1:]:
        value = value.get(name) if isinstance(value, dict) else None
    return value


def _canonical(values: list[Any]) -> str:
    return json.dumps(values, sort_keys=True, separators=(",", ":"))
