"""Every Redis key name jobplane uses, in one place.

A queue's ready and delayed sets carry the queue name as a hash tag, so the scripts that touch
both stay inside one Redis Cluster slot.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = ""

    def queue(self, queue: str) -> str:
        """Ready runs of a queue: a sorted set, score `-priority`, member the run id."""
        return f"{self.prefix}jobs:queue:{{{queue}}}"

    def delayed(self, queue: str) -> str:
        """Runs waiting for `notBefore`: a sorted set, score epoch ms, member `<id>|<priority>`."""
        return f"{self.prefix}jobs:delayed:{{{queue}}}"

    def lock(self, run_id: str) -> str:
        """The lease mirror of a run; value `<workerId>:<leaseToken>`."""
        return f"{self.prefix}jobs:lock:{run_id}"

    @property
    def scheduler_lock(self) -> str:
        return f"{self.prefix}jobs:scheduler:lock"

    def dedupe(self, key: str) -> str:
        return f"{self.prefix}jobs:dedupe:{key}"

    def cancel(self, run_id: str) -> str:
        return f"{self.prefix}jobs:cancel:{run_id}"

    @property
    def cancel_channel(self) -> str:
        """Pub/sub channel; each message is the id of a run whose cancel was requested."""
        return f"{self.prefix}jobs:cancel"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}jobs:workers:{worker_id}"


def delayed_member(run_id: str, priority: int) -> str:
    return f"{run_id}|{priority}"
