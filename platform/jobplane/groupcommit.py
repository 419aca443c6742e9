"""Batched writes: many small writes become one bulk write.

`GroupCommit` is for writes a caller waits on. A caller hands its item over and waits for its
own result. When nothing is being written the batch goes out at once (on the event loop's next
turn, which lets callers woken together join it); while a write is in flight, new items gather
and leave together as soon as it returns. So an idle system pays no wait, and a busy one pays at
most one bulk round trip of waiting, in exchange for one round trip (and one journal sync) per
batch instead of per item. A caller hears back only after the write that holds its item has
returned: nothing is acknowledged before it is durable.

`Backlog` is for writes nobody waits on (copies that can be made again later): items linger a
moment for more to share their write.
"""

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger("jobplane.groupcommit")

T = TypeVar("T")
R = TypeVar("R")

# The flush returns one outcome per item: its result, or the exception that item alone failed
# with. An exception the flush raises fails every item of the batch.
Flush = Callable[[list[T]], Awaitable[Sequence[R | BaseException]]]


class GroupCommit(Generic[T, R]):
    def __init__(self, flush: Flush[T, R], max_batch: int = 1000) -> None:
        self._flush = flush
        self._max_batch = max_batch
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def submit(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._writer is None:
            self._writer = asyncio.create_task(self._write())
        # A caller that gives up cancels its own future only; the batch goes on for the others.
        return await future

    async def _write(self) -> None:
        batch: list[tuple[T, asyncio.Future[R]]] = []
        try:
            while self._pending:
                batch = self._pending[: self._max_batch]
                del self._pending[: self._max_batch]
                try:
                    outcomes = await self._flush([item for item, _ in batch])
                except Exception as exc:
                    outcomes = [exc] * len(batch)
                for (_, future), outcome in zip(batch, outcomes, strict=True):
                    if future.done():
                        continue
                    if isinstance(outcome, BaseException):
                        future.set_exception(outcome)
                    else:
                        future.set_result(outcome)
        finally:
            self._writer = None
            # Cancelled mid-batch (the loop is closing): nobody may wait forever.
            for _, future in [*batch, *self._pending]:
                future.cancel()
            self._pending.clear()


class Backlog(Generic[T]):
    """Items handed over are written in batches off the callers' path.

    Each batch lingers `linger` seconds for more items to share its write: at a low rate many
    writers' items go in one write instead of one each. `drain` cuts the linger short and
    waits until every item handed over has been written (or failed to be). Beyond
    `max_backlog` items waiting, `hand` waits: the writes are not keeping up. `write` handles
    its own failures, as nobody is there to hear of them; one it lets through is logged and
    loses its batch only.
    """

    def __init__(
        self,
        write: Callable[[list[T]], Awaitable[None]],
        linger: float,
        max_backlog: int = 10_000,
    ) -> None:
        self._write = write
        self._linger = linger
        self._max_backlog = max_backlog
        self._pending: list[T] = []
        self._taken = asyncio.Event()
        self._hurry = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None

    async def hand(self, items: Sequence[T]) -> None:
        if not items:
            return
        self._pending.extend(items)
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_pending())
        while len(self._pending) > self._max_backlog and self._writer is not None:
            await self._taken.wait()

    async def drain(self) -> None:
        while self._writer is not None:
            self._hurry.set()
            await asyncio.wait([self._writer])

    async def _write_pending(self) -> None:
        try:
            while self._pending:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._hurry.wait(), self._linger)
                batch, self._pending = self._pending, []
                self._taken.set()
                self._taken = asyncio.Event()
                try:
                    await self._write(batch)
                except Exception:
                    log.exception("a write of %d items failed", len(batch))
        finally:
            self._writer = None
            self._hurry.clear()
