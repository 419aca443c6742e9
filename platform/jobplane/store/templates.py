"""Templates: versioned, immutable definitions, and the short cache creates read them through."""

import asyncio
import time

from pymongo import DESCENDING
from pymongo.errors import DuplicateKeyError

from jobplane.clock import Clock
from jobplane.model import Template, TemplateSpec
from jobplane.store import convert
from jobplane.store.convert import Doc
from jobplane.store.database import Collections

# How long a process creating runs trusts a template it read (see `cached`).
TEMPLATE_CACHE_SECONDS = 1.0


class MongoTemplateStore:
    def __init__(self, db: Collections, clock: Clock) -> None:
        self._db = db
        self._clock = clock
        self._cache: dict[tuple[str, int | None], tuple[float, Template]] = {}
        self._reading: dict[tuple[str, int | None], asyncio.Future[Template | None]] = {}

    async def register(self, spec: TemplateSpec) -> tuple[Template, bool]:
        """Store `spec` as the next version of its type; an unchanged spec returns the latest.

        Returns the template and whether a new version was created. Two authors registering at
        once race on the unique (type, version) index; the loser re-reads and tries again.
        """
        definition = _definition(spec)
        while True:
            latest = await self.get(spec.type)
            if latest is not None and _definition(latest) == definition:
                return latest, False
            now = self._clock.now()
            doc = spec.model_dump(by_alias=True, mode="json")
            doc |= {
                "version": latest.version + 1 if latest else 1,
                "enabled": latest.enabled if latest else spec.enabled,
                "createAt": now,
                "updateAt": now,
            }
            try:
                await self._db.templates.insert_one(doc)
            except DuplicateKeyError:
                continue
            self._cache.clear()
            return convert.template(doc), True

    async def get(self, type_: str, version: int | None = None) -> Template | None:
        """A version of a template type; without `version`, the latest."""
        query: Doc = {"type": type_}
        if version is not None:
            query["version"] = version
        doc = await self._db.templates.find_one(query, sort=[("version", DESCENDING)])
        return convert.template(doc) if doc else None

    async def cached(self, type_: str, version: int | None = None) -> Template | None:
        """`get` for creating runs, read at most once per `TEMPLATE_CACHE_SECONDS`.

        A version's definition never changes; only `enabled` and the latest version can, so
        another process's disable or new version is seen here within that time (this process's
        own at once).
        """
        key = (type_, version)
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is not None and now - cached[0] < TEMPLATE_CACHE_SECONDS:
            return cached[1]
        # Creates that miss together share one read: at each expiry a busy process had every
        # concurrent caller send its own (a tenth of its MongoDB requests per run at 32 callers).
        reading = self._reading.get(key)
        if reading is None:
            reading = asyncio.ensure_future(self._read(key, now))
            self._reading[key] = reading
            reading.add_done_callback(lambda done: self._reading.pop(key, None))
        # A caller cancelled does not cancel the read the others wait for.
        return await asyncio.shield(reading)

    async def _read(self, key: tuple[str, int | None], at: float) -> Template | None:
        template = await self.get(*key)
        if template is not None:  # one registered meanwhile is found at once
            self._cache[key] = (at, template)
        return template

    async def latest(self) -> list[Template]:
        """The latest version of every template type, by type."""
        cursor = await self._db.templates.aggregate(
            [
                {"$sort": {"type": 1, "version": -1}},
                {"$group": {"_id": "$type", "doc": {"$first": "$$ROOT"}}},
                {"$replaceWith": "$doc"},
                {"$sort": {"type": 1}},
            ]
        )
        return [convert.template(d) async for d in cursor]

    async def queues(self) -> list[str]:
        """Every queue a template version names (a run keeps the queue of its version)."""
        return sorted(await self._db.templates.distinct("queue"))

    async def set_enabled(self, type_: str, enabled: bool) -> Template | None:
        """Enable or disable a template type. `enabled` is not part of a version's definition,
        so it is set on every version: a run pinned to an old version is refused too."""
        now = self._clock.now()
        result = await self._db.templates.update_many(
            {"type": type_}, {"$set": {"enabled": enabled, "updateAt": now}}
        )
        self._cache.clear()
        return await self.get(type_) if result.matched_count else None


def _definition(spec: TemplateSpec) -> Doc:
    """What makes two registrations the same version: everything an author wrote but `enabled`."""
    fields = set(TemplateSpec.model_fields) - {"enabled"}
    return spec.model_dump(by_alias=True, mode="json", include=fields)
