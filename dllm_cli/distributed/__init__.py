"""Batch work under torchrun: input lines shared out over ranks, rank 0 writes it all in order.

Rank 0 reads the input and broadcasts the lines. Line n belongs to rank (n - 1) % world, so each
rank runs the same batch pipeline on every world-th line and reports its finished records to
rank 0 after every batch; rank 0 writes record n as soon as it holds records 1..n. Only small
pickled records cross ranks (no model tensors), so the group is gloo on every device: it can take
whichever rank's report comes first, and time out: rank 0 gives up on ranks that sent nothing
for DLLM_DIST_TIMEOUT seconds (default 1800). A rank that fails reports why; rank 0 writes an
error record for each line it held and never finished.

Nothing here prints or exits: `run` returns an Outcome (the failed ranks and their lines), and
the command turns it into stderr lines and an exit code.

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
