"""Speed at a real model's shape: random weights made on the device, so cost, not accuracy.

The model is built from its config directly on the device in bfloat16 (weights drawn from a
seeded generator by the architecture's own init; nothing downloaded or read from disk) and
fused as `load_model` fuses a loaded one. Random weights never answer anything: their drafts are
near-uniform, so the threshold rule commits one token per step and early stop never fires.
Forwards per answer therefore read like one token per step; the time per forward and per step
are what a real checkpoint of this shape costs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from dllm_cli.decoding import Decoder
from dllm_cli.doctor.checks import Outcome
from dllm_cli.doctor.report import pct
from dllm_cli.doctor.timing import PeakMemory, engine_events, kernel_share, sync, timed
from dllm_cli.families import FAMILIES
from dllm_cli.models.compiled import StepGraphs, enable_compile
from dllm_cli.models.loading import SpecialIds
from dllm_cli.settings import DecodeSettings

SEED = 0
PROFILED_BLOCKS = 1  # blocks of dual + threshold steps under torch.profiler


@dataclass(frozen=True)
class Shape:
    """A model shape to time, its special ids and the lengths to time it at."""

    name: str
    model_type: str  # a key of families.FAMILIES
    config: dict
    special: SpecialIds
    words: int  # prompt ids are drawn from [0, words): below every special id
    prompt: int = 512
    gens: tuple[int, ...] = (256, 1024)
    block: int = 32
    slots: int = 16  # static vs continuous: slots, and twice as many prompts
    dtype: torch.dtype = torch.bfloat16


LLADA_8B = {"d_model": 4096, "n_heads": 32, "n_kv_heads": 32, "n_layers": 32}
LLADA_8B |= {"mlp_hidden_size": 12288, "vocab_size": 126464, "embedding_size": 126464}
SMALL = {"d_model": 256, "n_heads": 4, "n_kv_heads": 4, "n_layers": 2, "mlp_hidden_size": 512}
SMALL |= {"vocab_size": 1024, "embedding_size": 1024, "max_sequence_length": 1024}
SMALL |= {"mask_token_id": 1000, "eos_token_id": 1001, "pad_token_id": 1001}

SHAPES: dict[str, Shape] = {
    # LLaDA-8B-Instruct's config.json; Dream-v0-Instruct-7B's is DreamConfig's defaults.
    "llada-8b": Shape(
        "llada-8b", "llada", LLADA_8B, SpecialIds(126336, 126081, 126081, 126080, 126348), 126000
    ),
    "dream-7b": Shape(
        "dream-7b", "Dream", {}, SpecialIds(151666, 151643, 151643, 151665, 151645), 151643
    ),
    # The CPU stand-in: the same code paths at a size a CPU runs in seconds.
    "small": Shape(
        "small",
        "llada",
        SMALL,
        SpecialIds(1000, 1001, 1001, 1002, 1003),
        1000,
        prompt=48,
        gens=(32, 64),
        block=16,
        slots=4,
        dtype=torch.float32,
    ),
}


@dataclass(frozen=True)
class Variant:
    """One way to decode: settings changed from LLaDA's reference (no cache, fixed)."""

    name: str
    settings: dict = field(default_factory=dict)
    compile: bool = False


DUAL = {"cache": "dual", "unmask": "threshold", "threshold": 0.9}
VARIANTS = (
    Variant("baseline"),
    Variant("dual+threshold", DUAL),
    Variant("dual+threshold+prune", DUAL | {"suffix_window": 64}),
    Variant("dual+threshold+compile", DUAL, compile=True),
)


def build(shape: Shape, device: torch.device) -> torch.nn.Module:
    """The shape's model in its dtype, initialised on `device` from SEED, fused for inference."""
    config_cls, model_cls = FAMILIES[shape.model_type].classes()
    config = config_cls(**shape.config)
    before = torch.get_default_dtype()
    torch.manual_seed(SEED)
    try:
        torch.set_default_dtype(shape.dtype)
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(before)
    model.to(device=device, dtype=shape.dtype).eval()
    model.fuse_projections()
    return model


