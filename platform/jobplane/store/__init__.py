"""MongoDB, the source of truth: templates, runs, schedules and the event trail."""

from jobplane.store.mongo import (
    DuplicateRun,
    Known,
    Lease,
    Lost,
    MongoStore,
    Moved,
    NewRun,
)

__all__ = ["DuplicateRun", "Known", "Lease", "Lost", "MongoStore", "Moved", "NewRun"]
