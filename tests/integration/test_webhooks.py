"""Signed webhooks, delivered to a real HTTP receiver that verifies them with the Standard
Webhooks reference library: retries, a receiver that was down, Retry-After, 410, scopes, SSRF."""

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from bson import ObjectId
from standardwebhooks.webhooks import WebhookVerificationError

from jobplane.backends import Backends
from jobplane.settings import Settings
from tests.integration.api_client import error_of, pointers
from tests.integration.conftest import Client, Register
from tests.integration.db import raw
from tests.integration.flow import until
from tests.integration.receiver import (
    Answer,
    Receiver,
    Request,
    hook_settings,
    notifying,
    received,
    serving,
)
from tests.integration.workers import running, settled

RUN = {"templateType": "t_noop", "scope": "user", "scopeId": "u1"}


async def subscribe(
    api: httpx.AsyncClient, url: str, events: list[str], scope_id: str = "u1"
) -> dict[str, Any]:
    made = await api.post(
        "/v1/webhooks", json={"url": url, "events": events, "scope": "user", "scopeId": scope_id}
    )
    assert made.status_code == 201, made.text
    hook: dict[str, Any] = made.json()
    return hook


async def deliveries(api: httpx.AsyncClient, hook_id: str) -> list[dict[str, Any]]:
    page = await api.get(f"/v1/webhooks/{hook_id}/deliveries")
    assert page.status_code == 200, page.text
    items: list[dict[str, Any]] = page.json()["items"]
    return items


