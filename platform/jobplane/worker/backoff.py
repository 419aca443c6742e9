"""How long a run waits before its next attempt."""

import random
from collections.abc import Callable

from jobplane.model import RetryPolicy


def backoff_seconds(
    policy: RetryPolicy, attempt: int, rand: Callable[[], float] = random.random
) -> float:
    """The delay after failed attempt number `attempt` (1-based).

    An explicit `backoffSeconds` list is used as written, its last value repeating. Otherwise
    the delay grows exponentially up to `maxSeconds`, with full jitter (uniform in [0, d]),
    equal jitter (uniform in [d/2, d]) or none; jitter keeps many failing runs from retrying
    in lockstep.
    """
    if policy.backoff_seconds:
        return policy.backoff_seconds[min(attempt, len(policy.backoff_seconds)) - 1]
    delay = min(policy.max_seconds, policy.initial_seconds * policy.multiplier ** (attempt - 1))
    if policy.jitter == "full":
        return rand() * delay
    if policy.jitter == "equal":
        return delay / 2 + rand() * delay / 2
    return delay
