"""`dllm bench --peer llama-cpp`: dllm against llama.cpp's diffusion CLI on the same work."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from dllm_cli.commands.common import load_runtime, stderr
from dllm_cli.errors import UsageError, write_json
from dllm_cli.options import Choices, in_panel
from dllm_cli.peer import (
    LOAD_LIMIT,
    LOAD_QUIET,
    LOAD_WAIT_S,
    PRECISIONS,
    Timed,
    Work,
    check_peer,
    compare,
    load_gate,
    markdown,
    precision_for,
)

PANEL = "Peer comparison"
PEERS = ("llama-cpp",)  # the tools --peer can run

peer_option = in_panel(PANEL)
Peer = Annotated[
    str | None,
    peer_option(
        "Instead: the same no-cache, one-token-per-step work in llama.cpp's "
        "llama-diffusion-cli (--peer-binary) on a GGUF of --model's folder (--peer-model), "
        "then in dllm, alternating --rounds times; both decode and wall times and their ratio."
    ),
]
PeerBinary = Annotated[Path | None, peer_option("--peer: the llama-diffusion-cli binary.")]
PeerModel = Annotated[
    Path | None,
    peer_option("--peer: the GGUF of --model's folder (float32, or --peer-quant's precision)."),
]
PeerQuant = Annotated[
    str | None,
    peer_option(
        f"--peer: the GGUF's precision, {' | '.join(PRECISIONS)} (default f32); dllm runs "
        "the matching --quantize (none, int8, int4). Quantize --peer-model to it with "
        "llama-quantize."
    ),
]
PeerPrompt = Annotated[str, peer_option("--peer: the prompt both decode (chat-wrapped).")]


def run_peer(
    choices: Choices,
    peer: str,
    binary: Path | None,
    gguf: Path | None,
    prompt: str,
    lengths: list[int],
    rounds: int,
    json_path: Path | None,
    peer_quant: str | None = None,
) -> None:
    """Check the peer's paths (exit 2), read the prompt's length, run both, print the table."""
    precision = precision_for(peer_quant, choices.overrides.get("model.quantize"))
    if peer not in PEERS:
        raise UsageError(f"--peer takes one of: {', '.join(PEERS)} (got {peer!r})")
    if binary is None or gguf is None:
        raise UsageError("--peer needs --peer-binary (llama-diffusion-cli) and --peer-model (GGUF)")
    if "model.path" not in choices.overrides:
        raise UsageError("--peer needs --model: the checkpoint folder the GGUF was converted from")
    check_peer(binary, gguf)
    threads = int(choices.overrides.get("model.threads") or 0) or os.cpu_count() or 1
    rt = load_runtime(choices)
    folder = str(rt.loaded.path)
    n = len(chat_ids(rt, prompt))
    works = [Work(prompt, n, gen, threads, precision.quantize) for gen in lengths]
    stderr.print(
        f"peer: {n}-token chat-wrapped prompt, {threads} threads, {rounds} rounds, "
        f"{precision.what}; load average now {os.getloadavg()[0]:.2f} (before each pair of runs "
        f"it waits up to {LOAD_WAIT_S:.0f} s for the load to fall below {LOAD_QUIET}; a pair "
        f"started above {LOAD_LIMIT} is marked not comparable)",
        highlight=False,
    )

    def report(name: str, work: Work, t: Timed) -> None:
        stderr.print(
            f"{name:>10} gen {work.gen}: decode {t.decode_s:.2f} s, wall {t.wall_s:.2f} s, "
            f"load average {os.getloadavg()[0]:.2f}",
            highlight=False,
        )

    def say(line: str) -> None:
        stderr.print(f"{'peer':>10}: {line}", highlight=False)

    records = compare(binary, gguf, folder, works, rounds, on_run=report, gate=load_gate(say))
    typer.echo(
        f"{folder} ({precision.what}) against {gguf}: no cache, one token per step, Dream's schedule, "
        f"{n}-token prompt, {threads} threads, medians of {rounds}; ratio = llama.cpp's "
        "seconds / dllm's (> 1: dllm faster)"
    )
    typer.echo(markdown(records), nl=False)
    write_json(json_path, records)


def chat_ids(rt, prompt: str) -> list[int]:
    """The prompt's ids inside the chat template, as `generate --chat` encodes it."""
    rt.chat = True
    return rt.encode(prompt)
