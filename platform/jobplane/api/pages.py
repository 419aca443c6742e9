"""Cursor pagination: a page of items and a cursor to the next one.

A cursor names the last item of its page: its id, and for an event its time as well. Its
pattern is in the document (`Cursor`, `EventCursor`), and every string that matches it is a
cursor: a page after the item it names, which need not exist (docs/contract.md, "Conventions").
"""

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Protocol, TypeVar

from fastapi import Query

from jobplane.model.answers import Page

T = TypeVar("T")
Limit = Annotated[int, Query(ge=1, le=500)]
# Ids are ObjectIds as `str(ObjectId())` writes them.
_ID = "[0-9a-f]{24}"
Cursor = Annotated[str | None, Query(pattern=f"^{_ID}$")]
# `<ms>-<id>`: milliseconds since 1970 have 13 digits until the year 2286.
EventCursor = Annotated[str | None, Query(pattern=f"^[0-9]{{1,13}}-{_ID}$")]


class Identified(Protocol):
    @property
    def id(self) -> str: ...


Item = TypeVar("Item", bound=Identified)


def newest_first(found: Sequence[Item], limit: int) -> "Page[Item]":
    """A page of what a store read newest first, `limit + 1` of it: the one beyond the page
    says there is more, and the page's last item is where the next starts."""
    items = list(found[:limit])
    more = len(found) > limit
    return Page(items=items, next_cursor=items[-1].id if more else None)


def event_cursor(at: datetime, event_id: str) -> str:
    return f"{round(at.timestamp() * 1000)}-{event_id}"


def after_event(cursor: str) -> tuple[datetime, str]:
    ms, event_id = cursor.split("-")
    return datetime.fromtimestamp(int(ms) / 1000, tz=UTC), event_id
