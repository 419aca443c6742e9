"""Webhooks when processes die: a worker SIGKILLed mid-run, a notifier SIGKILLed mid-delivery,
a notifier that was down, a change stream whose history is gone, and two fan-outs at once."""

import asyncio
import signal
from pathlib import Path

import httpx
import pytest

from jobplane.backends import Backends
from jobplane.model import RunStatus
from jobplane.runs import RunRequest, RunService
from jobplane.settings import Settings
from tests.integration.conftest import Register
from tests.integration.db import raw
from tests.integration.flow import until
from tests.integration.processes import spawn, terminate
from tests.integration.receiver import (
    Answer,
    Receiver,
    Request,
    hook_settings,
    notifying,
    received,
    serving,
)
from tests.integration.test_webhooks import RUN, deliveries, subscribe
from tests.integration.workers import running, settled


@pytest.mark.slow
async def test_a_worker_sigkilled_mid_run_yields_one_terminal_delivery(
    api: httpx.AsyncClient,
    backends: Backends,
    settings: Settings,
    register: Register,
    tmp_path: Path,
) -> None:
    steps = [{"id": "nap", "handler": "builtin.sleep"}, {"id": "after", "handler": "builtin.echo"}]
    await register(steps=steps, retryPolicy={"maxAttempts": 3, "backoffSeconds": [0]})
    quick = hook_settings(settings, lease_seconds=1.5, heartbeat_seconds=0.3)
    async with serving(Receiver()) as receiver, notifying(backends, quick):
        hook = await subscribe(api, receiver.url, ["*"])
        run, _ = await RunService(backends.store, backends.queue).create(
            RunRequest("t_noop", "user", "u1", {"sleepSeconds": 1.0}), "user:a"
        )
        victim = spawn(quick, "worker", tmp_path / "victim.log")
        try:
            await until(lambda: _status(backends, run.id, RunStatus.RUNNING), within=20)
            victim.send_signal(signal.SIGKILL)
            assert victim.wait(10) == -signal.SIGKILL
        finally:
            terminate(victim)
        async with running(backends, quick, scheduler=True):
            [done] = await settled(backends.store, [run.id], within=30)
            await received(receiver, lambda r: bool(r.of_type("run.succeeded")))
            await asyncio.sleep(0.5)
    assert done.status == RunStatus.SUCCEEDED and done.attempt == 2
    assert len(receiver.ids("run.succeeded")) == 1, "one terminal event, one message"
    assert len(receiver.of_type("run.succeeded")) == 1, "and it was sent once"
    assert len(receiver.ids("run.retrying")) == 1, "the lost attempt is announced"
    assert len(receiver.ids("run.succeeded", "run.failed", "run.expired", "run.cancelled")) == 1
    assert all(d["status"] == "succeeded" for d in await deliveries(api, hook["id"]))


async def _status(backends: Backends, run_id: str, status: RunStatus) -> bool:
    run = await backends.store.runs.get(run_id)
    return run is not None and run.status == status


@pytest.mark.slow
@pytest.mark.parametrize("killed", ["first try", "a stored delivery's try"])
async def test_a_notifier_sigkilled_mid_delivery_leaves_it_to_another(
    api: httpx.AsyncClient,
    backends: Backends,
    settings: Settings,
    register: Register,
    tmp_path: Path,
    killed: str,
) -> None:
    """A first try is made before its delivery is stored: killed then, the event is fanned out
    again by the next notifier (the position had not moved past it), which tries it at once.
    A later try is of a stored delivery, claimed: killed then, the claim runs out (the timeout
    and a margin) and the next notifier takes it over."""
    await register("t_noop")
    # The first try (or, for a stored delivery, the second) stalls; the notifier is killed.
    stalling = 0 if killed == "first try" else 1

    def answer(request: Request, earlier: list[Request]) -> Answer:
        if len(earlier) < stalling:
            return 500, {}, 0.0
        return 200, {}, (5.0 if len(earlier) == stalling else 0.0)

    quick = hook_settings(settings, webhook_timeout_seconds=3)
    async with serving(Receiver(answer=answer)) as receiver:
        hook = await subscribe(api, receiver.url, ["run.created"])
        victim = spawn(quick, "notifier", tmp_path / "notifier.log")
        try:
            await until(lambda: _following(backends), within=30)
            await api.post("/v1/runs", json=RUN)
            await received(receiver, lambda r: len(r.received) == stalling + 1)
            victim.send_signal(signal.SIGKILL)
            assert victim.wait(10) == -signal.SIGKILL
        finally:
            terminate(victim)
        async with notifying(backends, quick):
            await received(receiver, lambda r: len(r.received) == stalling + 2, within=30)
            await until(lambda: _delivered(api, hook["id"]))
    assert len(receiver.ids()) == 1, "every try has the same webhook-id: receivers dedupe by it"
    [done] = await deliveries(api, hook["id"])
    # The killed first try was never written; a killed claimed try was counted by its claim.
    assert (done["status"], done["attempts"]) == ("succeeded", 1 if stalling == 0 else 3)


