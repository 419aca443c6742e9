"""A branch handler only the first worker of bench/flows.py's "lent" shape offers, as
`branch_near:started`; `branch_far` holds the second's."""

import time


async def started(ctx: object) -> dict[str, float]:
    """The step's whole work, as `bench.started`: note when it began."""
    return {"startedAt": time.time()}
