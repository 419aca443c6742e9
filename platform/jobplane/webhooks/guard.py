"""Keeping webhook deliveries away from internal addresses (server-side request forgery).

A subscriber chooses the URL jobplane posts to. Left alone, they could name an address only the
platform can reach: a database or an admin port on localhost, a service on the private network,
the cloud metadata endpoint (169.254.169.254) that hands out the machine's credentials. Checking
the URL's host when it is submitted is not enough: a name is resolved again at every delivery,
and its owner can make it answer a public address to the check and 127.0.0.1 to the connection
(DNS rebinding), or use a numeric form only the resolver understands (`http://0x7f.1/`).

So the decision is made where the connection is made. `GuardedBackend` is the network backend
of the delivery client's connection pool: it resolves the host itself, refuses if any address it
gets is internal, and connects to an address it checked, by that address, so nothing is resolved
between the check and the connect. TLS is unaffected: httpcore starts it on the returned stream
with the URL's host name as `server_hostname`, so the certificate is still verified against the
name. `check_url` only refuses URLs that are malformed or not plain HTTP(S) when they are
submitted; it resolves nothing.
"""

import asyncio
import contextlib
import functools
import ipaddress
import socket
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

import httpcore
import httpx

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_URL_LENGTH = 2048

# Metadata endpoints outside the ranges refused anyway: AWS's IPv6 one sits in fc00::/7 but
# deserves its own reason; Oracle Cloud's is in 192.0.0.0/24, which Python counts as global.
_METADATA = frozenset(ipaddress.ip_address(a) for a in ("fd00:ec2::254", "192.0.0.192"))
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT: internal, yet not "private"
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def check_url(url: str) -> str:
    """The webhook URL `url` normalised (scheme and host lower case, the host in IDNA form).

    Raises `ValueError` saying what is wrong with it. Where it points is judged at delivery.
    """
    url = url.strip()
    if len(url) > MAX_URL_LENGTH:
        raise ValueError(f"the URL is longer than {MAX_URL_LENGTH} characters")
    # httpx would quietly percent-encode them, and then deliver to a URL nobody typed.
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ValueError("the URL contains spaces or control characters")
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"not a valid URL: {exc}") from None
    if parsed.scheme not in ("http", "https"):
        raise ValueError("the URL must start with http:// or https://")
    if not parsed.host:
        raise ValueError("the URL has no host")
    # httpx drops an empty userinfo ("http://@host/"): look at the authority as written.
    authority = url.split("//", 1)[-1].split("/", 1)[0].split("?", 1)[0]
    if parsed.userinfo or "@" in authority:
        raise ValueError("the URL must not contain a user name or password")
    # A fragment is never sent, so one can only be a mistake.
    if "#" in url:
        raise ValueError("the URL must not contain a fragment (#...)")
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        raise ValueError("the URL's port must be between 1 and 65535")
    return str(parsed)


