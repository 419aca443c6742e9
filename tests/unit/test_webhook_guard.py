"""The webhook SSRF guard: URLs as submitted, the addresses refused, and the refusal made at
connect time, after resolution, against a real server on 127.0.0.1."""

import asyncio
import ipaddress
import re
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest

from jobplane.webhooks import guard
from jobplane.webhooks.guard import check_url, refused


def test_check_url_accepts_http_and_https() -> None:
    assert check_url("https://hooks.example.com/jobplane?x=1") == (
        "https://hooks.example.com/jobplane?x=1"
    )
    assert check_url("http://hooks.example.com:8080/") == "http://hooks.example.com:8080/"
    assert check_url("HTTPS://Hooks.Example.COM/In") == "https://hooks.example.com/In"
    assert check_url("http://[2606:4700::1111]/") == "http://[2606:4700::1111]/"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://hooks.example.com/", "http:// or https://"),
        ("file:///etc/passwd", "http:// or https://"),
        ("hooks.example.com/x", "http:// or https://"),
        ("//hooks.example.com/x", "http:// or https://"),
        ("http:///path", "no host"),
        ("http://user:secret@hooks.example.com/", "user name or password"),
        ("http://user@hooks.example.com/", "user name or password"),
        ("http://@hooks.example.com/", "user name or password"),
        ("https://hooks.example.com/#part", "fragment"),
        ("https://hooks.example.com/#", "fragment"),
        ("https://hooks.example.com/" + "a" * 2048, "longer than 2048"),
        ("http://hooks.example.com:0/", "port"),
        ("http://hooks.example.com:65536/", "port"),
        ("http://hooks.example.com:http/", "not a valid URL"),
        ("http://[::1/", "not a valid URL"),
        ("http://hooks.example.com/a b", "spaces or control characters"),
        ("http://hooks.example.com/a\nb", "spaces or control characters"),
        (" https://hooks.example.com/", "spaces or control characters"),
    ],
)
def test_check_url_refuses_with_a_message(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_url(url)


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "a loopback address"),
        ("::1", "a loopback address"),
        ("10.0.0.1", "a private address"),
        ("172.16.0.1", "a private address"),
        ("192.168.1.1", "a private address"),
        ("fd12:3456::1", "a private address"),
        ("169.254.169.254", "a link-local or metadata address"),
        ("fe80::1", "a link-local or metadata address"),
        ("fd00:ec2::254", "a link-local or metadata address"),
        ("::ffff:127.0.0.1", "a loopback address"),
        ("::ffff:169.254.169.254", "a link-local or metadata address"),
        ("::127.0.0.1", "a loopback address"),
        ("64:ff9b::a00:1", "a private address"),  # NAT64 of 10.0.0.1
        ("2002:a9fe:a9fe::1", "a link-local or metadata address"),  # 6to4 of 169.254.169.254
        ("100.64.0.1", "a shared (carrier-grade NAT) address"),
        ("0.0.0.0", "an unspecified address"),
        ("::", "an unspecified address"),
        ("224.0.0.1", "a multicast address"),
        ("ff02::1", "a multicast address"),
        ("240.0.0.1", "a private address"),  # reserved; Python counts 240/4 as private
    ],
)
def test_internal_addresses_are_refused(address: str, reason: str) -> None:
    assert refused(ipaddress.ip_address(address)) == reason


@pytest.mark.parametrize(
    "address", ["93.184.216.34", "2606:4700::1111", "::ffff:93.184.216.34", "64:ff9b::5db8:d822"]
)
def test_public_addresses_are_allowed(address: str) -> None:
    assert refused(ipaddress.ip_address(address)) is None


@pytest.fixture
async def server() -> AsyncIterator[tuple[int, list[bytes]]]:
    """A one-response HTTP server on 127.0.0.1: its port, and the requests it received."""
    received: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    listener = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with listener:
        yield listener.sockets[0].getsockname()[1], received


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_the_guarded_session_refuses_loopback(
    server: tuple[int, list[bytes]], host: str
) -> None:
    port, received = server
    async with guard.session(5, allow_private=False) as http:
        with pytest.raises(aiohttp.ClientConnectorError) as caught:
            await http.post(f"http://{host}:{port}/", data=b"{}")
    assert "a loopback address" in str(caught.value.os_error)
    assert received == []


async def test_allow_private_connects(server: tuple[int, list[bytes]]) -> None:
    port, received = server
    async with (
        guard.session(5, allow_private=True) as http,
        http.post(f"http://127.0.0.1:{port}/", data=b"{}") as response,
    ):
        assert response.status == 200
    assert len(received) == 1


async def test_the_address_checked_is_the_one_connected_to(
    server: tuple[int, list[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check sees the address the socket connects to, resolved from the name, and the
    request still names the host of the URL."""
    port, received = server
    checked: list[str] = []

    def allow(address: guard.Address) -> None:
        checked.append(str(address))

    monkeypatch.setattr(guard, "refused", allow)
    async with (
        guard.session(5, allow_private=False) as http,
        http.get(f"http://localhost:{port}/") as response,
    ):
        assert response.status == 200
    assert checked[-1] in ("127.0.0.1", "::1")
    assert f"Host: localhost:{port}\r\n".encode() in received[0]


@pytest.mark.parametrize(
    ("address", "refusal"),
    [
        ("10.1.2.3", "refused to connect to 10.1.2.3: a private address"),
        ("fe80::1%eth0", "refused to connect to fe80::1: a link-local or metadata address"),
    ],
)
def test_a_socket_to_an_internal_address_is_never_made(address: str, refusal: str) -> None:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with pytest.raises(guard.Refused, match=re.escape(refusal)):
        guard._socket((family, socket.SOCK_STREAM, 6, "", (address, 443)))


def test_a_socket_to_a_public_address_is_made() -> None:
    made = guard._socket((socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", 443)))
    made.close()


async def test_a_name_that_does_not_resolve_is_a_connect_error() -> None:
    async with guard.session(5, allow_private=False) as http:
        with pytest.raises(aiohttp.ClientConnectorError):
            await http.get("http://nowhere.invalid/")
