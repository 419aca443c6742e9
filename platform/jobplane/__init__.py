"""jobplane: versioned job templates, durable runs, cooperative workers.

Producers use `jobplane.Client` (async) or `jobplane.SyncClient`; applications define templates
in code with `jobplane.Template` and `jobplane.Step`. They are loaded on first use, so that
importing any part of jobplane (a worker, the CLI) does not load their imports.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobplane.client import Client, CreateRequest, SyncClient
    from jobplane.templates.code import Step, Template

__all__ = ["Client", "CreateRequest", "Step", "SyncClient", "Template"]

_HOMES = {
    "Client": "jobplane.client",
    "CreateRequest": "jobplane.client",
    "SyncClient": "jobplane.client",
    "Step": "jobplane.templates.code",
    "Template": "jobplane.templates.code",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'jobplane' has no attribute {name!r}")
