"""Running the runs a worker holds: their steps' graph walked, each ready step started (its
locks taken, `worker/steplocks.py`; its handler called, `worker/call.py`) and its end written.

Every outcome is written through the lifecycle (`runs/lifecycle.py`); how a run stops is
settled in one place, `Runner.run`: a cancel asked is acknowledged, a passed deadline expires
the run, a step this worker cannot run is handed on, a lost lease writes nothing more, and a
shutdown hands the run back.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from jobplane.clock import Clock
from jobplane.model import TERMINAL, Run, RunError, StepOutcome, StepStatus, Template
from jobplane.model.graph import ENDED
from jobplane.process import log_context
from jobplane.queue.locks import Blocked
from jobplane.runs.admission.locks import Locks
from jobplane.runs.lifecycle import HeldStep, Lifecycle, StepStart
from jobplane.runs.policy import cancel_asked, retry_at
from jobplane.runs.service import RunService
from jobplane.store import Lost, Moved, StepEnd, Store
from jobplane.templates.expressions import ExpressionError, evaluate_when
from jobplane.worker import spans
from jobplane.worker.call import Caller
from jobplane.worker.context import CancelRequested, FatalError, step_failure
from jobplane.worker.fanout import ChildrenActive, Fanout, MapFailed
from jobplane.worker.flow import Flow
from jobplane.worker.handlers import HandlerRegistry
from jobplane.worker.held import (
    Held,
    Overdue,
    RunningStep,
    Stopped,
    stop_if_lost,
    time_left,
)
from jobplane.worker.lending import HolderLost, Lending, LentFailed, TakenBack
from jobplane.worker.steplocks import LockHeld, StepLocks

log = logging.getLogger("jobplane.worker")


@dataclass(frozen=True)
class _Failure:
    """The first step of this attempt that failed, and whether its run tries again."""

    step: RunningStep
    error: RunError
    retryable: bool
    retried: bool


class _HandOff(Exception):
    """The run's next step needs a handler this worker does not offer."""

    def __init__(self, handler: str) -> None:
        super().__init__(handler)
        self.handler = handler


@dataclass
class _Walk:
    """A walk of a run's graph in progress: its running steps, and what stops it."""

    running: dict[asyncio.Future[Any], RunningStep] = field(default_factory=dict)
    # The first step of this attempt that failed it.
    failure: _Failure | None = None
    # What stops the whole run: a cancel, a stop, the deadline.
    stopping: Exception | None = None
    # A ready step that waits for the run to itself, once nothing else runs.
    alone: Exception | None = None
    # Steps that stopped beside a failure, written with it.
    ended: list[StepEnd] = field(default_factory=list)
    # The locks of steps that ended once the walk had failed: let go after the failure's
    # write, which records their ends.
    unlocking: list[str] = field(default_factory=list)


class _External(Exception):
    """The run's next step is an external worker's."""

    def __init__(self, at: HeldStep) -> None:
        super().__init__(at.id)
        self.at = at


class _WaitChildren(Exception):
    """Only map steps waiting for their children are left."""


