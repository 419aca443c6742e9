from jobplane.model import RetryPolicy
from jobplane.runs.policy import backoff_seconds


def test_explicit_list_is_used_as_written_and_its_last_value_repeats() -> None:
    policy = RetryPolicy(max_attempts=5, backoff_seconds=[30, 120])
    assert [backoff_seconds(policy, n) for n in (1, 2, 3, 4)] == [30, 120, 120, 120]


def test_exponential_without_jitter_grows_and_is_capped() -> None:
    policy = RetryPolicy(initial_seconds=2, multiplier=3, max_seconds=50, jitter="none")
    assert [backoff_seconds(policy, n) for n in (1, 2, 3, 4)] == [2, 6, 18, 50]


def test_full_jitter_spans_zero_to_the_delay() -> None:
    policy = RetryPolicy(initial_seconds=10, multiplier=2, jitter="full")
    assert backoff_seconds(policy, 2, rand=lambda: 0.0) == 0
    assert backoff_seconds(policy, 2, rand=lambda: 0.999) == 20 * 0.999


def test_equal_jitter_keeps_at_least_half() -> None:
    policy = RetryPolicy(initial_seconds=10, multiplier=2, jitter="equal")
    assert backoff_seconds(policy, 2, rand=lambda: 0.0) == 10
    assert backoff_seconds(policy, 2, rand=lambda: 1.0) == 20
