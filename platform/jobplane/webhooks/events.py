"""Which trail events a webhook subscriber receives, under which names.

The trail names what a write did (`status_changed` by `claim`, `step_finished` with a status);
a subscriber asks for what happened to the run (`run.started`, `step.failed`). This is the one
place that translates. `run.progress` is no trail event: the notifier's feed brings progress
reports beside the trail (`store/feed.py`).
"""

from typing import Any

from jobplane.model.webhooks import WebhookEventType
from jobplane.store.feed import PROGRESS_REPORTED

# The trail's types that can become a webhook event: the notifier reads only these.
SOURCE_TYPES = ("created", "status_changed", "step_finished", "step_skipped")

_BY_TRANSITION: dict[str, WebhookEventType] = {
    "claim": "run.started",
    "claim_limited": "run.started",
    # A lost attempt (the reaper's requeue) is retried as an error's is.
    "retry": "run.retrying",
    "reap_requeue": "run.retrying",
}
_BY_END: dict[str, WebhookEventType] = {
    "succeeded": "run.succeeded",
    "failed": "run.failed",
    "cancelled": "run.cancelled",
    "expired": "run.expired",
}
_BY_STEP_END: dict[str, WebhookEventType] = {
    "succeeded": "step.succeeded",
    "failed": "step.failed",
}


def webhook_type(event: dict[str, Any]) -> WebhookEventType | None:
    """The webhook event a trail event (or a progress report of the notifier's feed) is, or
    None for one no subscriber receives."""
    kind, metadata = event["type"], event.get("metadata") or {}
    if kind == PROGRESS_REPORTED:
        return "run.progress"
    if kind == "created":
        return "run.created"
    if kind == "status_changed":
        by_transition = _BY_TRANSITION.get(metadata.get("transition", ""))
        return by_transition or _BY_END.get(event.get("to", ""))
    if kind == "step_finished":
        # A step's success is written without a status; a cancelled step is the run's news.
        return _BY_STEP_END.get(metadata.get("status", "succeeded"))
    if kind == "step_skipped":
        return "step.skipped"
    return None
