"""dllm against Fast-dLLM's own `generate_with_dual_cache` on one random LLaDA folder (not a test).

    python benchmarks/fastdllm_compare.py --fast-dllm PATH [--d-model 64 --layers 2
        --prompt-length 64] [--reps 5] [--profile]

PATH is a checkout of NVlabs/Fast-dLLM (or its `llada/` folder); its `llada/generate.py` and
`llada/model/modeling_llada.py` run unchanged, in this process, next to dllm's engine. Its
code is not part of this repository: it needs `einops` (and transformers; its own pin is 4.49,
but it runs on 5.x when built from its config and state dict instead of `from_pretrained`, as
here). Its one `torch.compile` (an SDPA wrapper) is disabled (`TORCH_COMPILE_DISABLE=1`,
eager on CPU; `--compile-peer` keeps it) so both run the same eager kernels.

Both decode the same prompt with the same settings: gen 256, block 32, dual cache, threshold
0.9, greedy, one thread, dllm with no suffix pruning (`suffix_window` 0). The script checks
the tokens are identical and the forwards equal, then prints each decoder's median decode
time over `--reps` interleaved runs (CPU seconds of this process, and wall seconds) and the
ratio. The folder is random LLaDA (tests/checkpoints.py, float32) with one change that keeps
the two samplers on the same distribution: dllm never drafts [MASK] or the embedding's padding
rows (their logits are -inf), Fast-dLLM has no such rule, so the folder's LM head gives those
rows a logit below -60 for every input (one residual dimension is held constant through the
blocks and only those rows read it), too small to move a float64 softmax's bits.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fast-dllm", required=True, type=Path, help="Fast-dLLM checkout")
    p.add_argument("--folder", type=Path, help="where to write the folder (default: a temp dir)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--prompt-length", type=int, default=64)
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile-peer", action="store_true", help="keep Fast-dLLM's torch.compile")
    p.add_argument("--profile", action="store_true", help="cProfile one dllm decode")
    p.add_argument(
        "--breakdown", action="store_true", help="dllm's step: CPU and ops in/out of the forward"
    )
    return p.parse_args()


def llada_dir(path: Path) -> Path:
    """The folder holding Fast-dLLM's generate.py (a checkout or its llada/ folder)."""
    for candidate in (path / "llada", path):
        if (candidate / "generate.py").is_file() and (candidate / "model").is_dir():
            return candidate
    sys.exit(f"error: no llada/generate.py under {path}")


def write_folder(root: Path, d_model: int, layers: int, heads: int, seed: int) -> Path:
    """A random float32 LLaDA folder whose head never prefers [MASK] or padding rows."""
    import torch
    from checkpoints import save_weights, write_llada

    shape = {"d_model": d_model, "n_heads": heads, "n_kv_heads": heads, "n_layers": layers}
    shape["mlp_hidden_size"] = 2 * d_model
    name = f"llada-d{d_model}-l{layers}"
    w = write_llada(root / name, dtype=torch.float32, seed=seed, **shape)
    t, ids = w.tensors, w.ids
    t["model.transformer.wte.weight"][:, 0] = 2.0  # residual dimension 0: constant 2 ...
    for i in range(layers):  # ... as no block writes to it
        t[f"model.transformer.blocks.{i}.attn_out.weight"][0] = 0.0
        t[f"model.transformer.blocks.{i}.ff_out.weight"][0] = 0.0
    head = t["model.transformer.ff_out.weight"]  # (table, d)
    head[:, 0] = 0.0
    banned = [ids["mask"], *range(ids["vocab_size"], head.shape[0])]
    head[banned] = 0.0
    head[banned, 0] = -1000.0  # logit -1000 * ln_f(x)[0], and ln_f(x)[0] > 0.06 here
    save_weights(w.folder, t)
    return w.folder


def load_peer(llada: Path, folder: Path, compile_peer: bool):
    """Fast-dLLM's model built from the folder's config and weights, and its generate module."""
    if not compile_peer:
        os.environ["TORCH_COMPILE_DISABLE"] = "1"
    sys.path.insert(0, str(llada))
    import generate as peer_generate  # Fast-dLLM's llada/generate.py
    from model.configuration_llada import LLaDAConfig
    from model.modeling_llada import LLaDAModelLM
    from safetensors.torch import load_file

    config = LLaDAConfig.from_pretrained(str(folder))
    model = LLaDAModelLM(config)
    missing = model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    return model.float().eval(), peer_generate


