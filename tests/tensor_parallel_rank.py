"""One rank of tests/test_tensor_parallel.py's torchrun launch (run as a script).

`python tensor_parallel_rank.py OUT [--expert-parallel] [--compile] [--quantize=SCHEME] FOLDER...`: every
rank loads each folder twice, its tensor-parallel shard and the whole model (both quantized
with the SCHEME named before the folder), and decodes the same prompts with each under every cache policy; it also drafts
random logits with the sharded sampler and the one-process Sampler. Rank 0 writes what it saw
to OUT as JSON; the test compares. `--compile`: the first folder's shard also decodes through
`enable_compile` (`recorded`). `--klass-tracks`: only KLASS's memory on the first folder's
shard through a continuous engine (`klass_tracks`).
"""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist

from dllm_cli.decoding import decode
from dllm_cli.decoding.engine import Engine
from dllm_cli.decoding.sampling import SAMPLERS, Sampler
from dllm_cli.decoding.shard_summaries import Last
from dllm_cli.decoding.sharded_sampling import ShardedSampler
from dllm_cli.models.collectives import Counts, Shards
from dllm_cli.models.compiled import enable_compile
from dllm_cli.models.loading import load_model
from dllm_cli.models.quantize import weight_bytes
from dllm_cli.settings import DecodeSettings

CACHES = ("none", "prefix", "dual", "freecache")
# Every cache policy under the threshold rule (one commit a step here: the most confident),
# the sdlm rule by margin, the fixed rule at 4 tokens a step by random confidence (every
# rank draws the same numbers), the origin rule (random positions) and the credit rule by its
# fused distribution's margin.
RUNS = [
    *((cache, "threshold", "low_confidence") for cache in CACHES),
    ("dual", "sdlm", "margin"),
    ("prefix", "fixed", "random"),
    ("freecache", "origin", "low_confidence"),
    ("dual", "credit", "margin"),
]
# Sampled drafts from the shards (the same seed: the tokens one process samples): top-p and
# top-k, the entropy confidence; the fixed rule's positions sampled too (alg_temp); WINO and
# the credit rule sampled.
SAMPLED = {
    "dual fixed entropy sampled": dict(
        cache="dual", unmask="fixed", confidence="entropy", top_p=0.9, top_k=20, alg_temp=0.5
    ),
    "prefix threshold margin sampled": dict(
        cache="prefix", unmask="threshold", confidence="margin", top_k=5
    ),
    "none wino margin sampled": dict(
        cache="none", unmask="wino", confidence="margin", threshold=0.0, wino_verify=0.04
    ),
    "freecache credit low_confidence sampled": dict(
        cache="freecache", unmask="credit", confidence="low_confidence", top_k=20
    ),
}
# WINO: every mask drafted (threshold 0), and commits revoked by their shadow probability (a
# verify bar among the tiny models' values, so which fall below and their order both count).
REVOKED = {
    "prefix wino low_confidence": dict(
        cache="prefix", unmask="wino", threshold=0.0, wino_verify=0.09
    ),
}
# EB's entropies and KLASS's step-to-step KLs from the shards (gamma and thresholds where the
# tiny models' tokens depend on them), greedy and sampled with top-k (Dream's distribution
# filtered: its KL from the gathered candidates; LLaDA's whole: from the shards' sums).
MEASURED = {
    "prefix eb entropy": dict(cache="prefix", unmask="eb", confidence="entropy", eb_gamma=6.0),
    "none klass low_confidence": dict(
        cache="none", unmask="klass", threshold=0.02, kl_threshold=0.5
    ),
}
MEASURED_SAMPLED = {
    "dual eb margin sampled": dict(
        cache="dual", unmask="eb", confidence="margin", eb_gamma=6.0, top_k=8
    ),
    "freecache klass sampled": dict(
        cache="freecache", unmask="klass", threshold=0.02, kl_threshold=0.5, top_k=5
    ),
}
PROMPTS = [[5, 9, 12, 3, 30, 31], [7, 8, 40]]  # two lengths: left padding in the batch


def decodes(folder: str, shards: Shards, quantize: str = "none") -> dict:
    """Tokens of the shard and of the whole model per cache policy, and the collectives."""
    split = load_model(folder, dtype="float32", device="cpu", shards=shards, quantize=quantize)
    whole = load_model(folder, dtype="float32", device="cpu", quantize=quantize)
    out = {"layers": len(split.model.blocks()), "bytes": list(split.model.weight_bytes)}
    if quantize != "none":  # the bytes held, int8 buffers and float parameters alike
        out["quantized_bytes"] = [weight_bytes(split.model), weight_bytes(whole.model)]
    out["expert_bytes"] = [expert_bytes(split.model), expert_bytes(whole.model)]
    plain = dict(gen_length=16, block_length=8, threshold=0.9, steps=4)
    every = {f"{c} {u} {k}": dict(cache=c, unmask=u, confidence=k) for c, u, k in RUNS}
    every.update(REVOKED)
    every.update({k: dict(v, temperature=0.8, seed=3) for k, v in SAMPLED.items()})
    every.update(MEASURED)
    every.update({k: dict(v, temperature=0.8, seed=3) for k, v in MEASURED_SAMPLED.items()})
    for name, values in every.items():
        settings = DecodeSettings(**{**plain, **values})
        before = replace(shards.counts)
        tokens = decode(split.model, split.special, PROMPTS, settings).tokens
        spent = {k: v - asdict(before)[k] for k, v in asdict(shards.counts).items()}
        expected = decode(whole.model, whole.special, PROMPTS, settings).tokens
        out[name] = {"split": tokens, "whole": expected, **spent}
    return out