def refused(address: Address) -> str | None:
    """Why a delivery may not connect to `address` ("a loopback address"...), or None."""
    if address in _METADATA:
        return "a link-local or metadata address"
    if isinstance(address, ipaddress.IPv6Address):
        # Translated forms reach exactly their IPv4 address: judge that alone.
        if address.ipv4_mapped is not None:
            return refused(address.ipv4_mapped)
        if address in _NAT64:
            return refused(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
        # Tunnels lead to their IPv4 end, but are IPv6 addresses too: judge both.
        for tunnelled in _tunnelled_ipv4(address):
            if reason := refused(tunnelled):
                return reason
    if address.is_unspecified:
        return "an unspecified address"
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local or metadata address"
    if address.is_multicast:
        return "a multicast address"
    if address in _SHARED:
        return "a shared (carrier-grade NAT) address"
    if address.is_private:
        return "a private address"
    if address.is_reserved:
        return "a reserved address"
    if not address.is_global:
        return "not a public address"
    return None


def _tunnelled_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    if address.sixtofour is not None:
        return [address.sixtofour]
    if address.teredo is not None:
        return list(address.teredo)
    # IPv4-compatible (::a.b.c.d, deprecated); :: and ::1 are themselves.
    if int(address) >> 32 == 0 and int(address) > 1:
        return [ipaddress.IPv4Address(int(address))]
    return []


class Refused(httpcore.ConnectError):
    """A delivery's destination is internal. httpx raises it as `httpx.ConnectError`."""


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, connecting only to addresses `refused` allows (asyncio)."""

    def __init__(self) -> None:
        self._backend = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's signature)
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            async with asyncio.timeout(timeout):
                addresses = await _resolve(host, port)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"resolving {host} timed out") from None
        # Any internal address refuses the host: which one a connection would get is the
        # resolver's (and so the name's owner's) choice.
        for address in addresses:
            if reason := refused(address):
                said = "" if host == str(address) else f"it resolves to {address}, "
                raise Refused(f"refused to connect to {host}: {said}{reason}")
        error: httpcore.ConnectError | None = None
        for address in addresses:  # in the resolver's order, as a connection by name would
            remaining = None if deadline is None else max(deadline - loop.time(), 0.0)
            try:
                return await self._backend.connect_tcp(
                    str(address),
                    port,
                    timeout=remaining,
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except httpcore.ConnectError as exc:
                error = exc
        assert error is not None  # `_resolve` returns at least one address
        raise error

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's signature)
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise Refused("refused to connect to a Unix socket")

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


async def _resolve(host: str, port: int) -> list[Address]:
    """`host`'s addresses, in the resolver's order, without repeats."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise httpcore.ConnectError(f"cannot resolve {host}: {exc}") from None
    addresses = [
        ipaddress.ip_address(info[4][0])
        for info in infos
        if info[0] in (socket.AF_INET, socket.AF_INET6)
    ]
    if not addresses:
        raise httpcore.ConnectError(f"cannot resolve {host}: no IP address")
    return list(dict.fromkeys(addresses))


def client(timeout: float, allow_private: bool) -> httpx.AsyncClient:
    """An HTTP client for deliveries: guarded (unless `allow_private`), no redirects followed
    (a redirect would be a second, unchecked URL), no proxy or settings from the environment."""
    transport: httpx.AsyncBaseTransport = (
        httpx.AsyncHTTPTransport(verify=_ssl_context(), trust_env=False)
        if allow_private
        else _GuardedTransport()
    )
    return httpx.AsyncClient(
        transport=transport, timeout=timeout, follow_redirects=False, trust_env=False
    )


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    return httpx.create_ssl_context(trust_env=False)  # made once: it reads the CA bundle


class _GuardedTransport(httpx.AsyncBaseTransport):
    """`httpx.AsyncHTTPTransport` on `GuardedBackend`. httpx takes no network backend, so this
    mirrors its transport (httpx 0.28, `_transports/default.py`), without proxies."""

    def __init__(self) -> None:
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=_ssl_context(),
            # httpx's default limits
            max_connections=100,
            max_keepalive_connections=20,
            keepalive_expiry=5.0,
            network_backend=GuardedBackend(),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _httpx_errors():
            response = await self._pool.handle_async_request(core_request)
        assert isinstance(response.stream, AsyncIterable)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_ResponseStream(response.stream),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._pool.aclose()


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, stream: AsyncIterable[bytes]) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _httpx_errors():
            async for part in self._stream:
                yield part

    async def aclose(self) -> None:
        # httpcore's response streams close; `AsyncIterable` says nothing of it.
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            await aclose()


# httpcore's exceptions as httpx raises them, each before its base class.
_ERRORS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
)


@contextlib.contextmanager
def _httpx_errors() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        for core, mapped in _ERRORS:
            if isinstance(exc, core):
                raise mapped(str(exc)) from exc
        raise
