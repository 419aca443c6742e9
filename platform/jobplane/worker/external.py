"""A reference external worker: claims external steps over HTTP and runs them with handlers.

It is what a process outside jobplane does for a step with `workerType: external`: long-poll
`POST /v1/external/{type}/claim`, run the step with the same `StepContext` handlers get inline,
heartbeat while it runs (a third of the lease), then `complete` or `fail`. A cancel requested
meanwhile shows in the heartbeat's reply; the handler's next `checkpoint()` raises.
"""

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import httpx

from jobplane.clock import SystemClock
from jobplane.model import Run, Template
from jobplane.process import Stopped, log_context, unless_stopped
from jobplane.worker import spans
from jobplane.worker.context import CancelRequested, FatalError, StepContext, StepInterrupted
from jobplane.worker.handlers import HandlerRegistry, registry

log = logging.getLogger("jobplane.external")

# Back off this long when the API cannot be reached or refuses a claim.
RETRY_SECONDS = 1.0


class ExternalWorker:
    def __init__(
        self,
        client: httpx.AsyncClient,
        worker_type: str,
        worker_id: str,
        handlers: HandlerRegistry = registry,
        wait_seconds: float = 20,
    ) -> None:
        self.client = client
        self.worker_type = worker_type
        self.worker_id = worker_id
        self.handlers = handlers
        self.wait_seconds = wait_seconds

    async def run(self, stop: asyncio.Event, concurrency: int = 1) -> None:
        """Work `concurrency` steps at a time until `stop` is set (a claim in progress is
        waited for, and a step that was claimed is finished)."""
        with log_context(worker_id=self.worker_id):
            await asyncio.gather(*(self._loop(stop) for _ in range(concurrency)))

    async def _loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                # A stop abandons a long poll rather than wait it out; the API stops polling
                # for a claim whose caller went away.
                claimed = await unless_stopped(self.claim(), stop)
            except Stopped:
                return
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("claim failed: %s; retrying", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), RETRY_SECONDS)
                continue
            if claimed is not None:
                with log_context(
                    run_id=claimed["runId"],
                    step=claimed["stepId"],
                    lease_token=claimed["leaseToken"],
                ):
                    await self.work(claimed)

    async def claim(self) -> dict[str, Any] | None:
        path = f"/v1/external/{self.worker_type}/claim"
        body = {"workerId": self.worker_id, "waitSeconds": self.wait_seconds}
        response = await self.client.post(path, json=body, timeout=self.wait_seconds + 30)
        if response.status_code == 204:
            return None
        response.raise_for_status()
        claimed: dict[str, Any] = response.json()
        return claimed

    async def work(self, claimed: dict[str, Any]) -> None:
        """Run one claimed step to its end and report it."""
        run = Run.model_validate(claimed["run"])
        template = Template.model_validate(claimed["template"])
        index = template.step_index(claimed["stepId"])
        step = template.steps[index]
        assert step.handler is not None, "an external step has a handler (registration)"
        base = f"/v1/runs/{run.id}/steps/{step.id}"
        lease = {"workerId": self.worker_id, "leaseToken": claimed["leaseToken"]}
        cancel = asyncio.Event()

        async def beat(percentage: float | None = None, message: str | None = None) -> None:
            body = {**lease, "percentage": percentage, "message": message}
            response = await self.client.post(f"{base}/heartbeat", json=body)
            response.raise_for_status()
            if response.json()["cancelRequested"]:
                cancel.set()

        async def renew() -> None:
            await beat()

        locked_until = datetime.fromisoformat(claimed["lockedUntil"])
        every = max(0.1, (locked_until - SystemClock().now()).total_seconds() / 3)
        ctx = StepContext(run, template, index, dict(run.outputs), cancel, beat, renew)
        keeper = asyncio.create_task(self._keep_alive(renew, every))
        try:
            with spans.process(run), spans.step(run, step.id):
                output = await self._call(step.handler, ctx)
        except (CancelRequested, StepInterrupted) as exc:
            await self._report(f"{base}/fail", {**lease, "message": f"stopped: {exc!r}"})
        except FatalError as exc:
            body = {**lease, "message": str(exc) or repr(exc), "retryable": False}
            await self._report(f"{base}/fail", body)
        except Exception as exc:
            await self._report(f"{base}/fail", {**lease, "message": repr(exc)})
        else:
            await self._report(f"{base}/complete", {**lease, "output": output})
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
            await ctx.close(write_latest=False)

    async def _call(self, name: str, ctx: StepContext) -> Any:
        handler = self.handlers.resolve(name)
        if handler is None:
            raise FatalError(f"unknown handler {name!r}")
        if inspect.iscoroutinefunction(handler):
            return await handler(ctx)
        return await asyncio.to_thread(handler, ctx)

    async def _keep_alive(self, renew: Callable[[], Awaitable[None]], every: float) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await renew()
            except httpx.HTTPError as exc:
                log.warning("heartbeat failed: %s", exc)

    async def _report(self, path: str, body: dict[str, Any]) -> None:
        response = await self.client.post(path, json=body)
        if response.status_code >= 400:
            # 409: the run was cancelled, or the lease was lost; either way nothing to redo.
            log.warning("%s: %s %s", path, response.status_code, response.text[:300])


async def serve_external(
    url: str,
    key: str | None,
    worker_type: str,
    worker_id: str,
    modules: list[str],
    concurrency: int,
) -> None:
    """`jobplane external-worker`: work until SIGTERM/SIGINT, finishing the steps in hand."""
    from jobplane.process import stop_on_signals
    from jobplane.worker.handlers import load_modules

    load_modules(modules)
    stop = asyncio.Event()
    stop_on_signals(stop)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers) as client:
        worker = ExternalWorker(client, worker_type, worker_id)
        log.info(
            "external worker %s serving %r at %s: concurrency %d, handlers %s",
            worker_id,
            worker_type,
            url,
            concurrency,
            ", ".join(registry.offered()),
        )
        await worker.run(stop, concurrency)
    log.info("external worker %s stopped", worker_id)
