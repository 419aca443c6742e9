"""How jobplane calls Redis: every call bounded in time, scripts loaded by name.

`queue/redis.py`, `queue/locks.py` and `queue/limits.py` share these; nothing else does.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from datetime import datetime
from importlib import resources
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, cast

from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from jobplane.queue.connect import RedisClient, RedisPipeline

P = ParamSpec("P")
R = TypeVar("R")


class Bounded(Protocol):
    """What `bounded` calls: an object of Redis calls and the longest any may take."""

    timeout_seconds: float


B = TypeVar("B", bound=Bounded)


@contextlib.asynccontextmanager
async def answered_within(seconds: float, what: str) -> AsyncIterator[None]:
    """Fail with redis-py's `TimeoutError` (a `RedisError`) past `seconds`.

    Socket timeouts bound each read and write, but a call can still wait without end inside
    the driver: under a Redis Cluster node's restart, redis-py's cluster client was seen to
    leave a call waiting for good. Every caller already treats a Redis error as "Redis did not
    answer" and carries on (the reconciler and the heartbeat repair what was not written), so
    the bound turns such a wait into one of those.

    Under the same restarts it was also seen writing to a connection uvloop had closed
    (`RuntimeError: unable to perform operation on <TCPTransport closed=True ...>`), out of a
    create's push: the create answered 500 for a run it had stored. That is Redis not
    answering too. So is redis-py 8.1 writing to a connection a reset closed meanwhile, which
    raises `AttributeError` or `TypeError` from inside its connection (redis/redis-py#4287):
    those are taken for Redis only when raised there, so a bug of ours still surfaces."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise RedisTimeoutError(f"Redis did not answer {what} within {seconds:g} s") from None
    except RuntimeError as exc:
        raise RedisConnectionError(f"Redis client failed {what}: {exc}") from exc
    except (AttributeError, TypeError) as exc:
        if not _raised_writing(exc):
            raise
        raise RedisConnectionError(f"Redis client failed {what}: {exc!r}") from exc


# Where a write to a connection closed under it fails: redis-py's connection, or the asyncio
# stream and transport beneath it.
_WRITING = ("redis/asyncio/connection.py", "asyncio/streams.py", "asyncio/selector_events.py")


def _raised_writing(exc: BaseException) -> bool:
    """Whether `exc` was raised in a connection's write path (its innermost frame's file)."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith(_WRITING)


def bounded(
    method: Callable[Concatenate[B, P], Awaitable[R]],
) -> Callable[Concatenate[B, P], Coroutine[Any, Any, R]]:
    """The call is bounded by its object's `timeout_seconds` (see `answered_within`)."""

    async def call(self: B, /, *args: P.args, **kwargs: P.kwargs) -> R:
        async with answered_within(self.timeout_seconds, method.__name__):
            return await method(self, *args, **kwargs)

    return call


def script(redis: RedisClient, name: str, *preludes: str) -> AsyncScript:
    """The script `lua/<name>.lua`, after the `preludes` it shares functions with, without its
    comment lines: `eval_in` sends the source with every call, and Redis reads and hashes it
    each time (the pop's comments were a third of its 12 KB, and of its cost to Redis)."""
    lua = resources.files("jobplane.queue") / "lua"
    source = "\n".join((lua / f"{part}.lua").read_text() for part in [*preludes, name])
    code = [line for line in source.splitlines() if not line.lstrip().startswith("--")]
    return redis.register_script("\n".join(code))


def eval_in(
    pipe: RedisPipeline, script: AsyncScript, keys: Sequence[str], args: Sequence[Any]
) -> None:
    # A script called by its hash in a pipeline makes redis-py ask SCRIPT EXISTS first, a round
    # trip of its own for every pipeline. EVAL carries the source instead: Redis hashes it and
    # runs its cached copy, and never answers NOSCRIPT after a restart or a SCRIPT FLUSH.
    pipe.eval(cast(str, script.script), len(keys), *keys, *args)  # `script` registers text


def epoch_ms(at: datetime) -> int:
    return int(at.timestamp() * 1000)


def text(value: bytes | str | float) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
