import json
from pathlib import Path
from typing import Any

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
        "partner_sync",
    }
    sync = specs["partner_sync"]
    assert (sync.concurrency_limit, sync.max_running, sync.fairness) == (2, 20, "round_robin")
    assert sync.rate_limit is not None and sync.steps[0].locks[0].name == "partner-api"
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
    with pytest.raises(ValidationFailed) as caught:
        parse_template(text, False)
    [problem] = caught.value.details["errors"]
    assert problem["pointer"] == "/steps" and "unique" in problem["message"]


FLOW_CONTROL = """
type: partner_sync
concurrencyPolicy: queue_same_scope
dedupeKeys: [payload.partner]
concurrencyLimit: 3
maxRunning: 20
rateLimit: {limit: 100, periodSeconds: 60, key: [payload.partner]}
fairness: round_robin
steps:
  - id: call
    handler: builtin.noop
    locks: [{name: partner-api, key: [payload.partner]}, {name: global-quota}]
"""


def test_flow_control_fields_are_read_as_written() -> None:
    spec = parse_template(FLOW_CONTROL, True)
    assert (spec.concurrency_limit, spec.max_running, spec.fairness) == (3, 20, "round_robin")
    assert spec.rate_limit is not None and spec.rate_limit.key == ["payload.partner"]
    assert [(lock.name, lock.key) for lock in spec.steps[0].locks] == [
        ("partner-api", ["payload.partner"]),
        ("global-quota", []),
    ]
    assert parse_template(FLOW_CONTROL.replace("queue_same_scope", "cancel_previous"), True)


@pytest.mark.parametrize(
    ("change", "pointer"),
    [
        # A limit of 0, of each kind.
        ({"concurrencyLimit": 0}, "/concurrencyLimit"),
        ({"maxRunning": 0}, "/maxRunning"),
        # A cap its gate's list could not hold.
        ({"maxRunning": 100_001}, "/maxRunning"),
        ({"rateLimit": {"limit": 0, "periodSeconds": 60}}, "/rateLimit/limit"),
        ({"rateLimit": {"limit": 5, "periodSeconds": 0}}, "/rateLimit/periodSeconds"),
        # A limit with nothing to limit.
        ({"concurrencyPolicy": "allow"}, "/concurrencyLimit"),
        # Two runs of a key that may succeed only once.
        ({"repeatable": False}, "/concurrencyLimit"),
        # Key parts dedupeKeys would refuse.
        ({"rateLimit": {"limit": 5, "periodSeconds": 1, "key": ["partner"]}}, "/rateLimit/key/0"),
        (
            {"steps": [{"id": "a", "handler": "h", "locks": [{"name": "l", "key": ["payload"]}]}]},
            "/steps/0/locks/0/key/0",
        ),
        (
            {"steps": [{"id": "a", "handler": "h", "locks": [{"name": "no spaces"}]}]},
            "/steps/0/locks/0/name",
        ),
        (
            {"steps": [{"id": "a", "handler": "h", "locks": [{"name": "l"}, {"name": "l"}]}]},
            "/steps/0/locks/1",
        ),
        ({"fairness": "weighted"}, "/fairness"),
        ({"concurrencyPolicy": "latest_wins"}, "/concurrencyPolicy"),
    ],
)
def test_flow_control_nonsense_is_refused_with_a_pointer(
    change: dict[str, Any], pointer: str
) -> None:
    doc: dict[str, Any] = {
        "type": "x",
        "concurrencyPolicy": "queue_same_scope",
        "concurrencyLimit": 2,
        "steps": [{"id": "a", "handler": "h"}],
    }
    doc.update(change)
    with pytest.raises(ValidationFailed) as caught:
        parse_template(json.dumps(doc), False)
    assert pointer in [e["pointer"] for e in caught.value.details["errors"]]


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
