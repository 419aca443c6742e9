"""Registering and reading templates."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from jobplane.api.deps import CallerDep, StoreDep
from jobplane.api.errors import ERROR_RESPONSES
from jobplane.errors import NotFound
from jobplane.model import Template
from jobplane.templates import parse_template

router = APIRouter(prefix="/v1/templates", tags=["templates"], responses=ERROR_RESPONSES)


@router.post("", status_code=201, response_model=Template, response_model_by_alias=True)
async def register(request: Request, store: StoreDep, caller: CallerDep) -> JSONResponse:
    """Register a template from JSON or YAML (`Content-Type: application/yaml`).

    An unchanged definition returns the latest version with 200; a changed one is stored as
    the next version with 201.
    """
    yaml_syntax = "yaml" in request.headers.get("content-type", "")
    spec = parse_template(await request.body(), yaml_syntax)
    template, created = await store.register_template(spec)
    body = template.model_dump(by_alias=True, mode="json")
    return JSONResponse(body, status_code=201 if created else 200)


@router.get("/{type_}", response_model=Template, response_model_by_alias=True)
async def latest(type_: str, store: StoreDep, caller: CallerDep) -> Template:
    template = await store.get_template(type_)
    if template is None:
        raise NotFound(f"template {type_!r} not found")
    return template


@router.get("/{type_}/versions/{version}", response_model=Template, response_model_by_alias=True)
async def version(type_: str, version: int, store: StoreDep, caller: CallerDep) -> Template:
    template = await store.get_template(type_, version)
    if template is None:
        raise NotFound(f"template {type_!r} version {version} not found")
    return template
