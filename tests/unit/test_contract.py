"""The contract a client is written against is complete: the OpenAPI document the API serves
documents every route (a summary, its success answer's schema, its error answers), and
docs/contract.md names every route and every transition of the code's table, as the code has it.

The routes are those of the `router` each module of `jobplane.api.routes` exports, so a module
the app forgot to include shows as routes missing from the document. No servers: the document is
served by the app without its backends.
"""

import importlib
import pkgutil
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute

import jobplane.api.routes
from jobplane.api import create_app
from jobplane.model import STEP_MOVES, TRANSITIONS, RunStatus, StepLeaseState, StepWriter
from jobplane.settings import Settings

CONTRACT = Path(__file__).parents[2] / "docs" / "contract.md"
# The error answers of every /v1 route (docs/contract.md, "Errors"), each `{"error": {...}}`,
# with a code each one's description names.
V1_ERRORS = {
    "401": "Unauthorized",
    "403": "Forbidden",
    "404": "NotFound",
    "409": "ConcurrencyConflict",
    "413": "PayloadTooLarge",
    "422": "ValidationFailed",
    "503": "Unavailable",
}
# POST routes that take no body: the path says it all.
NO_BODY = {
    "/rerun",
    "/enable",
    "/disable",
    "/pause",
    "/resume",
    "/trigger",
    "/rotate-secret",
    "/redeliver",
}


@pytest.fixture(scope="module")
async def document() -> dict[str, Any]:
    transport = httpx.ASGITransport(app=create_app(Settings()))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        response = await client.get("/openapi.json")
    assert response.status_code == 200
    served: dict[str, Any] = response.json()
    return served


def api_routes() -> list[APIRoute]:
    found = []
    for module in pkgutil.iter_modules(jobplane.api.routes.__path__):
        router = importlib.import_module(f"jobplane.api.routes.{module.name}").router
        found += [r for r in router.routes if isinstance(r, APIRoute)]
    return found


def routes() -> set[tuple[str, str]]:
    return {(method.lower(), route.path) for route in api_routes() for method in route.methods}


def operations(document: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(m, p): op for p, ops in document["paths"].items() for m, op in ops.items()}


def test_every_route_is_in_the_document(document: dict[str, Any]) -> None:
    assert routes() == set(operations(document))
    assert all(route.include_in_schema for route in api_routes())


def test_every_operation_has_a_summary_of_its_own() -> None:
    """Written by hand: FastAPI's default, made from the function's name ("Get", "Create"), says
    nothing in a list of fifty operations."""
    summaries = [route.summary for route in api_routes()]
    assert None not in summaries
    assert len(set(summaries)) == len(summaries)


def test_every_operation_documents_its_answers(document: dict[str, Any]) -> None:
    for (method, path), op in operations(document).items():
        responses = op["responses"]
        successes = [code for code in responses if code.startswith("2")]
        assert successes, (method, path)
        for code in successes:
            if code == "204":  # no content, by definition
                continue
            content = responses[code].get("content", {})
            assert any("schema" in media for media in content.values()), (method, path, code)
        if not path.startswith("/v1/"):
            continue
        assert V1_ERRORS.keys() <= responses.keys(), (method, path)
        for code in V1_ERRORS:
            schema = responses[code]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (method, path, code)
            assert V1_ERRORS[code] in responses[code]["description"], (method, path, code)
        if method in {"post", "patch"} and not path.endswith(tuple(NO_BODY)):
            assert "requestBody" in op, (method, path)


def test_the_error_shape_is_documented(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    assert schemas["ErrorResponse"]["properties"]["error"]["$ref"].endswith("/ErrorBody")
    assert set(schemas["ErrorBody"]["properties"]) == {"code", "message", "details"}


def normalized(path: str) -> str:
    """A path with its parameters unnamed: the contract may call `{run_id}` `{id}`."""
    return re.sub(r"\{[^}]*\}", "{}", path)


def test_the_contract_names_every_route() -> None:
    text = CONTRACT.read_text()
    named = {
        (method.lower(), normalized(path))
        for method, path in re.findall(r"\b(GET|POST|PATCH|DELETE) (/[^\s`,|]*)", text)
    }
    missing = {(m, p) for m, p in routes() if (m, normalized(p)) not in named}
    assert not missing, f"docs/contract.md does not name {sorted(missing)}"


def test_the_contract_lists_the_transitions_of_the_code() -> None:
    """Its table, row by row: `| \\`name\\` | from, from | to | fenced | ... |`."""
    text = CONTRACT.read_text()
    section = text[text.index("## Transitions") :]
    section = section[: section.index("\n## ", 1)]
    listed = {}
    for row in re.findall(r"^\| `(\w+)` \| ([a-z_, ]+) \| ([a-z_]+) \| *(yes)? *\|", section, re.M):
        name, sources, target, fenced = row
        listed[name] = (
            frozenset(RunStatus(s.strip()) for s in sources.split(",")),
            RunStatus(target),
            fenced == "yes",
        )
    assert listed == {t.name: (t.sources, t.target, t.fenced) for t in TRANSITIONS.values()}


def test_the_contract_describes_every_status() -> None:
    text = CONTRACT.read_text()
    described = set(re.findall(r"^\| `([a-z_]+)` \| ", text, re.M))
    assert set(RunStatus) <= described


def test_the_contract_lists_the_step_moves_of_the_code() -> None:
    """The lent steps' table, row by row: `| \\`name\\` | from, from | to | by ... |`."""
    text = CONTRACT.read_text()
    section = text[text.index("### Lent steps") :]
    section = section[: section.index("\n### ", 1)]
    state = {"not lent": StepLeaseState.NONE, **{s.value: s for s in StepLeaseState}}
    listed = {}
    for name, sources, target, by in re.findall(
        r"^\| `(\w+)` \| ([a-z, ]+) \| ([a-z ]+) \| (the holder|the borrower|a worker)",
        section,
        re.M,
    ):
        listed[name] = (
            frozenset(state[s.strip()] for s in sources.split(",")),
            state[target],
            StepWriter.HOLDER if by == "the holder" else StepWriter.BORROWER,
        )
    assert listed == {m.name: (m.sources, m.target, m.by) for m in STEP_MOVES.values()}
