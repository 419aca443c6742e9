"""Step handlers for the chaos tests, loaded by worker processes through JOBPLANE_HANDLERS.

Only a worker process started with CHAOS_KILLS in its environment runs the poison for real:
imported anywhere else (the test process itself, say), the handler fails the run instead of
killing whoever called it.
"""

import os
import signal

from jobplane.worker import FatalError, StepContext, handler


@handler("chaos.kill_own_process")
def kill_own_process(ctx: StepContext) -> None:
    """A poison step: notes this process's id in the CHAOS_KILLS file, then SIGKILLs it.

    Sync on purpose: it dies in a step thread, the way a crashing native library would.
    """
    kills = os.environ.get("CHAOS_KILLS")
    if not kills:
        raise FatalError("chaos.kill_own_process runs only in a chaos test's worker process")
    with open(kills, "a") as out:
        out.write(f"{os.getpid()} {ctx.run.id} {ctx.attempt}\n")
    os.kill(os.getpid(), signal.SIGKILL)
