"""Running a jobplane process: signals, logging, the HTTP server in the same event loop."""

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Generator
from contextlib import contextmanager

import uvicorn


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM or SIGINT asks for a graceful stop; a second one exits at once.

    After a hard exit, leases held by a worker simply expire and the reaper recovers them.
    """

    def handle(signum: int) -> None:
        if stop.is_set():
            logging.getLogger("jobplane").warning("second signal: exiting now")
            os._exit(128 + signum)
        stop.set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, handle, signum)


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )


class HTTPServer(uvicorn.Server):
    """uvicorn without its own signal handling: our `stop` event governs every part."""

    @contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def serve_http(server: HTTPServer, stop: asyncio.Event) -> None:
    task = asyncio.create_task(server.serve())
    await asyncio.wait([task, asyncio.create_task(stop.wait())], return_when="FIRST_COMPLETED")
    server.should_exit = True
    await task
