"""Each chaos scenario, shortened (`make chaos` runs them at full length): a load of mixed
runs through the real API, worker, scheduler and API processes, faults injected until the
backlog drains, then the invariant checker's audit, which must find nothing.
"""

from pathlib import Path

import pytest

from tests.chaos.scenarios import SCENARIOS, SHORT, Where


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", SCENARIOS)
async def test_scenario(name: str, mongo_url: str, db_name: str, tmp_path: Path) -> None:
    result = await SCENARIOS[name](Where(tmp_path, mongo_url, db_name), SHORT)
    assert result.faults > 0, "no fault was injected"
    assert result.runs >= SHORT.runs * 0.9, result.notes
    assert result.violations == [], "\n".join(result.violations[:50])
