"""External steps: a step with `workerType: external` is done by a process outside jobplane.

The inline worker hands the run over (`waiting_worker`); an external worker claims the step
over HTTP, which resumes the run under that worker's own lease, heartbeats, and completes or
fails it. A completed step that is not the last hands the run back to the inline workers
(`queued`, without spending an attempt), which resume at the next step.
"""

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jobplane import metrics
from jobplane.errors import NotFound, ResourceInvalidState
from jobplane.model import Run, RunError, RunStatus, StepStatus, Template
from jobplane.model.graph import ENDED
from jobplane.queue.redis import RedisQueue
from jobplane.runs.lifecycle import HeldStep
from jobplane.runs.policy import cancel_asked
from jobplane.runs.service import RunService
from jobplane.store import Lease, Lost, Moved, Store

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
    def __init__(self, store: Store, queue: RedisQueue, lease_seconds: float) -> None:
        self.store = store
        self.runs = RunService(store, queue)
        self.lifecycle = self.runs.lifecycle
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
            claimed = await self.store.transitions.resume(
                worker_type, worker_id, self.lease_seconds
            )
            if claimed is not None:
                run, lease = claimed
                template = await self.store.templates.get(run.template_type, run.template_version)
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
        step = await self._step(lease, step_id)
        held, _ = await self.store.leases.heartbeat(lease.worker_id, [lease], self.lease_seconds)
        if lease.run_id not in held:
            await self.store.leases.lease_lost(lease, "heartbeat")
            metrics.STALE_WRITES.inc()
            raise ResourceInvalidState(f"run {lease.run_id}: this lease no longer holds the run")
        if percentage is not None:
            await self.lifecycle.report_progress(step, percentage, message)
        return await self.runs.get(lease.run_id)

    async def complete(self, lease: Lease, step_id: str, output: Any) -> Run:
        step = await self._step(lease, step_id)
        await self._unless_cancelled(step)
        template = step.template
        steps = step.run.progress.steps
        statuses = [s.status for s in steps]
        statuses[step.index] = StepStatus.SUCCEEDED
        if all(s in ENDED or p.final for s, p in zip(statuses, steps, strict=True)):
            last = template.steps[-1].id
            result = output if step.id == last else step.run.outputs.get(last)
            moved = await self.lifecycle.complete(step, output, result=result)
        else:
            # The run goes back to the inline workers, in the lane of the step it goes on with.
            handler = template.next_handler(statuses)
            onward = step.run.model_copy(update={"handler": handler})
            lost = await self.lifecycle.finish_step(step, output, next_handler=handler)
            moved = lost or await self.lifecycle.release(onward, lease)
        await self._settle(step, moved)
        return await self.runs.get(lease.run_id)

    async def fail(
        self, lease: Lease, step_id: str, code: str, message: str, retryable: bool
    ) -> Run:
        """A retryable failure queues the run again after the template's backoff (the inline
        workers send it back to an external worker); otherwise, or with no attempts left, the
        run fails."""
        step = await self._step(lease, step_id)
        await self._unless_cancelled(step)
        error = RunError(code=code, message=message, step=step_id)
        await self._settle(step, await self.lifecycle.attempt_failed(step, error, retryable))
        return await self.runs.get(lease.run_id)

    async def _step(self, lease: Lease, step_id: str) -> HeldStep:
        """The step `lease` holds, as the worker names it."""
        run = await self.runs.get(lease.run_id)
        template = await self.store.templates.get(run.template_type, run.template_version)
        if template is None or step_id not in {s.id for s in template.steps}:
            raise NotFound(f"run {run.id} has no step {step_id!r}")
        if run.phase != step_id or (run.locked_by, run.lease_token) != (
            lease.worker_id,
            lease.token,
        ):
            await self.store.leases.lease_lost(lease, "external")
            metrics.STALE_WRITES.inc()
            raise ResourceInvalidState(f"run {run.id}: step {step_id!r} is not held by this lease")
        done = sum(1 for s in run.progress.steps if s.status in ENDED or s.final)
        return HeldStep(run, lease, template, template.step_index(step_id), done)

    async def _unless_cancelled(self, step: HeldStep) -> None:
        """Once a cancel was asked, the worker's report is refused and the run ends cancelled.
        (A cancel landing during the report itself keeps the finished step's output, as an
        inline step that ran to its end does.)"""
        run = step.run
        if run.status == RunStatus.CANCEL_REQUESTED:
            await self._settle(step, Lost(run.id, "status", run.status))

    async def _settle(self, step: HeldStep, moved: Moved | Lost | None) -> None:
        """A write refused because a cancel was asked ends the run cancelled, and the worker is
        told (409): its step's result is not kept."""
        if not isinstance(moved, Lost):
            return
        run_id = step.run.id
        if cancel_asked(moved):
            await self.lifecycle.acknowledge_cancel(step.run, step.lease, interrupted=True)
            raise ResourceInvalidState(f"run {run_id}: a cancel was requested; it is cancelled")
        raise ResourceInvalidState(f"run {run_id}: this lease no longer holds the run")