@dataclass
class Runner:
    """Runs the steps of the runs a worker holds, one task a run."""

    store: Store
    lifecycle: Lifecycle
    handlers: HandlerRegistry
    # The handlers the worker offers: a step needing another is handed on, never failed.
    offered: list[str]
    clock: Clock
    # Where sync handlers run: the worker's pool, a thread a slot.
    threads: ThreadPoolExecutor
    # What a handler's `ctx.heartbeat()` calls: the worker renews the lease at once.
    renew: Callable[[list[Held]], Awaitable[None]]
    # The locks steps hold and handlers take.
    locks: Locks
    # Makes map steps' children.
    service: RunService
    # Lends steps whose handler this worker lacks to workers that offer it.
    lending: Lending
    # Called when a run stops taking a slot while it goes on (it only watches lent steps).
    slot_freed: Callable[[], None]
    # Versions are immutable, so a template cached never goes stale.
    _templates: dict[tuple[str, int], Template] = field(default_factory=dict, init=False)
    _fanout: Fanout = field(init=False)
    _step_locks: StepLocks = field(init=False)
    _caller: Caller = field(init=False)

    def __post_init__(self) -> None:
        self._fanout = Fanout(self.store, self.service, stop_if_lost)
        self._step_locks = StepLocks(self.locks, self.lifecycle, self.clock)
        self._caller = Caller(
            self.handlers, self.lifecycle, self.clock, self.threads, self.renew, self._step_locks
        )

    async def run(self, held: Held) -> None:
        """Run `held` from its first step not done until it ends, or until it must stop; what
        stops it is settled here. Raises nothing: an error is logged, and the lease expires."""
        try:
            try:
                await self._step_locks.adopt_ahead(held)
                await self._run_steps(held)
            except CancelRequested as cancel:
                ack = await self.lifecycle.acknowledge_cancel(
                    held.run, held.lease, cancel.interrupted
                )
                self._check(held.run, ack)
            except Overdue:
                # Not fenced: if the reaper got there first, the run is expired already.
                moved = await self.lifecycle.deadline_expire(held.run, held.lease.actor)
                self._finished(held.run, moved)
            except _HandOff as handoff:
                log.info("run %s: handed on for handler %r", held.run.id, handoff.handler)
                await self._release(held, handoff.handler)
            except LockHeld as wait:
                await self._wait_for_lock(held, wait.blocked)
            except _External as external:
                # The run waits for an external worker's callback; this worker lets go of it.
                self._check(held.run, await self.lifecycle.wait_worker(external.at))
            except _WaitChildren:
                # Only map steps are left: this worker lets go while their children run.
                waiting = await self.lifecycle.wait_children(held.run, held.lease)
                if cancel_asked(waiting):
                    acked = await self.lifecycle.acknowledge_cancel(
                        held.run, held.lease, interrupted=False
                    )
                    self._finished(held.run, acked)
                else:
                    stop_if_lost(waiting)
        except Stopped as stopped:
            if stopped.reason == "lost":
                log.warning("run %s: lease lost, stopped without writing", held.run.id)
            else:
                if stopped.reason == "lock":
                    log.warning("run %s: a lock its step held was lost; handed back", held.run.id)
                try:
                    await self._release(held)
                except Exception:
                    log.exception("run %s: release failed; its lease will expire", held.run.id)
        except Exception:
            log.exception("run %s: worker error", held.run.id)
        finally:
            await self._step_locks.let_go_unused(held)

    async def run_lent(self, held: Held) -> None:
        """Run the step lent to this worker (`held.lease.step`) and report how it ended: its
        run's holder writes that end. Raises nothing: an error is logged, and the step's
        lease expires."""
        run, lease = held.run, held.lease
        assert lease.step is not None, "a step lease"
        lent = run.progress.steps[lease.step].lease
        try:
            template = await self._template(run)
            if template is None or lent is None:
                raise RuntimeError(f"run {run.id}: step {lease.step} lent, but not to be found")
            done = sum(1 for s in run.progress.steps if s.status in ENDED)
            at = HeldStep(run, lease, template, lease.step, done)
            step = RunningStep(at, StepStart(self.clock.now(), lent.attempt))
            status, output, error, retryable = StepStatus.SUCCEEDED, None, None, False
            try:
                with spans.step(run, at.id):
                    output = await self._caller.call(held, step, dict(run.outputs))
            except CancelRequested:
                status = StepStatus.CANCELLED
            except Overdue:
                return  # the run's deadline passed: its holder, or the reaper, ends it
            except Stopped as stopped:
                if stopped.reason != "lost":
                    await self.lending.give_back(at, lent.handler)
                return
            except Exception as exc:
                status, error = StepStatus.FAILED, step_failure(exc, at.id)
                retryable = not isinstance(exc, FatalError)
            outcome = StepOutcome(
                status=status,
                output=output,
                error=error,
                retryable=retryable,
                started_at=step.start.at,
                start_written=step.start_written,
            )
            if isinstance(await self.lending.report(lease, outcome), Lost):
                log.warning("run %s: step %s ended, but its lease was lost first", run.id, at.id)
        except Exception:
            log.exception("run %s: lent step %s: worker error", run.id, lease.step)

    async def _wait_for_lock(self, held: Held, blocked: Blocked) -> None:
        """Hand the run back to wait for a lock its step found held, or finish a cancel."""
        wait, until = self.locks.wait(held.run, blocked, self.clock.now())
        log.info("run %s: waits for lock %s until %s at the latest", held.run.id, wait.lock, until)
        released = await self.lifecycle.wait_for_lock(held.run, held.lease, wait, until)
        if cancel_asked(released):
            acked = await self.lifecycle.acknowledge_cancel(held.run, held.lease, interrupted=False)
            self._finished(held.run, acked)

    async def _release(self, held: Held, handler: str | None = None) -> None:
        """Hand the run back to the queue (on shutdown, or to the lane of `handler`, which
        this worker lacks), or finish a cancel that was asked for."""
        released = await self.lifecycle.release(held.run, held.lease, handler)
        if cancel_asked(released):
            acked = await self.lifecycle.acknowledge_cancel(held.run, held.lease, interrupted=True)
            self._finished(held.run, acked)

    async def _run_steps(self, held: Held) -> None:
        """Walk the run's graph from where it stands: each step whose needs are met starts,
        beside those running, until every step has ended or the run must stop. Raises
        `CancelRequested` to stop; a step that needs the run to itself (an external step, a
        handler this worker lacks, a lock held) waits until nothing else runs."""
        run, lease = held.run, held.lease
        template = await self._template(run)
        if template is None:
            missing = f"template {run.template_type} v{run.template_version} not found"
            error = RunError(code="fatal", message=missing)
            self._check(run, await self.lifecycle.fail(run, lease, 0, error))
            return
        # Resume, don't restart: steps that succeeded in an earlier attempt keep their outputs.
        flow = Flow(template, run)
        if flow.finished:  # every step ended before a crash cut the final write short
            await self._complete_ended(held, flow)
            return
        walk = _Walk()
        try:
            await self._walk(held, flow, walk)
        finally:
            await self._step_locks.let_go(held, walk.unlocking)

    async def _walk(self, held: Held, flow: Flow, walk: _Walk) -> None:
        """`_run_steps`'s walk of the graph, and the write that ends it."""
        run, lease, template = held.run, held.lease, flow.template
        for index, lent in flow.lent.items():  # lent by an earlier holder, and not ended yet
            at = HeldStep(run, lease, template, index, flow.done)
            start = StepStart(lent.lent_at, lent.attempt)
            step = RunningStep(at, start, start_written=True, lent=lent.handler)
            flow.running.add(index)
            walk.running[asyncio.ensure_future(self._watch(held, step, walk))] = step
        while True:
            if walk.stopping is None and walk.failure is None:
                try:
                    self._go_on(held)
                    starting = await self._start_ready(held, flow, walk)
                except (CancelRequested, Stopped, Overdue) as exc:
                    walk.stopping, starting = exc, []
                await self._step_locks.let_go_unused(held)
                if not walk.running and len(starting) == 1:
                    # Alone, as every step of a line is: awaited here, without a task.
                    [step] = starting
                    done = asyncio.get_running_loop().create_future()
                    try:
                        with log_context(step=step.at.id):
                            done.set_result(await self._work(held, step, flow, walk))
                    except Exception as exc:
                        done.set_exception(exc)
                    if await self._step_ended(held, flow, walk, step, done):
                        return
                    continue
                for step in starting:
                    with log_context(step=step.at.id):  # the task copies the context
                        task = asyncio.ensure_future(self._work(held, step, flow, walk))
                    walk.running[task] = step
            if not walk.running:
                break
            held.watching = all(s.lent is not None for s in walk.running.values())
            if held.watching:
                self.slot_freed()
            finished, _ = await asyncio.wait(walk.running, return_when=asyncio.FIRST_COMPLETED)
            held.watching = False
            for future in finished:
                if await self._step_ended(held, flow, walk, walk.running.pop(future), future):
                    return
        if walk.stopping is not None:
            raise walk.stopping
        if (failure := walk.failure) is not None:
            spans.failed(failure.error.message)
            if not failure.retried:
                # The run ends: its waiting map steps stop with it (their children are
                # cancelled as it ends).
                walk.ended += [
                    StepEnd(i, flow.template.steps[i].id, StepStatus.CANCELLED)
                    for i in flow.waiting
                ]
            if walk.ended:
                self._check(run, await self.lifecycle.end_steps(failure.step.at, walk.ended))
            moved = await self.lifecycle.attempt_failed(
                failure.step.at, failure.error, failure.retryable, failure.step.unwritten_start
            )
            self._check(run, moved)
            return
        if walk.alone is not None:
            raise walk.alone
        if flow.waiting:
            raise _WaitChildren
        if flow.finished:
            await self._complete_ended(held, flow)
            return
        raise RuntimeError(f"run {run.id}: steps {flow.statuses} neither ready nor running")

    async def _step_ended(
        self, held: Held, flow: Flow, walk: _Walk, step: RunningStep, future: asyncio.Future[Any]
    ) -> bool:
        """Write how a step ended, and what that means for the walk; True when it ended the
        run."""
        flow.running.discard(step.at.index)
        try:
            try:
                output = future.result()
            except ChildrenActive:
                step.start_written = True  # with its children's number
                flow.wait(step.at.index)
                return False
            except TakenBack:
                flow.tries[step.at.index] -= 1  # never tried: ready again, to be handed on
                return False
            except (CancelRequested, Stopped, Overdue):
                if not self._asked_aside(held, future, step):
                    raise
                walk.ended.append(self._stopped(step, StepStatus.CANCELLED))
                return False
            except Exception as exc:
                await self._step_locks.confirm(held, step.locks)
                walk.failure = await self._step_failed(held, flow, step, exc, walk)
                if walk.failure is not None and not walk.failure.retried:
                    self._cancel_all(walk.running)
                return False
            await self._step_locks.confirm(held, step.locks)
            return await self._succeeded(held, flow, step, output)
        except (CancelRequested, Stopped, Overdue) as exc:
            # What stops one step (or its write) stops the run: the steps beside it stop too,
            # and their ends are the run's transition's to write. A cancel that interrupted a
            # step says so, even if it was first seen between steps.
            if walk.stopping is None or (
                isinstance(exc, CancelRequested)
                and exc.interrupted
                and isinstance(walk.stopping, CancelRequested)
            ):
                walk.stopping = exc
            if isinstance(exc, CancelRequested):
                held.cancel.set()
            elif isinstance(exc, Stopped) and held.stop is None:
                held.interrupt(exc.reason)
            return False
        finally:
            # Its end is written by now, or (the walk failed) with the failure: its locks are
            # let go after it, so that its recorded span lies inside its hold of them.
            if walk.failure is None:
                await self._step_locks.let_go(held, step.locks)
            else:
                walk.unlocking += step.locks

    async def _start_ready(self, held: Held, flow: Flow, walk: _Walk) -> list[RunningStep]:
        """The steps to start now: every step whose needs are met, with its locks taken (those
        whose `when` is false are written skipped). A step that must wait for the run to itself
        is noted in `walk.alone`; a `when` that could not be evaluated is the walk's failure."""
        walk.alone = None
        starting: list[RunningStep] = []
        template = flow.template
        while True:
            # A pass's false `when`s are written together, then the pass looks again.
            skips: list[StepEnd] = []
            # Ready steps whose handler only other workers offer.
            elsewhere: list[tuple[HeldStep, str]] = []
            for index in flow.ready:
                step = template.steps[index]
                at = HeldStep(held.run, held.lease, template, index, flow.done)
                if step.when is not None:
                    try:
                        go = evaluate_when(step.when, flow.activation())
                    except ExpressionError as exc:
                        error = RunError(code="WhenError", message=str(exc), step=step.id)
                        failing = RunningStep(at, StepStart(self.clock.now(), flow.tries[index]))
                        failing.start_written = True  # it never started
                        self._cancel_all(walk.running)
                        walk.failure = _Failure(failing, error, retryable=False, retried=False)
                        await self._unprepare(held, flow, starting)
                        return []
                    if not go:
                        reason = f"when {step.when!r} is false"
                        skips.append(StepEnd(index, step.id, StepStatus.SKIPPED, reason=reason))
                        continue
                if step.worker_type == "external":
                    walk.alone = walk.alone or _External(at)
                    continue
                if step.worker_type == "map":
                    # Ready again after its children ended, it reads them: not a new try.
                    made = index in flow.made
                    if not made:
                        flow.tries[index] += 1
                    start = StepStart(self.clock.now(), flow.tries[index])
                    starting.append(RunningStep(at, start, start_written=made))
                    flow.running.add(index)
                    continue
                assert step.handler is not None, "every step but a map step has a handler"
                if step.handler not in self.offered:
                    if step.locks:  # a step's own locks are its run holder's to take
                        walk.alone = walk.alone or _HandOff(step.handler)
                    else:
                        elsewhere.append((at, step.handler))
                    continue
                try:
                    taken = await self._step_locks.take(held, at)
                except LockHeld as blocked:
                    walk.alone = walk.alone or blocked
                    continue
                flow.tries[index] += 1
                start = StepStart(self.clock.now(), flow.tries[index])
                starting.append(RunningStep(at, start, locks=taken))
                flow.running.add(index)
            if skips:
                at = HeldStep(held.run, held.lease, template, skips[0].index, flow.done)
                try:
                    self._check(held.run, await self.lifecycle.end_steps(at, skips))
                except BaseException:
                    await self._unprepare(held, flow, starting)
                    raise
                for skip in skips:
                    flow.end(skip.index, StepStatus.SKIPPED)
                continue
            if elsewhere and (walk.running or starting):
                # Others run here meanwhile: lent, to run beside them on another worker.
                for at, handler in elsewhere:
                    try:
                        starting.append(await self._lend(held, flow, at, handler))
                    except BaseException:
                        await self._unprepare(held, flow, starting)
                        raise
            elif elsewhere:
                walk.alone = walk.alone or _HandOff(elsewhere[0][1])
            if walk.running or starting:
                walk.alone = None
            return starting

    async def _lend(self, held: Held, flow: Flow, at: HeldStep, handler: str) -> RunningStep:
        """Lend step `at` to a worker offering `handler`: a step of the walk, watched."""
        try_ = flow.tries[at.index] + 1
        self._check(held.run, await self.lending.lend(at, handler, try_))
        flow.tries[at.index] = try_
        flow.running.add(at.index)
        log.info("run %s: step %s lent to a worker offering %r", held.run.id, at.id, handler)
        return RunningStep(at, StepStart(self.clock.now(), try_), lent=handler)

    async def _watch(self, held: Held, step: RunningStep, walk: _Walk) -> Any:
        """Wait for a lent step's end, as its borrower reports it: its output, or what it
        raised, as if it had run here."""

        def check() -> None:
            if held.stop is not None:
                raise Stopped(held.stop)
            if time_left(held.run, self.clock.now()) == 0:
                raise Overdue

        def idle() -> bool:
            return all(s.lent is not None for s in walk.running.values())

        assert step.lent is not None
        try:
            outcome = await self.lending.watch(
                step.at, step.lent, check, lambda: step.stop_asked or held.cancel.is_set(), idle
            )
        except HolderLost:
            raise Stopped("lost") from None
        except LentFailed:
            step.start_written = True  # its borrower's, if it wrote one
            raise
        step.start = StepStart(outcome.started_at, step.start.attempt)
        step.start_written = outcome.start_written
        if outcome.status == StepStatus.CANCELLED:
            raise CancelRequested(held.run.id, interrupted=True)
        if outcome.status == StepStatus.FAILED:
            assert outcome.error is not None, "a failure reported with its error"
            raise LentFailed(outcome.error, outcome.retryable)
        return outcome.output

    async def _unprepare(self, held: Held, flow: Flow, starting: list[RunningStep]) -> None:
        """Steps prepared to start that will not: their tries and locks are given back (a
        step lent meanwhile is taken back by the run's next holder, or ends with the run)."""
        for prepared in starting:
            flow.running.discard(prepared.at.index)
            flow.tries[prepared.at.index] -= 1
            await self._step_locks.let_go(held, prepared.locks)

    async def _succeeded(self, held: Held, flow: Flow, step: RunningStep, output: Any) -> bool:
        """Write a step's success; True when that ended the run."""
        at, run = step.at, held.run
        flow.outputs[at.id] = output
        flow.end(at.index, StepStatus.SUCCEEDED)
        done = HeldStep(at.run, at.lease, at.template, at.index, flow.done - 1)
        if not flow.finished:
            handler = flow.next_handler
            self._check(
                run,
                await self.lifecycle.finish_step(
                    done, output, step.unwritten_start, next_handler=handler
                ),
            )
            held.run = held.run.model_copy(update={"handler": handler})
            return False
        moved = await self.lifecycle.complete(
            done, output, step.unwritten_start, result=flow.result
        )
        if cancel_asked(moved):
            # The step ran to its end (it may be non-cancelable): keep its output, then
            # acknowledge the cancel, which the table requires over success.
            kept = await self.lifecycle.finish_step(
                done, output, step.unwritten_start, next_handler=None
            )
            self._check(run, kept)
            raise CancelRequested(run.id, interrupted=False)
        self._check(run, moved)
        return True

    async def _step_failed(
        self,
        held: Held,
        flow: Flow,
        step: RunningStep,
        exc: Exception,
        walk: _Walk,
    ) -> _Failure | None:
        """A step raised. Failed for good with `onFailure: continue`, it ends `failed` and the
        steps that need it are skipped; otherwise it fails this attempt (the first to, that
        is; a later one is written with it), and the run is tried again or fails."""
        at = step.at
        error, retryable = step_failure(exc, at.id), not isinstance(exc, FatalError)
        if isinstance(exc, LentFailed):  # its borrower's error, as it reported it
            error, retryable = exc.error, exc.retryable
        if isinstance(exc, MapFailed):  # the platform's own words, not a handler's exception
            error = RunError(code=exc.code, message=str(exc), step=at.id)
        run = held.run
        retried = retry_at(run, at.template, at.id, retryable, self.clock.now()) is not None
        spec = at.template.steps[at.index]
        if not retried and spec.on_failure == "continue":
            failed = self._stopped(step, StepStatus.FAILED, error, final=True)
            reason = f"needs {at.id!r}, which failed"
            skips = [
                StepEnd(i, at.template.steps[i].id, StepStatus.SKIPPED, reason=reason)
                for i in flow.to_skip(at.index)
            ]
            now = replace(at, done=flow.done)  # steps beside it may have ended since it began
            self._check(run, await self.lifecycle.end_steps(now, [failed, *skips]))
            flow.end(at.index, StepStatus.FAILED)
            for skip in skips:
                flow.end(skip.index, StepStatus.SKIPPED)
            return walk.failure
        if walk.failure is None:
            return _Failure(step, error, retryable, retried)
        walk.ended.append(self._stopped(step, StepStatus.FAILED, error))
        return walk.failure

    async def _complete_ended(self, held: Held, flow: Flow) -> None:
        """Every step has ended, the last of them without a success to write with the run's."""
        last = len(flow.template.steps) - 1
        if flow.statuses[last] == StepStatus.SUCCEEDED:
            at = HeldStep(held.run, held.lease, flow.template, last, flow.done - 1)
            output = flow.outputs.get(at.id)
            moved = await self.lifecycle.complete(at, output, result=flow.result)
        else:
            moved = await self.lifecycle.complete_ended(
                held.run, held.lease, flow.template, flow.result
            )
        self._check(held.run, moved)

    def _go_on(self, held: Held) -> None:
        """Raise what stops the run before its next step: a stop, a cancel, its deadline."""
        if held.stop is not None:
            raise Stopped(held.stop)
        if held.cancel.is_set():
            raise CancelRequested(held.run.id, interrupted=False)
        if time_left(held.run, self.clock.now()) == 0:
            raise Overdue

    @staticmethod
    def _asked_aside(held: Held, future: asyncio.Future[Any], step: RunningStep) -> bool:
        """The step stopped because a step beside it failed the run, not for a cancel."""
        asked = step.stop_asked or (step.ctx is not None and step.ctx.cancel_asked)
        return (
            asked and isinstance(future.exception(), CancelRequested) and not held.cancel.is_set()
        )

    @staticmethod
    def _stopped(
        step: RunningStep, status: StepStatus, error: RunError | None = None, final: bool = False
    ) -> StepEnd:
        """The end of a step that ran but gave no result."""
        at, start = step.at, step.unwritten_start
        began, attempt = (start.at, start.attempt) if start else (None, 0)
        return StepEnd(at.index, at.id, status, began, attempt, error, final=final)

    @staticmethod
    def _cancel_all(running: dict[asyncio.Future[Any], RunningStep]) -> None:
        """A step failed the run: the steps beside it are asked to stop (a lent step's
        watch tells its borrower)."""
        for step in running.values():
            if step.lent is not None:
                step.stop_asked = True
            elif step.ctx is not None:
                step.ctx.cancel_asked = True

    async def _work(self, held: Held, running: RunningStep, flow: Flow, walk: _Walk) -> Any:
        """Do a step's work: a map step's fan-out, a lent step's watch, or its handler's
        call."""
        at = running.at
        if running.lent is not None:  # worked, and traced, by its borrower
            return await self._watch(held, running, walk)
        with spans.step(held.run, at.id):
            if at.template.steps[at.index].worker_type == "map":
                made = flow.made.get(at.index)
                return await self._fanout.run(at, running.start, flow.activation(), made)
            return await self._caller.call(held, running, flow.outputs)

    def _check(self, run: Run, outcome: Moved | Lost | None) -> None:
        """Say so when a write finished `run`, and stop the run when the write was lost."""
        self._finished(run, outcome)
        stop_if_lost(outcome)

    def _finished(self, run: Run, outcome: Moved | Lost | None) -> None:
        """Say so when a write finished `run` (the lifecycle counted it)."""
        if isinstance(outcome, Moved) and outcome.to in TERMINAL:
            # From the run's first start, as its duration metric; clocks may disagree a little.
            began = run.started_at or run.create_at
            took = max(0.0, (self.clock.now() - began).total_seconds())
            log.info("run %s (%s) %s in %.1f s", run.id, run.template_type, outcome.to.value, took)

    async def _template(self, run: Run) -> Template | None:
        key = (run.template_type, run.template_version)
        if key not in self._templates:
            template = await self.store.templates.get(*key)
            if template is None:
                return None
            self._templates[key] = template
        return self._templates[key]
