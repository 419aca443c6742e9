"""Every Redis key name jobplane uses, in one place.

On a Redis Cluster a command, pipeline step or script may touch keys of one hash slot only.
Three groups of keys are used together and share a hash tag (the part in braces, which alone
decides the slot):
- every queue's ready and delayed sets, tagged `{<prefix>queues}`: a worker's blocking pop
  waits on all its lanes in one BZPOPMIN, and one pop script promotes and pops them all;
- the resource locks and their token counter, tagged `{<prefix>locks}`: one script takes a
  step's locks together;
- the worker registry's keys, tagged `{<prefix>workers}`: its scripts read and prune them.

A queue is split into lanes, one per handler: a run waits in the lane of its current step's
handler, and a worker pops only the lanes of the handlers it offers. A run whose current
step is external (any worker hands it on) waits in the queue's own lane, `handler` None.
A fair lane (a template's `fairness: round_robin`) keeps its runs in one sorted set per group
(a scope and scope id), which take turns through the lane's ring (`lua/fair.lua`). A run with
a rate window waits in its lane's rated set, apart from the ready set a blocking pop takes
from, so that only the pop script takes it, past its window. The lane's bell holds every run
of its fair groups and rated set, for a worker blocked in BZPOPMIN to wake on. The pause
mirror, the ring turn counter and the rate windows share the queues' tag, so a pop reads
them in the same script.

The singletons' locks (the scheduler's, the notifier's) carry no tag. Why one slot for all
queues rather than one per queue is in docs/architecture.md.
"""

import hashlib
from dataclasses import dataclass
from typing import Literal

# The roles one process plays at a time, each under its lock.
Singleton = Literal["scheduler", "notifier"]


