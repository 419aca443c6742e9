"""Every error leaves the API as {"error": {"code", "message", "details"}}."""

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pymongo.errors import ConnectionFailure
from redis.exceptions import RedisClusterException, RedisError
from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import Scope

from jobplane.errors import JobplaneError

log = logging.getLogger("jobplane.api")

_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
_HTTP_CODES = {
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    413: "PayloadTooLarge",
}


class ErrorBody(BaseModel):
    code: str
    message: str
    details: dict[str, Any] = {}


class ErrorResponse(BaseModel):
    error: ErrorBody


def error_response(
    status: int,
    code: str,
    message: str,
    details: dict[str, Any],
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"code": code, "message": message, "details": details}}
    return JSONResponse(body, status_code=status, headers=headers)


def http_error(exc: HTTPException) -> JSONResponse:
    if exc.status_code == 400:
        # FastAPI's answer to a body it could not decode (too deeply nested, not UTF-8): to
        # the caller that is malformed input like any other.
        problem = [{"pointer": "", "message": str(exc.detail)}]
        return error_response(
            422, "ValidationFailed", "malformed request body", {"errors": problem}
        )
    code = _HTTP_CODES.get(exc.status_code, "Error")
    return error_response(exc.status_code, code, str(exc.detail), {}, exc.headers)


def install(app: FastAPI) -> None:
    @app.exception_handler(JobplaneError)
    async def domain(_: Request, exc: JobplaneError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.details)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {
                "pointer": "".join(f"/{p}" for p in err["loc"][1:]),
                "message": err["msg"],
            }
            for err in exc.errors()
        ]
        return error_response(422, "ValidationFailed", "invalid request", {"errors": errors})

    @app.exception_handler(HTTPException)
    async def http(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 405:
            # Starlette's `Allow` names the methods of the first route of the path only: each
            # of FastAPI's routes has one.
            exc = method_not_allowed(request.app, request.scope)
        return http_error(exc)

    async def redis_down(_: Request, exc: Exception) -> JSONResponse:
        return error_response(503, "Unavailable", f"Redis unavailable: {exc}", {})

    # Not OSError, which may be anything's: it stays a 500.
    for redis_error in (RedisError, RedisClusterException):
        app.add_exception_handler(redis_error, redis_down)

    @app.exception_handler(ConnectionFailure)
    async def mongo_down(_: Request, exc: ConnectionFailure) -> JSONResponse:
        # Also raised while a replica set elects a primary: the client may try again.
        return error_response(503, "Unavailable", f"MongoDB unavailable: {exc}", {})

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(500, "Internal", "internal error; it was logged", {})


def method_not_allowed(app: FastAPI, scope: Scope) -> HTTPException:
    """A 405 whose `Allow` names the methods the app takes at the request's path."""
    allowed = written_methods(app, scope["path"]) or {
        # Each method asked of every route, through Starlette's public `matches` (FastAPI
        # nests routers in routes of its own).
        method
        for method in _METHODS
        if any(r.matches({**scope, "method": method})[0] == Match.FULL for r in app.routes)
    }
    return HTTPException(405, "Method Not Allowed", {"Allow": ", ".join(sorted(allowed))})


def written_methods(app: FastAPI, path: str) -> set[str]:
    """The methods the OpenAPI document gives `path`, if it lists it as written (none if not).
    As OpenAPI reads paths, `/v1/runs/batch` is such a path, and no run id of
    `/v1/runs/{run_id}`: only its own methods are allowed there."""
    return {method.upper() for method in app.openapi()["paths"].get(path, {})}


# What each error status of a /v1 route means, with the codes it carries (docs/contract.md).
_ERRORS = {
    401: "Unauthorized: no bearer API key, or one the platform does not know",
    403: "Forbidden: the key's role lacks the permission, or the scope is not the key's",
    404: "NotFound: no such resource, or one outside the key's scopes",
    409: "ResourceInvalidState, ConcurrencyConflict or TemplateDisabled",
    413: "PayloadTooLarge: the body or the run payload is over its limit",
    422: "ValidationFailed: `details.errors` lists each bad field with a JSON pointer",
    503: "Unavailable: MongoDB or Redis did not answer; the call may be repeated",
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text} for status, text in _ERRORS.items()
}
