"""JOBPLANE_REDIS_URL's three forms, and the one-line refusals of malformed ones."""

import subprocess
import sys

import pytest

from jobplane.queue.connect import RedisTarget, RedisURLError, parse_redis_url
from jobplane.queue.keys import Keys


def test_one_server_keeps_redis_pys_own_url() -> None:
    for url in ["redis://localhost:6379/0", "rediss://u:p@h:6380/2?socket_timeout=3", "unix:///s"]:
        assert parse_redis_url(url) == RedisTarget("single", url)


def test_a_cluster_url_names_seed_nodes_credentials_and_options() -> None:
    url = "redis+cluster://app:s%40cret@10.0.0.1:7000,[::1]:7001,node-3:7002?socket_timeout=2.5"
    target = parse_redis_url(url)
    assert target.kind == "cluster"
    assert target.nodes == (("10.0.0.1", 7000), ("::1", 7001), ("node-3", 7002))
    assert target.options == {"socket_timeout": 2.5, "username": "app", "password": "s@cret"}


def test_a_sentinel_url_names_sentinels_master_and_database() -> None:
    url = "redis+sentinel://:pw@s1:26379,s2:26379/mymaster/3?ssl=true&sentinel_password=sp"
    target = parse_redis_url(url)
    assert (target.kind, target.master, target.db) == ("sentinel", "mymaster", 3)
    assert target.nodes == (("s1", 26379), ("s2", 26379))
    assert target.options == {"ssl": True, "password": "pw"}
    assert target.sentinel_options == {"sentinel_password": "sp"}
    assert parse_redis_url("redis+sentinel://s1:26379/mymaster").db == 0


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://h:6379", "must start with redis://, rediss://, redis+cluster://"),
        ("redis://", "names no host"),
        ("redis+cluster://h1:7000,h2", "'h2' is not host:port"),
        ("redis+cluster://h1:99999", "'h1:99999' is not host:port"),
        ("redis+cluster://h1:7000/0", "a Redis Cluster has no master name or database"),
        ("redis+cluster://h1:7000?sentinel_password=x", "sentinel_* options are for"),
        ("redis+sentinel://s1:26379", "must name the master after the hosts"),
        ("redis+sentinel://s1:26379/m/1/2", "must name the master after the hosts"),
        ("redis+sentinel://s1:26379/m/one", "database 'one' is not a number"),
        ("redis+cluster://h:1?socket_timeout=soon", "option socket_timeout='soon' is not valid"),
        ("redis+cluster://h:1?db=2", "unknown option 'db'"),
        ("redis+cluster://h:1?colour=red", "unknown option 'colour' (known: "),
    ],
)
def test_a_malformed_url_is_refused_saying_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(RedisURLError) as refused:
        parse_redis_url(url)
    assert says in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_refusal_never_shows_the_password() -> None:
    with pytest.raises(RedisURLError) as refused:
        parse_redis_url("redis+cluster://app:hunter2@h:1?socket_timeout=x")
    assert "hunter2" not in str(refused.value)
    assert "app:***@h:1" in str(refused.value)


def test_a_prefix_with_a_brace_is_refused() -> None:
    for prefix in ["a{b", "b}"]:
        with pytest.raises(ValueError, match="may not hold"):
            Keys(prefix)


def test_keys_that_scripts_use_together_share_a_slot() -> None:
    keys = Keys("app:")

    def tag(key: str) -> str:
        return key[key.index("{") + 1 : key.index("}")]

    queues = {tag(keys.queue(q)) for q in ["a", "b"]} | {tag(keys.delayed(q)) for q in "ab"}
    assert queues == {"app:queues"}
    assert tag(keys.workers) == tag(keys.workers_held) == "app:workers"
    assert "{" not in keys.singleton_lock("scheduler") + keys.cancel_channel
    assert all(
        k.startswith("app:")
        for k in [keys.queue("a"), keys.workers, keys.singleton_lock("scheduler")]
    )


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"JOBPLANE_REDIS_URL": "redis+sentinel://u:hunter2@s1:26379"}, "must name the master"),
        ({"JOBPLANE_REDIS_PREFIX": "{x}"}, "JOBPLANE_REDIS_PREFIX '{x}' may not hold"),
    ],
)
def test_every_process_refuses_bad_redis_settings_in_one_line(
    env: dict[str, str], says: str
) -> None:
    for command in ["api", "worker", "scheduler", "dev"]:
        done = subprocess.run(
            [sys.executable, "-m", "jobplane", command],
            env={"PATH": "", "JOBPLANE_MONGODB_URL": "mongodb://127.0.0.1:1", **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1, done.stderr
        assert done.stderr.startswith("error: InvalidSettings: ") and says in done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
        assert "hunter2" not in done.stderr
