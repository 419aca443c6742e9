"""What every jobplane process does to Python's collector, and an application may do too."""

import gc
from collections.abc import Iterator

import pytest

from jobplane.process import tune_collector


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
