"""MongoDB, the source of truth: templates, runs, schedules and the event trail."""

from jobplane.store.mongo import (
    DuplicateRun,
    EventQuery,
    KeyHeld,
    Known,
    Lease,
    Lost,
    MongoStore,
    Moved,
    NewRun,
    RunQuery,
    ScheduleQuery,
)

__all__ = [
    "DuplicateRun",
    "EventQuery",
    "KeyHeld",
    "Known",
    "Lease",
    "Lost",
    "MongoStore",
    "Moved",
    "NewRun",
    "RunQuery",
    "ScheduleQuery",
]