async def _following(backends: Backends) -> bool:
    return (await backends.store.feed.position()).token is not None


async def _delivered(api: httpx.AsyncClient, hook_id: str) -> bool:
    found = await deliveries(api, hook_id)
    return bool(found) and all(d["status"] == "succeeded" for d in found)


async def test_events_written_while_no_notifier_ran_are_delivered_once_one_does(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register("t_noop")
    settings = hook_settings(settings)
    async with serving(Receiver()) as receiver:
        hook = await subscribe(api, receiver.url, ["run.created"])
        async with notifying(backends, settings):
            await api.post("/v1/runs", json=RUN)
            await received(receiver, lambda r: len(r.received) == 1)
        # Down: these wait in the trail, after the position the notifier saved.
        for _ in range(3):
            await api.post("/v1/runs", json=RUN)
        await asyncio.sleep(0.3)
        assert len(receiver.received) == 1
        async with notifying(backends, settings):
            await received(receiver, lambda r: len(r.received) == 4)
            await asyncio.sleep(0.3)
    assert len(receiver.ids()) == 4 and len(receiver.received) == 4, "none twice"
    assert len(await deliveries(api, hook["id"])) == 4


async def test_a_notifier_whose_stream_history_is_gone_reads_the_trail_again(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register("t_noop")
    settings = hook_settings(settings)
    async with serving(Receiver()) as receiver:
        await subscribe(api, receiver.url, ["run.created"])
        async with notifying(backends, settings):
            await api.post("/v1/runs", json=RUN)
            await received(receiver, lambda r: len(r.received) == 1)
        for _ in range(2):
            await api.post("/v1/runs", json=RUN)
        # A token of no stream: MongoDB refuses to resume from it, as from one the oplog lost.
        await raw(backends.store).meta.update_one(
            {"_id": "webhook_feed"}, {"$set": {"token": {"_data": "00"}}}
        )
        async with notifying(backends, settings):
            await received(receiver, lambda r: len(r.ids()) == 3)
            await asyncio.sleep(0.3)
    assert len(receiver.received) == 3, "the event read again was delivered before: no-op"


async def test_two_fan_outs_of_the_same_events_store_each_delivery_once(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register("t_noop")
    settings = hook_settings(settings)
    receiver = Receiver()
    first = await subscribe(api, receiver.url, ["*"])
    second = await subscribe(api, receiver.url, ["run.created"])
    async with running(backends, settings):
        made = [(await api.post("/v1/runs", json=RUN)).json()["id"] for _ in range(5)]
        await settled(backends.store, made)
    events = await raw(backends.store).events.find({"jobId": {"$in": made}}).to_list()
    async with notifying(backends, settings) as one, notifying(backends, settings) as two:
        fanned = await asyncio.gather(
            one.fanout.fan_out(events), two.fanout.fan_out(events), one.fanout.fan_out(events)
        )
        # A first try is made before its delivery is stored, which its outcome then is.
        await asyncio.gather(*(stored for each in fanned for stored in each.trying))
    # The notifier that follows the trail fans them out as well; each delivery is stored once.
    assert len(await deliveries(api, first["id"])) == 20
    assert len(await deliveries(api, second["id"])) == 5


async def test_a_webhook_made_before_any_notifier_ran_misses_nothing(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register("t_noop")
    settings = hook_settings(settings)
    async with serving(Receiver()) as receiver:
        await subscribe(api, receiver.url, ["run.created"])
        made = [(await api.post("/v1/runs", json=RUN)).json()["id"] for _ in range(2)]
        await backends.store.trail.flush()
        async with notifying(backends, settings):
            await received(receiver, lambda r: len(r.received) == 2)
    assert {r.message["data"]["run"]["id"] for r in receiver.received} == set(made)


async def test_with_no_webhook_the_trail_is_not_followed_and_a_new_one_misses_nothing(
    api: httpx.AsyncClient, backends: Backends, settings: Settings, register: Register
) -> None:
    await register("t_noop")
    settings = hook_settings(settings)
    async with serving(Receiver()) as receiver, notifying(backends, settings):
        await until(lambda: _idle(backends))
        await api.post("/v1/runs", json=RUN)  # before any webhook: never delivered
        hook = await subscribe(api, receiver.url, ["run.created"])
        made = (await api.post("/v1/runs", json=RUN)).json()["id"]
        await received(receiver, lambda r: len(r.received) == 1)
        await until(lambda: _following(backends))
        await api.delete(f"/v1/webhooks/{hook['id']}")
        await until(lambda: _idle(backends))
    [delivered] = receiver.received
    assert delivered.message["data"]["run"]["id"] == made


async def _idle(backends: Backends) -> bool:
    feed = await backends.store.feed.position()
    return feed.token is None and feed.idle_since is not None
