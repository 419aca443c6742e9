"""Time, injectable so tests can move it without sleeping."""

from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime: ...


def as_stored(t: datetime) -> datetime:
    """`t` in UTC to the millisecond, as a BSON date keeps it: reads then equal what was
    written."""
    t = t.astimezone(UTC)
    return t.replace(microsecond=t.microsecond // 1000 * 1000)


class SystemClock:
    def now(self) -> datetime:
        # `as_stored` without its conversion: this is UTC already, and workers ask often.
        t = datetime.now(UTC)
        return t.replace(microsecond=t.microsecond // 1000 * 1000)


class ManualClock:
    """A clock that only moves when told to."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or SystemClock().now()

    def now(self) -> datetime:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += timedelta(seconds=seconds)
