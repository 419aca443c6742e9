"""MongoDB, the source of truth: templates, runs and their transitions, schedules, API keys and
the event trail, each behind an interface of `abc.py`."""

from jobplane.store.abc import (
    KeyStore,
    LeaseStore,
    LockStore,
    MaintenanceStore,
    OverviewStore,
    QueueStore,
    RunStore,
    ScheduleStore,
    Store,
    TemplateStore,
    TrailStore,
    TransitionStore,
)
from jobplane.store.mongo import MongoStore
from jobplane.store.types import (
    DuplicateRun,
    EventQuery,
    KeyHeld,
    Known,
    Lease,
    Lost,
    Moved,
    NewRun,
    NotSharded,
    RunQuery,
    ScheduleQuery,
)

__all__ = [
    "DuplicateRun",
    "EventQuery",
    "KeyHeld",
    "KeyStore",
    "Known",
    "Lease",
    "LeaseStore",
    "LockStore",
    "Lost",
    "MaintenanceStore",
    "MongoStore",
    "Moved",
    "NewRun",
    "NotSharded",
    "OverviewStore",
    "QueueStore",
    "RunQuery",
    "RunStore",
    "ScheduleQuery",
    "ScheduleStore",
    "Store",
    "TemplateStore",
    "TrailStore",
    "TransitionStore",
]
