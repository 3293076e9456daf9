"""One rank of tests/test_tensor_parallel_block.py's decode launch (run as a script).

`python tensor_parallel_block_rank.py OUT [--expert-parallel] [--quantize=SCHEME] FOLDER...`:
every rank loads each block-diffusion folder twice, its tensor-parallel shard (with
--expert-parallel: E/N whole experts) and the whole model (both quantized with SCHEME), and decodes the same prompts with each under both block cache
policies (and, with LLaDA2.x, LLaDA2.1's token editing). Rank 0 writes what it saw to OUT as
JSON; the test compares.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch.distributed as dist

from dllm_cli.decoding import decode
from dllm_cli.models.collectives import Counts, Shards
from dllm_cli.models.loading import load_model
from dllm_cli.models.quantize import weight_bytes
from dllm_cli.settings import DecodeSettings

PROMPTS = [[5, 9, 12, 3, 30, 31], [7, 8, 40]]  # two lengths: rows at their own blocks
PLAIN = dict(gen_length=12, block_length=4, threshold=0.6, steps=6)
EDITING = dict(PLAIN, edit_threshold=0.0, threshold=0.5, max_post_steps=2)  # LLaDA2.1


def runs(folder: str) -> dict[str, DecodeSettings]:
    """name -> settings: both caches, both rules; LLaDA2.1's editing on the LLaDA2.x folder."""
    out = {}
    for cache in ("prefix", "none"):
        out[f"{cache} threshold"] = DecodeSettings(cache=cache, **PLAIN)
        out[f"{cache} fixed"] = DecodeSettings(cache=cache, unmask="fixed", **PLAIN)
        # sampled drafts: top-k, then top-p, then torch.multinomial's draw (the same seed)
        sampled = dict(PLAIN, temperature=1.0, top_k=20, top_p=0.9, seed=5)
        out[f"{cache} sampled"] = DecodeSettings(cache=cache, **sampled)
        if "llada2" in Path(folder).name:
            out[f"{cache} editing"] = DecodeSettings(cache=cache, **EDITING)
    return out


def decodes(folder: str, shards: Shards, quantize: str = "none") -> dict:
    """Tokens of the shard and of the whole model per run, and the collectives it spent."""
    split = load_model(folder, dtype="float32", device="cpu", shards=shards, quantize=quantize)
    whole = load_model(folder, dtype="float32", device="cpu", quantize=quantize)
    out = {"expert_bytes": [expert_bytes(split.model), expert_bytes(whole.model)]}
    if quantize != "none":  # the bytes held, int8 buffers and float parameters alike
        out["quantized_bytes"] = [weight_bytes(split.model), weight_bytes(whole.model)]
    for name, settings in runs(folder).items():
        before = replace(shards.counts)
        result = decode(split.model, split.special, PROMPTS, settings)
        spent = {k: v - asdict(before)[k] for k, v in asdict(shards.counts).items()}
        edits = []  # LLaDA2.1's token edits, per step
        expected = decode(whole.model, whole.special, PROMPTS, settings, on_step=edits.append)
        edited = sum(len(e.drafts) for e in edits)
        out[name] = {"split": result.tokens, "whole": expected.tokens, "edited": edited, **spent}
    return out


def expert_bytes(model) -> int:
    """Bytes of the routed experts' weights this model holds."""
    held = (p for name, p in model.named_parameters() if ".mlp.experts." in name)
    return sum(p.numel() * p.element_size() for p in held)


def main(out: str, *args: str) -> None:
    dist.init_process_group("gloo")
    folders = [a for a in args if not a.startswith("--")]
    schemes = [a.removeprefix("--quantize=") for a in args if a.startswith("--quantize=")]
    shards = Shards(dist.get_rank(), dist.get_world_size(), counts=Counts())
    shards.expert_parallel = "--expert-parallel" in args
    results = {Path(f).name: decodes(f, shards, *schemes) for f in folders}
    if shards.rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
