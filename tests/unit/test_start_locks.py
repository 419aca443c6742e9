"""The locks a new run's first steps take, which its worker takes beside its claim."""

from datetime import UTC, datetime
from typing import Any

from jobplane.model import Template
from jobplane.runs.admission.keys import start_locks

NOW = datetime(2026, 1, 1, tzinfo=UTC)
PARTNER = {"name": "partner-api", "key": ["payload.partner"]}


def template(*steps: dict[str, Any]) -> Template:
    doc = {"type": "t", "steps": list(steps), "version": 1, "createAt": NOW, "updateAt": NOW}
    return Template.model_validate(doc)


def test_the_inline_steps_that_need_none_name_their_locks_each_once() -> None:
    graph = template(
        {"id": "a", "handler": "h", "locks": [PARTNER, {"name": "quota"}]},
        # Needs none, as `a`: a second first step, whose shared lock is named once.
        {"id": "b", "handler": "h", "needs": [], "locks": [{"name": "quota"}, PARTNER]},
        # After `a`: its lock is taken as it starts.
        {"id": "c", "handler": "h", "locks": [{"name": "later"}]},
        # An external worker's step: its locks are not the inline worker's to take.
        {"id": "d", "handler": "h", "needs": [], "workerType": "external", "locks": [PARTNER]},
    )
    locks = start_locks(graph, "user", "u", {"partner": "acme"})
    assert locks == ['partner-api:["acme"]', "quota"]


def test_a_template_whose_first_step_takes_none_names_none() -> None:
    line = template({"id": "a", "handler": "h"}, {"id": "b", "handler": "h", "locks": [PARTNER]})
    assert start_locks(line, "user", "u", {"partner": "acme"}) == []
