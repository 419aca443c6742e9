"""The one door tests have to jobplane's collections, behind the store's back.

Tests go through the store's methods wherever one does what they need. Some must do what no
method does, or should not trust the store to tell: put a run in a state no transition makes
(a table-walking test starts a run in every status), count or read what was written, build an
older version's indexes, profile a query. They reach the collections through `raw`, by the
names the store itself uses (`jobplane.store.database.Collections`); nothing else in the tests
names a collection of the store.
"""

from jobplane.store import MongoStore, Store
from jobplane.store.database import Collections


def raw(store: Store) -> Collections:
    """The collections of `store`'s database (a `MongoStore`, as every test's store is)."""
    assert isinstance(store, MongoStore), store
    return Collections.of(store.db)
