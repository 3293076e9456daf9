"""CPU benchmarks of issue 30 (not tests): int8 against float32, the forward per op group.

    python benchmarks/cpu_bench.py quant [--gen 128] [--reps 3]
    python benchmarks/cpu_bench.py profile [--width 512] [--quantize int8]
    python benchmarks/cpu_bench.py startup [--reps 5] [--against OTHER_CHECKOUT]
    python benchmarks/cpu_bench.py forwards [--folder DIR] [--threads 1] [--reps 9]

Every ratio is measured inside one process, the contenders interleaved, in CPU time
(`time.process_time`, one thread), so other load on a shared machine barely moves it. Random
folders are written in the real Dream format by tests/checkpoints.py (the peer's shape:
hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1408, vocabulary 405).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from checkpoints import write_dream  # noqa: E402

from dllm_cli.decoding import decode  # noqa: E402
from dllm_cli.models.loading import load_model  # noqa: E402
from dllm_cli.models.quantize import weight_bytes  # noqa: E402
from dllm_cli.settings import DecodeSettings  # noqa: E402

PEER = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8}
PEER |= {"num_key_value_heads": 4, "intermediate_size": 1408, "vocab_size": 405}
PROMPT = 64  # the peer's chat-wrapped prompt length


def peer_folder(root: Path, width: int = 512) -> Path:
    """A random Dream folder at the peer's shape, scaled to `width` (heads of 64)."""
    shape = dict(PEER, hidden_size=width, num_attention_heads=width // 64)
    shape |= {"num_key_value_heads": width // 128, "intermediate_size": width * 11 // 4}
    return write_dream(root / f"dream-{width}", dtype=torch.float32, seed=0, **shape).folder


def peer_settings(gen: int) -> DecodeSettings:
    """The peer's work: no cache, one token per step, Dream's schedule, greedy."""
    return DecodeSettings(
        gen_length=gen,
        block_length=gen,
        steps=gen,
        cache="none",
        unmask="fixed",
        schedule="dream",
        confidence="low_confidence",
        temperature=0.0,
        early_stop=False,
    )


def prompt_ids(loaded, n: int = PROMPT) -> list[int]:
    """n ordinary token ids (no special roles), the same for every contender."""
    special = set(loaded.special.stop) | {loaded.special.mask, loaded.special.pad}
    vocab = loaded.special.real_vocab(loaded.model.vocab_size)
    ordinary = [t for t in range(vocab) if t not in special]
    return [ordinary[(7 * i) % len(ordinary)] for i in range(n)]


RSS = """
import ctypes, gc, sys, torch
from dllm_cli.models.loading import load_model
def kb(key):
    return int(next(x for x in open('/proc/self/status') if x.startswith(key)).split()[1])
base = kb('VmRSS')
m = load_model(sys.argv[1], device='cpu', quantize=sys.argv[2])
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)  # the same for both (load_model does it under int8)
with torch.no_grad():  # touches every weight: a float32 folder's are mapped from the file
    m.model(torch.zeros(1, 192, dtype=torch.long))
print((kb('VmRSS') - base) / 1024, kb('VmHWM') / 1024)
"""


def resident_mb(folder: str, quantize: str) -> tuple[float, float]:
    """(MiB a fresh process holds after loading and one forward, its peak resident MiB)."""
    out = subprocess.run([sys.executable, "-c", RSS, folder, quantize], capture_output=True)
    held, peak = out.stdout.decode().split()[-2:]
    return round(float(held), 1), round(float(peak), 1)


def quant(gen: int, reps: int) -> dict:
    """float32 against int8 on the shipped model and a random peer-shape folder."""
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = {
            "builtin:tiny-gsm-dream": "builtin:tiny-gsm-dream",
            "random d512": str(peer_folder(Path(tmp), 512)),
            "random d1024": str(peer_folder(Path(tmp), 1024)),
        }
        for name, folder in folders.items():
            models = {q: load_model(folder, device="cpu", quantize=q) for q in ("none", "int8")}
            ids = prompt_ids(models["none"])
            s = peer_settings(gen)
            cpu = {q: [] for q in models}
            tokens = {}
            for _ in range(reps):  # interleaved
                for q, lm in models.items():
                    t = time.process_time()
                    tokens[q] = decode(lm.model, lm.special, [ids], s).tokens[0]
                    cpu[q].append(time.process_time() - t)
            same = sum(a == b for a, b in zip(tokens["none"], tokens["int8"], strict=True))
            best = {q: min(v) for q, v in cpu.items()}
            rows[name] = {
                "cpu_s_float32": round(best["none"], 3),
                "cpu_s_int8": round(best["int8"], 3),
                "speedup": round(best["none"] / best["int8"], 2),
                "agreement": round(same / len(tokens["none"]), 3),
                "weights_mb_float32": round(weight_bytes(models["none"].model) / 2**20, 2),
                "weights_mb_int8": round(weight_bytes(models["int8"].model) / 2**20, 2),
                "rss_mb_float32 (held, peak)": resident_mb(folder, "none"),
                "rss_mb_int8 (held, peak)": resident_mb(folder, "int8"),
            }
            print(name, json.dumps(rows[name]), flush=True)
            del models
    return rows


def forwards(folder: str | None, threads: int, reps: int) -> None:
    """One no-cache forward of 192 and 320 columns: float32 on MKL's packed GEMM (before) and
    on oneDNN's (now), int8 and int4, interleaved; median CPU time per thread, weight MiB."""
    from dllm_cli.models import fused

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = folder or str(peer_folder(Path(tmp), 512))
        fused.ONEDNN_PACKED = False
        models = {"float32 MKL": load_model(folder, device="cpu")}
        fused.ONEDNN_PACKED = True
        models["float32 oneDNN"] = load_model(folder, device="cpu")
        for q in ("int8", "int4"):
            models[q] = load_model(folder, device="cpu", quantize=q)
    print({k: round(weight_bytes(m.model) / 2**20, 2) for k, m in models.items()}, "MiB")
    for t in (192, 320):
        ids = torch.tensor([prompt_ids(models["int8"], t)])
        cpu: dict[str, list[float]] = {q: [] for q in models}
        with torch.inference_mode():
            for _ in range(reps + 2):  # the first two of each: warm-up
                for q, lm in models.items():
                    start = time.process_time()
                    lm.model(ids)
                    cpu[q].append(time.process_time() - start)
        med = {q: sorted(v[2:])[reps // 2] * 1e3 / threads for q, v in cpu.items()}
        base = med["float32 MKL"]
        cells = [f"{q} {v:.1f} ms ({base / v:.2f}x)" for q, v in med.items()]
        print(f"{t} columns, {threads} threads: " + " | ".join(cells), flush=True)


STARTUP = """
import json, os, sys, time
t0 = (time.perf_counter(), time.process_time())
import torch
t1 = (time.perf_counter() - t0[0], time.process_time() - t0[1])

def first_forward(module, args):
    if any(c.__name__ == "DiffusionLM" for c in type(module).__mro__):
        wall, cpu = time.perf_counter() - t0[0], time.process_time() - t0[1]
        heavy = [m for m in ("transformers", "transformers.modeling_utils", "torch._dynamo")
                 if m in sys.modules]
        print(json.dumps({"torch": t1, "first_forward": (wall, cpu), "imported": heavy}))
        sys.stdout.flush()
        os._exit(0)

torch.nn.modules.module.register_module_forward_pre_hook(first_forward)
from dllm_cli import cli
sys.argv = ["dllm", *json.loads(sys.argv[1])]
cli.main()
"""

STARTUP_PROMPT = "Tom has 3 apples and buys 4 more. How many apples does he have?"


def startup(reps: int = 5, against: str | None = None) -> None:
    """Seconds (wall, CPU) from interpreter start to the first diffusion forward of a real
    `dllm generate` (the CLI in-process; median of `reps` fresh interpreters), with and
    without the default profile's AR guide. `against`: another checkout (e.g. an extracted
    older commit) run interleaved with this one, run by run, so both see the same load."""
    roots = {"this": ROOT} | ({"against": Path(against)} if against else {})
    print("| checkout | command | import torch s | first forward wall s | CPU s (runs) | heavy |")
    print("|---|---|---|---|---|---|")
    for args in (["generate", "--no-guide", STARTUP_PROMPT], ["generate", STARTUP_PROMPT]):
        runs = {name: [] for name in roots}
        for _ in range(reps):
            for name, root in roots.items():
                cmd = [sys.executable, "-c", STARTUP, json.dumps(args)]
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=root, check=True)
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
        for name, rs in runs.items():
            mid = sorted(rs, key=lambda r: r["first_forward"][1])[len(rs) // 2]
            (tw, _), (fw, fc) = mid["torch"], mid["first_forward"]
            every = " ".join(f"{r['first_forward'][1]:.2f}" for r in rs)
            shown = " ".join(args[:-1]) + ' "..."'
            heavy = ", ".join(mid["imported"]) or "none"
            print(f"| {name} | dllm {shown} | {tw:.2f} | {fw:.2f} | {fc:.2f} ({every}) | {heavy} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["quant", "profile", "startup", "forwards"])
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--quantize", default="none")
    parser.add_argument("--against", default=None, help="startup: another checkout, interleaved")
    parser.add_argument("--folder", default=None, help="forwards: a Dream folder (else random)")
    parser.add_argument("--threads", type=int, default=1, help="forwards: torch threads")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.what == "forwards":
        forwards(args.folder, args.threads, args.reps)
    elif args.what == "quant":
        quant(args.gen, args.reps)
    elif args.what == "startup":
        startup(args.reps, args.against)
    else:
        from cpu_profile import profile_forward

        profile_forward(args.width, quantize=args.quantize)


if __name__ == "__main__":
    main()
