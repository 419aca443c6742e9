"""Starting runs: a worker's claim, and the limits a run passes as it starts.

Most runs have none and are claimed in one conditional update (`transitions.claim`). A run of a
template with `rateLimit` or `maxRunning` is left out of that update and starts only past both:

- **`rateLimit`**: at most `limit` starts in any `periodSeconds` of its window (the template,
  or one window per value of the limit's key). The window lives in Redis (`queue/lua/rate.lua`,
  a log of the starts of the last period), and the pop that takes a run takes its window in
  the same script: a run over the limit goes back to its lane's delayed set until the window
  allows it, a share of the period after the run refused before it, so a backlog comes back at
  the limit's pace. It never reaches a worker's claim and is never refused.
- **`maxRunning`**: at most that many runs of the template (all versions, all scopes) started
  at once. MongoDB decides: the template's gate gives a run a place before its claim takes it
  (`store/gates.py`, `transitions.claim_limited`), so no loss of Redis lets more start. A run
  over the cap is held back out of every lane (Redis's held set, `queue/keys.py`) and goes
  back to its lane when a started run of its template ends: no worker pops it meanwhile.
  Should that hand-over be lost (a process died, Redis was wiped), the scheduler's tick takes
  back the places dead processes left admitted and lets held runs go while there is room, and
  the reconciler pushes again what Redis lost.

A Redis wipe loses the rate windows: in the window after it, up to `limit` more runs may start
than the limit allows (at most one window's over-admission).
"""

import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import datetime

from jobplane import metrics
from jobplane.clock import Clock
from jobplane.model import Run, StartLimits, WaitingFor
from jobplane.queue.entry import QueueEntry
from jobplane.queue.pop import Popped
from jobplane.queue.redis import RedisQueue
from jobplane.store import Lease, Store

log = logging.getLogger("jobplane.runs")


# After a run's end found none of its template's runs held back, how long this process's
# later ends take that as still so and skip asking Redis: under a cap that does not bind, the
# question would cost every run's end a round trip. A run held back meanwhile waits at most this
# long for a later end, and its holder lets it go at once if there is room (`_hold`).
NONE_HELD_SECONDS = 0.05


