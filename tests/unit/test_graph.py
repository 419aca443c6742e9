"""The graph of a template's steps (`model/graph.py`) and the registration checks of `needs`."""

import json
from typing import Any

import pytest

from jobplane.errors import ValidationFailed
from jobplane.model import StepStatus
from jobplane.model.graph import Graph, GraphError
from jobplane.templates import parse_template

P, S, K, F = StepStatus.PENDING, StepStatus.SUCCEEDED, StepStatus.SKIPPED, StepStatus.FAILED
DIAMOND = Graph.of([("a", None), ("b", ["a"]), ("c", ["a"]), ("d", ["b", "c"])])


def test_omitted_needs_make_the_line_every_template_was() -> None:
    line = Graph.of([("a", None), ("b", None), ("c", None)])
    assert line.linear and line.needs == ((), (0,), (1,))
    assert line.layers == (("a",), ("b",), ("c",))
    assert not Graph.of([("a", None), ("b", [])]).linear


def test_a_diamond_has_three_layers_and_fans_in() -> None:
    assert DIAMOND.layers == (("a",), ("b", "c"), ("d",))
    assert DIAMOND.ready([P, P, P, P]) == [0]
    assert DIAMOND.ready([S, P, P, P]) == [1, 2]
    assert DIAMOND.ready([S, S, P, P]) == [2], "d waits for c"
    assert DIAMOND.ready([S, S, K, P]) == [3], "a skipped need is met"
    assert DIAMOND.ready([S, S, F, P]) == [], "a failed one is not"
    assert DIAMOND.dependents(0) == [1, 2, 3]
    assert DIAMOND.dependents(2) == [3]


def test_needs_listed_out_of_order_and_twice_still_layer() -> None:
    g = Graph.of([("d", ["b", "c", "b"]), ("b", []), ("c", ["b"])])
    assert g.needs[0] == (1, 2)
    assert g.layers == (("b",), ("c",), ("d",))


@pytest.mark.parametrize(
    ("steps", "problems"),
    [
        ([("a", ["a"])], [("/steps/0/needs/0", "step 'a' needs itself")]),
        (
            [("a", None), ("b", ["a", "x"])],
            [("/steps/1/needs/1", "step 'b' needs 'x', no such step")],
        ),
        (
            [("a", ["c"]), ("b", None), ("c", None)],
            [
                (
                    "/steps/0/needs",
                    "the steps' needs make a cycle: a → c → b → a (each needs the next)",
                )
            ],
        ),
        (
            # Named from a step whose needs were written, though found from c (x needs it).
            [("a", []), ("x", ["c"]), ("b", ["d"]), ("c", None), ("d", None)],
            [
                (
                    "/steps/2/needs",
                    "the steps' needs make a cycle: b → d → c → b (each needs the next)",
                )
            ],
        ),
        (
            [("a", []), ("b", ["c"]), ("c", ["b"])],
            [("/steps/1/needs", "the steps' needs make a cycle: b → c → b (each needs the next)")],
        ),
    ],
)
def test_needs_that_make_no_graph_are_named(
    steps: list[tuple[str, list[str] | None]], problems: list[tuple[str, str]]
) -> None:
    with pytest.raises(GraphError) as caught:
        Graph.of(steps)
    assert caught.value.problems == problems


def template(*steps: dict[str, Any]) -> str:
    return json.dumps({"type": "g", "steps": list(steps)})


def test_registration_refuses_needs_that_make_no_graph_with_a_pointer() -> None:
    text = template(
        {"id": "a", "handler": "h"},
        {"id": "b", "handler": "h", "needs": ["nope"]},
        {"id": "c", "handler": "h", "needs": ["c"]},
    )
    with pytest.raises(ValidationFailed) as caught:
        parse_template(text, yaml_syntax=False)
    assert [p["pointer"] for p in caught.value.details["errors"]] == [
        "/steps/1/needs/0",
        "/steps/2/needs/0",
    ]
    cycle = template(
        {"id": "a", "handler": "h", "needs": ["b"]},
        {"id": "b", "handler": "h", "needs": ["a"]},
    )
    with pytest.raises(ValidationFailed) as caught:
        parse_template(cycle, yaml_syntax=False)
    assert caught.value.details["errors"] == [
        {
            "pointer": "/steps/0/needs",
            "message": "the steps' needs make a cycle: a → b → a (each needs the next)",
        }
    ]


def test_a_long_line_checks_without_recursion() -> None:
    steps = [(f"s{i}", None) for i in range(5000)]
    assert Graph.of(steps).linear
    looped = [("s0", ["s4999"]), *steps[1:]]
    with pytest.raises(GraphError):
        Graph.of(looped)
