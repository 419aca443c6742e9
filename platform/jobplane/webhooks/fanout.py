"""The fan-out: each new trail event becomes a delivery for every webhook that asked for it.

The trail is the outbox. Every event reaches `job_events` once, written with its run's write
(or copied there by the sweep from the run's own trail), so a change stream on its inserts sees
each event once, in the order they arrived. The same stream brings the steps' progress reports
(`store/feed.py`). The stream's position (a resume token) is saved in MongoDB only after the
deliveries of everything before it are stored (a first try is made before its delivery is
stored: `webhooks/sender.py`). A notifier killed at any point starts again from the last saved
position; the deliveries it makes a second time are looked up first and not sent again if they
were stored (one per webhook and event, `store/webhooks.py`). Nothing is lost; what is sent
twice is a first try the kill cut short.

If the stream's history is gone when a notifier resumes (it was down longer than the oplog
holds), it reads `job_events` again from a minute before the last event it fanned out. Progress
reports are state, not events: only the trail is read again, so the reports in that gap are not
delivered (the run's next report or event carries its progress).

A run's reports that arrive together are delivered once, as its latest: each delivery carries
the run as it is when the delivery is made.

With no webhook enabled, nothing is followed: the trail is not read at all, and the position is
dropped. When a webhook appears (or the first notifier ever starts), the stream starts anew and
`job_events` is read from the webhook's creation (or from when the fan-out went idle), so that
nothing a webhook asked for is missed.
"""

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from bson import ObjectId
from pymongo.errors import OperationFailure

from jobplane.clock import Clock
from jobplane.model import Run
from jobplane.model.webhooks import SignedWebhook
from jobplane.settings import Settings
from jobplane.store import Store
from jobplane.store.feed import PROGRESS_REPORTED, FedRun
from jobplane.webhooks.events import SOURCE_TYPES, webhook_type
from jobplane.webhooks.sender import Sender

log = logging.getLogger("jobplane.notifier")

Doc = dict[str, Any]

# A batch is what arrived while the last one was fanned out, up to this many events.
BATCH = 1000
# How often the position is saved while no event arrives, so that a resume stays within the
# oplog's history however quiet the trail is.
IDLE_SAVE_SECONDS = 10.0
# How far before its last fanned-out event a notifier that lost the stream's history reads
# `job_events` again: the writers' clocks may disagree by that much.
REPLAY_SKEW = timedelta(minutes=1)
# How often the fan-out looks whether any webhook is enabled: with none, it reads nothing.
IDLE_SECONDS = 1.0
# After a failure, the fan-out waits this long before it tries again.
RETRY_SECONDS = 1.0


