"""What every jobplane process does to Python's collector (an application may do it too), and the
helpers that keep a process's start-up and stop within bounds."""

import asyncio
import gc
from collections.abc import Iterator

import pytest

from jobplane.process import Stopped, finish_within, tune_collector, unless_stopped


@pytest.fixture
def collector() -> Iterator[None]:
    """Python's settings come back after the test: the rest of the suite runs with them."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_tune_collector_freezes_what_start_up_left_and_widens_the_young_generation(
    collector: None,
) -> None:
    alive = [[] for _ in range(1000)]  # tracked containers, as modules and tables are
    frozen = gc.get_freeze_count()
    tune_collector()
    assert gc.get_freeze_count() >= frozen + len(alive), "what was alive is out of the way"
    assert gc.get_threshold() == (10_000, 10, 10)


async def test_unless_stopped_returns_the_result_when_the_work_ends_first() -> None:
    assert await unless_stopped(asyncio.sleep(0, "started"), asyncio.Event()) == "started"


async def test_unless_stopped_cancels_the_work_once_stop_is_set() -> None:
    stop, cancelled = asyncio.Event(), asyncio.Event()

    async def start_up() -> None:  # as PyMongo waiting 30 s for a server
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    asyncio.get_running_loop().call_later(0.05, stop.set)
    async with asyncio.timeout(5):
        with pytest.raises(Stopped):
            await unless_stopped(start_up(), stop)
    assert cancelled.is_set()


async def test_finish_within_waits_for_a_task_that_ends_in_time() -> None:
    task = asyncio.ensure_future(asyncio.sleep(0.05))
    assert await finish_within(task, 5, "a quick task")
    assert task.done() and not task.cancelled()


async def test_finish_within_cancels_a_task_past_its_seconds() -> None:
    task = asyncio.ensure_future(asyncio.sleep(30))
    async with asyncio.timeout(5):
        assert not await finish_within(task, 0.05, "a stuck write")
    assert task.cancelled()


async def test_finish_within_leaves_a_task_that_absorbs_its_cancel_behind() -> None:
    async def absorbing() -> None:  # a cancel landing inside a driver's read, lost there
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(30)

    task = asyncio.ensure_future(absorbing())
    async with asyncio.timeout(5):
        assert not await finish_within(task, 0.05, "an absorbing write")
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