class Starts:
    def __init__(self, store: Store, queue: RedisQueue, clock: Clock | None = None) -> None:
        self.store = store
        self.queue = queue
        self.clock = clock or store.clock
        # By template: until when (monotonic) its ends need not ask Redis for a held run.
        self._none_held: dict[str, float] = {}

    async def claim(
        self,
        run_ids: Sequence[str],
        worker_id: str,
        lease_seconds: float,
        popped: Popped | None = None,
        token: str | None = None,
    ) -> AsyncIterator[list[tuple[Run, Lease]]]:
        """Lease the runs among `run_ids` that may start, to `worker_id`, a batch at a time:
        those without limits at once, then those with limits once they pass them, so that the
        first may start while the others wait on their limits. The others are where they
        belong again (delayed by their rate window, or held back by `maxRunning`), or were not
        claimable (cancelled, claimed by another worker).

        `popped` says what the runs with limits must pass, and which rate windows the pop took:
        those gated skip the plain claim, and nothing is read to check them. A run whose limits
        the pop did not know of (pushed before it had them, or claimed by id alone) is found
        among the ids the plain claim left, which are read only then. The plain claim leases
        under `token` when given (the one its caller took the runs' locks for), else a fresh
        one."""
        limits = popped.limits if popped else {}
        plain = [i for i in run_ids if i not in limits or not limits[i].gated]
        claimed = await self.store.transitions.claim(plain, worker_id, lease_seconds, token)
        if claimed:
            yield claimed
        won = {run.id for run, _ in claimed}
        limited = [(i, limits[i]) for i in run_ids if i in limits and limits[i].gated]
        if rest := [i for i in plain if i not in won]:
            unknown = await self.store.runs.limited(rest)
            limited += [(r.id, sl) for r in unknown if (sl := r.start_limits)]
        if limited:
            windows, at = (popped.windows, popped.at) if popped else ({}, None)
            also = await self._claim_limited(limited, worker_id, lease_seconds, windows, at)
            if also:
                yield also

    async def _claim_limited(
        self,
        runs: Sequence[tuple[str, StartLimits]],
        worker_id: str,
        lease_seconds: float,
        windows: Mapping[str, bool],
        at: datetime | None,
    ) -> list[tuple[Run, Lease]]:
        now = self.clock.now()
        # A rated run whose window the pop did not take (a member pushed before rated runs
        # waited apart, or a run claimed by id alone) goes back to its lane, for a pop to take
        # it past its window: the pop is the one place a window is taken.
        back = [i for i, limits in runs if limits.rate is not None and i not in windows]
        going = [(i, limits) for i, limits in runs if limits.rate is None or i in windows]
        counted = {i: limits.rate.key for i, limits in going if limits.rate and windows[i]}
        # A rated run starts when its window counted it.
        claimed, held = await self.store.transitions.claim_limited(
            going, worker_id, lease_seconds, at or now
        )
        # From here on the claims stand: nothing that fails below may keep their runs from
        # starting (their leases would run out unused).
        try:
            # The starts this take counted for runs `maxRunning` then held back. A run not
            # claimed for another reason keeps its count: it may have been claimed by another
            # worker's pop of it, whose start that count now is (a cancelled one's costs a
            # place in the window for one period).
            unused = [(i, counted[i]) for i in held if i in counted]
            if unused:
                await self.queue.limits.rate_return(unused)
            if back or held:
                # Their lanes are needed to put them back: read only for those.
                found = {r.id: r for r in await self.store.runs.limited([*back, *held])}
                await self.queue.push([QueueEntry.of(found[i]) for i in back if i in found], now)
                if over := [found[i] for i in held if i in found]:
                    await self._hold(over)
        except Exception:
            # Runs popped and neither claimed nor put back: the reconciler pushes them again.
            log.exception("runs past their limits not put back in Redis")
        return claimed

    async def _hold(self, runs: Sequence[Run]) -> None:
        """Hold runs over `maxRunning` back, then let go as many as there is room for now: a
        run of the template that ended while they were on their way found none held."""
        await self.queue.limits.hold([QueueEntry.of(r) for r in runs])
        for run in runs:
            self._none_held.pop(run.template_type, None)
            metrics.RUNS_HELD.labels(run.template_type).inc()
        for template_type in {r.template_type for r in runs}:
            cap = min(r.max_running or 0 for r in runs if r.template_type == template_type)
            await self.release_room(template_type, cap)

    async def release_room(self, template_type: str, cap: int | None) -> int:
        """Let as many held runs of `template_type` go back to their lanes as `cap` leaves
        room for (all of them without a cap); how many went."""
        room = 1 << 30
        if cap is not None:
            room = cap - await self.store.gates.admitted(template_type)
        return await self.queue.limits.release(template_type, room, self.clock.now())

    async def freed(self, run: Run) -> None:
        """A started run left its template's started runs (it ended or went back to its
        queue): under `maxRunning`, one held run may take its place."""
        template_type = run.template_type
        if run.max_running is None or time.monotonic() < self._none_held.get(template_type, 0):
            return
        if not await self.queue.limits.release(template_type, 1, self.clock.now()):
            self._none_held[template_type] = time.monotonic() + NONE_HELD_SECONDS

    async def give_back_spares(self, everything: bool = False) -> None:
        """Give back this process's spare places under `maxRunning` that are too old to use
        (all of them as the worker stops), and let as many held runs go."""
        for template_type, n in (await self.store.gates.give_back_spares(everything)).items():
            await self.queue.limits.release(template_type, n, self.clock.now())

    async def release_all_room(self) -> int:
        """The scheduler's backstop: for every template with runs held back, take back the
        places processes that died left admitted, then let go as many runs as its latest
        `maxRunning` leaves room for. Returns how many went."""
        released = 0
        for template_type, held in (await self.queue.limits.held_counts()).items():
            if held:
                await self.store.gates.sweep(template_type)
                template = await self.store.templates.get(template_type)
                cap = template.max_running if template else None
                released += await self.release_room(template_type, cap)
        return released


def held_back(run: Run, holding: set[str]) -> WaitingFor | None:
    """A run held back by its template's `maxRunning` says so."""
    if run.id not in holding:
        return None
    return WaitingFor(reason="max_running", detail=f"{run.max_running} runs of it have started")


def rate_delayed(run: Run, due: datetime | None) -> WaitingFor | None:
    """A run its rate window sent back to wait (later than its own `notBefore`) says until
    when."""
    if run.rate is None or due is None or (run.not_before is not None and due <= run.not_before):
        return None
    per = f"{run.rate.limit} starts per {run.rate.period_seconds:g} s"
    return WaitingFor(reason="rate_limit", detail=f"{per}; tries again at {due.isoformat()}")
