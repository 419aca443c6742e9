"""Every Redis key name jobplane uses, in one place.

On a Redis Cluster a command, pipeline step or script may touch keys of one hash slot only.
Two groups of keys are used together and share a hash tag (the part in braces, which alone
decides the slot):
- every queue's ready and delayed sets, tagged `{<prefix>queues}`: a worker's blocking pop
  waits on all its queues in one BZPOPMIN, and a claim script promotes and pops a queue's two
  sets at once;
- the worker registry's two keys, tagged `{<prefix>workers}`: its scripts read and prune both.
Run locks and the scheduler lock carry no tag, so per-run keys spread over the
cluster. Why one slot for all queues rather than one per queue is in docs/architecture.md.
"""

from dataclasses import dataclass


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

    def queue(self, queue: str) -> str:
        """Ready runs of a queue: a sorted set, score `-priority`, member the run id."""
        return f"{self.prefix}jobs:queue:{{{self.prefix}queues}}:{queue}"

    def delayed(self, queue: str) -> str:
        """Runs waiting for `notBefore`: a sorted set, score epoch ms, member `<id>|<priority>`."""
        return f"{self.prefix}jobs:delayed:{{{self.prefix}queues}}:{queue}"

    def lock(self, run_id: str) -> str:
        """The lease mirror of a run; value `<workerId>:<leaseToken>`."""
        return f"{self.prefix}jobs:lock:{run_id}"

    @property
    def scheduler_lock(self) -> str:
        return f"{self.prefix}jobs:scheduler:lock"

    def dedupe(self, key: str) -> str:
        return f"{self.prefix}jobs:dedupe:{key}"

    @property
    def cancel_channel(self) -> str:
        """Pub/sub channel; each message is the id of a run whose cancel was requested."""
        return f"{self.prefix}jobs:cancel"

    @property
    def workers(self) -> str:
        """Live workers: a sorted set, member the worker id, score when it stops counting as
        alive (epoch ms of Redis's clock)."""
        return f"{self.prefix}jobs:workers:{{{self.prefix}workers}}"

    @property
    def workers_held(self) -> str:
        """Runs each live worker holds, as of its last heartbeat: a hash, worker id -> count."""
        return f"{self.prefix}jobs:workers:{{{self.prefix}workers}}:held"


def delayed_member(run_id: str, priority: int) -> str:
    return f"{run_id}|{priority}"
