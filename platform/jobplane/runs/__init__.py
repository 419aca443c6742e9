"""Creating, cancelling and reading runs: the rules every entry point (API, CLI, client) shares."""

from jobplane.runs.service import RunRequest, RunService

__all__ = ["RunRequest", "RunService"]
