"""The floor of an HTTP create: a bare FastAPI endpoint that takes `POST /v1/runs`'s body.

`bench/api.py --key-role bare` serves this instead of `jobplane api`, on the same uvicorn
defaults and interpreter, to the same load. It parses and validates the same body (jobplane's
own `RunCreate` model), checks the bearer key as the admin key is checked (a constant-time
comparison), and answers 201 with a run of the size jobplane answers (jobplane's `Run` model,
serialized by its aliases): what HTTP, FastAPI and pydantic cost a create, with no MongoDB, no
Redis and none of jobplane's own work. The difference between the two API processes' CPU per
request is what a create costs jobplane itself.

    JOBPLANE_PORT=8001 JOBPLANE_ADMIN_KEY=secret .venv/bin/python bench/bare_api.py
"""

from __future__ import annotations

import hmac
import os
from datetime import UTC, datetime
from typing import Annotated

import uvicorn
from bson import ObjectId
from fastapi import FastAPI, Header, HTTPException

from jobplane.model import Run
from jobplane.runs.request import RunCreate


def answer(body: RunCreate) -> Run:
    """A queued run of one `builtin.noop` step, as `POST /v1/runs` answers for the body."""
    now = datetime.now(UTC)
    return Run.model_validate(
        {
            "id": str(ObjectId()),
            "templateType": body.template_type,
            "templateVersion": 1,
            "scope": body.scope,
            "scopeId": body.scope_id,
            "status": "queued",
            "payload": body.payload,
            "queue": "default",
            "handler": "builtin.noop",
            "progress": {"steps": [{"id": "only", "status": "pending"}]},
            "createAt": now,
            "updateAt": now,
            "version": 1,
        }
    )


def app(key: str) -> FastAPI:
    bare = FastAPI()
    expected = f"Bearer {key}".encode()

    @bare.get("/readyz")
    async def ready() -> dict[str, str]:
        return {"status": "ok"}

    @bare.post("/v1/runs", status_code=201, response_model=Run, response_model_by_alias=True)
    async def create(body: RunCreate, authorization: Annotated[str, Header()] = "") -> Run:
        if not hmac.compare_digest(authorization.encode(), expected):
            raise HTTPException(401)
        return answer(body)

    return bare


if __name__ == "__main__":
    # uvicorn's defaults, as `jobplane api` takes them (its access log included).
    uvicorn.run(
        app(os.environ["JOBPLANE_ADMIN_KEY"]),
        host="127.0.0.1",
        port=int(os.environ["JOBPLANE_PORT"]),
    )