def breakdown(run, model, steps: int, reps: int) -> None:
    """Per dllm step (one forward each here): CPU microseconds inside the model's forward and outside it (the
    engine's own work), and top-level aten ops in each (torch.profiler, one more decode)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    forward, inside = type(model).forward, [0.0]

    def timed_forward(self, *a, **k):
        began = time.process_time()
        with record_function("MODEL"):
            out = forward(self, *a, **k)
        inside[0] += time.process_time() - began
        return out

    type(model).forward = timed_forward
    try:
        began = time.process_time()
        for _ in range(reps):
            run()
        total, forwards = time.process_time() - began, inside[0]
        with profile(activities=[ProfilerActivity.CPU]) as prof:  # (not in the timings)
            run()
    finally:
        type(model).forward = forward
    ops = {True: 0, False: 0}

    def walk(event, under: bool) -> None:
        for child in event.cpu_children:
            if child.name == "MODEL":
                walk(child, True)
            elif child.name.startswith("aten::"):
                ops[under] += 1
            else:
                walk(child, under)

    for event in prof.events():
        if event.cpu_parent is None:
            if event.name.startswith("aten::"):
                ops[False] += 1
            else:
                walk(event, event.name == "MODEL")
    n = steps * reps
    print(
        f"dllm per step: {total / n * 1e6:.0f} us CPU = forward {forwards / n * 1e6:.0f} us",
        end="",
    )
    print(f" + outside {(total - forwards) / n * 1e6:.0f} us; top-level aten ops: ", end="")
    print(f"forward {ops[True] / steps:.1f}, outside {ops[False] / steps:.1f}")


def main() -> None:
    args = parse()
    llada = llada_dir(args.fast_dllm)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from dllm_cli.decoding import decode
    from dllm_cli.models.loading import load_model
    from dllm_cli.settings import DecodeSettings

    tmp = None if args.folder else tempfile.TemporaryDirectory()
    root = args.folder or Path(tmp.name)
    folder = write_folder(root, args.d_model, args.layers, args.heads, args.seed)
    peer, peer_generate = load_peer(llada, folder, args.compile_peer)
    loaded = load_model(folder, dtype="float32", device="cpu")
    special = loaded.special
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(1, 60, (1, args.prompt_length), generator=gen)  # plain words
    s = DecodeSettings(
        gen_length=args.gen_length, block_length=args.block_length, cache="dual",
        unmask="threshold", threshold=args.threshold, temperature=0.0, suffix_window=0,
    )  # fmt: skip

    def run_dllm():
        result = decode(loaded.model, special, [prompt[0].tolist()], s)
        return result.tokens[0], result.forwards

    def run_peer():
        x, nfe = peer_generate.generate_with_dual_cache(
            peer, prompt, steps=args.gen_length, gen_length=args.gen_length,
            block_length=args.block_length, temperature=0.0, remasking="low_confidence",
            mask_id=special.mask, threshold=args.threshold,
        )  # fmt: skip
        return x[0, args.prompt_length :].tolist(), nfe

    def timed(fn):
        cpu, wall = time.process_time(), time.perf_counter()
        out = fn()
        return out, time.process_time() - cpu, time.perf_counter() - wall

    with torch.inference_mode():
        (ours, n_ours), (theirs, n_theirs) = run_dllm(), run_peer()  # warm-up
        same = ours == theirs
        times: dict[str, list[tuple[float, float]]] = {"dllm": [], "fast-dllm": []}
        for _ in range(args.reps):
            for name, fn in (("fast-dllm", run_peer), ("dllm", run_dllm)):
                (tokens, _), cpu, wall = timed(fn)
                same &= tokens == (ours if name == "dllm" else theirs)
                times[name].append((cpu, wall))
        if args.breakdown:
            breakdown(run_dllm, loaded.model, n_ours, args.reps)
        if args.profile:
            prof = cProfile.Profile()
            prof.runcall(run_dllm)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    print(f"folder {folder.name}: prompt {args.prompt_length}, gen {args.gen_length}, ", end="")
    print(f"block {args.block_length}, threshold {args.threshold}, {args.threads} thread(s)")
    print(f"forwards: dllm {n_ours}, fast-dllm {n_theirs}")
    print(f"identical tokens: {same}" + ("" if first is None else f" (first diff at {first})"))
    med = {k: [statistics.median(x[i] for x in v) for i in (0, 1)] for k, v in times.items()}
    for name, (cpu, wall) in med.items():
        runs = " ".join(f"{c:.3f}" for c, _ in times[name])
        print(f"{name:>9}: median CPU {cpu:.3f} s, wall {wall:.3f} s  (CPU runs: {runs})")
    ratio = med["fast-dllm"][0] / med["dllm"][0]
    wall_ratio = med["fast-dllm"][1] / med["dllm"][1]
    print(f"dllm vs fast-dllm: {ratio:.2f}x (CPU), {wall_ratio:.2f}x (wall)")
    if tmp is not None:
        tmp.cleanup()
    if not same or n_ours != n_theirs:
        sys.exit(1)


if __name__ == "__main__":
    main()
