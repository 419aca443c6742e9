"""The pop: the ready runs a worker takes from the lanes of its queues, in one script call
(`lua/pop.lua`), after a blocking wait for one when it has nothing to do.

`RedisQueue.pop` is its entry and says what a pop takes; this module holds how, and what it
answers (`Popped`).
"""

import asyncio
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from jobplane.model import StartLimits
from jobplane.queue.calls import epoch_ms, eval_in, script, text
from jobplane.queue.connect import RedisClient
from jobplane.queue.entry import run_of
from jobplane.queue.keys import Keys, bell_run


@dataclass(frozen=True)
class Popped:
    """What a pop took, and what claiming it needs."""

    run_ids: list[str]
    # When the earliest delayed run of the queues falls due, so a worker knows how long to block.
    next_due: datetime | None
    # The queues asked for that are paused: none of their runs were popped.
    paused: frozenset[str] = frozenset()
    # False while Redis holds no copy of the queues' pauses (new, or wiped): nothing was popped,
    # and the caller loads the copy from MongoDB (`mirror_pauses`) before it pops again.
    mirrored: bool = True
    # The limits of those of `run_ids` whose runs have some to pass as they start.
    limits: dict[str, StartLimits] = field(default_factory=dict)
    # Those of `run_ids` whose rate window the pop took: True where it counted their start,
    # False where the window had counted it before (a stale pop of a run started since).
    windows: dict[str, bool] = field(default_factory=dict)
    # When the pop took the windows (its `now`): a claim starts their runs at that time.
    at: datetime | None = None
    # The runs the pop found over their rate window, sent back to their delayed sets: each
    # one's limits and when it tries again.
    refused: tuple[tuple[StartLimits, datetime], ...] = ()


@dataclass(frozen=True)
class _PopAnswer:
    """The pop script's answer, decoded (`lua/pop.lua` says what each part is)."""

    members: tuple[str, ...]
    due: int | None
    paused: frozenset[str]
    mirrored: bool
    windows: dict[str, bool]
    # Each member refused by its window, and when it tries again (epoch ms).
    refused: dict[str, int]

    @classmethod
    def of(cls, reply: list[Any]) -> "_PopAnswer":
        popped, due, paused, mirrored, windows, refused = reply
        return cls(
            tuple(text(m) for m in popped),
            int(float(text(due))) if due else None,
            frozenset(text(q) for q in paused),
            bool(mirrored),
            {text(windows[i]): int(windows[i + 1]) == 0 for i in range(0, len(windows), 2)},
            {text(refused[i]): int(refused[i + 1]) for i in range(0, len(refused), 2)},
        )

    def then(self, later: "_PopAnswer") -> "_PopAnswer":
        """This answer followed by a later pop's, taken at once."""
        due = min((d for d in (self.due, later.due) if d is not None), default=None)
        return _PopAnswer(
            (*self.members, *later.members),
            due,
            later.paused,
            later.mirrored,
            self.windows | later.windows,
            self.refused | later.refused,
        )

    def next_due(self, now: datetime) -> datetime | None:
        return None if self.due is None else datetime.fromtimestamp(self.due / 1000, now.tzinfo)


class Popper:
    """Pops ready runs from the lanes of queues, for `RedisQueue.pop` and `promote`."""

    def __init__(self, redis: RedisClient, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._pop_script = script(redis, "pop", "fair", "rate")
        self._ring = script(redis, "ring")

    async def pop(
        self,
        queues: Sequence[str],
        handlers: Sequence[str],
        n: int,
        now: datetime,
        block_seconds: float,
        paused: Collection[str],
    ) -> Popped:
        """`RedisQueue.pop`, which says what it takes, without its bound on time."""
        lanes = [(q, h) for q in queues for h in [None, *handlers]]
        keys = [self.keys.paused, self.keys.turn]
        for q, h in lanes:
            keys += [self.keys.queue(q, h), self.keys.delayed(q, h)]
            keys += [self.keys.ring(q, h), self.keys.bell(q, h), self.keys.rated(q, h)]
        args: list[str | int] = [epoch_ms(now), n, 1000, self.keys.rates]
        for q in queues:
            args += [q, len(handlers) + 1]
        # Redis truncates a timeout to whole milliseconds (0.001 s can come out as 0.999 ms)
        # and reads 0 as "forever".
        timeout = max(block_seconds, 0.002)
        awake = [(q, h) for q, h in lanes if q not in paused]
        waiting = [k for q, h in awake for k in (self.keys.queue(q, h), self.keys.bell(q, h))]
        blocking = block_seconds > 0 and n > 0 and bool(waiting)
        async with self.redis.pipeline(transaction=False) as pipe:
            if blocking:
                pipe.bzpopmin(waiting, timeout=timeout)
            args[1] = n - 1 if blocking else n
            eval_in(pipe, self._pop_script, keys, args)
            replies = await pipe.execute()
        waited = replies[0] if blocking else None
        answer = _PopAnswer.of(replies[-1])
        members = list(answer.members)
        if waited:
            key, member, score = text(waited[0]), text(waited[1]), waited[2]
            stays = not answer.mirrored or self._queue_of(key, lanes) in answer.paused
            # The bells waited on, each with its lane's rated set, where a rated run waits.
            bells = {self.keys.bell(q, h): self.keys.rated(q, h) for q, h in awake}
            if stays or key in bells:
                # A bell only woke this worker (the run is still in its group or rated set,
                # unless a pop took it), or the queue may not be popped (paused since the last
                # answer, or Redis has no copy of the pauses): the member goes back, a bell's
                # only while its run waits (`lua/ring.lua`).
                run = bell_run(member)
                if run not in members and run not in answer.refused:
                    async with self.redis.pipeline(transaction=False) as pipe:
                        if key in bells:
                            eval_in(pipe, self._ring, [key, bells[key]], [member, score])
                        else:
                            pipe.zadd(key, {member: score})
                        if not stays and not members:
                            # Woken for a bell's run, and the pop after the wait took none (it
                            # was asked for one less): pop now, rather than at the next call.
                            args[1] = n
                            eval_in(pipe, self._pop_script, keys, args)
                        again = await pipe.execute()
                    if len(again) > 1:
                        answer = answer.then(_PopAnswer.of(again[1]))
                        members = list(answer.members)
            else:
                members.insert(0, member)
        elif block_seconds > 0 and n > 0 and not waiting and not members:
            await asyncio.sleep(block_seconds)  # every queue paused: wait as a pop would
        next_due = answer.next_due(now)
        runs = [run_of(m) for m in members]
        limits = {run_id: limit for run_id, limit in runs if limit is not None}
        refused = tuple(
            (limit, datetime.fromtimestamp(at / 1000, now.tzinfo))
            for m, at in answer.refused.items()
            if (limit := run_of(m)[1]) is not None
        )
        return Popped(
            [run_id for run_id, _ in runs],
            next_due,
            answer.paused,
            answer.mirrored,
            limits,
            answer.windows,
            now,
            refused,
        )

    def _queue_of(self, key: str, lanes: Sequence[tuple[str, str | None]]) -> str | None:
        return next((q for q, h in lanes if self.keys.queue(q, h) == key), None)
