"""int4 on CPU: the dequant path against torch's CPU int4 kernel, per forward (issue 41).

    python benchmarks/int4_kernels.py [--columns 192 320] [--threads 2] [--rounds 41]

One forward of the peer checkpoint's projections (benchmarks/peer_gguf.py: hidden 512,
8 blocks of q/k/v 1024 x 512, o 512 x 512, gate/up 2816 x 512, down 512 x 1408, and the
336 x 512 output head), random weights quantized once per kernel, float32 input of
`columns` rows, as `Int4Linear.forward` runs it (bfloat16 in, float32 out). The kernels
alternate in one process, the first one swapping every round; medians of wall and CPU time
(`time.process_time`) per forward, the least wall time, and the load average before and
after (a shared machine: the medians of many alternations, not one run, are the figures to
read; the least wall time is the run least disturbed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from dllm_cli.models.int4 import Int4Linear

BLOCKS = 8
SHAPES = ((1024, 512), (512, 512), (2816, 512), (512, 1408))  # (out, in) per block
HEAD = (336, 512)
KERNELS = ("dequant", "tinygemm-cpu")


def layers(kernel: str) -> list[Int4Linear]:
    """One forward's projections in 4 bits for `kernel` (the same weights for every kernel)."""
    torch.manual_seed(0)
    shapes = [s for _ in range(BLOCKS) for s in SHAPES] + [HEAD]
    return [Int4Linear.of(torch.randn(o, i) * 0.02, kernel=kernel) for o, i in shapes]


def forward(stack: list[Int4Linear], inputs: dict[int, torch.Tensor]) -> None:
    """Every projection once on its input width's activations."""
    with torch.inference_mode():
        for layer in stack:
            layer(inputs[layer.in_features])


def timed(stack: list[Int4Linear], inputs: dict[int, torch.Tensor]) -> tuple[float, float]:
    """(wall ms, CPU ms) of one forward."""
    wall, cpu = time.perf_counter(), time.process_time()
    forward(stack, inputs)
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def compare(columns: int, rounds: int) -> dict[str, dict[str, float]]:
    """Medians per kernel over `rounds` alternations at `columns` rows."""
    stacks = {k: layers(k) for k in KERNELS}
    inputs = {i: torch.randn(columns, i) for i in {512, 1408}}  # (columns, in)
    for stack in stacks.values():
        forward(stack, inputs)  # warm-up: first-call allocations, oneDNN primitives
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in KERNELS}
    for r in range(rounds):
        for k in KERNELS if r % 2 == 0 else reversed(KERNELS):
            runs[k].append(timed(stacks[k], inputs))
    return {
        k: {
            "wall_ms": statistics.median(w for w, _ in v),
            "cpu_ms": statistics.median(c for _, c in v),
            "best_wall_ms": min(w for w, _ in v),  # the least disturbed run
        }
        for k, v in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--columns", type=int, nargs="+", default=[192, 320])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=41)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds")
    for columns in args.columns:
        before = os.getloadavg()[0]
        got = compare(columns, args.rounds)
        after = os.getloadavg()[0]
        cells = ", ".join(
            f"{k} {v['wall_ms']:.2f} ms wall / {v['cpu_ms']:.2f} ms CPU (best wall "
            f"{v['best_wall_ms']:.2f})"
            for k, v in got.items()
        )
        ratio = got["dequant"]["wall_ms"] / got["tinygemm-cpu"]["wall_ms"]
        print(
            f"{columns} columns: {cells}; dequant / tinygemm-cpu wall {ratio:.2f}; "
            f"load average {before:.2f} -> {after:.2f}"
        )


if __name__ == "__main__":
    main()
