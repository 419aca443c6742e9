"""Schedules: cron in an account's time zone, validated when written, never when fired."""

from jobplane.schedules.service import ScheduleService, render_payload

__all__ = ["ScheduleService", "render_payload"]
