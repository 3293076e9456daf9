"""One rank of tests/test_tensor_parallel_block.py's launch (run as a script).

`python tensor_parallel_forward.py OUT FOLDER...`: every rank loads its tensor-parallel shard of
each block-diffusion folder and the whole model, runs one block-causal forward of the same ids
through each, and writes to OUT.NAME.RANK how far its vocabulary range of the logits is from the
whole model's, the shape of the keys it cached (its share of the KV heads) and its bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dllm_cli.cache import KVCache
from dllm_cli.models.block import block_key_mask
from dllm_cli.models.collectives import Shards
from dllm_cli.models.loading import load_model


def main(out: str, *folders: str) -> None:
    dist.init_process_group("gloo")
    shards = Shards(dist.get_rank(), dist.get_world_size())
    for folder in folders:
        seen = forward(folder, shards)
        Path(f"{out}.{Path(folder).name}.{shards.rank}").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


def forward(folder: str, shards: Shards) -> dict:
    """One forward through this rank's shard and through the whole model, compared."""
    split = load_model(folder, dtype="float32", device="cpu", shards=shards).model
    whole = load_model(folder, dtype="float32", device="cpu").model
    ids = torch.randint(1, 60, (2, 12), generator=torch.Generator().manual_seed(0))  # (B, T)
    seen = {}
    with torch.no_grad():
        keys = block_key_mask(12, 4).expand(2, 12, 12)  # (B, T, T)
        cache = KVCache.for_model(split, 2, 12)
        mine = split(ids, None, cache, keys)  # (B, T, own vocabulary)
        expected = whole(ids, None, KVCache.for_model(whole, 2, 12), keys)
    lo = split.vocab_start
    seen["difference"] = float((mine - expected[..., lo : lo + mine.shape[-1]]).abs().max())
    seen["columns"] = [lo, lo + mine.shape[-1], expected.shape[-1]]
    seen["keys"] = list(cache.k[0].shape)  # (B, own KV heads, T, D)
    seen["bytes"] = list(split.weight_bytes)
    return seen


if __name__ == "__main__":
    main(*sys.argv[1:])
