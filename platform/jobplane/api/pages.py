"""Cursor pagination: a page of items and an opaque cursor to the next one."""

import base64
import binascii
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Protocol, TypeVar

from bson import ObjectId
from fastapi import Query

from jobplane.errors import ValidationFailed
from jobplane.model.answers import Page

T = TypeVar("T")
Limit = Annotated[int, Query(ge=1, le=500)]
# Cursors are unpadded URL-safe base64 (`_encode`): any other character is no cursor of ours.
Cursor = Annotated[str | None, Query(max_length=200, pattern=r"^[A-Za-z0-9_-]*$")]


def run_cursor(run_id: str) -> str:
    return _encode(run_id)


class Identified(Protocol):
    @property
    def id(self) -> str: ...


Item = TypeVar("Item", bound=Identified)


def newest_first(found: Sequence[Item], limit: int) -> "Page[Item]":
    """A page of what a store read newest first, `limit + 1` of it: the one beyond the page
    says there is more, and the page's last item is where the next starts."""
    items = list(found[:limit])
    more = len(found) > limit
    return Page(items=items, next_cursor=run_cursor(items[-1].id) if more else None)


def after_run(cursor: str) -> str:
    [run_id] = _decode(cursor, 1)
    return run_id


def event_cursor(at: datetime, event_id: str) -> str:
    return _encode(str(round(at.timestamp() * 1000)), event_id)


def after_event(cursor: str) -> tuple[datetime, str]:
    ms, event_id = _decode(cursor, 2)
    return datetime.fromtimestamp(int(ms) / 1000, tz=UTC), event_id


def _encode(*parts: str) -> str:
    return base64.urlsafe_b64encode("|".join(parts).encode()).decode().rstrip("=")


def _decode(cursor: str, parts: int) -> list[str]:
    """The parts of a cursor made here (the last one an id, any other a number)."""
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError):
        text = ""
    decoded = text.split("|")
    if (
        len(decoded) != parts
        or not ObjectId.is_valid(decoded[-1])
        # Milliseconds since 1970 have 13 digits until the year 2286.
        or not all(p.isdigit() and len(p) <= 13 for p in decoded[:-1])
    ):
        raise ValidationFailed(
            "invalid cursor", [{"pointer": "/cursor", "message": "not a cursor from this API"}]
        )
    return decoded
