"""Cron in a time zone, against instants worked out by hand (UTC offsets from the zones' rules)."""

from datetime import UTC, date, datetime, timedelta
from itertools import pairwise

import pytest

from jobplane.schedules.cron import Cron, CronError


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


@pytest.mark.parametrize(
    ("expression", "zone", "after", "expected"),
    [
        # New York springs forward on 2026-03-08 at 02:00 EST: 02:30 does not exist and fires
        # once, at the jump (03:00 EDT = 07:00 UTC).
        (
            "30 2 * * *",
            "America/New_York",
            "2026-03-07T00:00",
            ["2026-03-07T07:30", "2026-03-08T07:00", "2026-03-09T06:30"],
        ),
        # ...and falls back on 2026-11-01 at 02:00 EDT: 01:30 happens twice and fires once, at
        # the first (01:30 EDT = 05:30 UTC).
        (
            "30 1 * * *",
            "America/New_York",
            "2026-10-31T00:00",
            ["2026-10-31T05:30", "2026-11-01T05:30", "2026-11-02T06:30"],
        ),
        # Every half hour across the fall-back: the repeated hour's second pass does not fire.
        (
            "*/30 * * * *",
            "America/New_York",
            "2026-11-01T04:00",
            ["2026-11-01T04:30", "2026-11-01T05:00", "2026-11-01T05:30", "2026-11-01T07:00"],
        ),
        # Across the spring-forward: 02:00, 02:30 and 03:00 are all the instant of the jump.
        (
            "*/30 * * * *",
            "America/New_York",
            "2026-03-08T06:00",
            ["2026-03-08T06:30", "2026-03-08T07:00", "2026-03-08T07:30", "2026-03-08T08:00"],
        ),
        ("0 9 * * *", "Asia/Taipei", "2026-01-01T00:00", ["2026-01-01T01:00", "2026-01-02T01:00"]),
        # London: 01:00 on 2026-03-29 does not exist (GMT 01:00 → BST 02:00).
        (
            "0 1 * * *",
            "Europe/London",
            "2026-03-28T12:00",
            ["2026-03-29T01:00", "2026-03-30T00:00"],
        ),
        # London falls back on 2026-10-25 at 02:00 BST: 01:30 BST first.
        (
            "30 1 * * *",
            "Europe/London",
            "2026-10-24T12:00",
            ["2026-10-25T00:30", "2026-10-26T01:30"],
        ),
        (
            "0 12 * * *",
            "Asia/Kolkata",
            "2026-06-01T00:00",
            ["2026-06-01T06:30", "2026-06-02T06:30"],
        ),
        # Mondays in Tokyo; 2026-01-01 is a Thursday.
        ("0 9 * * 1", "Asia/Tokyo", "2026-01-01T00:00", ["2026-01-05T00:00", "2026-01-12T00:00"]),
        # Auckland leaves daylight time on 2026-04-05 at 03:00 NZDT (+13 → +12).
        (
            "@daily",
            "Pacific/Auckland",
            "2026-04-04T00:00",
            ["2026-04-04T11:00", "2026-04-05T12:00", "2026-04-06T12:00"],
        ),
        # Lord Howe moves by half an hour (02:00 → 02:30 on 2026-10-04, +10:30 → +11).
        (
            "0 2 * * *",
            "Australia/Lord_Howe",
            "2026-10-03T00:00",
            ["2026-10-03T15:30", "2026-10-04T15:00"],
        ),
        # Six fields: seconds come last.
        ("0 9 * * * 30", "UTC", "2026-01-01T00:00", ["2026-01-01T09:00:30", "2026-01-02T09:00:30"]),
        ("@hourly", "Europe/Berlin", "2026-01-01T00:10", ["2026-01-01T01:00", "2026-01-01T02:00"]),
    ],
)
def test_fire_times(expression: str, zone: str, after: str, expected: list[str]) -> None:
    fires = Cron.parse(expression, zone).upcoming(utc(after), len(expected))
    assert fires == [utc(t) for t in expected]


def test_taipei_nine_am_is_one_am_utc_every_day() -> None:
    fires = Cron.parse("0 9 * * *", "Asia/Taipei").upcoming(utc("2025-12-31T12:00"), 365)
    assert fires == [utc("2026-01-01T01:00") + timedelta(days=d) for d in range(365)]


def test_half_past_two_in_new_york_fires_once_on_every_day_of_a_dst_year() -> None:
    cron = Cron.parse("30 2 * * *", "America/New_York")
    fires = cron.upcoming(utc("2026-01-01T12:00"), 365)
    local = [f.astimezone(cron.zone) for f in fires]
    days = [t.date() for t in local]
    assert days == [date(2026, 1, 2) + timedelta(days=d) for d in range(365)]
    off_the_clock = {
        t.date(): t.strftime("%H:%M %Z") for t in local if t.strftime("%H:%M") != "02:30"
    }
    assert off_the_clock == {date(2026, 3, 8): "03:00 EDT"}


def test_fire_times_only_move_forward() -> None:
    cron = Cron.parse("*/15 * * * *", "America/New_York")
    fires = cron.upcoming(utc("2026-03-01T00:00"), 30_000)  # past both of 2026's changes
    assert all(a < b for a, b in pairwise(fires))
    assert fires[-1] > utc("2026-11-02T00:00")
    # Resuming from any fire time gives the same sequence.
    assert cron.upcoming(fires[9999], 5) == fires[10000:10005]


@pytest.mark.parametrize(
    ("expression", "zone"),
    [
        ("61 * * * *", "UTC"),
        ("* * *", "UTC"),
        ("* * * * * * *", "UTC"),
        ("@sometimes", "UTC"),
        ("", "UTC"),
        ("0 9 * * *", "Mars/Olympus_Mons"),
        ("0 9 * * *", "../../etc/passwd"),
    ],
)
def test_bad_expressions_and_zones_are_refused(expression: str, zone: str) -> None:
    with pytest.raises(CronError):
        Cron.parse(expression, zone)


@pytest.mark.parametrize(
    ("expression", "says"),
    [
        ("61 * * * *", "the minute field '61' is not 0-59"),
        ("0 25 * * *", "the hour field '25' is not 0-23"),
        ("0 0 * 13 *", "the month field '13' is not 1-12 or jan-dec"),
        ("0 0 * * * 61", "the seconds field '61' is not 0-59"),
        ("0 0 1", "has 3 fields: a cron expression has 5"),
    ],
)
def test_a_refused_expression_says_which_field_is_wrong(expression: str, says: str) -> None:
    with pytest.raises(CronError) as refused:
        Cron.parse(expression, "UTC")
    assert says in str(refused.value) and str(refused.value).count(expression) == 1