class Fanout:
    def __init__(self, store: Store, settings: Settings, clock: Clock, sender: Sender):
        self.store = store
        self.settings = settings
        self.clock = clock
        # Tries the new deliveries before they are stored (`Sender.take`), and the stored ones
        # when woken.
        self.sender = sender
        # Events written before this may have had their deliveries stored by an earlier
        # fan-out (before a restart, or by another notifier): those are looked up first, so
        # that a delivery stored is not tried again as new. Set as a stream is followed.
        self._fresh_after = datetime.max.replace(tzinfo=UTC)

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the trail until `stop`, from where the last notifier left it."""
        while not stop.is_set():
            try:
                await self._follow(stop)
            except Exception:
                # Whatever failed, the saved position is before everything not yet fanned out.
                log.warning("following the trail failed; following it again", exc_info=True)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), RETRY_SECONDS)

    async def _follow(self, stop: asyncio.Event) -> None:
        """Follow the trail while a webhook is enabled; with none, nothing is read at all."""
        # A writer whose clock is behind makes a new event look older: looked up for nothing.
        self._fresh_after = self.clock.now()
        feed = await self.store.feed.position()
        hooks = await self.store.webhooks.enabled()
        if not hooks:
            if feed.idle_since is None:
                await self.store.feed.go_idle(self.clock.now())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), IDLE_SECONDS)
            return
        if feed.token is None:  # the first notifier, or the first webhook since it was idle
            stream = await self.store.feed.watch(None, SOURCE_TYPES)
            # What happened since the webhooks were made (or since the notifier went idle),
            # before the stream began.
            since = min(h.create_at for h in hooks)
            if feed.idle_since is not None:
                since = max(since, feed.idle_since - REPLAY_SKEW)
            await self._replay(since)
        else:
            try:
                stream = await self.store.feed.watch(feed.token, SOURCE_TYPES)
            except OperationFailure as exc:
                log.error(
                    "the trail's history since the last fan-out is gone (%s); reading it", exc
                )
                stream = await self.store.feed.watch(None, SOURCE_TYPES)
                await self._replay(None if feed.at is None else feed.at - REPLAY_SKEW)
        # Batches fanned out whose deliveries are not all stored yet (some are being tried
        # first), oldest first: the position moves past each once they are.
        unsaved: deque[tuple[Any, datetime, Fanned]] = deque()
        async with stream:
            await self._save(stream.resume_token, None)
            loop = asyncio.get_running_loop()
            saved = looked = loop.time()
            try:
                while not stop.is_set():
                    batch: list[Doc] = []
                    # `try_next` waits a moment (`WATCH_WAIT_MS`) for a change not yet sent.
                    while len(batch) < BATCH and (change := await stream.try_next()) is not None:
                        batch.append(change)
                        if stop.is_set():
                            break
                    now = loop.time()
                    if batch:
                        events = [self.store.feed.news(c) for c in batch]
                        fanned = await self.fan_out(events)
                        unsaved.append((batch[-1]["_id"], events[-1]["createAt"], fanned))
                    if await self._save_stored(unsaved):
                        saved = now
                    elif not unsaved and now - saved >= IDLE_SAVE_SECONDS:
                        await self._save(stream.resume_token, None)
                        saved = now
                    if now - looked >= IDLE_SECONDS:
                        looked = now
                        if not await self.store.webhooks.enabled():
                            return  # the next pass goes idle
            finally:
                # A stop leaves the tries in flight some time to be stored: what is not, a
                # restart fans out again.
                trying = [f for _, _, fanned in unsaved for f in fanned.trying]
                if trying:
                    await asyncio.wait(trying, timeout=self.settings.close_seconds)
                    with contextlib.suppress(Exception):
                        await self._save_stored(unsaved)

    async def _save_stored(self, unsaved: deque[tuple[Any, datetime, "Fanned"]]) -> bool:
        """Move the position past the oldest batches whose deliveries are all stored; True if
        it moved. A delivery that could not be stored fails the fan-out: it follows the trail
        again from the position saved."""
        last = None
        while unsaved and unsaved[0][2].settled():
            last = unsaved.popleft()
            last[2].check()
        if last is None:
            return False
        await self._save(last[0], last[1])
        return True

    async def _replay(self, since: datetime | None) -> None:
        """Fan out the trail's events written `since` then, as `job_events` holds them: the
        stream, opened before, brings what comes after (what both bring is stored once)."""
        if since is None:
            return
        cursor = self.store.trail.since(since, SOURCE_TYPES)
        batch: list[Doc] = []
        trying: list[asyncio.Future[None]] = []
        async for event in cursor:
            batch.append(event)
            if len(batch) == BATCH:
                trying += (await self.fan_out(batch)).trying
                batch = []
        trying += (await self.fan_out(batch)).trying
        # The position saved next is past all of them.
        await asyncio.gather(*trying)

    async def _save(self, token: Any, at: Any) -> None:
        if token is not None:
            await self.store.feed.save_position(token, at)

    async def fan_out(self, events: Sequence[Doc]) -> "Fanned":
        """Make a delivery of each event for each enabled webhook of its run's scope that asked
        for its type and existed when it happened: tried at once before it is stored (when the
        first try is due at once and the sender runs), or stored for the sender to try."""
        typed = [
            (e, kind) for e in _latest_reports(events) if (kind := webhook_type(e)) is not None
        ]
        if not typed:
            return Fanned(0, [])
        hooks = await self.store.webhooks.enabled()
        wanted = [(e, kind, h) for e, kind in typed for h in hooks if _wants(h, e, kind)]
        if not wanted:
            return Fanned(0, [])
        runs = await self.store.feed.runs_of([e["jobId"] for e, _, _ in wanted])
        now = self.clock.now()
        first_try = now + timedelta(seconds=self.settings.webhook_retry_seconds[0])
        deliveries: list[Doc] = []
        # Each run as JSON once per batch, however many of its events and webhooks are in it.
        as_json: dict[str, str] = {}
        for event, kind, hook in wanted:
            fed = runs.get(event["jobId"])
            if fed is None:  # no run can lose its document; say so if one did
                log.warning("event %s names run %s, which is gone", event["_id"], event["jobId"])
                continue
            run = fed.run
            if (hook.scope, hook.scope_id) != (run.scope, run.scope_id):
                continue  # a progress report of another scope's run
            sequence = _sequence(fed, event)
            deliveries.append(
                {
                    "_id": ObjectId(),
                    "messageId": _message_id(event),
                    "webhookId": hook.id,
                    "eventId": str(event["_id"]),
                    "type": kind,
                    "runId": run.id,
                    "sequence": sequence,
                    "scope": run.scope,
                    "scopeId": run.scope_id,
                    "status": "pending",
                    "attempts": 0,
                    "tries": 0,
                    "nextAttemptAt": first_try,
                    "body": _body(event, kind, _json_of(run, as_json), sequence),
                    "createAt": now,
                }
            )
        if any(e["createAt"] < self._fresh_after for e, _, _ in wanted):
            known = await self.store.webhooks.stored(
                [(d["webhookId"], d["eventId"]) for d in deliveries]
            )
            deliveries = [d for d in deliveries if (d["webhookId"], d["eventId"]) not in known]
        by_id = {h.id: h for h in hooks}
        trying: list[asyncio.Future[None]] = []
        stored: list[Doc] = []
        for doc in deliveries:
            taken = self.sender.take(by_id[doc["webhookId"]], doc) if first_try <= now else None
            if taken is None:
                stored.append(doc)
            else:
                trying.append(taken)
        await self.store.webhooks.add(stored)
        self.sender.wake.set()
        return Fanned(len(deliveries), trying)


@dataclass(frozen=True)
class Fanned:
    """What one fan-out made: how many deliveries, and those being tried before they are
    stored, each done once stored."""

    made: int
    trying: list[asyncio.Future[None]]

    def settled(self) -> bool:
        return all(f.done() for f in self.trying)

    def check(self) -> None:
        """Raise unless every delivery is stored."""
        for stored in self.trying:
            if stored.cancelled():
                raise RuntimeError("a delivery was neither tried nor stored")
            if (error := stored.exception()) is not None:
                raise error


def _wants(hook: SignedWebhook, event: Doc, kind: str) -> bool:
    """Whether the webhook asked for the event: a trail event says its run's scope; a progress
    report does not, and its run's is checked once the run is read. A webhook receives what
    happened after it was made, never a backlog from before it."""
    if "scope" in event and (hook.scope, hook.scope_id) != (event["scope"], event["scopeId"]):
        return False
    return hook.wants(kind) and event["createAt"] >= hook.create_at


def _latest_reports(events: Sequence[Doc]) -> list[Doc]:
    """The events, with only the latest progress report of each run."""
    latest = {e["jobId"]: e["_id"] for e in events if e["type"] == PROGRESS_REPORTED}
    return [e for e in events if e["type"] != PROGRESS_REPORTED or latest[e["jobId"]] == e["_id"]]


def _sequence(fed: FedRun, event: Doc) -> int:
    """The event's place in its run's trail (1, 2, ...); a progress report, which is in no
    trail, has the place of the last event written before it."""
    if event["type"] == PROGRESS_REPORTED:
        return sum(1 for _, version in fed.trail if version < event["runVersion"])
    return next((i for i, (id_, _) in enumerate(fed.trail, 1) if id_ == str(event["_id"])), 0)


def _message_id(event: Doc) -> str:
    return f"msg_{event['_id']}"


def _json_of(run: Run, made: dict[str, str]) -> str:
    """The run as `GET /v1/runs/{id}` answers it, made once into `made`."""
    if run.id not in made:
        made[run.id] = run.model_dump_json(by_alias=True)
    return made[run.id]


def _body(event: Doc, kind: str, run_json: str, sequence: int) -> str:
    """The JSON a receiver gets (docs/contract.md, "Webhooks"): the run as it is when the
    delivery is made (`run_json`), which may be past the event; `sequence` orders one run's
    events. The run's JSON is put in as it was made, not parsed and written again."""
    envelope = {
        "id": _message_id(event),
        "type": kind,
        "timestamp": event["createAt"].isoformat().replace("+00:00", "Z"),
        "sequence": sequence,
    }
    data = f'{{"run":{run_json}'
    if kind.startswith("step."):
        step = (event.get("metadata") or {}).get("step")
        data += f',"step":{json.dumps(step, separators=(",", ":"))}'
    return f'{json.dumps(envelope, separators=(",", ":"))[:-1]},"data":{data}}}}}'
