"""Cron in a time zone: when a schedule fires, as UTC instants, correct across DST changes.

croniter walks the schedule's wall clock (naive local times, plain calendar arithmetic); each
wall time is then placed on the time line of the schedule's zone by these rules:

- a wall time that occurs once is that instant;
- a wall time that does not exist (the clock jumped over it, spring forward) fires once, at the
  first instant after the gap, the moment the clock jumped;
- a wall time that occurs twice (fall back) fires once, at its first occurrence.

Several wall times in one gap land on the same instant and fire once; a fire time is always
strictly later than the one before. Fire times end with year 9999, as Python's dates do.
"""

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import islice
from zoneinfo import ZoneInfo, available_timezones

from croniter import CroniterBadDateError, croniter

# Aliases croniter understands; anything else must be 5 fields, or 6 with seconds last.
ALIASES = frozenset(
    {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}
)
# Names among the tz files that stand for no place: the machine's own zone (`localtime`), the
# rules for POSIX TZ strings (`posixrules`, which `available_timezones` leaves out already) and
# tzdata's zone for a machine not yet set up (`Factory`, "-00").
_NOT_PLACES = frozenset({"localtime", "posixrules", "Factory"})
# Walls are placed from here on: a zone's reading of an earlier instant may fall before year 1.
_EARLIEST = datetime(1, 1, 2, tzinfo=UTC)


@functools.cache
def _zones() -> frozenset[str]:
    """The IANA zone names this machine knows: the `tzdata` package's list and the system's tz
    files (read once, since it opens each of them)."""
    return frozenset(available_timezones()) - _NOT_PLACES


class CronError(ValueError):
    """An expression or time zone that cannot make a schedule; the message says why, and
    `field` which of the two (`cron` or `timezone`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# Each field's name and values, in the order of an expression (seconds come last).
_FIELDS = (
    ("minute", "0-59"),
    ("hour", "0-23"),
    ("day", "1-31"),
    ("month", "1-12 or jan-dec"),
    ("weekday", "0-7 or sun-sat"),
    ("seconds", "0-59"),
)


def _fault(fields: list[str]) -> str:
    """Which field of an expression croniter refuses, and what it takes."""
    for index, value in enumerate(fields):
        alone = " ".join(value if i == index else "*" for i in range(len(fields)))
        if not croniter.is_valid(alone):
            name, values = _FIELDS[index]
            return (
                f"the {name} field {value!r} is not {values}, *, or a list, range or step of them"
            )
    return "its fields cannot all hold at once"


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
        elif len(fields) not in (5, 6):
            raise CronError(
                "cron",
                f"{expression!r} has {len(fields)} field{'s' * (len(fields) != 1)}: a cron "
                "expression has 5 (minute hour day month weekday), 6 with seconds last, or is "
                "an alias such as @daily",
            )
        elif not croniter.is_valid(text):
            raise CronError("cron", f"{expression!r} is not a cron expression: {_fault(fields)}")
        # Only names from the list: ZoneInfo would also open paths and folders of tz files.
        if timezone not in _zones():
            raise CronError("timezone", f"{timezone!r} is not an IANA time zone (e.g. Asia/Taipei)")
        cron = cls(text, ZoneInfo(timezone))
        try:
            cron.next_after(datetime.now(UTC))
        except CroniterBadDateError as exc:
            raise CronError("cron", f"{expression!r} never fires (no date matches it)") from exc
        return cron

    def next_after(self, instant: datetime) -> datetime:
        """The first fire time strictly after `instant` (aware), in UTC."""
        for fire in self._fires(instant):
            return fire
        raise CronError("cron", f"no fire time after {instant.isoformat()} before year 10000")

    def upcoming(self, after: datetime, count: int) -> list[datetime]:
        """The next `count` fire times after `after`, in UTC; fewer near the end of year 9999."""
        return list(islice(self._fires(after), count))

    def _fires(self, after: datetime) -> Iterator[datetime]:
        after = max(after.astimezone(UTC), _EARLIEST)
        try:
            start = after.astimezone(self.zone).replace(tzinfo=None)
        except OverflowError:
            return  # in this zone `after` reads past year 9999
        # No wall time before `after`'s own reading can fire after it: gap times fire at the
        # jump, which reads as the gap's end, and repeated times fire at their first pass.
        walls = croniter(self.expression, start)
        last = after
        while True:
            try:
                instant = self._place(walls.get_next(datetime))
            except CroniterBadDateError:
                raise  # no date matches the expression at all
            except (OverflowError, ValueError):
                return  # the next wall time, or its UTC reading, is past year 9999
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
