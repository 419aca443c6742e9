"""Cron in a time zone: when a schedule fires, as UTC instants, correct across DST changes.

croniter walks the schedule's wall clock (naive local times, plain calendar arithmetic); each
wall time is then placed on the time line of the schedule's zone by these rules:

- a wall time that occurs once is that instant;
- a wall time that does not exist (the clock jumped over it, spring forward) fires once, at the
  first instant after the gap, the moment the clock jumped;
- a wall time that occurs twice (fall back) fires once, at its first occurrence.

Several wall times in one gap land on the same instant and fire once; a fire time is always
strictly later than the one before.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter

# Aliases croniter understands; anything else must be 5 fields, or 6 with seconds last.
ALIASES = frozenset(
    {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}
)


class CronError(ValueError):
    """An expression or time zone that cannot make a schedule; the message says why, and
    `field` which of the two (`cron` or `timezone`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Cron:
    expression: str
    zone: ZoneInfo

    @classmethod
    def parse(cls, expression: str, timezone: str) -> "Cron":
        text = " ".join(expression.split())
        fields = text.split(" ")
        if text.lower() in ALIASES:
            text = text.lower()
        elif len(fields) not in (5, 6) or not croniter.is_valid(text):
            raise CronError(
                "cron",
                f"{expression!r} is not a cron expression: 5 fields (minute hour day month "
                "weekday), 6 with seconds last, or an alias such as @daily",
            )
        try:
            zone = ZoneInfo(timezone)
        except (ZoneInfoNotFoundError, ValueError, OSError) as exc:  # OSError: a tzdata folder
            raise CronError(
                "timezone", f"{timezone!r} is not an IANA time zone (e.g. Asia/Taipei)"
            ) from exc
        cron = cls(text, zone)
        try:
            cron.next_after(datetime.now(UTC))
        except CroniterBadDateError as exc:
            raise CronError("cron", f"{expression!r} never fires (no date matches it)") from exc
        return cron

    def next_after(self, instant: datetime) -> datetime:
        """The first fire time strictly after `instant` (aware), in UTC."""
        return next(self._fires(instant))

    def upcoming(self, after: datetime, count: int) -> list[datetime]:
        """The next `count` fire times after `after`, in UTC."""
        fires = self._fires(after)
        return [next(fires) for _ in range(count)]

    def _fires(self, after: datetime) -> Iterator[datetime]:
        after = after.astimezone(UTC)
        # No wall time before `after`'s own reading can fire after it: gap times fire at the
        # jump, which reads as the gap's end, and repeated times fire at their first pass.
        walls = croniter(self.expression, after.astimezone(self.zone).replace(tzinfo=None))
        last = after
        while True:
            instant = self._place(walls.get_next(datetime))
            if instant > last:
                last = instant
                yield instant

    def _place(self, wall: datetime) -> datetime:
        """The UTC instant a wall time of this zone fires at (the module's rules)."""
        first = wall.replace(tzinfo=self.zone, fold=0).astimezone(UTC)
        if first.astimezone(self.zone).replace(tzinfo=None) == wall:
            return first  # it exists; fold=0 is its first (or only) occurrence
        # In a gap. fold=0 reads the wall time with the offset before the jump and fold=1
        # with the one after, so the jump lies between the two readings: find it.
        low = wall.replace(tzinfo=self.zone, fold=1).astimezone(UTC)
        high = first
        low, high = min(low, high), max(low, high)
        while high - low > timedelta(seconds=1):
            middle = low + (high - low) / 2
            if middle.astimezone(self.zone).replace(tzinfo=None) >= wall:
                high = middle
            else:
                low = middle
        return high.replace(microsecond=0)
