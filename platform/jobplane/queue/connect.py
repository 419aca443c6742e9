"""Reaching Redis from `JOBPLANE_REDIS_URL`: one server, a Redis Cluster, or Sentinel.

Three URL forms, each a client redis-py ships:
- `redis://` / `rediss://`: one server (`Redis.from_url`);
- `redis+cluster://[user:password@]host:port[,host:port...][?options]`: a Redis Cluster
  (`RedisCluster`); the nodes are seeds, the rest are discovered;
- `redis+sentinel://[user:password@]host:port[,host:port...]/<master-name>[/<db>][?options]`:
  the master Sentinel names (`Sentinel(...).master_for(...)`), followed through failovers.

Options are redis-py's URL options (`socket_timeout`, `health_check_interval`, ...), plus
`ssl=true` for TLS to the cluster's nodes or the Sentinel's master, and `sentinel_username`
and `sentinel_password` for Sentinels that require authentication.
A URL is parsed whole before anything connects, so a malformed one fails at start-up with one
line naming the problem.
"""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterNode, ClusterPipeline
from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS, to_bool
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import RedisClusterException, RedisError

RedisClient = Redis | RedisCluster
RedisPipeline = Pipeline | ClusterPipeline

Kind = Literal["single", "cluster", "sentinel"]

# What a call raises when Redis does not answer. redis-py's cluster client raises some of its
# own outside `RedisError` (a slot no node serves while one is down: `SlotNotCoveredError`).
REDIS_DOWN: tuple[type[Exception], ...] = (RedisError, RedisClusterException, OSError)

_SCHEMES: dict[str, Kind] = {
    "redis": "single",
    "rediss": "single",
    "unix": "single",
    "redis+cluster": "cluster",
    "redis+sentinel": "sentinel",
}
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
# Client options a URL may not set: they are the URL's own parts, or jobplane's to choose.
_NOT_OPTIONS = ("db", "protocol", "legacy_responses")
_PARSERS = {
    **{k: v for k, v in URL_QUERY_ARGUMENT_PARSERS.items() if k not in _NOT_OPTIONS},
    "ssl": to_bool,
}


class RedisURLError(ValueError):
    """A `JOBPLANE_REDIS_URL` jobplane cannot use; the message is one line for the operator."""


@dataclass(frozen=True)
class RedisTarget:
    """What a Redis URL names, checked; `open_redis` connects to it."""

    kind: Kind
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    master: str | None = None
    db: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    sentinel_options: dict[str, str] = field(default_factory=dict)


def parse_redis_url(url: str) -> RedisTarget:
    """Check a `JOBPLANE_REDIS_URL`; raises `RedisURLError` saying what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in _SCHEMES:
        raise RedisURLError(
            f"JOBPLANE_REDIS_URL {_shown(url)!r} must start with redis://, rediss://, "
            "redis+cluster:// or redis+sentinel://"
        )
    kind = _SCHEMES[scheme.lower()]
    if kind == "single":
        if not rest or (scheme.lower() != "unix" and rest.startswith(("/", "?"))):
            raise RedisURLError(f"JOBPLANE_REDIS_URL {_shown(url)!r} names no host")
        return RedisTarget("single", url)
    rest, _, query = rest.partition("?")
    authority, _, path = rest.partition("/")
    userinfo, at, hosts = authority.rpartition("@")
    if not at:
        hosts = authority
    options, sentinel_options = _options(url, query)
    if at:
        user, colon, password = userinfo.partition(":")
        if user:
            options["username"] = unquote(user)
        if colon:
            options["password"] = unquote(password)
    nodes = tuple(_node(url, part) for part in hosts.split(","))
    parts = [unquote(p) for p in path.split("/")] if path else []
    if kind == "cluster":
        if parts:
            raise RedisURLError(
                f"JOBPLANE_REDIS_URL {_shown(url)!r}: a Redis Cluster has no master name or "
                "database number (a cluster serves database 0 only)"
            )
        if sentinel_options:
            raise RedisURLError(
                f"JOBPLANE_REDIS_URL {_shown(url)!r}: sentinel_* options are for "
                "redis+sentinel:// URLs"
            )
        return RedisTarget("cluster", url, nodes, options=options)
    if not parts or not parts[0] or len(parts) > 2:
        raise RedisURLError(
            f"JOBPLANE_REDIS_URL {_shown(url)!r} must name the master after the hosts: "
            "redis+sentinel://host:port[,host:port...]/<master-name>[/<db>]"
        )
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise RedisURLError(
                f"JOBPLANE_REDIS_URL {_shown(url)!r}: database {parts[1]!r} is not a number"
            )
        db = int(parts[1])
    return RedisTarget("sentinel", url, nodes, parts[0], db, options, sentinel_options)


@asynccontextmanager
async def open_redis(target: RedisTarget, **options: Any) -> AsyncIterator[RedisClient]:
    """A client of `target`, closed on exit; `options` are defaults the URL's options override."""
    if target.kind == "single":
        single: Redis = Redis.from_url(target.url, **options)
        try:
            yield single
        finally:
            await single.aclose()
        return
    merged = {**options, **target.options}
    if target.kind == "cluster":
        nodes = [ClusterNode(host, port) for host, port in target.nodes]
        cluster = RedisCluster(startup_nodes=nodes, **merged)
        try:
            yield cluster
        finally:
            await cluster.aclose()
        return
    assert target.master is not None
    # The Sentinels are asked where the master is with the URL's socket options (and their own
    # credentials when given); the master itself gets every option and the URL's credentials.
    sentinel_kwargs = {k: v for k, v in merged.items() if k.startswith("socket_")}
    sentinel_kwargs.update(
        (name.removeprefix("sentinel_"), value) for name, value in target.sentinel_options.items()
    )
    sentinel = Sentinel(  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
        list(target.nodes), sentinel_kwargs=sentinel_kwargs, **merged
    )
    master: Redis = sentinel.master_for(target.master, redis_class=Redis, db=target.db)
    try:
        yield master
    finally:
        await master.aclose()
        for client in sentinel.sentinels:
            await client.aclose()


def _options(url: str, query: str) -> tuple[dict[str, Any], dict[str, str]]:
    options: dict[str, Any] = {}
    sentinel_options: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name in _SENTINEL_OPTIONS:
            sentinel_options[name] = value
            continue
        parser = _PARSERS.get(name)
        if parser is None:
            known = sorted([*_PARSERS, *_SENTINEL_OPTIONS])
            raise RedisURLError(
                f"JOBPLANE_REDIS_URL {_shown(url)!r}: unknown option {name!r} "
                f"(known: {', '.join(known)})"
            )
        try:
            options[name] = parser(value)
        except (TypeError, ValueError):
            raise RedisURLError(
                f"JOBPLANE_REDIS_URL {_shown(url)!r}: option {name}={value!r} is not valid"
            ) from None
    return options, sentinel_options


def _node(url: str, part: str) -> tuple[str, int]:
    host, colon, port = part.rpartition(":")
    if host.startswith("[") and host.endswith("]"):  # an IPv6 address
        host = host[1:-1]
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RedisURLError(
            f"JOBPLANE_REDIS_URL {_shown(url)!r}: {part!r} is not host:port "
            "(each node needs its port)"
        )
    return host, int(port)


def _shown(url: str) -> str:
    """The URL with any password masked, for messages and logs."""
    scheme, sep, rest = url.partition("://")
    authority, slash, tail = rest.partition("/")
    userinfo, at, hosts = authority.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return f"{scheme}://{user}:***@{hosts}{slash}{tail}"
