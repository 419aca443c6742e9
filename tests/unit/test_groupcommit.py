"""Group commit: concurrent items leave together, and each caller hears only its own outcome.
A backlog: items nobody waits for linger to share a write, and a drain writes them all."""

import asyncio

import pytest

from jobplane.groupcommit import Backlog, GroupCommit


class Recorder:
    """A flush that records its batches and fails the items it is told to."""

    def __init__(self, fail: set[int] | None = None) -> None:
        self.batches: list[list[int]] = []
        self.fail = fail or set()

    async def __call__(self, items: list[int]) -> list[int | BaseException]:
        self.batches.append(items)
        await asyncio.sleep(0.01)  # a round trip, during which new items gather
        return [ValueError(i) if i in self.fail else i * 10 for i in items]


async def test_items_submitted_together_leave_in_one_batch() -> None:
    flush = Recorder()
    commit = GroupCommit(flush)
    assert await asyncio.gather(*(commit.submit(i) for i in range(20))) == [
        i * 10 for i in range(20)
    ]
    assert flush.batches == [list(range(20))]


async def test_items_arriving_during_a_write_leave_together_next() -> None:
    flush = Recorder()
    commit = GroupCommit(flush)
    first = asyncio.ensure_future(commit.submit(0))
    await asyncio.sleep(0.001)  # the first batch is in flight
    later = [asyncio.ensure_future(commit.submit(i)) for i in range(1, 6)]
    assert await first == 0
    assert await asyncio.gather(*later) == [10, 20, 30, 40, 50]
    assert flush.batches == [[0], [1, 2, 3, 4, 5]]


async def test_batches_are_capped() -> None:
    flush = Recorder()
    commit = GroupCommit(flush, max_batch=4)
    await asyncio.gather(*(commit.submit(i) for i in range(10)))
    assert [len(b) for b in flush.batches] == [4, 4, 2]


async def test_an_item_that_fails_fails_alone() -> None:
    commit = GroupCommit(Recorder(fail={3}))
    outcomes = await asyncio.gather(*(commit.submit(i) for i in range(5)), return_exceptions=True)
    assert [o if not isinstance(o, ValueError) else "failed" for o in outcomes] == [
        0,
        10,
        20,
        "failed",
        40,
    ]


async def test_a_failed_write_fails_every_item_of_its_batch_only() -> None:
    calls = 0

    async def flaky(items: list[int]) -> list[int | BaseException]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("down")
        return items

    commit = GroupCommit(flaky)
    first = await asyncio.gather(*(commit.submit(i) for i in range(3)), return_exceptions=True)
    assert all(isinstance(o, ConnectionError) for o in first)
    assert await commit.submit(7) == 7  # the next batch is written as usual


async def test_a_caller_that_gives_up_does_not_stop_the_others() -> None:
    flush = Recorder()
    commit = GroupCommit(flush)
    quitter = asyncio.ensure_future(commit.submit(1))
    stayer = asyncio.ensure_future(commit.submit(2))
    await asyncio.sleep(0)
    quitter.cancel()
    assert await stayer == 20
    with pytest.raises(asyncio.CancelledError):
        await quitter
    assert flush.batches == [[1, 2]]  # written all the same: a write once sent cannot be undone


async def test_a_backlog_writes_after_its_linger_what_gathered_meanwhile() -> None:
    written: list[list[int]] = []
    done = asyncio.Event()

    async def write(items: list[int]) -> None:
        written.append(items)
        done.set()

    backlog = Backlog(write, linger=0.05)
    await backlog.hand([1, 2])
    await backlog.hand([3])
    assert written == []  # handing over does not wait for the write
    async with asyncio.timeout(30):
        await done.wait()
    assert written == [[1, 2, 3]]


async def test_a_drain_cuts_the_linger_short_and_writes_everything() -> None:
    written: list[list[int]] = []

    async def write(items: list[int]) -> None:
        written.append(items)
        await asyncio.sleep(0)

    backlog = Backlog(write, linger=3600)
    await backlog.hand([1, 2])
    await backlog.hand([3])
    await backlog.drain()
    assert written == [[1, 2, 3]]
    await backlog.hand([4])
    await backlog.drain()
    assert written == [[1, 2, 3], [4]]


async def test_handing_over_waits_while_the_backlog_is_full() -> None:
    release = asyncio.Event()
    written: list[list[int]] = []

    async def write(items: list[int]) -> None:
        await release.wait()
        written.append(items)

    backlog = Backlog(write, linger=0, max_backlog=3)
    await backlog.hand([1])
    await asyncio.sleep(0.01)  # the writer took [1] and is stuck writing it
    more = asyncio.ensure_future(backlog.hand([2, 3, 4, 5]))
    await asyncio.sleep(0.01)
    assert not more.done()  # four waiting, more than three
    release.set()
    await more  # the writer took them
    await backlog.drain()
    assert written == [[1], [2, 3, 4, 5]]


async def test_a_backlog_write_that_raises_loses_its_batch_only() -> None:
    written: list[list[int]] = []

    async def write(items: list[int]) -> None:
        if items == [1]:
            raise ConnectionError("down")
        written.append(items)

    backlog = Backlog(write, linger=3600)
    await backlog.hand([1])
    await backlog.drain()
    await backlog.hand([2])
    await backlog.drain()
    assert written == [[2]]
