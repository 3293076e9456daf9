"""A `dllm` run whose rank DYING_RANK dies after DYING_AFTER forwards (run as a script under
torchrun by tests/test_tensor_parallel_failures.py): DYING_HOW=kill sends itself SIGKILL (the
OOM killer's way), DYING_HOW=hang stops answering (a rank stuck in a driver)."""

from __future__ import annotations

import os
import signal
import time

from dllm_cli.cli import main
from dllm_cli.models.sharding import ShardedLM

RANK, AFTER = int(os.environ["DYING_RANK"]), int(os.environ["DYING_AFTER"])
HOW = os.environ.get("DYING_HOW", "kill")
forward = ShardedLM.forward


def dying_forward(self, *args, **kwargs):
    """The real forward, until this rank's AFTER-th: then it dies as HOW says."""
    if self.shards.rank == RANK and self.shards.counts.forwards >= AFTER:
        if HOW == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)
    return forward(self, *args, **kwargs)


ShardedLM.forward = dying_forward

if __name__ == "__main__":
    main()
