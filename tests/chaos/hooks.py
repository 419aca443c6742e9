"""The chaos scenarios' webhook receiver: a real HTTP server on 127.0.0.1, in the driver's
process, to which the cluster's notifiers deliver the end of every run.

Each scope the load's runs use has a webhook for the runs' ends, posting to a path of its own.
The receiver verifies each request's signature with the Standard Webhooks reference library,
with the secret of the webhook whose path it came to, records the message id (`webhook-id`) of
each verified one, and answers 200; a request it cannot verify is answered 400 and recorded as
a violation. `invariants.webhook_deliveries` then compares what it got with the trail.
"""

from dataclasses import dataclass, field

import httpx
from standardwebhooks.webhooks import Webhook, WebhookVerificationError
from starlette.types import Receive, Scope, Send

from jobplane.devstack import free_port
from tests.chaos.invariants import Subscribed
from tests.integration.receiver import body_of, serving

__all__ = ["ENDS", "SCOPES", "Receiver", "serving"]

# Every scope the load's runs use (`Load.request`: `acct<i % 7>`, a map's children in their
# parent's, the schedule's runs in acct0), each with its webhook: every run's end is checked.
SCOPES: list[Subscribed] = [("account", f"acct{i}") for i in range(7)]
ENDS = ["run.succeeded", "run.failed", "run.cancelled", "run.expired"]


@dataclass
class Receiver:
    port: int = field(default_factory=free_port)
    # By path: the scope of the webhook that posts there, and its secret.
    hooks: dict[str, tuple[Subscribed, str]] = field(default_factory=dict)
    # The webhook (its scope) and the message id of each verified request, as they came.
    received: list[tuple[Subscribed, str]] = field(default_factory=list)
    # By message id (or path), why a request to it was refused: each is a violation.
    forged: dict[str, str] = field(default_factory=dict)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    @property
    def subscribed(self) -> set[Subscribed]:
        return {where for where, _ in self.hooks.values()}

    async def subscribe(self, http: httpx.AsyncClient) -> None:
        """Make each scope's webhook (through the API, as a user would)."""
        for scope, scope_id in SCOPES:
            path = f"/hook/{scope}/{scope_id}"
            body = {"url": self.url(path), "events": ENDS, "scope": scope, "scopeId": scope_id}
            made = await http.post("/v1/webhooks", json=body)
            assert made.status_code == 201, made.text
            self.hooks[path] = ((scope, scope_id), made.json()["secret"])

    async def __call__(self, asgi: Scope, receive: Receive, send: Send) -> None:
        assert asgi["type"] == "http"
        body = await body_of(receive)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in asgi["headers"]}
        status = self.record(asgi["path"], headers, body)
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    def record(self, path: str, headers: dict[str, str], body: bytes) -> int:
        message_id = headers.get("webhook-id", "")
        if path not in self.hooks:
            self.forged[path] = f"a request to {path}, which no webhook posts to"
            return 404
        where, secret = self.hooks[path]
        try:
            verified = Webhook(secret).verify(body, headers)
        except (WebhookVerificationError, ValueError) as exc:  # ValueError: malformed
            self.forged[message_id] = f"{message_id} to {path}: the signature failed ({exc!r})"
            return 400
        if not isinstance(verified, dict) or verified.get("id") != message_id:
            self.forged[message_id] = f"{message_id} to {path}: its body is not that message"
            return 400
        self.received.append((where, message_id))
        return 200
