"""Registering, reading, enabling and disabling templates."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from jobplane.api.deps import StoreDep, TemplateAuthor, TemplateReader, WaitingDep
from jobplane.api.errors import ERROR_RESPONSES
from jobplane.api.schema import inline_schema
from jobplane.errors import NotFound
from jobplane.model import Template, TemplateSpec, Version
from jobplane.model.answers import Registered
from jobplane.runs.waiting import Waiting
from jobplane.templates import parse_template

router = APIRouter(prefix="/v1/templates", tags=["templates"], responses=ERROR_RESPONSES)


# The body is read by hand, as JSON or YAML.
_TEMPLATE_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": inline_schema(TemplateSpec)},
            "application/yaml": {"schema": {"type": "string"}},
        },
    }
}


@router.post(
    "",
    summary="Register a template",
    status_code=201,
    response_model=Registered,
    response_model_by_alias=True,
    responses={200: {"model": Registered, "description": "unchanged: the latest version"}},
    openapi_extra=_TEMPLATE_BODY,
)
async def register(
    request: Request, store: StoreDep, caller: TemplateAuthor, waiting: WaitingDep
) -> JSONResponse:
    """Register a template from JSON or YAML (`Content-Type: application/yaml`).

    An unchanged definition returns the latest version with 200 and `created: false`; a
    changed one is stored as the next version with 201 and `created: true`. `warnings` names
    each handler no live worker offers.
    """
    yaml_syntax = "yaml" in request.headers.get("content-type", "")
    spec = parse_template(await request.body(), yaml_syntax)
    template, created = await store.templates.register(spec)
    warnings = await _unserved(template, waiting)
    registered = Registered(**template.model_dump(), created=created, warnings=warnings)
    body = registered.model_dump(by_alias=True, mode="json")
    return JSONResponse(body, status_code=201 if created else 200)


async def _unserved(template: Template, waiting: Waiting) -> list[str]:
    offered = await waiting.offered()
    if offered is None:
        return ["the worker registry in Redis could not be read: handlers were not checked"]
    needed = sorted({s.handler for s in template.steps if s.handler and s.worker_type == "inline"})
    return [
        f"no live worker offers handler {h!r} on queue {template.queue!r}: its runs wait "
        "until one does"
        for h in needed
        if (template.queue, h) not in offered
    ]


@router.get(
    "",
    summary="List templates (latest versions)",
    response_model=list[Template],
    response_model_by_alias=True,
)
async def latest_of_each(store: StoreDep, caller: TemplateReader) -> list[Template]:
    """The latest version of every template."""
    return await store.templates.latest()


@router.get(
    "/{type_}",
    summary="Get a template's latest version",
    response_model=Template,
    response_model_by_alias=True,
)
async def latest(type_: str, store: StoreDep, caller: TemplateReader) -> Template:
    return _found(await store.templates.get(type_), type_)


@router.get(
    "/{type_}/versions/{version}",
    summary="Get one version of a template",
    response_model=Template,
    response_model_by_alias=True,
)
async def version(
    type_: str, version: Version, store: StoreDep, caller: TemplateReader
) -> Template:
    template = await store.templates.get(type_, version)
    if template is None:
        raise NotFound(f"template {type_!r} version {version} not found")
    return template


@router.post(
    "/{type_}/enable",
    summary="Enable a template",
    response_model=Template,
    response_model_by_alias=True,
)
async def enable(type_: str, store: StoreDep, caller: TemplateAuthor) -> Template:
    return _found(await store.templates.set_enabled(type_, True), type_)


@router.post(
    "/{type_}/disable",
    summary="Disable a template",
    response_model=Template,
    response_model_by_alias=True,
)
async def disable(type_: str, store: StoreDep, caller: TemplateAuthor) -> Template:
    """New runs (and schedule fires) are refused with 409 `TemplateDisabled`; runs already
    created go on."""
    return _found(await store.templates.set_enabled(type_, False), type_)


def _found(template: Template | None, type_: str) -> Template:
    if template is None:
        raise NotFound(f"template {type_!r} not found")
    return template
