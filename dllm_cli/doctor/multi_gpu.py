"""The multi-GPU section: `dllm generate --tensor-parallel N` under torchrun over NCCL, on
1, 2 and 4 of the machine's GPUs (as many as it has): tokens against one GPU's, and speed.

Each degree is a real launch (`python -m torch.distributed.run`, loopback rendezvous) of the
command users run, on a tiny random LLaDA folder in float32 (tokens: must equal one GPU's) and
on a wider one in bfloat16 (seconds per step: a measurement). With fewer than two GPUs (or
without --gpu) the section is one skip row: `skipped: N GPU(s)`.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import torch

from dllm_cli.doctor.checks import Outcome
from dllm_cli.doctor.folders import TINY_FOLDERS, randomize, save, write_diffusion, write_tokenizer

DEGREES = (1, 2, 4)  # 1: the one-GPU baseline
PROMPTS = "w3 w14 w15\nw9 w2 w6 w5 w35\nw8 w9\nw7 w9 w3 w23 w8 w4 w6\n"  # the folders' words
WIDE = {"d_model": 1024, "n_heads": 16, "n_kv_heads": 16, "n_layers": 8, "mlp_hidden_size": 4096}
LAUNCH_TIMEOUT = 600  # seconds one launch may take (loading included)
STATS = re.compile(r"(\d+) steps, ([\d.]+) s")


def degrees(gpus: int) -> list[int]:
    """The degrees run on a machine with `gpus` GPUs: none below two, else 1, 2 (and 4)."""
    return [n for n in DEGREES if n <= gpus] if gpus >= 2 else []


def skipped(gpus: int, cpu_reason: str | None) -> str | None:
    """The skip row's detail (None: the section runs)."""
    if cpu_reason:
        return f"skipped: {gpus} GPU(s) under test ({cpu_reason})"
    return f"skipped: {gpus} GPU(s)" if gpus < 2 else None


def write_wide(folder: Path) -> Path:
    """A random LLaDA folder wide enough for the split to matter (8 layers of width 1024)."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(folder, TINY_FOLDERS["llada"])
    config = TINY_FOLDERS["llada"].config(
        **WIDE, vocab_size=ids["size"], embedding_size=ids["size"] + 7,
        max_sequence_length=1024, mask_token_id=ids["mask"], eos_token_id=ids["eos"],
        pad_token_id=ids["pad"], bos_token_id=ids["bos"],
    )  # fmt: skip
    model = TINY_FOLDERS["llada"].model(config).float()
    randomize(model, seed=3)
    save(folder, model.to(torch.bfloat16))
    return folder


def command(folder: Path, degree: int, dtype: str, port: int, device: str = "cuda") -> list[str]:
    """`dllm generate -` on `degree` GPUs (one: no torchrun), greedy, --json --stats."""
    args = ["generate", "-", "--model", str(folder), "--device", device, "--dtype", dtype]
    args += ["--gen-length", "64", "--block-length", "16", "--json", "--stats", "--no-chat"]
    if degree == 1:
        return [sys.executable, "-m", "dllm_cli", *args]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(degree)]
    launch += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    return [*launch, "-m", "dllm_cli", *args, "--tensor-parallel", str(degree)]


def decode(
    folder: Path, degree: int, dtype: str, device: str = "cuda"
) -> tuple[list[list[int]], float]:
    """One launch's token ids per prompt and its seconds per step (`device` cpu: gloo, for
    the tests of this module on a machine without GPUs)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(degree)))}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    run = subprocess.run(
        command(folder, degree, dtype, free_port(), device), input=PROMPTS, capture_output=True,
        text=True, env=env, timeout=LAUNCH_TIMEOUT,
    )  # fmt: skip
    if run.returncode != 0:
        said = [line for line in run.stderr.splitlines() if line.startswith("dllm: error")]
        raise RuntimeError(f"{degree} GPU(s): exit {run.returncode}: {said[-1:] or '(no line)'}")
    ids = [json.loads(line)["token_ids"] for line in run.stdout.splitlines()]
    steps, seconds = STATS.findall(run.stderr)[-1]
    return ids, float(seconds) / max(int(steps), 1)


def tokens_check(root: Path, gpus: int, device: str = "cuda") -> Outcome:
    """Greedy tokens at every degree against one GPU's (tiny folder, float32)."""
    folder = write_diffusion(root / "tp-llada", "llada", seed=5)
    runs = {n: decode(folder, n, "float32", device)[0] for n in degrees(gpus)}
    differ = [n for n, ids in runs.items() if ids != runs[1]]
    shown = ", ".join(map(str, runs))
    if differ:
        return Outcome("fail", f"tokens at {differ} GPU(s) differ from one GPU's")
    return Outcome("pass", f"NCCL tensor parallel on {shown} GPU(s): one GPU's tokens")


def speed_check(root: Path, gpus: int) -> Outcome:
    """Seconds per step at every degree (the wide folder, bfloat16)."""
    folder = write_wide(root / "tp-wide")
    per_step = {n: decode(folder, n, "bfloat16")[1] for n in degrees(gpus)}
    shown = ", ".join(f"{n} GPU(s) {1000 * s:.2f} ms" for n, s in per_step.items())
    return Outcome("info", f"per step: {shown}", {str(n): s for n, s in per_step.items()})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
