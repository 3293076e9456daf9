"""Batch throughput: the same prompts through static and continuous batching, in one process.

Static batching decodes `batch_size` prompts at a time in lockstep (a batch ends when its
slowest row does); continuous batching refills a slot the step after its row finishes
(decoding/slots.py). Both passes decode the same prompts with the same settings and are
timed by the wall clock around the whole pass; `rounds` > 1 alternates them (static,
continuous, static, ...) so a noisy machine slows both alike. Each record also says how many
prompts got exactly the same tokens from both (greedy decoding: all of them), and the work
each pass did, counted, not timed, so passes compare on a busy machine too: steps, forwards,
`row_columns` (columns forwarded: rows x columns) and `key_columns` (query-key pairs attended
per layer) of the diffusion model, and the same for the guide when guided (its admission
prefills included).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from dllm_cli.decoding import answer_length
from dllm_cli.decoding.run import open_engine
from dllm_cli.decoding.slots import static_reason
from dllm_cli.errors import UsageError
from dllm_cli.evaluate import held_out
from dllm_cli.runtime import Runtime
from dllm_cli.settings import DecodeSettings


def mixed_shots(encode: Callable[[str], list[int]], n: int, most: int, start: int = 0) -> list:
    """Held-out problems start.. start+n-1, problem i with i mod (most + 1) shots (mixed
    prompt lengths, as a real request stream has)."""
    return [held_out(encode, 1, i % (most + 1), start + i)[0].prompt for i in range(n)]


def run_pass(
    runtime: Runtime,
    prompts: Sequence[list[int]],
    settings,
    size: int,
    admission: str,
    guided: bool = False,
) -> dict:
    """Every prompt through one engine of `size` slots under `admission` (static: whole
    batches one after another; continuous: a slot refilled the step after its row ends);
    `guided`: the runtime's AR guide verifies the drafts."""
    model, special = runtime.loaded.model, runtime.loaded.special
    began = time.perf_counter()
    committer = runtime.committer() if guided else None
    engine = open_engine(model, special, settings, committer, slots=size, admission=admission)
    for i, p in enumerate(prompts):
        engine.add(p, key=i)
    out: dict[int, list[int]] = {}
    while engine.has_work:
        for f in engine.step().finished:
            out[f.key] = f.tokens
    seconds = time.perf_counter() - began
    tokens = [out[i] for i in range(len(prompts))]
    record = summary(admission, tokens, engine.forwards, engine.served, seconds, runtime)
    guide = committer.arithmetic if committer is not None else (0, 0)
    record.update(
        steps=engine.steps,
        row_columns=engine.stepper.executor.row_columns,
        key_columns=engine.stepper.executor.key_columns,
        guide_forwards=committer.forwards if committer is not None else 0,
        guide_row_columns=guide[0],
        guide_key_columns=guide[1],
    )
    return record


def run_static(runtime: Runtime, prompts, settings, size: int, guided: bool = False) -> dict:
    return run_pass(runtime, prompts, settings, size, "static", guided)


def run_continuous(runtime: Runtime, prompts, settings, size: int, guided: bool = False) -> dict:
    return run_pass(runtime, prompts, settings, size, "continuous", guided)


PASSES: dict[str, Callable[..., dict]] = {"static": run_static, "continuous": run_continuous}


def summary(name: str, tokens, forwards: int, served: int, seconds: float, rt: Runtime) -> dict:
    stop = rt.loaded.special.stop
    return {
        "batching": name,
        "prompts": len(tokens),
        "answer_tokens": sum(answer_length(t, stop) for t in tokens),
        "forwards": forwards,
        "occupancy": served / forwards if forwards else 0.0,
        "seconds": seconds,
        "prompts_per_second": len(tokens) / seconds if seconds > 0 else 0.0,
        "tokens": tokens,
    }


def compare_batching(
    runtime: Runtime,
    prompts: Sequence[list[int]],
    settings: DecodeSettings,
    batch_size: int,
    rounds: int = 1,
    on_record: Callable[[dict], None] | None = None,
    guided: bool = False,
) -> list[dict]:
    """Static then continuous, `rounds` times; records carry the continuous/static ratio."""
    reason = static_reason(runtime.loaded.model)
    if reason is not None:
        raise UsageError(f"--batching-compare: {reason}")
    if batch_size < 1 or rounds < 1:
        raise UsageError("--batching-compare needs --batch-size >= 1 and --rounds >= 1")
    short = replace(settings, gen_length=min(settings.block_length, settings.gen_length))
    for run in PASSES.values():  # warm-up: one-off setup costs nobody
        run(runtime, prompts[:batch_size], short, batch_size, guided)
    records = []
    for r in range(rounds):
        static = run_static(runtime, prompts, settings, batch_size, guided)
        continuous = run_continuous(runtime, prompts, settings, batch_size, guided)
        same = sum(a == b for a, b in zip(static["tokens"], continuous["tokens"], strict=True))
        for rec in (static, continuous):
            rec.update(
                round=r,
                batch_size=batch_size,
                gen_length=settings.gen_length,
                identical=same,
                speedup=static["seconds"] / rec["seconds"] if rec["seconds"] > 0 else 0.0,
            )
            records.append(rec)
            if on_record is not None:
                on_record(rec)
    return records


def table(records: Sequence[dict]) -> str:
    """Markdown: one row per pass (row- and key-columns: the diffusion model's, then the
    guide's; thousands and millions)."""
    head = (
        "| round | batching | prompts/s | seconds | steps | forwards | rows/forward | "
        "row-cols (k) | key-cols (M) | guide row-cols (k) | guide key-cols (M) | identical |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in records:
        lines.append(
            f"| {r['round']} | {r['batching']} | {r['prompts_per_second']:.3f} | "
            f"{r['seconds']:.1f} | {r['steps']} | {r['forwards']} | {r['occupancy']:.2f} | "
            f"{r['row_columns'] / 1e3:.1f} | {r['key_columns'] / 1e6:.1f} | "
            f"{r['guide_row_columns'] / 1e3:.1f} | {r['guide_key_columns'] / 1e6:.1f} | "
            f"{r['identical']}/{r['prompts']} |"
        )
    return "\n".join(lines) + "\n"