def recorded(folder: str, shards: Shards) -> dict:
    """--compile on the shard with a CPU stand-in recorder (a replay reruns the step, its
    collectives too): tokens when every rank records, and when rank 1's recordings fail
    (the ranks agree, and every rank decodes eagerly)."""
    settings = DecodeSettings(gen_length=16, block_length=8, cache="dual", threshold=0.9)
    whole = load_model(folder, dtype="float32", device="cpu")
    expected = decode(whole.model, whole.special, PROMPTS, settings).tokens
    seen = {}
    for case, fails in (("replayed", False), ("failed on rank 1", True)):
        split = load_model(folder, dtype="float32", device="cpu", shards=shards)

        def record(run, fails=fails):
            out = run()  # the warm-up step, eager on every rank (as record_cuda_graph's)
            if fails and shards.rank == 1:  # then capture fails on this rank alone
                raise RuntimeError("capture not supported")
            buffer = out.clone()
            return out, lambda: buffer.copy_(run()), buffer

        enable_compile(split.model, record)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            tokens = decode(split.model, split.special, PROMPTS, settings).tokens
        steps = split.model.forward
        seen[case] = {"equal": tokens == expected, "failed": steps.failed}
        seen[case] |= {"recordings": steps.recordings, "replays": steps.replays}
    return seen


def klass_tracks(folder: str, shards: Shards) -> dict:
    """KLASS on the shard through a continuous engine (four prompts, two slots, one aborted
    mid-decode): the tracks its memory held at a step and what stays once every request
    left (the sampler keeps each row's shard in the rule's memory, freed with it)."""
    split = load_model(folder, dtype="float32", device="cpu", shards=shards)
    settings = DecodeSettings(
        gen_length=16, block_length=8, steps=4, cache="dual", unmask="klass", threshold=0.02
    )
    engine = Engine(split.model, split.special, settings, slots=2, admission="continuous")
    memory = engine.stepper.committer.params.memory
    rids = [engine.add(p) for p in [*PROMPTS, [4, 6, 8], [11, 13, 15, 17]]]
    held, shared, shards_kept, steps = [], engine.stepper.sampler.memory is memory, True, 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps == 3:  # the second request leaves mid-decode (a client gone)
            engine.abort(rids[1])
        held.append(sorted(memory.tracks))
        shards_kept &= all(isinstance(t.last, Last) for t in memory.tracks.values())
    left = sorted(memory.tracks)
    return {"rids": rids, "held": held, "left": left, "shared": shared, "parts": shards_kept}


def expert_bytes(model) -> int:
    """Bytes of the routed experts' weights this model holds."""
    held = (p for name, p in model.named_parameters() if ".mlp.experts." in name)
    return sum(p.numel() * p.element_size() for p in held)


def drafts(shards: Shards) -> list[dict]:
    """Sharded drafts and confidences against the one-process Sampler's on random logits."""
    torch.manual_seed(0)  # the same logits on every rank
    logits = torch.randn(2, 5, 101) * 3  # (B, L, V): 101 splits unevenly over 2 ranks
    logits[0, 0, 10] = logits[0, 0, 60] = 20.0  # a tie across ranks: the lower id wins
    logits[1, 1, 7] = 30.0  # the mask id's logit is never drafted
    logits[1, 2, 20:24] = 15.0  # four ties on rank 0 at the top: top_k 3 keeps all four
    lo, hi = shards.vocabulary(101)
    seen = []
    for family in ("llada", "dream"):
        for confidence in ("low_confidence", "margin", "entropy"):
            for top_k, temperature, top_p in ((0, 0.0, None), (3, 0.0, None), (3, 0.7, 0.8)):
                settings = DecodeSettings(
                    confidence=confidence, top_k=top_k, temperature=temperature, top_p=top_p
                )
                whole = Sampler(settings, SAMPLERS[family], 99, 7)  # ids 99, 100: padding
                sharded = ShardedSampler(shards, lo, 101, settings, SAMPLERS[family], 99, 7, True)
                tokens, conf, probs = whole.draft(logits, torch.Generator().manual_seed(1))
                mine, mine_conf, part = sharded.draft(
                    logits[..., lo:hi], torch.Generator().manual_seed(1)
                )
                # the shard's part of the distribution (a grammar reads it): padding ids 0
                real = min(hi, 99) - lo
                spread = (probs[..., lo : lo + real].double() - part[..., :real].double()).abs()
                seen.append(
                    {
                        "case": f"{family} {confidence} top_k {top_k} T {temperature} p {top_p}",
                        "tokens": tokens.tolist() == mine.tolist(),
                        "difference": float((conf.double() - mine_conf.double()).abs().max()),
                        "probs": float(spread.max()) + float(part[..., real:].abs().sum()),
                    }
                )
    return seen


def folders_of(args: tuple[str, ...]) -> list[str]:
    return [a for a in args if not a.startswith("--")]


def main(out: str, *args: str) -> None:
    experts = "--expert-parallel" in args  # the MoE folders' experts shared out whole
    dist.init_process_group("gloo")
    shards = Shards(dist.get_rank(), dist.get_world_size(), counts=Counts())
    shards.expert_parallel = experts
    results, quantize = {}, "none"
    only_klass = "--klass-tracks" in args  # that check alone
    for arg in args:
        if arg.startswith("--quantize="):
            quantize = arg.removeprefix("--quantize=")
        elif not arg.startswith("--") and not only_klass:
            results[Path(arg).name] = decodes(arg, shards, quantize)
    if "--compile" in args:
        results["compiled"] = recorded(folders_of(args)[0], shards)
    if only_klass:
        results["klass"] = klass_tracks(folders_of(args)[0], shards)
    elif not experts and quantize == "none":
        results["drafts"] = drafts(shards)
    if shards.rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
