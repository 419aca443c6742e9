"""The sender: tries each due delivery, signed, and writes how the try went.

Each try is its own task, at most `webhook_concurrency` of them in a notifier and 16 for one
webhook (more wait their turn), so a slow or dead endpoint holds its own sixteen and never
another's. A stored delivery's try is claimed for twice its timeout and a margin; if the
notifier dies mid-try, the delivery is due again once the claim runs out, and another notifier
tries it: deliveries are at least once, and a receiver dedupes by `webhook-id`.

A new delivery's first try is made before the delivery is stored (`take`): the delivery is
stored once, with the try's outcome, one insert instead of an insert, a claim and an update.
The fan-out moves its position in the trail past it only once it is stored. One that waits
for its turn is stored untried instead (and tried as any stored delivery) when its webhook's
endpoint has not answered for `SPILL_SECONDS` (a dead or stuck endpoint), or after
`BACKLOG_SECONDS` whatever the cause: the trail's position is held back a few seconds by an
endpoint that does not answer, and never long by one that answers slowly. A notifier merely
behind (its CPU taken) answers its endpoints' tries as it goes, so its deliveries keep their
first try and their single insert: storing them untried would cost a claim and an update
each, MongoDB's dearest writes, just when the machine has no CPU to spare.

Signatures follow the Standard Webhooks specification, computed by its reference library.
"""

import asyncio
import email.utils
import logging
import random
from collections import Counter, defaultdict, deque
from datetime import datetime, timedelta

import aiohttp
from standardwebhooks.webhooks import Webhook as Signer

from jobplane.clock import Clock
from jobplane.model.webhooks import SignedWebhook
from jobplane.process import finish_within
from jobplane.settings import Settings
from jobplane.store import Store
from jobplane.store.convert import Doc
from jobplane.store.webhooks import Claimed
from jobplane.webhooks import guard

log = logging.getLogger("jobplane.notifier")

PER_WEBHOOK = 16
# Beyond its wait and its timeout, how long a claimed try may take (writing its outcome) before
# another notifier may take it over.
CLAIM_MARGIN_SECONDS = 10.0
# How often due deliveries are looked for when nothing wakes the sender sooner: retries
# coming due, and deliveries another notifier's fan-out stored.
POLL_SECONDS = 1.0
# How stale the sender's list of enabled webhooks may be: a new one's first deliveries, or a
# disabled one's last tries, wait up to this long.
HOOKS_SECONDS = 1.0
# How long a new delivery waits for its webhook's turn before it is stored untried, if the
# webhook's endpoint has answered nothing meanwhile; and whatever it answered.
SPILL_SECONDS = 2.0
BACKLOG_SECONDS = 30.0
# A webhook whose deliveries have all failed this long is disabled.
DISABLE_AFTER = timedelta(days=5)
# The longest `Retry-After` honoured.
MAX_RETRY_AFTER = 86400.0
# How far each wait of the retry schedule is moved, either way, so that the tries of many
# deliveries that failed together do not come due together.
JITTER = 0.2
USER_AGENT = "jobplane-webhooks"


