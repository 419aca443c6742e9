"""The data model: documents, statuses and the transition table."""

from jobplane.model.documents import (
    CancelPolicy,
    Event,
    Progress,
    RetryPolicy,
    Run,
    RunError,
    Scope,
    StepProgress,
    StepSpec,
    Template,
    TemplateSpec,
)
from jobplane.model.status import (
    ACTIVE,
    ALLOWED,
    CLAIMABLE,
    LEASED,
    TERMINAL,
    TRANSITIONS,
    RunStatus,
    StepStatus,
    Transition,
)

__all__ = [
    "ACTIVE",
    "ALLOWED",
    "CLAIMABLE",
    "LEASED",
    "TERMINAL",
    "TRANSITIONS",
    "CancelPolicy",
    "Event",
    "Progress",
    "RetryPolicy",
    "Run",
    "RunError",
    "RunStatus",
    "Scope",
    "StepProgress",
    "StepSpec",
    "StepStatus",
    "Template",
    "TemplateSpec",
    "Transition",
]
