"""Every RedisQueue call ends within its bound, even against a server that never answers."""

import asyncio
import time
from datetime import UTC, datetime

import pytest
from redis.asyncio import Redis
from redis.exceptions import TimeoutError as RedisTimeoutError

from jobplane.queue.connect import REDIS_DOWN
from jobplane.queue.entry import QueueEntry
from jobplane.queue.keys import Keys
from jobplane.queue.redis import RedisQueue


async def test_a_call_to_a_redis_that_never_answers_fails_within_the_bound() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # takes every command, answers none
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    # No socket timeout at all: only the queue's own bound can end the calls.
    redis = Redis(host="127.0.0.1", port=port, socket_timeout=None)
    queue = RedisQueue(redis, Keys("t:"), timeout_seconds=0.3)
    calls = {
        "push": queue.push([QueueEntry("r1", "q", 0)], datetime.now(UTC)),
        "pop": queue.pop(["q"], 4, datetime.now(UTC), block_seconds=0.2),
        "promote": queue.promote(["q"], datetime.now(UTC)),
        "signal_cancel": queue.signal_cancel("r1"),
        "signal_reported": queue.signal_reported("r1#1"),
        "mark_alive": queue.mark_alive("w", 10, 1),
    }
    try:
        for name, call in calls.items():
            began = time.monotonic()
            with pytest.raises(RedisTimeoutError, match="did not answer") as refused:
                await call
            assert isinstance(refused.value, REDIS_DOWN)
            # Bounded (0.3 s, and 0.2 s more for the pop's wait), with slack for a busy machine.
            assert time.monotonic() - began < 30, name
    finally:
        await redis.aclose()
        server.close()


async def test_a_driver_writing_to_a_closed_connection_is_a_redis_error() -> None:
    """redis-py's cluster client, under a node's restart, was seen writing to a connection
    uvloop had closed: a RuntimeError, which callers must see as Redis not answering."""
    redis = Redis(host="127.0.0.1", port=1)

    async def closed(*args: object, **kwargs: object) -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")

    redis.execute_command = closed  # type: ignore[method-assign]
    queue = RedisQueue(redis, Keys("t:"), timeout_seconds=0.3)
    try:
        with pytest.raises(REDIS_DOWN, match="TCPTransport closed"):
            await queue.signal_cancel("r1")
    finally:
        await redis.aclose()


# A write redis-py 8.1 makes to a connection a reset closed meanwhile (redis/redis-py#4287),
# compiled as if it were redis-py's own code: where the error is raised is what tells it apart.
_CLOSED_WRITE = compile(
    "async def write(*args, **kwargs):\n    None.writelines(args)\n",
    "/site-packages/redis/asyncio/connection.py",
    "exec",
)


async def test_a_driver_failing_inside_its_connection_write_is_a_redis_error() -> None:
    found: dict[str, object] = {}
    exec(_CLOSED_WRITE, found)
    redis = Redis(host="127.0.0.1", port=1)
    redis.execute_command = found["write"]  # type: ignore[method-assign]
    queue = RedisQueue(redis, Keys("t:"), timeout_seconds=0.3)
    try:
        with pytest.raises(REDIS_DOWN, match="writelines"):
            await queue.signal_cancel("r1")
    finally:
        await redis.aclose()


async def test_an_attribute_error_of_our_own_is_not_taken_for_redis() -> None:
    redis = Redis(host="127.0.0.1", port=1)

    async def ours(*args: object, **kwargs: object) -> None:
        raise AttributeError("a bug of ours")

    redis.execute_command = ours  # type: ignore[method-assign]
    queue = RedisQueue(redis, Keys("t:"), timeout_seconds=0.3)
    try:
        with pytest.raises(AttributeError, match="a bug of ours"):
            await queue.signal_cancel("r1")
    finally:
        await redis.aclose()