class Sender:
    def __init__(
        self,
        store: Store,
        settings: Settings,
        clock: Clock,
        wake: asyncio.Event,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.clock = clock
        self.wake = wake
        self._rng = rng or random.Random()
        # Tries whose request is in flight, by webhook (their outcomes may still be written).
        self._in_flight: Counter[str] = Counter()
        self._tries: set[asyncio.Task[None]] = set()
        self._hooks: dict[str, SignedWebhook] = {}
        self._read_at = -HOOKS_SECONDS
        # Tries beyond their webhook's room, by webhook, in the order claimed or taken, each
        # with when it began to wait.
        self._waiting: defaultdict[str, deque[tuple[SignedWebhook, Claimed, float]]] = defaultdict(
            deque
        )
        # When each webhook's endpoint last answered a try (or was first sent one after none
        # were in flight), by webhook: one silent for SPILL_SECONDS is stuck.
        self._answered_at: dict[str, float] = {}
        # Of the first tries taken before their delivery was stored, by delivery id: set once
        # the delivery is stored (with the try's outcome, or untried).
        self._stored: dict[str, asyncio.Future[None]] = {}
        # The session while the sender runs: the fan-out hands it tries only then.
        self._http: aiohttp.ClientSession | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Send until `stop`; tries in flight then get `close_seconds` to finish (one cut short
        is tried again once its claim runs out)."""
        timeout = self.settings.webhook_timeout_seconds
        async with guard.session(timeout, self.settings.webhook_allow_private) as http:
            self._http = http
            try:
                while not stop.is_set():
                    self.wake.clear()
                    # A stop does not wait on a MongoDB that does not answer (30 s).
                    looking = asyncio.ensure_future(self.send_due(http))
                    stopping = asyncio.ensure_future(stop.wait())
                    await asyncio.wait([looking, stopping], return_when=asyncio.FIRST_COMPLETED)
                    stopping.cancel()
                    if not looking.done():
                        seconds = self.settings.close_seconds
                        await finish_within(looking, seconds, "looking for due deliveries")
                        break
                    try:
                        full = looking.result()
                    except Exception:
                        log.exception("looking for due deliveries failed; looking again")
                        full = False
                    if not full:
                        waking = asyncio.create_task(self.wake.wait())
                        stopping = asyncio.create_task(stop.wait())
                        await asyncio.wait(
                            [waking, stopping],
                            timeout=POLL_SECONDS,
                            return_when=asyncio.FIRST_COMPLETED,
                        )
                        waking.cancel()
                        stopping.cancel()
            finally:
                self._http = None
                for _, waiting in self._waiting.items():
                    for _, claimed, _ in waiting:  # never tried nor stored: the trail has them
                        self._settle(claimed, cancelled=True)
                self._waiting.clear()
                if self._tries:
                    gathered = asyncio.gather(*self._tries, return_exceptions=True)
                    await finish_within(gathered, self.settings.close_seconds, "webhook tries")

    async def send_due(self, http: aiohttp.ClientSession) -> bool:
        """Start a try of each due delivery there is room for; True if the room ran out
        first (more may be due)."""
        await self._spill()
        room = self.settings.webhook_concurrency - self._in_flight.total()
        if room <= 0:
            return False
        hooks = await self._enabled()
        open_ = [i for i in hooks if self._in_flight[i] + len(self._waiting[i]) < PER_WEBHOOK]
        if not open_:
            return False
        now = self.clock.now()
        limit = min(room, PER_WEBHOOK)
        claimed = await self.store.webhooks.claim(now, open_, self.claim_until(now), limit)
        for each in claimed:
            hook = hooks[each.delivery.webhook_id]
            if self._in_flight[hook.id] < PER_WEBHOOK:
                self._in_flight[hook.id] += 1
                self._start(http, hook, each)
            else:  # one claim may bring a webhook more than its room: they wait their turn
                self._waiting[hook.id].append((hook, each, loop_time()))
        return len(claimed) == limit

    def claim_until(self, now: datetime) -> datetime:
        """Until when a try claimed at `now` holds its delivery: a try waiting its turn waits
        for one try of its webhook at most, then takes its own timeout."""
        timeout = self.settings.webhook_timeout_seconds
        return now + timedelta(seconds=2 * timeout + CLAIM_MARGIN_SECONDS)

    def take(self, hook: SignedWebhook, delivery: Doc) -> asyncio.Future[None] | None:
        """Try a new delivery (`delivery` as the fan-out would store it) before it is stored;
        the future is set once it is stored. None while the sender is not running: the caller
        stores it."""
        if self._http is None:
            return None
        claimed = Claimed.first_try(delivery)
        stored = self._stored[claimed.delivery.id] = asyncio.get_running_loop().create_future()
        room = self.settings.webhook_concurrency - self._in_flight.total()
        if room > 0 and self._in_flight[hook.id] < PER_WEBHOOK:
            self._in_flight[hook.id] += 1
            self._start(self._http, hook, claimed)
        else:
            self._waiting[hook.id].append((hook, claimed, loop_time()))
        return stored

    async def _spill(self) -> None:
        """Store untried the new deliveries that waited for their turn too long: past
        SPILL_SECONDS behind an endpoint that answered nothing meanwhile, else past
        BACKLOG_SECONDS."""
        now = loop_time()
        spilled: list[Claimed] = []
        for webhook_id, waiting in self._waiting.items():
            stuck = now - self._answered_at.get(webhook_id, now) >= SPILL_SECONDS
            cutoff = now - (SPILL_SECONDS if stuck else BACKLOG_SECONDS)
            # Oldest first: if the first waited less, all did (a queue may hold thousands).
            if not waiting or waiting[0][2] >= cutoff:
                continue
            if any(c.unstored is not None and at < cutoff for _, c, at in waiting):
                kept = deque(w for w in waiting if w[1].unstored is None or w[2] >= cutoff)
                spilled += [c for _, c, at in waiting if c.unstored is not None and at < cutoff]
                self._waiting[webhook_id] = kept
        if not spilled:
            return
        try:
            await self.store.webhooks.add([c.unstored for c in spilled if c.unstored])
        except Exception as exc:
            for claimed in spilled:
                self._settle(claimed, error=exc)
            raise
        for claimed in spilled:
            self._settle(claimed)

    def _settle(
        self, claimed: Claimed, error: BaseException | None = None, cancelled: bool = False
    ) -> None:
        """Say whether a delivery taken before it was stored is stored now."""
        stored = self._stored.pop(claimed.delivery.id, None)
        if stored is None or stored.done():
            return
        if cancelled:
            stored.cancel()
        elif error is not None:
            stored.set_exception(error)
        else:
            stored.set_result(None)

    def _start(self, http: aiohttp.ClientSession, hook: SignedWebhook, claimed: Claimed) -> None:
        if self._in_flight[hook.id] == 1:  # the first in flight: silence is counted from now
            self._answered_at[hook.id] = loop_time()
        task = asyncio.create_task(self.attempt(http, hook, claimed))
        self._tries.add(task)
        task.add_done_callback(self._tries.discard)
        if claimed.unstored is not None:

            def settle(done: asyncio.Task[None]) -> None:
                failed = None if done.cancelled() else done.exception()
                self._settle(claimed, error=failed, cancelled=done.cancelled())

            task.add_done_callback(settle)

    async def _enabled(self) -> dict[str, SignedWebhook]:
        """The enabled webhooks, read again at most every `HOOKS_SECONDS`."""
        now = asyncio.get_running_loop().time()
        if now - self._read_at >= HOOKS_SECONDS:
            self._hooks = {h.id: h for h in await self.store.webhooks.enabled()}
            self._read_at = now
        return self._hooks

    async def attempt(
        self, http: aiohttp.ClientSession, hook: SignedWebhook, claimed: Claimed
    ) -> None:
        """One try of one delivery, and its outcome written. Its place among the webhook's
        tries in flight is free once the receiver answered, while the outcome is written."""
        started = self.clock.now()
        headers = self.signed(hook, claimed)
        try:
            async with http.post(
                hook.url, data=claimed.body.encode(), headers=headers, allow_redirects=False
            ) as response:
                code, retry_after = response.status, response.headers.get("retry-after", "")
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._answered(hook)
            await self._failed(hook, claimed, started, None, _describe(exc), None)
            return
        except Exception:
            self._answered(hook)
            log.exception("trying delivery %s failed", claimed.delivery.id)
            error = "the try failed in the notifier"
            await self._failed(hook, claimed, started, None, error, None)
            return
        self._answered(hook)
        if 200 <= code < 300:
            await self._succeeded(hook, claimed, started, code)
        elif code == 410:
            await self._gone(hook, claimed, started)
        else:
            wait = _retry_after(retry_after) if code in (429, 503) else None
            error = f"the endpoint answered {code}"
            await self._failed(hook, claimed, started, code, error, wait)

    def _answered(self, hook: SignedWebhook) -> None:
        self._answered_at[hook.id] = loop_time()
        waiting = self._waiting[hook.id]
        if waiting and self._http is not None:
            waiter, claimed, _ = waiting.popleft()
            self._start(self._http, waiter, claimed)  # its place passes to the next
            return
        self._in_flight[hook.id] -= 1
        self.wake.set()  # room for the next try

    def signed(self, hook: SignedWebhook, claimed: Claimed) -> dict[str, str]:
        """The headers of a try: a `v1,` signature with each live secret (a rotated secret's
        for a day after the rotation), over this try's timestamp."""
        now = self.clock.now()
        message_id = claimed.delivery.message_id
        signatures = [
            Signer(secret).sign(message_id, now, claimed.body) for secret in hook.signing(now)
        ]
        return {
            "content-type": "application/json",
            "user-agent": USER_AGENT,
            "webhook-id": message_id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": " ".join(signatures),
        }

    async def _tried(self, claimed: Claimed, started: datetime, outcome: Doc) -> None:
        """Write the outcome; a first try's before its delivery was stored stores it, tried
        once (a stored delivery's claim counted its try)."""
        if claimed.unstored is not None:
            outcome = {"attempts": 1, "tries": 1, "lastAttemptAt": started} | outcome
        await self.store.webhooks.tried(claimed, outcome)

    async def _succeeded(
        self, hook: SignedWebhook, claimed: Claimed, started: datetime, code: int
    ) -> None:
        now = self.clock.now()
        outcome = {
            "status": "succeeded",
            "lastStatusCode": code,
            "lastError": None,
            "deliveredAt": now,
            "nextAttemptAt": None,
        }
        await self._tried(claimed, started, outcome)
        if hook.failing_since is not None:
            await self.store.webhooks.note_healthy(hook.id)

    async def _gone(self, hook: SignedWebhook, claimed: Claimed, started: datetime) -> None:
        """A 410: the receiver says the endpoint is gone for good."""
        error = "the endpoint answered 410 Gone; the webhook was disabled"
        outcome = {"status": "failed", "lastStatusCode": 410, "lastError": error}
        await self._tried(claimed, started, outcome | {"nextAttemptAt": None})
        await self._disable(hook, "the endpoint answered 410 Gone")

    async def _failed(
        self,
        hook: SignedWebhook,
        claimed: Claimed,
        started: datetime,
        code: int | None,
        error: str,
        wait: float | None,
    ) -> None:
        now = self.clock.now()
        next_at = self.next_try(claimed.tries, now, wait)
        outcome: Doc = {"lastStatusCode": code, "lastError": error, "nextAttemptAt": next_at}
        if next_at is None:
            outcome["status"] = "failed"
        await self._tried(claimed, started, outcome)
        since = await self.store.webhooks.note_failing(hook.id, now)
        if since is not None and now - since >= DISABLE_AFTER:
            await self._disable(hook, f"every delivery failed since {since.isoformat()}")

    def next_try(self, tries: int, now: datetime, wait: float | None) -> datetime | None:
        """When to try again after the `tries`-th try of a round failed: after the schedule's
        next wait (or the receiver's `Retry-After`); None when the schedule is spent."""
        schedule = self.settings.webhook_retry_seconds
        if tries >= len(schedule):
            return None
        if wait is None:
            wait = schedule[tries] * self._rng.uniform(1 - JITTER, 1 + JITTER)
        return now + timedelta(seconds=wait)

    async def _disable(self, hook: SignedWebhook, reason: str) -> None:
        fields = {"enabled": False, "disabledAt": self.clock.now(), "disabledReason": reason}
        changed = await self.store.webhooks.change(
            hook.id, fields, "webhook_disabled", "notifier", reason, {"enabled": True}
        )
        if changed is not None:
            log.warning("webhook %s (%s) disabled: %s", hook.id, hook.url, reason)


def loop_time() -> float:
    return asyncio.get_running_loop().time()


def _retry_after(header: str) -> float | None:
    """The wait a 429's or 503's `Retry-After` asks for, in seconds or as a date; None if it
    asks for none."""
    value = header.strip()
    if not value:
        return None
    if value.isdigit():
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            return None
        seconds = (when - datetime.now(when.tzinfo)).total_seconds()
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)


def _describe(exc: Exception) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer within the timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        # Its own text names the OS error's code only; the error says why (an address refused).
        return f"cannot connect to {exc.host}:{exc.port}: {exc.os_error}"[:500]
    return f"{type(exc).__name__}: {exc}"[:500]