@dataclass(frozen=True)
class Keys:
    prefix: str = ""

    def __post_init__(self) -> None:
        # A brace in the prefix would move the hash tag, and with it the slot of every key.
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError(
                f"JOBPLANE_REDIS_PREFIX {self.prefix!r} may not hold '{{' or '}}': jobplane's "
                "keys use braces as Redis Cluster hash tags"
            )

    def queue(self, queue: str, handler: str | None = None) -> str:
        """Ready runs of a queue's lane: a sorted set, score `-priority`, member the run id.
        (A queue name holds no colon, so the lane's part cannot be mistaken for it.)"""
        return f"{self.prefix}jobs:queue:{{{self.prefix}queues}}:{queue}{_lane(handler)}"

    def delayed(self, queue: str, handler: str | None = None) -> str:
        """Runs of a lane waiting for `notBefore`: a sorted set, score epoch ms, member
        `<id>|<priority>`."""
        return f"{self.prefix}jobs:delayed:{{{self.prefix}queues}}:{queue}{_lane(handler)}"

    def rated(self, queue: str, handler: str | None = None) -> str:
        """Ready runs of a lane that have a rate window to pass: a sorted set like a ready
        set. No blocking pop waits on it (its runs ring the lane's bell instead), so only the
        pop script takes them, and it takes each one's window in the same step."""
        return f"{self.prefix}jobs:rated:{{{self.prefix}queues}}:{queue}{_lane(handler)}"

    def ring(self, queue: str, handler: str | None = None) -> str:
        """A fair lane's groups in turn: a sorted set, score priority class and turn, member
        the group's key."""
        return f"{self.prefix}jobs:ring:{{{self.prefix}queues}}:{queue}{_lane(handler)}"

    def bell(self, queue: str, handler: str | None = None) -> str:
        """Every ready run of a lane's fair groups and of its rated set: a sorted set, score
        `-priority`, member the run's (`bell_member`)."""
        return f"{self.prefix}jobs:bell:{{{self.prefix}queues}}:{queue}{_lane(handler)}"

    def group(self, queue: str, handler: str | None, group: str) -> str:
        """One group's ready runs in a fair lane: a sorted set like a ready set. The group (a
        scope and its id, which may hold any printable character) is hashed, so the key parts
        stay apart."""
        digest = hashlib.sha1(group.encode(), usedforsecurity=False).hexdigest()[:24]
        return f"{self.prefix}jobs:group:{{{self.prefix}queues}}:{queue}:{digest}{_lane(handler)}"

    @property
    def turn(self) -> str:
        """The counter fair lanes' rings take turns by."""
        return f"{self.prefix}jobs:turn:{{{self.prefix}queues}}"

    @property
    def paused(self) -> str:
        """The copy of MongoDB's queue pauses the pops read: a hash, queue -> `<version>:<1 if
        paused else 0>`, and `_loaded` once a full copy was written."""
        return f"{self.prefix}jobs:paused:{{{self.prefix}queues}}"

    def held(self, template_type: str) -> str:
        """Runs a claim found over their template's `maxRunning`: a sorted set, score
        `-priority`, member the run's queue entry (JSON, its id first, so a priority's members
        sort by age). They go back to their lanes as started runs of the template end."""
        return f"{self.prefix}jobs:held:{{{self.prefix}queues}}:{template_type}"

    @property
    def held_types(self) -> str:
        """The template types whose runs were ever held back by `maxRunning`: a set."""
        return f"{self.prefix}jobs:held:{{{self.prefix}queues}}"

    @property
    def rates(self) -> str:
        """What the key of every rate window begins with (`rate`): the pop script, which
        takes a popped run's window, appends the window's digest itself."""
        return f"{self.prefix}jobs:rate:{{{self.prefix}queues}}:"

    def rate(self, window: str) -> str:
        """One rate window's starts: a sorted set, member the run id, score when it started.
        A window (a template type and its key's values) may hold any character, so it is
        hashed; beside it, `:next` appended, the latest time a run it refused was told to come
        back (`lua/rate.lua`)."""
        digest = hashlib.sha1(window.encode(), usedforsecurity=False).hexdigest()[:24]
        return self.rates + digest

    def lanes(self, queue: str) -> str:
        """The handlers a queue's runs were ever pushed for: a set, read by the metrics."""
        return f"{self.prefix}jobs:lanes:{{{self.prefix}queues}}:{queue}"

    def lock(self, lock_id: str) -> str:
        """A resource lock (`<name>:<key values>`, a step's or a handler's): a string, its
        owner and its fencing token. Every lock shares the tag `{<prefix>locks}` with the
        token counter, so that one script takes a step's locks together and gives each its
        token."""
        return f"{self.prefix}jobs:lock:{{{self.prefix}locks}}:{lock_id}"

    @property
    def lock_tokens(self) -> str:
        """The locks' fencing token counter: a hash of the Redis's incarnation, the last token
        handed out, and the end of the block of tokens MongoDB allotted it."""
        return f"{self.prefix}jobs:locks:{{{self.prefix}locks}}"

    def lock_waiters(self, lock_id: str) -> str:
        """Runs handed back because another run held the lock: a sorted set, member the run's
        queue entry, score when it was handed back. Letting go of the lock takes the oldest
        (in the same script, so it shares the locks' tag), which goes back to its lane at once,
        rather than at the end of its back-off."""
        return f"{self.prefix}jobs:lockwait:{{{self.prefix}locks}}:{lock_id}"

    def singleton_lock(self, role: Singleton) -> str:
        """The lock of the process that plays `role` alone: the active scheduler, or the
        notifier that follows the trail."""
        return f"{self.prefix}jobs:{role}:lock"

    @property
    def cancel_channel(self) -> str:
        """Pub/sub channel; each message is the id of a run whose cancel was requested, or
        the queue entry id of a lent step its holder asks to stop."""
        return f"{self.prefix}jobs:cancel"

    @property
    def reported_channel(self) -> str:
        """Pub/sub channel; each message is the queue entry id of a lent step whose borrower
        reported its end, for its holder to write it now rather than at its next look."""
        return f"{self.prefix}jobs:reported"

    @property
    def workers(self) -> str:
        """Live workers: a sorted set, member the worker id, score when it stops counting as
        alive (epoch ms of Redis's clock)."""
        return f"{self.prefix}jobs:workers:{{{self.prefix}workers}}"

    @property
    def workers_held(self) -> str:
        """Runs each live worker holds, as of its last heartbeat: a hash, worker id -> count."""
        return f"{self.prefix}jobs:workers:{{{self.prefix}workers}}:held"

    @property
    def workers_offers(self) -> str:
        """What each live worker serves: a hash, worker id -> JSON `{queues, handlers}`."""
        return f"{self.prefix}jobs:workers:{{{self.prefix}workers}}:offers"


def _lane(handler: str | None) -> str:
    return "" if handler is None else f":{handler}"


def bell_member(member: str, group_key: str | None = None) -> str:
    """A ready run in its lane's bell: its member, and in a fair lane the key of its group, so
    that a worker its ring woke can tell whether the run still waits (`lua/ring.lua`)."""
    return member + (f"|{group_key}" if group_key else "")


def bell_run(member: str) -> str:
    """The queue member of the run a bell's member names."""
    return member.partition("|")[0]


def delayed_member(run_id: str, priority: int, group_key: str | None = None) -> str:
    """A delayed run: its id and priority, and in a fair lane the key of its group."""
    return f"{run_id}|{priority}" + (f"|{group_key}" if group_key else "")