def prompts(shape: Shape, n: int) -> list[list[int]]:
    """n seeded prompts of `shape.prompt` ordinary ids."""
    gen = torch.Generator().manual_seed(SEED)
    return torch.randint(shape.words, (n, shape.prompt), generator=gen).tolist()


@contextmanager
def compiled(model: torch.nn.Module, on: bool) -> Iterator[str | None]:
    """CUDA-graph replay for the block (None) or why not; the model is eager again after."""
    if not on:
        yield None
        return
    why = enable_compile(model)
    try:
        yield why
    finally:
        if isinstance(model.__dict__.get("forward"), StepGraphs):
            del model.forward  # back to the class's eager forward


def memory(model, batch: int, columns: int, cached: bool, peak: int | None) -> dict:
    """Peak memory against weights + the per-slot KV formula of docs/decoding.md (2 x layers x
    KV heads x head dim x bytes per canvas column)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    layers, kv_heads, head_dim = model.kv_shape()
    size = next(model.parameters()).element_size()
    per_slot = 2 * layers * kv_heads * head_dim * size * columns if cached else 0
    out = {"weights_bytes": weights, "kv_per_slot_bytes": per_slot, "slots": batch}
    out["predicted_bytes"] = weights + batch * per_slot
    out["peak_bytes"] = peak
    out["other_bytes"] = None if peak is None else peak - out["predicted_bytes"]
    return out


def settings(shape: Shape, gen: int, extra: dict) -> DecodeSettings:
    return DecodeSettings(gen_length=gen, block_length=shape.block, **extra)


def warm_up(model, shape: Shape, s: DecodeSettings, batch: list[list[int]]) -> None:
    """One untimed block: kernels chosen, caches allocated once, before the clock starts."""
    short = replace(s, gen_length=min(shape.block, s.gen_length))
    Decoder(model, shape.special, short).run(batch).result()


def time_variant(model, shape: Shape, v: Variant, gen: int, device, deadline) -> Outcome:
    """One batch-1 decode of `gen` tokens: forwards, tok/s, ms per step and forward of each
    kind, peak memory, the share of a step outside the model."""
    s, batch = settings(shape, gen, v.settings), prompts(shape, 1)
    with compiled(model, v.compile) as why:
        if why:
            return Outcome("skip", why)
        warm_up(model, shape, s, batch)
        with PeakMemory(device) as mem:
            times = timed(Decoder(model, shape.special, s).run(batch), model, device, deadline)
        replays = getattr(model.forward, "replays", None)  # counted by StepGraphs
    data = times.summary()
    columns = shape.prompt + gen + 1
    data |= {"gen_length": gen, "prompt_length": shape.prompt, "batch": 1}
    data["memory"] = memory(model, 1, columns, s.cache != "none", mem.peak)
    data["tok_per_s"] = times.tokens / data["seconds"] if data["seconds"] else None
    detail = line(data)
    if v.compile:
        data["graph_replays"] = replays
        if not replays:  # StepGraphs fell back to eager (its warning says why)
            return Outcome("fail", f"no step was replayed from a CUDA graph; {detail}", data)
        detail += f", {replays} graph replays"
    return Outcome("info", detail, data)


def line(d: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{x:.2f} ms"

    cut = " (cut short by the time budget)" if d.get("cut_short") else ""
    rate = "-" if d.get("tok_per_s") is None else f"{d['tok_per_s']:.1f} tok/s"
    return (
        f"{d['forwards']} forwards, {rate}, full step {ms(d['full_step_ms'])}, cached step "
        f"{ms(d['cached_step_ms'])}, outside model {pct(d['outside_model'])}{cut}"
    )


def time_batching(model, shape: Shape, device, deadline) -> Outcome:
    """`slots` slots over 2 x slots prompts: static batches, then continuous batching."""
    s = settings(shape, shape.gens[0], DUAL)
    batch = prompts(shape, 2 * shape.slots)
    warm_up(model, shape, s, batch[: shape.slots])
    runs, answers = {}, {}
    for mode in ("static", "continuous"):
        with PeakMemory(device) as mem:
            answers[mode], steps = run_batching(model, shape, s, batch, mode, device, deadline)
        columns = shape.prompt + s.gen_length + 1
        summary = steps.summary()
        summary["memory"] = memory(model, shape.slots, columns, True, mem.peak)
        done = sum(1 for a in answers[mode] if a is not None)
        summary["prompts_per_s"] = done / summary["seconds"] if summary["seconds"] else None
        summary["tok_per_s"] = steps.tokens / summary["seconds"] if summary["seconds"] else None
        runs[mode] = summary
    same = sum(a == b and a is not None for a, b in zip(*answers.values(), strict=True))
    data = {"slots": shape.slots, "prompts": len(batch), "gen_length": s.gen_length, **runs}
    data["identical"] = same
    times = runs["static"]["seconds"], runs["continuous"]["seconds"]
    ratio = f"{times[0] / times[1]:.2f}x" if times[1] else "-"
    detail = (
        f"static {fmt(runs['static']['prompts_per_s'])} prompts/s, continuous "
        f"{fmt(runs['continuous']['prompts_per_s'])} prompts/s ({ratio}); "
        f"{same}/{len(batch)} identical answers"
    )
    return Outcome("info", detail, data)


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def run_batching(model, shape, s, batch, mode: str, device, deadline):
    """Answers (None where unfinished) and merged step times of one batching mode."""
    out: list = [None] * len(batch)
    if mode == "static":
        merged = None
        for first in range(0, len(batch), shape.slots):
            chunk = batch[first : first + shape.slots]
            run = Decoder(model, shape.special, s).run(chunk)
            times = timed(run, model, device, deadline)
            if not times.cut_short:
                out[first : first + len(chunk)] = run.result().tokens
            merged = times if merged is None else merge(merged, times)
            if times.cut_short:
                break
        return out, merged

    run = engine_events(Decoder(model, shape.special, s), batch, shape.slots, out)
    return out, timed(run, model, device, deadline)


def merge(a, b):
    """Step times of two runs as one (forwards add up)."""
    for kind in a.wall:
        a.wall[kind] += b.wall[kind]
        a.model[kind] += b.model[kind]
    a.steps, a.forwards, a.tokens = a.steps + b.steps, a.forwards + b.forwards, a.tokens + b.tokens
    a.cut_short = a.cut_short or b.cut_short
    return a


def profile_steps(model, shape: Shape, device) -> Outcome:
    """The share of dual + threshold steps the GPU spends in kernels (torch.profiler)."""
    if device.type != "cuda":
        return Outcome("skip", "CPU run: the kernel share is measured on CUDA only")
    s = settings(shape, shape.gens[0], DUAL)
    batch = prompts(shape, 1)
    warm_up(model, shape, s, batch)
    events = iter(Decoder(model, shape.special, s).run(batch))
    data = kernel_share(lambda: next(events), device, PROFILED_BLOCKS * shape.block)
    if not data["kernel_s"]:
        return Outcome("error", "torch.profiler recorded no CUDA kernels (is CUPTI missing?)", data)
    detail = f"GPU busy in kernels for {pct(data['kernel_share'])} of {data['profiled_steps']}"
    return Outcome("info", detail + " dual + threshold steps (torch.profiler)", data)


def plan(shape: Shape) -> list[tuple[int, Variant]]:
    """(gen, variant) in run order; the longest baseline, the costliest run, goes last."""
    longest = max(shape.gens)
    first = [(g, v) for g in shape.gens for v in VARIANTS if (g, v.name) != (longest, "baseline")]
    return [*first, (longest, VARIANTS[0])]


def release(device: torch.device) -> None:
    """Give cached GPU memory back (after a model or an out-of-memory error)."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.empty_cache()