async def test_a_run_s_events_reach_the_endpoint_signed_with_a_sequence(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register("t_noop")
    settings = hook_settings(settings)
    async with serving(Receiver()) as receiver, notifying(backends, settings):
        hook = await subscribe(api, receiver.url, ["*"])
        assert hook["secret"].startswith("whsec_") and hook["enabled"]
        assert "secret" not in (await api.get(f"/v1/webhooks/{hook['id']}")).json()
        run = (await api.post("/v1/runs", json=RUN)).json()
        async with running(backends, settings):
            await settled(backends.store, [run["id"]])
            await received(receiver, lambda r: bool(r.of_type("run.succeeded")))
        await asyncio.sleep(0.3)  # nothing more comes
    bodies = [r.verified(hook["secret"]) for r in receiver.received]
    assert sorted(bodies, key=lambda b: b["sequence"]) == sorted(
        bodies, key=lambda b: b["sequence"]
    )
    in_order = [b["type"] for b in sorted(bodies, key=lambda b: b["sequence"])]
    assert in_order == ["run.created", "run.started", "step.succeeded", "run.succeeded"]
    assert len({b["sequence"] for b in bodies}) == 4, "one run's sequences are distinct"
    for request, body in zip(receiver.received, bodies, strict=True):
        assert request.path == "/hook"
        assert request.headers["webhook-id"] == body["id"] and body["id"].startswith("msg_")
        assert body["data"]["run"]["id"] == run["id"]
        with pytest.raises(WebhookVerificationError):
            request.verified("whsec_" + "A" * 43)  # a wrong secret
    [step] = [b for b in bodies if b["type"] == "step.succeeded"]
    assert step["data"]["step"] == "only"
    [ended] = [b for b in bodies if b["type"] == "run.succeeded"]
    assert ended["data"]["run"]["status"] == "succeeded"
    listed = await deliveries(api, hook["id"])
    assert len(listed) == 4
    assert {(d["status"], d["attempts"], d["lastStatusCode"]) for d in listed} == {
        ("succeeded", 1, 200)
    }
    assert "body" not in listed[0] and listed[0]["runId"] == run["id"]
    events = (await api.get("/v1/events", params={"jobId": hook["id"]})).json()["items"]
    assert [(e["type"], e["actor"]) for e in events] == [("webhook_created", "user:admin")]


async def test_progress_reaches_a_webhook_that_asked_for_it_between_its_run_s_events(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    """`run.progress` comes from the runs' progress reports, which write no trail event; a
    webhook that did not ask for it gets none, nor does one of another scope, and a run's
    reports that arrive together are sent once, as the latest."""
    await register("t_sleep", steps=[{"id": "nap", "handler": "builtin.sleep"}])
    settings = hook_settings(settings)
    async with (
        serving(Receiver()) as progress,
        serving(Receiver()) as ends,
        serving(Receiver()) as elsewhere,
    ):
        watched = await subscribe(api, progress.url, ["run.progress", "run.succeeded"])
        await subscribe(api, ends.url, ["run.succeeded"])
        await subscribe(api, elsewhere.url, ["run.progress"], scope_id="u2")
        # Reports made before the notifier follows the trail are not sent (docs/contract.md).
        async with notifying(backends, settings):
            body = RUN | {"templateType": "t_sleep", "payload": {"sleepSeconds": 1}}
            run = (await api.post("/v1/runs", json=body)).json()
            async with running(backends, settings):
                await settled(backends.store, [run["id"]])
            await received(progress, lambda r: bool(r.of_type("run.succeeded")))
            await received(ends, lambda r: bool(r.of_type("run.succeeded")))
            await asyncio.sleep(0.3)  # nothing more comes
    bodies = [r.verified(watched["secret"]) for r in progress.received]
    reports = [b for b in bodies if b["type"] == "run.progress"]
    # The step reports 10 times, at most 4 a second; a busy notifier may send fewer.
    assert 1 <= len(reports) <= 10
    assert len({b["id"] for b in reports}) == len(reports), "one message per report"
    seen = [b["data"]["run"]["progress"]["percentage"] for b in reports]
    assert seen == sorted(seen) and all(b["data"]["run"]["id"] == run["id"] for b in reports)
    assert all(b["data"]["run"]["progress"]["reportedAt"] for b in reports)
    # The trail: created, started, step_started (3), step_finished, succeeded (5). A report
    # has the place of the event before it.
    [ended] = [b for b in bodies if b["type"] == "run.succeeded"]
    assert {b["sequence"] for b in reports} == {3} and ended["sequence"] == 5
    assert [r.message["type"] for r in ends.received] == ["run.succeeded"]
    assert elsewhere.received == [], "another scope's run's progress"


async def test_tries_that_fail_with_a_500_or_a_timeout_are_tried_again(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register("t_noop")

    def flaky(request: Request, earlier: list[Request]) -> Answer:
        # Two 500s, then an answer later than the notifier's 1 s timeout, then a 200.
        answers: list[Answer] = [(500, {}, 0.0), (500, {}, 0.0), (200, {}, 1.5)]
        return answers[len(earlier)] if len(earlier) < len(answers) else (200, {}, 0.0)

    settings = hook_settings(settings)
    async with serving(Receiver(answer=flaky)) as receiver, notifying(backends, settings):
        hook = await subscribe(api, receiver.url, ["run.succeeded"])
        runs = [(await api.post("/v1/runs", json=RUN)).json()["id"] for _ in range(3)]
        async with running(backends, settings):
            await settled(backends.store, runs)
        await received(receiver, lambda r: len(r.received) == 12)
        await until(lambda: _all(api, hook["id"], lambda d: d["status"] == "succeeded"), within=10)
    assert len(receiver.ids()) == 3, "one message per run, the same id on every try"
    listed = await deliveries(api, hook["id"])
    assert {(d["attempts"], d["lastStatusCode"], d["lastError"]) for d in listed} == {
        (4, 200, None)
    }


async def _all(api: httpx.AsyncClient, hook_id: str, holds: Any) -> bool:
    """Whether the webhook has deliveries and each `holds`."""
    found = await deliveries(api, hook_id)
    return bool(found) and all(holds(d) for d in found)


async def test_an_endpoint_that_was_down_receives_every_event_once_it_is_back(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register("t_noop")
    settings = hook_settings(settings, webhook_retry_seconds=[0, 0.5, 1, 1, 1, 1, 1, 1, 1, 1])
    receiver = Receiver()
    async with notifying(backends, settings):
        hook = await subscribe(api, receiver.url, ["run.succeeded", "run.created"])
        runs = [(await api.post("/v1/runs", json=RUN)).json()["id"] for _ in range(5)]
        async with running(backends, settings):
            await settled(backends.store, runs)
        await until(
            lambda: _all(api, hook["id"], lambda d: d["attempts"] >= 2 and d["lastError"]),
            within=15,
        )
        async with serving(receiver):
            await received(receiver, lambda r: len(r.ids()) == 10, within=15)
    assert len(receiver.received) == 10, "each message once, when the endpoint came back"
    got = {(r.message["type"], r.message["data"]["run"]["id"]) for r in receiver.received}
    assert got == {(t, run) for t in ("run.created", "run.succeeded") for run in runs}


async def test_retry_after_is_honoured_and_a_410_disables_the_webhook(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register("t_noop")

    def busy_then_gone(request: Request, earlier: list[Request]) -> Answer:
        if not earlier:
            return 429, {"retry-after": "2"}, 0.0
        return 410, {}, 0.0

    settings = hook_settings(settings)
    async with serving(Receiver(answer=busy_then_gone)) as receiver, notifying(backends, settings):
        hook = await subscribe(api, receiver.url, ["run.created"])
        await api.post("/v1/runs", json=RUN)
        await received(receiver, lambda r: len(r.received) == 2, within=15)
        await until(lambda: _all(api, hook["id"], lambda d: d["status"] == "failed"))
        second = (await api.post("/v1/runs", json=RUN)).json()
        await asyncio.sleep(1.0)
    first, then = receiver.received
    assert then.at - first.at >= 1.9, "the retry waited as Retry-After said, not 0.2 s"
    shown = (await api.get(f"/v1/webhooks/{hook['id']}")).json()
    assert not shown["enabled"] and "410" in shown["disabledReason"]
    [failed] = await deliveries(api, hook["id"])
    assert (failed["status"], failed["lastStatusCode"], failed["nextAttemptAt"]) == (
        "failed",
        410,
        None,
    )
    assert all(r.message["data"]["run"]["id"] != second["id"] for r in receiver.received)
    events = (await api.get("/v1/events", params={"jobId": hook["id"]})).json()["items"]
    assert [(e["type"], e["actor"]) for e in events][-1] == ("webhook_disabled", "notifier")
    enabled = await api.patch(f"/v1/webhooks/{hook['id']}", json={"enabled": True})
    assert enabled.status_code == 200 and enabled.json()["enabled"], enabled.text
    assert enabled.json()["disabledReason"] is None


async def test_a_spent_schedule_fails_the_delivery_and_a_redelivery_tries_again(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register("t_noop")
    failing = True

    def answer(request: Request, earlier: list[Request]) -> Answer:
        return (500 if failing else 204), {}, 0.0

    settings = hook_settings(settings, webhook_retry_seconds=[0, 0.1, 0.1])
    async with serving(Receiver(answer=answer)) as receiver, notifying(backends, settings):
        hook = await subscribe(api, receiver.url, ["run.created"])
        await api.post("/v1/runs", json=RUN)
        await until(lambda: _all(api, hook["id"], lambda d: d["status"] == "failed"))
        [spent] = await deliveries(api, hook["id"])
        assert (spent["attempts"], spent["lastStatusCode"]) == (3, 500)
        assert spent["lastError"] == "the endpoint answered 500"
        failing = False
        again = await api.post(f"/v1/webhooks/{hook['id']}/deliveries/{spent['id']}/redeliver")
        assert again.status_code == 200 and again.json()["status"] == "pending", again.text
        await until(lambda: _all(api, hook["id"], lambda d: d["status"] == "succeeded"))
    [done] = await deliveries(api, hook["id"])
    assert (done["attempts"], done["lastStatusCode"]) == (4, 204)
    assert len(receiver.ids()) == 1 and len(receiver.received) == 4
    missing = await api.post(f"/v1/webhooks/{hook['id']}/deliveries/{'0' * 24}/redeliver")
    error_of(missing, 404, "NotFound")


async def test_a_rotated_secret_signs_beside_the_new_one(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register("t_noop")
    settings = hook_settings(settings)
    async with serving(Receiver()) as receiver, notifying(backends, settings):
        hook = await subscribe(api, receiver.url, ["run.created"])
        rotated = await api.post(f"/v1/webhooks/{hook['id']}/rotate-secret")
        assert rotated.status_code == 200, rotated.text
        new = rotated.json()["secret"]
        assert new != hook["secret"] and new.startswith("whsec_")
        await api.post("/v1/runs", json=RUN)
        await received(receiver, lambda r: len(r.received) == 1)
    [request] = receiver.received
    assert len(request.headers["webhook-signature"].split(" ")) == 2
    assert request.verified(new) == request.verified(hook["secret"])


async def test_a_user_key_subscribes_and_sees_only_its_own_scopes(
    api: httpx.AsyncClient,
    client_for: Client,
    backends: Backends,
    settings: Settings,
    register: Register,
) -> None:
    await register("t_noop")
    made = await api.post(
        "/v1/api-keys", json={"name": "alice", "role": "user", "scopes": ["user:u1"]}
    )
    alice = client_for(made.json()["key"])
    auditor_key = await api.post("/v1/api-keys", json={"name": "aud", "role": "auditor"})
    auditor = client_for(auditor_key.json()["key"])
    author_key = await api.post("/v1/api-keys", json={"name": "auth", "role": "author"})
    author = client_for(author_key.json()["key"])
    settings = hook_settings(settings)
    async with serving(Receiver()) as receiver, notifying(backends, settings):
        own = await subscribe(alice, receiver.url, ["run.created"])
        other = await subscribe(api, receiver.url, ["run.created"], scope_id="u2")
        refused = await alice.post(
            "/v1/webhooks",
            json={"url": receiver.url, "events": ["*"], "scope": "user", "scopeId": "u2"},
        )
        error_of(refused, 403, "Forbidden")
        error_of(await author.get("/v1/webhooks"), 403, "Forbidden")
        await api.post("/v1/runs", json=RUN)
        await api.post("/v1/runs", json=RUN | {"scopeId": "u2"})
        await received(receiver, lambda r: len(r.received) == 2)
        await asyncio.sleep(0.3)
    listed = (await alice.get("/v1/webhooks")).json()["items"]
    assert [h["id"] for h in listed] == [own["id"]]
    assert {h["id"] for h in (await auditor.get("/v1/webhooks")).json()["items"]} == {
        own["id"],
        other["id"],
    }
    for path in ("", "/deliveries"):
        error_of(await alice.get(f"/v1/webhooks/{other['id']}{path}"), 404, "NotFound")
    error_of(await alice.delete(f"/v1/webhooks/{other['id']}"), 404, "NotFound")
    error_of(await auditor.delete(f"/v1/webhooks/{other['id']}"), 403, "Forbidden")
    [mine] = await deliveries(alice, own["id"])
    [theirs] = await deliveries(api, other["id"])
    by_url = {r.message["data"]["run"]["scopeId"] for r in receiver.received}
    assert by_url == {"u1", "u2"}
    assert mine["runId"] != theirs["runId"], "each webhook got its own scope's run only"
    gone = await alice.delete(f"/v1/webhooks/{own['id']}")
    assert gone.status_code == 200, gone.text
    error_of(await alice.get(f"/v1/webhooks/{own['id']}"), 404, "NotFound")
    events = (await alice.get("/v1/events", params={"jobId": own["id"]})).json()["items"]
    assert [e["type"] for e in events] == ["webhook_created", "webhook_deleted"]


@pytest.mark.parametrize(
    ("body", "pointer"),
    [
        ({"url": "ftp://example.com/hook"}, "/url"),
        ({"url": "http://user:pw@example.com/hook"}, "/url"),
        ({"url": "not a url"}, "/url"),
        ({"events": ["run.exploded"]}, "/events/0"),
        ({"events": []}, "/events"),
        ({"scopeId": "has space"}, "/scopeId"),
    ],
)
async def test_a_malformed_webhook_is_refused_with_a_pointer(
    api: httpx.AsyncClient, body: dict[str, Any], pointer: str
) -> None:
    base = {"url": "https://example.com/hook", "events": ["*"], "scope": "user", "scopeId": "u1"}
    refused = await api.post("/v1/webhooks", json=base | body)
    assert pointer in pointers(error_of(refused, 422, "ValidationFailed"))
    assert (await api.get("/v1/webhooks")).json()["items"] == [], "nothing half-written"


async def test_deliveries_to_internal_addresses_are_refused_after_resolution(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register("t_noop")
    settings = hook_settings(settings, webhook_allow_private=False)
    receiver = Receiver()
    async with serving(receiver), notifying(backends, settings):
        by_name = await subscribe(api, f"http://localhost:{receiver.port}/hook", ["run.created"])
        by_address = await subscribe(api, receiver.url, ["run.created"])
        await api.post("/v1/runs", json=RUN)
        for hook in (by_name, by_address):
            await until(lambda h=hook: _all(api, h["id"], lambda d: d["lastError"]))
    assert receiver.received == [], "nothing reached the loopback receiver"
    for hook in (by_name, by_address):
        [refused] = await deliveries(api, hook["id"])
        assert "a loopback address" in refused["lastError"], refused


async def test_a_dead_endpoint_delays_no_other_endpoint(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    """An endpoint that never answers holds at most 16 tries, each until the timeout; another
    endpoint's deliveries go out meanwhile, at once. The dead one's other deliveries wait for
    their turn 2 s at most, then are stored untried, so that the notifier's place in the trail
    is held back by the 16 tries' timeout, not by every delivery queued behind them."""
    await register("t_noop")

    def hangs(request: Request, earlier: list[Request]) -> Answer:
        return 200, {}, 60.0

    # A timeout far above what the other endpoint's deliveries take, however loaded the machine.
    settings = hook_settings(settings, webhook_timeout_seconds=30)
    async with (
        serving(Receiver(answer=hangs)) as dead,
        serving(Receiver()) as alive,
        notifying(backends, settings),
    ):
        stuck = await subscribe(api, dead.url, ["run.created"])
        await subscribe(api, alive.url, ["run.created"])
        for _ in range(30):
            await api.post("/v1/runs", json=RUN)
        # Behind the dead endpoint's tries they would wait their 30 s timeout: under 25 s they
        # did not.
        await received(alive, lambda r: len(r.received) == 30, within=25)
        assert len(dead.received) == 16, "the dead endpoint holds 16 tries, no more"

        async def untried() -> bool:
            listed = await deliveries(api, stuck["id"])
            waiting = [d for d in listed if (d["status"], d["attempts"]) == ("pending", 0)]
            return len(waiting) == 14 and len(listed) == 14  # the 16 in flight are not stored

        await until(untried, within=25)  # before the 16 tries time out and are stored


async def test_deliveries_queued_behind_an_endpoint_that_answers_keep_their_first_try(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    """An endpoint that answers, however slowly, moves its queue: deliveries waiting behind
    its 16 tries longer than 2 s are not stored untried (a claim and an update each later),
    but tried first and stored once, with their outcome."""
    await register("t_noop")

    def slow(request: Request, earlier: list[Request]) -> Answer:
        return 204, {}, 0.5

    settings = hook_settings(settings)
    async with serving(Receiver(answer=slow)) as receiver, notifying(backends, settings):
        hook = await subscribe(api, receiver.url, ["run.created"])
        for _ in range(100):  # 16 tries every 0.5 s: the last waits 3 s for its turn
            await api.post("/v1/runs", json=RUN)
        seen_untried = False
        while len(receiver.received) < 100:
            listed = await deliveries(api, hook["id"])
            seen_untried |= any(d["attempts"] == 0 for d in listed)
            await asyncio.sleep(0.1)
        await until(lambda: _all(api, hook["id"], lambda d: d["status"] == "succeeded"))
    assert not seen_untried, "a delivery was stored untried"
    assert len(receiver.ids()) == 100
    stored = await raw(backends.store).deliveries.find({}).to_list()
    assert [d["attempts"] for d in stored] == [1] * 100


async def test_a_webhook_failing_for_five_days_is_disabled(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register("t_noop")

    def fails(request: Request, earlier: list[Request]) -> Answer:
        return 500, {}, 0.0

    settings = hook_settings(settings)
    async with serving(Receiver(answer=fails)) as receiver, notifying(backends, settings):
        hook = await subscribe(api, receiver.url, ["run.created"])
        await api.post("/v1/runs", json=RUN)
        await until(lambda: _all(api, hook["id"], lambda d: d["attempts"] >= 2))
        shown = (await api.get(f"/v1/webhooks/{hook['id']}")).json()
        assert shown["enabled"] and shown["failingSince"] is not None
        # As if its first failure were six days old: the next failed try disables it.
        six_days_ago = datetime.now(UTC) - timedelta(days=6)
        await raw(backends.store).webhooks.update_one(
            {"_id": ObjectId(hook["id"])}, {"$set": {"failingSince": six_days_ago}}
        )
        await until(lambda: _disabled(api, hook["id"]))
    shown = (await api.get(f"/v1/webhooks/{hook['id']}")).json()
    assert shown["disabledReason"].startswith("every delivery failed since")
    events = (await api.get("/v1/events", params={"jobId": hook["id"]})).json()["items"]
    assert [(e["type"], e["actor"]) for e in events][-1] == ("webhook_disabled", "notifier")


async def _disabled(api: httpx.AsyncClient, hook_id: str) -> bool:
    return not (await api.get(f"/v1/webhooks/{hook_id}")).json()["enabled"]
