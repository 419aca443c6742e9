from pathlib import Path

import pytest

from jobplane.errors import ValidationFailed
from jobplane.templates import load_path, parse_template

TEMPLATES = Path(__file__).parents[2] / "templates"


def test_shipped_templates_load() -> None:
    specs = {s.type: s for s in load_path(TEMPLATES)}
    assert set(specs) >= {
        "demo_long_task",
        "multi_step_pipeline",
        "scheduled_report",
        "external_worker_task",
    }
    demo = specs["demo_long_task"]
    assert [s.id for s in demo.steps] == ["prepare", "execute", "finalize"]
    assert [s.cancelable for s in demo.steps] == [True, True, False]
    assert specs["external_worker_task"].steps[1].worker_type == "external"
    assert specs["scheduled_report"].schedulable


def test_yaml_and_json_give_the_same_spec() -> None:
    yaml_text = "type: x\nsteps:\n  - {id: a, handler: builtin.noop}\n"
    json_text = '{"type": "x", "steps": [{"id": "a", "handler": "builtin.noop"}]}'
    assert parse_template(yaml_text, True) == parse_template(json_text, False)


@pytest.mark.parametrize(
    ("text", "yaml_syntax", "pointer"),
    [
        ("type: [unclosed", True, ""),
        ('{"type": ', False, ""),
        ('{"type": "x", "steps": [], "bogus": 1}', False, "/steps"),
        ('{"type": "x", "steps": [{"id": "a", "handler": "h"}], "bogus": 1}', False, "/bogus"),
        ('{"type": "x", "steps": [{"id": "a.b", "handler": "h"}]}', False, "/steps/0/id"),
        (
            '{"type": "x", "steps": [{"id": "a", "handler": "h", "timeoutSeconds": "0 * * * *"}]}',
            False,
            "/steps/0/timeoutSeconds",
        ),
        (
            '{"type": "x", "payloadSchema": {"type": 12}, "steps": [{"id": "a", "handler": "h"}]}',
            False,
            "/payloadSchema/type",
        ),
    ],
)
def test_bad_templates_name_the_bad_field(text: str, yaml_syntax: bool, pointer: str) -> None:
    with pytest.raises(ValidationFailed) as caught:
        parse_template(text, yaml_syntax)
    pointers = [e["pointer"] for e in caught.value.details["errors"]]
    assert pointer in pointers


def test_duplicate_step_ids_are_rejected() -> None:
    text = '{"type": "x", "steps": [{"id": "a", "handler": "h"}, {"id": "a", "handler": "h"}]}'
    with pytest.raises(ValidationFailed, match="unique"):
        parse_template(text, False)


def test_yaml_cannot_build_python_objects() -> None:
    with pytest.raises(ValidationFailed):
        parse_template("!!python/object/apply:os.system ['true']", True)


def test_a_yaml_bomb_is_refused_before_it_expands() -> None:
    """Nine anchors of nine aliases each: 387 million strings once expanded, 1 KB as text."""
    laughs = ['  - a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 9):
        laughs.append(f"    a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]")
    text = "\n".join(
        [
            "type: t_bomb",
            "steps: [{id: a, handler: builtin.noop}]",
            "payloadSchema:",
            "  type: object",
            "  examples:",
            *laughs,
        ]
    )
    with pytest.raises(ValidationFailed) as refused:
        parse_template(text, yaml_syntax=True)
    assert "aliases are expanded" in refused.value.details["errors"][0]["message"]
