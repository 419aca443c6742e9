"""Templates defined in code are the templates a file defines: the same fields, in snake_case
or camelCase, checked at construction with registration's own messages and pointers."""

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from jobplane import Step, Template
from jobplane.errors import ValidationFailed
from jobplane.templates import parse_template
from jobplane.templates.code import load_code
from jobplane.worker import StepContext, handler

EXAMPLES = Path(__file__).parents[2] / "examples"


class Item(BaseModel):
    sku: str


class Order(BaseModel):
    account: str
    items: list[Item]


@handler("orders.pack")
async def pack(ctx: StepContext) -> None:
    return None


def ship(ctx: StepContext) -> None:
    return None


def test_a_template_in_code_is_the_file_it_exports() -> None:
    order = Template(
        "order",
        payload=Order,
        steps=[
            Step("pack", pack, timeout_seconds=60, locks=[{"name": "warehouse"}]),
            Step("ship", ship, needs=["pack"], when="payload.account != 'test'"),
            Step("notify", "mail.send", retry_policy={"maxAttempts": 5}),
        ],
        retry_policy={"max_attempts": 3},
        concurrency_policy="queue_same_scope",
        dedupe_keys=["scopeId"],
    )
    body = order.body()
    assert [s["handler"] for s in body["steps"]] == [
        "orders.pack",  # its registered name
        f"{__name__}:ship",  # what a worker that loads this module offers
        "mail.send",
    ]
    assert body["payloadSchema"] == Order.model_json_schema()
    assert body["retryPolicy"] == {"maxAttempts": 3}
    assert body["steps"][0]["timeoutSeconds"] == 60
    assert body["steps"][2]["retryPolicy"] == {"maxAttempts": 5}
    # Exported, then read as a file: the same definition.
    assert parse_template(order.yaml(), yaml_syntax=True) == order.spec
    assert yaml.safe_load(order.yaml()) == body


@pytest.mark.parametrize(
    ("fields", "step", "pointers"),
    [
        ({}, {"timeout_seconds": -1}, ["/steps/0/timeoutSeconds"]),
        ({}, {"on_failure": "shrug", "colour": "red"}, ["/steps/0/onFailure", "/steps/0/colour"]),
        ({"retry_policy": {"max_attempts": 0}}, {}, ["/retryPolicy/maxAttempts"]),
        ({"concurrency_limit": 2}, {}, ["/concurrencyLimit"]),
        ({}, {"when": "payload.("}, ["/steps/0/when"]),
    ],
)
def test_a_template_in_code_is_refused_as_its_file_would_be(
    fields: dict[str, Any], step: dict[str, Any], pointers: list[str]
) -> None:
    with pytest.raises(ValidationFailed) as in_code:
        Template("t", steps=[Step("s", "h.h", **step)], **fields)
    as_file = {"type": "t", "steps": [{"id": "s", "handler": "h.h", **step}], **fields}
    with pytest.raises(ValidationFailed) as from_file:
        parse_template(json.dumps(as_file), yaml_syntax=False)
    assert in_code.value.message == from_file.value.message
    problems = in_code.value.details["errors"]
    assert sorted(p["pointer"] for p in problems) == sorted(pointers)
    said = {p["message"] for p in from_file.value.details["errors"]}
    assert {p["message"] for p in problems} == said


def test_a_payload_is_a_model_or_a_schema_never_both() -> None:
    schema = {"type": "object", "required": ["x"]}
    assert Template("t", payload=schema, steps=[Step("s", "h.h")]).spec.payload_schema == schema
    with pytest.raises(ValidationFailed) as both:
        Template("t", payload=Order, payload_schema=schema, steps=[Step("s", "h.h")])
    assert both.value.details["errors"][0]["pointer"] == "/payloadSchema"


def test_a_handler_a_worker_could_not_find_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match="@handler"):
        Step("s", lambda ctx: None)

    def nested(ctx: StepContext) -> None:
        return None

    with pytest.raises(ValueError, match="top level"):
        Step("s", nested)


def test_module_attribute_names_a_template_or_a_list_of_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    [report] = load_code("reports:report")
    assert report.type == "report"
    assert load_code(f"{__name__}:BOTH") == BOTH
    with pytest.raises(LookupError, match="not a jobplane Template"):
        load_code(f"{__name__}:Order")
    with pytest.raises(LookupError, match="no attribute"):
        load_code(f"{__name__}:nothing")
    with pytest.raises(LookupError, match="PYTHONPATH"):
        load_code("no_such_module:report")


BOTH = [Template("one", steps=[Step("s", "h.h")]), Template("two", steps=[Step("s", "h.h")])]
