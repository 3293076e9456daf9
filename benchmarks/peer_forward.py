"""One no-cache forward in dllm and in llama.cpp's `llama-diffusion-cli`, per forward (issue 30).

    python benchmarks/peer_forward.py --binary .../llama-diffusion-cli --gguf dream-512-f32.gguf \
        --folder dream-512 [--columns 192] [--threads 1] [--rounds 5]

`dllm bench --peer llama-cpp` times whole decodes; this isolates the forward both decodes
repeat, at the same column count and threads, the contenders alternating in one process.
llama.cpp: two runs of the CLI at the same `-ub` (= columns) with 2 and 2 + N steps; the
difference of their CPU time (getrusage of the child) and of their own `total time` over N is
one step, i.e. one forward over every column plus its sampling (0.1-0.3 ms). dllm: the loaded
float32 model (fused and packed as loading makes it) forwarding `columns` ids N times, CPU time
(`time.process_time`) and wall time. CPU time at one thread is the load-robust figure on a
shared machine; wall time at two threads needs a quiet one.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import time
from pathlib import Path

import torch

from dllm_cli.models.loading import load_model
from dllm_cli.peer import PEER_PROMPT, Work, llamacpp_argv, parse_llamacpp

FIRST = 2  # steps of the shorter llama.cpp run (model load, graph reservation, warm-up)


def llamacpp_run(binary: Path, gguf: Path, columns: int, steps: int, threads: int):
    """(CPU s, own decode s) of one CLI run: `steps` forwards over `columns` columns."""
    work = Work(PEER_PROMPT, columns - steps, steps, threads)  # -ub = columns, steps = steps
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        llamacpp_argv(binary, gguf, work), capture_output=True, text=True, errors="replace"
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return cpu, parse_llamacpp(done.stdout + done.stderr)


def llamacpp_forward(binary: Path, gguf: Path, columns: int, n: int, threads: int):
    """(CPU ms, own wall ms) of one step, from the difference of a short and a long run."""
    short = llamacpp_run(binary, gguf, columns, FIRST, threads)
    long = llamacpp_run(binary, gguf, columns, FIRST + n, threads)
    return (long[0] - short[0]) * 1e3 / n, (long[1] - short[1]) * 1e3 / n


def dllm_forward(model, columns: int, n: int):
    """(CPU ms, wall ms) of one forward over `columns` ids (after two warm-up forwards)."""
    ids = torch.randint(0, 300, (1, columns))
    with torch.inference_mode():
        model(ids)
        model(ids)  # the second call with this row count packs the weights (models/fused.py)
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(n):
            model(ids)
        return (time.process_time() - cpu) * 1e3 / n, (time.perf_counter() - wall) * 1e3 / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", type=Path, required=True)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--folder", required=True)
    parser.add_argument("--columns", type=int, default=192)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--forwards", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.folder, dtype="float32", device="cpu").model
    rows = {"llama.cpp CPU": [], "llama.cpp wall": [], "dllm CPU": [], "dllm wall": []}
    for r in range(args.rounds):
        peer = llamacpp_forward(args.binary, args.gguf, args.columns, args.forwards, args.threads)
        ours = dllm_forward(model, args.columns, args.forwards)
        for key, value in zip(rows, (*peer, *ours), strict=True):
            rows[key].append(value)
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f} ms" for k, v in rows.items()))
    mid = {k: statistics.median(v) for k, v in rows.items()}
    print(
        f"{args.columns} columns, {args.threads} threads, medians of {args.rounds} "
        f"(load average {os.getloadavg()[0]:.2f} at the end): "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in mid.items())
        + f"; CPU ratio {mid['llama.cpp CPU'] / mid['dllm CPU']:.2f}"
        + f", wall ratio {mid['llama.cpp wall'] / mid['dllm wall']:.2f}"
    )


if __name__ == "__main__":
    main()
