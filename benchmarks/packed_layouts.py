"""Packed against padded forwards under continuous batching (issue 36 item 3), not a test.

    python benchmarks/packed_layouts.py [--d-model 256] [--layers 4] [--reps 3] [--gen 32]
    python benchmarks/packed_layouts.py --block [--batch 4]   (from each checkout compared)

Rows of a continuous engine sit at different places of their decode, so a step either packs
them into one forward (decoding/packing.py) or runs padded forwards (decoding/forwards.py).
Plain decoding already packed; this measures classifier-free guidance (its second branch as
more packed rows) and WINO (its shadow block as one more attention group). Each case runs both layouts in one process, interleaved, in CPU time
(`time.process_time`, one thread), so load on a shared machine barely moves the ratio; the
tokens must agree. A random float32 LLaDA folder is written by tests/checkpoints.py.

`--block`: CPU milliseconds per forward of the block-causal stepper (a d256 x 4 SDAR folder
from tests/block_checkpoints.py, gen 64 in blocks of 4, one token a step), under the exact
block cache and recomputing; run it with each checkout's Python to compare them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

import dllm_cli

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.append(str(ROOT))  # (tests.checkpoints; dllm_cli stays the running Python's own)

from block_checkpoints import write_sdar  # noqa: E402
from checkpoints import write_llada  # noqa: E402

from dllm_cli.decoding import Engine, decode  # noqa: E402
from dllm_cli.models.loading import load_model  # noqa: E402
from dllm_cli.settings import DecodeSettings  # noqa: E402

LENGTHS = [4, 120, 12, 200, 40, 90, 8, 160]  # prompts far apart: padding would cost much
CASES = {
    "plain": {},
    "cfg 0.5": {"cfg_scale": 0.5},
    "wino": {"unmask": "wino", "threshold": 0.5},
}


def run(model, special, prompts, s: DecodeSettings, packs: bool) -> tuple[list, float, int]:
    """Every prompt through a continuous engine of 3 slots: tokens, CPU seconds, steps."""
    engine = Engine(model, special, s, slots=3, admission="continuous", quantum=8)
    engine.stepper.executor.packs = packs and engine.stepper.executor.packs
    for i, p in enumerate(prompts):
        engine.add(p, key=i)
    out, start = {}, time.process_time()
    while engine.has_work:
        for f in engine.step().finished:
            out[f.key] = f.tokens
    return [out[i] for i in range(len(prompts))], time.process_time() - start, engine.steps


def block(batch: int, reps: int) -> None:
    """The block stepper's best CPU time per forward, each cache, this checkout's code."""
    shape = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4}
    shape |= {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32}
    lm = load_model(write_sdar(Path(tempfile.mkdtemp()) / "sdar", **shape).folder)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(24, 40, (batch,), generator=g).tolist()
    prompts = [torch.randint(20, 60, (n,), generator=g).tolist() for n in lengths]
    for cache in ("prefix", "none"):
        s = DecodeSettings(
            gen_length=64, block_length=4, cache=cache, unmask="threshold", threshold=0.9
        )
        best = float("inf")
        for _ in range(reps):
            start = time.process_time()
            out = decode(lm.model, lm.special, prompts, s)
            best = min(best, (time.process_time() - start) / out.forwards)
        where = Path(dllm_cli.__file__).parents[1]
        print(f"{where} block batch {batch} {cache:6} {out.forwards} forwards", end=" ")
        print(f"{best * 1e3:.2f} ms/forward")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block", action="store_true", help="the block stepper's forwards")
    parser.add_argument("--batch", type=int, default=4, help="--block: prompts")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.block:
        return block(args.batch, args.reps)
    shape = {"d_model": args.d_model, "n_heads": args.d_model // 64, "n_layers": args.layers}
    shape |= {"n_kv_heads": args.d_model // 64, "mlp_hidden_size": 2 * args.d_model}
    root = Path(tempfile.mkdtemp())
    lm = load_model(write_llada(root / "llada", dtype=torch.float32, **shape).folder)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 60, (n,), generator=g).tolist() for n in LENGTHS]
    for cache in ("prefix", "dual", "none"):
        for name, extra in CASES.items():
            s = DecodeSettings(gen_length=args.gen, block_length=8, cache=cache, **extra)
            best = {True: float("inf"), False: float("inf")}
            tokens = {}
            for _ in range(args.reps):
                for packs in (True, False):
                    tokens[packs], seconds, steps = run(lm.model, lm.special, prompts, s, packs)
                    best[packs] = min(best[packs], seconds / steps)
            same = "same tokens" if tokens[True] == tokens[False] else "TOKENS DIFFER"
            print(
                f"{cache:7} {name:14} packed {best[True] * 1e3:7.2f} ms/step  padded "
                f"{best[False] * 1e3:7.2f} ms/step  padded/packed "
                f"{best[False] / best[True]:.2f}x  {same}"
            )


if __name__ == "__main__":
    main()
