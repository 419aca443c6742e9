"""Keeping webhook deliveries away from internal addresses (server-side request forgery).

A subscriber chooses the URL jobplane posts to. Left alone, they could name an address only the
platform can reach: a database or an admin port on localhost, a service on the private network,
the cloud metadata endpoint (169.254.169.254) that hands out the machine's credentials. Checking
the URL's host when it is submitted is not enough: a name is resolved again at every delivery,
and its owner can make it answer a public address to the check and 127.0.0.1 to the connection
(DNS rebinding), or use a numeric form only the resolver understands (`http://0x7f.1/`).

So the decision is made where the connection is made: the delivery session's connector makes
each socket through `_socket`, which is handed the very address the socket will connect to
(resolved from the name, or written in the URL) and refuses an internal one. Nothing is
resolved between the check and the connect. TLS is unaffected: it is started with the URL's
host name, so the certificate is still verified against the name. `check_url` only refuses URLs
that are malformed or not plain HTTP(S) when they are submitted; it resolves nothing.
"""

import errno
import ipaddress
import re
import socket

import aiohttp
import httpx
from aiohappyeyeballs import AddrInfoType

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_URL_LENGTH = 2048
# How a URL starts, as the OpenAPI document says it; `check_url` checks the rest.
URL_PATTERN = "^[Hh][Tt][Tt][Pp][Ss]?://"

# Metadata endpoints outside the ranges refused anyway: AWS's IPv6 one sits in fc00::/7 but
# deserves its own reason; Oracle Cloud's is in 192.0.0.0/24, which Python counts as global.
_METADATA = frozenset(ipaddress.ip_address(a) for a in ("fd00:ec2::254", "192.0.0.192"))
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT: internal, yet not "private"
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def check_url(url: str) -> str:
    """The webhook URL `url` normalised (scheme and host lower case, the host in IDNA form).

    Raises `ValueError` saying what is wrong with it. Where it points is judged at delivery.
    """
    if len(url) > MAX_URL_LENGTH:
        raise ValueError(f"the URL is longer than {MAX_URL_LENGTH} characters")
    # httpx would quietly percent-encode them, and then deliver to a URL nobody typed.
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ValueError("the URL contains spaces or control characters")
    if not re.match(URL_PATTERN, url):
        raise ValueError("the URL must start with http:// or https://")
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"not a valid URL: {exc}") from None
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


class Refused(OSError):
    """A delivery's destination is internal. aiohttp raises it as a connection error."""


def _socket(addr_info: AddrInfoType) -> socket.socket:
    """The socket of one connection attempt, if its address may be connected to."""
    family, type_, proto, _, sockaddr = addr_info
    host = str(sockaddr[0]).split("%", 1)[0]  # an IPv6 scope (fe80::1%eth0) is no part of it
    if reason := refused(ipaddress.ip_address(host)):
        raise Refused(errno.EACCES, f"refused to connect to {host}: {reason}")
    return socket.socket(family, type_, proto)


def session(timeout: float, allow_private: bool) -> aiohttp.ClientSession:
    """An HTTP session for deliveries: guarded (unless `allow_private`), and no proxy or
    settings from the environment. Callers pass `allow_redirects=False`: a redirect would be a
    second URL, one nobody submitted."""
    connector = aiohttp.TCPConnector(
        limit=0,  # the sender bounds its tries in flight itself
        socket_factory=None if allow_private else _socket,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=timeout),
        trust_env=False,
        auto_decompress=False,
    )
