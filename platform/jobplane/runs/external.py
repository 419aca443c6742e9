"""External steps: a step with `workerType: external` is done by a process outside jobplane.

The inline worker hands the run over (`waiting_worker`); an external worker claims the step
over HTTP, which resumes the run under that worker's own lease, heartbeats, and completes or
fails it. A completed step that is not the last hands the run back to the inline workers
(`queued`, without spending an attempt), which resume at the next step.
"""

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from jobplane import metrics
from jobplane.errors import NotFound, ResourceInvalidState
from jobplane.model import Run, RunError, RunStatus, Template
from jobplane.queue.redis import QueueEntry, RedisQueue
from jobplane.runs.service import RunService
from jobplane.store import Lease, Lost, MongoStore, Moved
from jobplane.worker.backoff import backoff_seconds

# How often a long-polling claim looks for waiting steps.
CLAIM_POLL_SECONDS = 0.2


@dataclass(frozen=True)
class ExternalClaim:
    run: Run
    template: Template
    step_index: int
    lease: Lease
    locked_until: datetime


class ExternalSteps:
    def __init__(self, store: MongoStore, queue: RedisQueue, lease_seconds: float) -> None:
        self.store = store
        self.queue = queue
        self.lease_seconds = lease_seconds

    async def claim(
        self,
        worker_type: str,
        worker_id: str,
        wait_seconds: float,
        gone: Callable[[], Awaitable[bool]] | None = None,
    ) -> ExternalClaim | None:
        """The oldest step waiting for a `worker_type` worker, waiting up to `wait_seconds`
        for one to come, or until `gone()` says the caller went away (a lease granted to a
        caller that stopped would hold the step until it expired)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + wait_seconds
        while gone is None or not await gone():
            claimed = await self.store.claim_external(worker_type, worker_id, self.lease_seconds)
            if claimed is not None:
                run, lease = claimed
                template = await self.store.get_template(run.template_type, run.template_version)
                if template is None or run.phase is None or run.locked_until is None:
                    raise NotFound(f"run {run.id}: its template or step is gone")
                index = template.step_index(run.phase)
                return ExternalClaim(run, template, index, lease, run.locked_until)
            if loop.time() >= until:
                return None
            await asyncio.sleep(min(CLAIM_POLL_SECONDS, max(0.0, until - loop.time())))
        return None

    async def heartbeat(
        self, lease: Lease, step_id: str, percentage: float | None, message: str | None
    ) -> Run:
        """Renew the lease (and record progress); the run says whether a cancel was asked."""
        run, template, index = await self._step(lease, step_id)
        held, _ = await self.store.heartbeat(lease.worker_id, [lease], self.lease_seconds)
        if lease.run_id not in held:
            await self.store.lease_lost(lease, "heartbeat")
            metrics.STALE_WRITES.inc()
            raise ResourceInvalidState(f"run {run.id}: this lease no longer holds the run")
        if percentage is not None:
            overall = 100 * (index + percentage / 100) / len(template.steps)
            await self.store.report_progress(lease, index, percentage, overall, message)
        return await self._get(lease.run_id)

    async def complete(self, lease: Lease, step_id: str, output: Any) -> Run:
        run, template, index = await self._step(lease, step_id)
        await self._unless_cancelled(run, lease)
        last = index == len(template.steps) - 1
        if last:
            spend = not template.repeatable
            moved = await self.store.complete(
                lease, index, step_id, output, output, spend_key=spend
            )
        else:
            percentage = 100 * (index + 1) / len(template.steps)
            following = template.handler_at(index + 1)
            lost = await self.store.finish_step(
                lease, index, step_id, output, percentage, next_handler=following
            )
            moved = lost or await self.store.release(lease)
        await self._settle(run, lease, moved)
        if last:
            await self._ended(run, lease)
        else:
            await self._push(run.model_copy(update={"handler": following, "not_before": None}))
        return await self._get(run.id)

    async def fail(
        self, lease: Lease, step_id: str, code: str, message: str, retryable: bool
    ) -> Run:
        """A retryable failure queues the run again after the template's backoff (the inline
        workers send it back to an external worker); otherwise, or with no attempts left, the
        run fails."""
        run, template, index = await self._step(lease, step_id)
        await self._unless_cancelled(run, lease)
        error = RunError(code=code, message=message, step=step_id)
        if not retryable or run.attempt >= run.max_attempts:
            await self._settle(run, lease, await self.store.fail(lease, index, error))
            await self._ended(run, lease)
            return await self._get(run.id)
        delay = backoff_seconds(template.retry_policy, run.attempt)
        not_before = self.store.clock.now() + timedelta(seconds=delay)
        await self._settle(run, lease, await self.store.retry(lease, index, error, not_before))
        metrics.RUN_RETRIES.labels(run.template_type).inc()
        await self._push(run.model_copy(update={"not_before": not_before}))
        return await self._get(run.id)

    async def _step(self, lease: Lease, step_id: str) -> tuple[Run, Template, int]:
        run = await self._get(lease.run_id)
        template = await self.store.get_template(run.template_type, run.template_version)
        if template is None or step_id not in {s.id for s in template.steps}:
            raise NotFound(f"run {run.id} has no step {step_id!r}")
        if run.phase != step_id or (run.locked_by, run.lease_token) != (
            lease.worker_id,
            lease.token,
        ):
            await self.store.lease_lost(lease, "external")
            metrics.STALE_WRITES.inc()
            raise ResourceInvalidState(f"run {run.id}: step {step_id!r} is not held by this lease")
        return run, template, template.step_index(step_id)

    async def _unless_cancelled(self, run: Run, lease: Lease) -> None:
        """Once a cancel was asked, the worker's report is refused and the run ends cancelled.
        (A cancel landing during the report itself keeps the finished step's output, as an
        inline step that ran to its end does.)"""
        if run.status == RunStatus.CANCEL_REQUESTED:
            await self._settle(run, lease, Lost(run.id, "status", run.status))

    async def _settle(self, run: Run, lease: Lease, moved: Moved | Lost | None) -> None:
        """A write refused because a cancel was asked ends the run cancelled, and the worker is
        told (409): its step's result is not kept."""
        metrics.observe(run, moved, self.store.clock.now())
        if not isinstance(moved, Lost):
            return
        if moved.status == RunStatus.CANCEL_REQUESTED:
            acked = await self.store.acknowledge_cancel(lease, interrupted=True)
            metrics.observe(run, acked, self.store.clock.now())
            await self._ended(run, lease)
            raise ResourceInvalidState(f"run {run.id}: a cancel was requested; it is cancelled")
        raise ResourceInvalidState(f"run {run.id}: this lease no longer holds the run")

    async def _ended(self, run: Run, lease: Lease) -> None:
        """The run let go of its dedupe key (unless it spent it): a waiting run may start."""
        if run.dedupe_key is not None:
            await RunService(self.store, self.queue).admit_next(run.dedupe_key, lease.actor)

    async def _push(self, run: Run) -> None:
        await self.queue.push([QueueEntry.of(run)], self.store.clock.now())

    async def _get(self, run_id: str) -> Run:
        run = await self.store.get_run(run_id)
        if run is None:
            raise NotFound(f"run {run_id!r} not found")
        return run
