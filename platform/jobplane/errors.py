"""Errors a caller can act on, each with the code and HTTP status of the error list in
docs/contract.md."""

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


class ServerError(JobplaneError):
    """The server failed (a 5xx other than 503 `Unavailable`) or did not answer as the API does."""

    code, status = "ServerError", 500


# The errors the API answers with, by code.
_ANSWERED: dict[str, type[JobplaneError]] = {
    kind.code: kind
    for kind in (
        Unauthorized,
        Forbidden,
        NotFound,
        ResourceInvalidState,
        ConcurrencyConflict,
        TemplateDisabled,
        PayloadTooLarge,
        ValidationFailed,
        Unavailable,
    )
}


def answered(code: str, message: str, details: dict[str, Any], status: int) -> JobplaneError:
    """The error an API answer carrying `code` stands for, as the service would have raised it."""
    kind = _ANSWERED.get(code)
    error: JobplaneError
    if kind is ConcurrencyConflict:
        error = ConcurrencyConflict(details.get("activeRunId"))
    elif kind is ValidationFailed:
        error = ValidationFailed(message, list(details.get("errors") or []))
    elif kind is not None:
        error = kind(message, details)
    else:  # a 500 `Internal`, or a code this client does not know yet
        error = ServerError(f"{code}: {message}", details)
        error.status = status
    error.details = details
    return error
