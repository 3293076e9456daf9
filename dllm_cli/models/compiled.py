"""`--compile`: cached block steps replayed as CUDA graphs (the eager kernels, recorded once).

Within a block every cached step runs the same kernels on the same buffers; only the token ids
change. On CUDA the first such step (per shape, columns and cache) runs eagerly and is recorded;
the following ones copy their inputs into the recorded buffers and replay it (no per-kernel
launch cost), bit-identical to eager decoding. Full-canvas forwards stay eager. Elsewhere the
model stays eager and `enable_compile` says why (torch.compile was slower on CPU:
docs/decoding.md, "Speed").
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from dllm_cli.cache import KVCache
from dllm_cli.errors import DllmError

# record(run) -> (this step's output, replay, the buffer each replay rewrites)
Recorder = Callable[
    [Callable[[], torch.Tensor]], tuple[torch.Tensor, Callable[[], None], torch.Tensor]
]


def record_cuda_graph(run: Callable[[], torch.Tensor]):
    """Run once eagerly on a side stream (warm-up and this step's result), then record."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run()
    return out, graph.replay, static_out


class StepGraphs:
    """A model forward that replays recorded cached block steps and runs the rest eagerly;
    `agree` (tensor parallelism: `Shards.agree`) makes one rank's failed recording leave every
    rank eager, so every rank runs the same collectives."""

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        record: Recorder,
        agree: Callable[[bool], bool] | None = None,
    ):
        self.forward, self.record, self.agree = forward, record, agree
        self.key = self.replay = self.static = self.output = None
        self.failed: str | None = None
        self.recordings = self.replays = 0

    def __call__(
        self, input_ids, positions=None, cache=None, key_mask=None, columns=None, logits_slice=None
    ):
        args = (input_ids, positions, cache, key_mask, columns, logits_slice)
        if self.failed or not graphable(*args):
            return self.forward(*args)
        key = recording_key(*args)
        if key != self.key:
            return self._record(key, *args)
        for buffer, value in zip(self.static, (input_ids, positions, key_mask), strict=True):
            if buffer is not None:
                buffer.copy_(value)
        self.replay()
        self.replays += 1
        return self.output.clone()  # the next replay rewrites the buffer

    def _record(self, key, input_ids, positions, cache, key_mask, columns, logits_slice):
        self.key = self.replay = self.output = None  # release the previous graph first
        self.static = tuple(
            None if t is None else t.clone() for t in (input_ids, positions, key_mask)
        )
        ids, pos, keys = self.static

        def run() -> torch.Tensor:
            return self.forward(ids, pos, cache, keys, columns, logits_slice)

        why = None
        try:
            out, self.replay, self.output = self.record(run)
        except DllmError:  # a lost rank: no recording problem, the job ends
            raise
        except Exception as e:  # recording is an optimisation: never let it break a decode
            why = str(e)
        if self.agree is not None and not self.agree(why is None) and why is None:
            why = "on another rank"
        if why is not None:
            self.failed = f"--compile: CUDA graph recording failed ({why}); decoding eagerly"
            self.replay = self.output = None
            warnings.warn(self.failed, RuntimeWarning, stacklevel=2)
            # every rank runs the step again, eagerly (the same collectives on every rank)
            return self.forward(input_ids, positions, cache, key_mask, columns, logits_slice)
        self.key = key
        self.recordings += 1
        return out


def graphable(input_ids, positions, cache, key_mask, columns, logits_slice) -> bool:
    """A lockstep cached step over part of the canvas; full-canvas refreshes (every column
    attended is computed) and per-row steps (columns, cache rows, logit picks) run eagerly."""
    lockstep = isinstance(columns, slice) and not isinstance(logits_slice, torch.Tensor)
    if not lockstep or not isinstance(cache, KVCache) or not cache.whole or positions is None:
        return False
    attended = cache.width if key_mask is None else min(cache.width, key_mask.shape[1])
    return (columns.start or 0) > 0 or columns.stop < attended


def recording_key(input_ids, positions, cache, key_mask, columns, logits_slice) -> tuple:
    """Everything a recording bakes in: shapes, columns, the cache's buffers, the mask's shape."""
    span = None if logits_slice is None else (logits_slice.start, logits_slice.stop)
    buffers = (id(cache), cache.k[0].data_ptr(), cache.v[-1].data_ptr())
    mask = None if key_mask is None else tuple(key_mask.shape)
    return (tuple(input_ids.shape), columns.start, columns.stop, span, buffers, mask)


def enable_compile(model, record: Recorder | None = None) -> str | None:
    """Turn on CUDA-graph replay of cached block steps; None, or why the model stays eager. A
    tensor-parallel shard records its NCCL all-reduces with the step (NCCL >= 2.9.6): every
    rank records the same steps, and the ranks agree on each recording."""
    from dllm_cli.models.sharding import ShardedLM

    device = next(model.parameters()).device
    if record is None:
        if device.type != "cuda":
            return (
                f"--compile: CUDA graphs need a CUDA device; decoding eagerly on {device.type} "
                "(torch.compile was slower on CPU, see docs/decoding.md)"
            )
        record = record_cuda_graph
    if not isinstance(model.forward, StepGraphs):
        agree = model.shards.agree if isinstance(model, ShardedLM) else None
        model.forward = StepGraphs(model.forward, record, agree)
    return None
