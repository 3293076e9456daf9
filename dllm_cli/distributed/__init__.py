"""Batch work under torchrun: input lines shared out over ranks, rank 0 writes it all in order.

Rank 0 broadcasts the input lines; line n belongs to rank (n - 1) % world, which reports its
finished records to rank 0 after every batch, and rank 0 writes record n once it holds 1..n.
Only small pickled records cross ranks, so the group is gloo on every device (any rank's report
first, with a timeout: DLLM_DIST_TIMEOUT seconds, default 1800). A failed rank's unfinished lines
get error records. Nothing here prints or exits: `run` returns an Outcome for the command.

    job.py       the launch, this rank's device, the process group, the input lines
    exchange.py  reports from ranks to rank 0 (gloo point-to-point, a listener thread)
    merge.py     rank 0's ledger: records in from every rank, out in input order; Ctrl-C
    run.py       one rank's part of the job
    tensor.py    --tensor-parallel: which ranks form each replica (the split model: models/)
"""

from dllm_cli.distributed.exchange import Failure
from dllm_cli.distributed.job import (
    Ended,
    Job,
    ended_by_sigterm,
    process_group,
    rank_device,
    share_lines,
)
from dllm_cli.distributed.merge import Interrupts, Merge
from dllm_cli.distributed.run import Outcome, Stranded, run

__all__ = [
    "Ended",
    "Failure",
    "Interrupts",
    "Job",
    "Merge",
    "Outcome",
    "Stranded",
    "ended_by_sigterm",
    "process_group",
    "rank_device",
    "run",
    "share_lines",
]
