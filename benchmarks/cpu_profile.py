"""The CPU forward per op group against its FLOP count (issue 30), and a decode step's overhead.

    python benchmarks/cpu_bench.py profile --width 512

A random Dream model at the peer's shape (scaled by width: heads of 64, intermediate 11/4 of
the width, vocabulary 405) forwards the peer's 192 columns (64 prompt + 128 canvas), no cache,
on one thread. torch.profiler's self CPU time is summed per op group; FLOPs are counted from the
shapes (a matmul of (m, k) by (k, n): 2 m k n).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from dllm_cli.models import DreamConfig, DreamModel
from dllm_cli.models.quantize import quantize_model

GROUPS = {
    "linear (GEMM)": ("aten::mm", "aten::addmm", "aten::_int_mm"),
    "int8 activations": ("aten::abs", "aten::amax", "aten::round", "aten::clamp", "aten::div"),
    "attention": ("aten::_scaled_dot_product", "aten::_flash_attention", "aten::bmm"),
    "norm": ("aten::rms_norm", "aten::_fused_rms_norm", "aten::rsqrt", "aten::pow"),
    "rope": ("aten::cat", "aten::neg", "aten::index"),
    "elementwise": ("aten::silu", "aten::mul", "aten::add", "aten::copy_", "aten::to"),
    "embedding": ("aten::embedding",),
}


def model_at(width: int) -> DreamModel:
    cfg = DreamConfig(
        vocab_size=405,
        hidden_size=width,
        intermediate_size=width * 11 // 4,
        num_hidden_layers=8,
        num_attention_heads=width // 64,
        num_key_value_heads=max(1, width // 128),
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    return DreamModel(cfg).eval()


def flops(model: DreamModel, t: int) -> dict[str, float]:
    """FLOPs of one no-cache forward over t columns, per group."""
    c = model.config
    d, hd = c.hidden_size, c.head_dim
    per_layer = d * (c.num_attention_heads + 2 * c.num_key_value_heads) * hd  # q, k, v
    per_layer += c.num_attention_heads * hd * d + 3 * d * c.intermediate_size  # o, MLP
    linear = 2 * t * (c.num_hidden_layers * per_layer + d * c.vocab_size)
    attention = c.num_hidden_layers * 4 * t * t * c.num_attention_heads * hd
    return {"linear (GEMM)": linear, "attention": attention}


def group_of(name: str) -> str:
    return next((g for g, ops in GROUPS.items() if name.startswith(ops)), "other")


def profile_forward(width: int, t: int = 192, reps: int = 10, quantize: str = "none") -> None:
    model = model_at(width)
    if quantize == "none":
        model.fuse_projections()
    else:
        quantize_model(model, quantize)
    ids = torch.randint(0, 400, (1, t))
    with torch.inference_mode():
        model(ids)
        start = time.process_time()
        for _ in range(reps):
            model(ids)
        per_forward = (time.process_time() - start) / reps
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(reps):
                model(ids)
    spent: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        spent[group_of(event.key)] += event.self_cpu_time_total / reps / 1e3  # ms
    # The profiler times wall clock: its shares are scaled to the forward's CPU time.
    total = sum(spent.values())
    counted = flops(model, t)
    print(
        f"{quantize}, width {width}, {t} columns, 1 thread: {per_forward * 1e3:.1f} ms CPU per forward"
    )
    print("| group | ms (CPU) | share | GFLOP | GFLOP/s |\n|---|---|---|---|---|")
    for group, wall in sorted(spent.items(), key=lambda kv: -kv[1]):
        ms = wall / total * per_forward * 1e3
        f = counted.get(group)
        rate = f"{f / ms / 1e6:.1f}" if f else ""
        gf = f"{f / 1e9:.3f}" if f else ""
        print(f"| {group} | {ms:.2f} | {wall / total:.0%} | {gf} | {rate} |")
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]
    print(
        "top ops (share):",
        ", ".join(f"{e.key} {e.self_cpu_time_total / 1e3 / reps / total:.1%}" for e in top),
    )
