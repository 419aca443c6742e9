"""Errors a caller can act on, each with the code and HTTP status of SPEC.md's error list."""

from typing import Any


class JobplaneError(Exception):
    code = "Error"
    status = 500

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}


class Unauthorized(JobplaneError):
    code, status = "Unauthorized", 401


class Forbidden(JobplaneError):
    code, status = "Forbidden", 403


class NotFound(JobplaneError):
    code, status = "NotFound", 404


class ResourceInvalidState(JobplaneError):
    code, status = "ResourceInvalidState", 409


class ConcurrencyConflict(JobplaneError):
    code, status = "ConcurrencyConflict", 409

    def __init__(self, active_run_id: str | None) -> None:
        super().__init__(
            "an active run with the same dedupe key exists", {"activeRunId": active_run_id}
        )
        self.active_run_id = active_run_id


class TemplateDisabled(JobplaneError):
    code, status = "TemplateDisabled", 409


class PayloadTooLarge(JobplaneError):
    code, status = "PayloadTooLarge", 413


class ValidationFailed(JobplaneError):
    code, status = "ValidationFailed", 422

    def __init__(self, message: str, errors: list[dict[str, Any]]) -> None:
        """`errors` lists each bad field as `{"pointer": "/payload/x", "message": ...}`."""
        super().__init__(message, {"errors": errors})


class Unavailable(JobplaneError):
    code, status = "Unavailable", 503
