"""jobplane: versioned job templates, durable runs, cooperative workers.

Producers use `jobplane.Client` (async) or `jobplane.SyncClient`. They are loaded on first use,
so that importing any part of jobplane (a worker, the CLI) does not load the client's imports.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobplane.client import Client, CreateRequest, SyncClient

__all__ = ["Client", "CreateRequest", "SyncClient"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from jobplane import client

        return getattr(client, name)
    raise AttributeError(f"module 'jobplane' has no attribute {name!r}")
