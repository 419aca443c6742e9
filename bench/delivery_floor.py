"""What one webhook delivery's HTTP request costs, with nothing of jobplane around it: the floor
under the price of webhooks per run.

Each delivery is a try as `webhooks/sender.py` makes it, and nothing else: a body the size of
a run event's (the run's JSON inside Standard Webhooks' envelope), signed with
`standardwebhooks` as the sender signs it, POSTed through the sender's own aiohttp session
(`webhooks/guard.py`), 16 in flight as the sender keeps for one webhook. The receiver is
bench/webhooks.py's (a bare asyncio protocol answering 204, in a process of its own). No
MongoDB, no change stream, no run read: the notifier's work but the request is left out.

CPU is this process's (`time.process_time()`) and the receiver's (from /proc), per delivery,
three rounds of `--deliveries`. A no-op run subscribed to `*` makes four deliveries
(`run.created`, `run.started`, `step.succeeded`, `run.succeeded`). docs/benchmarks.md ("Issue
28") has the figures.

    .venv/bin/python bench/delivery_floor.py [--deliveries N]
"""

import argparse
import asyncio
import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from standardwebhooks.webhooks import Webhook as Signer

import jobplane.process
from jobplane.devstack.servers import free_port
from jobplane.webhooks import guard
from throughput import cpu_seconds

IN_FLIGHT = 16
SECRET = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
# A no-op run as a delivery carries it: about the size of the bench's runs' events.
RUN = {
    "id": "6b0b6cfe2b329c3ee509a575",
    "templateType": "bench_noop",
    "templateVersion": 1,
    "queue": "default",
    "scope": "user",
    "scopeId": "u1",
    "status": "succeeded",
    "priority": 0,
    "payload": {"i": 1},
    "attempt": 1,
    "maxAttempts": 3,
    "progress": {
        "percentage": 100,
        "steps": [{"id": "noop", "status": "succeeded", "percentage": 100, "attempt": 1}],
    },
    "outputs": {"noop": None},
    "createdBy": "bench",
    "createAt": "2026-11-29T07:00:00.000Z",
    "updateAt": "2026-11-29T07:00:00.010Z",
    "startedAt": "2026-11-29T07:00:00.004Z",
    "completedAt": "2026-11-29T07:00:00.010Z",
    "lockedBy": "worker-1",
    "version": 4,
}


# Made once, as the sender makes a run's JSON once for all the deliveries that carry it.
RUN_JSON = json.dumps(RUN, separators=(",", ":"))


def body(i: int) -> str:
    """Standard Webhooks' envelope around the run: only the envelope is made per delivery."""
    head = (
        f'"id":"evt_{i:024x}","type":"run.succeeded","timestamp":"{datetime.now(UTC).isoformat()}"'
    )
    return f'{{{head},"data":{{"run":{RUN_JSON}}}}}'


async def deliver(url: str, count: int) -> None:
    """`count` signed POSTs, IN_FLIGHT at a time, each answered 204."""
    signer = Signer(SECRET)
    queue = iter(range(count))
    async with guard.session(15, allow_private=True) as http:

        async def one_at_a_time() -> None:
            for i in queue:
                data, message_id, now = body(i), f"msg_{i}", datetime.now(UTC)
                headers = {
                    "content-type": "application/json",
                    "user-agent": "jobplane-bench",
                    "webhook-id": message_id,
                    "webhook-timestamp": str(int(now.timestamp())),
                    "webhook-signature": signer.sign(message_id, now, data),
                }
                async with http.post(url, data=data.encode(), headers=headers) as response:
                    assert response.status == 204, response.status

        await asyncio.gather(*(one_at_a_time() for _ in range(IN_FLIGHT)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deliveries", type=int, default=20_000)
    args = parser.parse_args()
    port = free_port()
    receiver = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("webhooks.py")),
            "--serve-receiver",
            str(port),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert receiver.stdout is not None
        receiver.stdout.readline()  # "receiver listening on ..."
        url = f"http://127.0.0.1:{port}/hook"
        jobplane.process.run(deliver(url, 1_000))  # warm-up
        for _ in range(3):
            client, server, began = time.process_time(), cpu_seconds(receiver.pid), time.time()
            jobplane.process.run(deliver(url, args.deliveries))
            took = time.time() - began
            client = (time.process_time() - client) / args.deliveries * 1e6
            server = (cpu_seconds(receiver.pid) - server) / args.deliveries * 1e6
            print(
                f"CPU µs per delivery: sender {client:.0f}, receiver {server:.0f} "
                f"({args.deliveries / took:,.0f} deliveries/s)",
                flush=True,
            )
    finally:
        receiver.kill()
        receiver.wait()


if __name__ == "__main__":
    main()
