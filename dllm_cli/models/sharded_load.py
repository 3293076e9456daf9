"""Tensor parallelism's loading: a meta-built model shrunk to this rank's pieces, and only those
slices of every tensor read from the safetensors files (`get_slice`, never the whole tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from dllm_cli.models.expert_parallel import keep_experts
from dllm_cli.models.moe import LLaDAMoESparseBlock
from dllm_cli.models.sharded_llada2 import ROWS, read_rows, split_llada2_block
from dllm_cli.models.sharding import (
    ZERO,
    RowLinear,
    ShardedLM,
    Shards,
    Slice,
    SummedExperts,
    VocabEmbedding,
    check_degree,
    layout_of,
)
from dllm_cli.models.weights import retie, tied_groups, weight_files

# Families whose blocks are split by a function of their own (the layout's lists: empty).
BLOCK_SPLITS = {"llada2": split_llada2_block}


def split(model: nn.Module, family: str, shards: Shards) -> dict[str, Slice | str]:
    """Shrink a meta-built model's parameters to this rank's pieces, in place; returns each
    checkpoint tensor's slice (None: read whole; ZERO: this rank adds no bias)."""
    layout = layout_of(family)
    sizes = layout.sizes(model.config)
    heads, kv = sizes["attention heads"], sizes["KV heads"]
    check_degree(family, model.config, shards.world, shards.expert_parallel)
    plan: dict[str, Slice | str] = {}
    names = {id(m): name for name, m in model.named_modules()}
    for block in model.blocks():
        prefix = names[id(block)]
        columns, rows = list(layout.columns), list(layout.rows)
        if family in BLOCK_SPLITS:
            ops = (split_columns, split_inputs, split_rows)
            BLOCK_SPLITS[family](block, shards, plan, prefix, ops)
        if layout.feed_forward is not None:
            columns, rows = split_feed_forward(block, layout.feed_forward, shards, plan, prefix)
            columns, rows = [*layout.columns, *columns], [*layout.rows, *rows]
        for name in columns:
            split_columns(block.get_submodule(name), shards, plan, f"{prefix}.{name}")
        for name in rows:
            split_rows(block.get_submodule(name), shards, plan, f"{prefix}.{name}")
        holder = block.get_submodule(layout.attention) if layout.attention else block
        holder.n_heads, holder.n_kv = heads // shards.world, kv // shards.world
    for name in layout.vocabulary:
        module = _find(model, name)
        if module is None:  # a tied head (LLaDA's weight_tying) reads the embedding
            continue
        table = module.weight.shape[0]
        lo, hi = shards.vocabulary(table)
        model.vocab_start, model.vocab_width = lo, table
        _narrow(module, 0, lo, hi, plan, name)
        if isinstance(module, nn.Embedding):
            module.__class__, module.shards, module.start = VocabEmbedding, shards, lo
        else:
            module.out_features = hi - lo
    cls = type(model)
    model.__class__ = type(f"Sharded{cls.__name__}", (ShardedLM, cls), {})
    model.shards, model.local_kv = shards, kv // shards.world
    return plan


def split_columns(lin: nn.Linear, shards: Shards, plan: dict, name: str) -> None:
    """A column-parallel linear: this rank's share of the outputs (and of their biases)."""
    lo, hi = shards.even(lin.out_features)
    _narrow(lin, 0, lo, hi, plan, name)
    lin.out_features = hi - lo


def split_inputs(lin: nn.Linear, shards: Shards, plan: dict, name: str) -> None:
    """This rank's share of a linear's inputs (the caller sums the partial outputs)."""
    lo, hi = shards.even(lin.in_features)
    _narrow(lin, 1, lo, hi, plan, name)
    if lin.bias is not None and shards.rank:
        plan[f"{name}.bias"] = ZERO
    lin.in_features = hi - lo


def split_rows(lin: nn.Linear, shards: Shards, plan: dict, name: str) -> None:
    """A row-parallel linear: its partial output summed over ranks by one all-reduce."""
    split_inputs(lin, shards, plan, name)
    lin.__class__, lin.shards = RowLinear, shards


def split_feed_forward(block, name: str, shards: Shards, plan: dict, prefix: str):
    """A MoE layer's experts split in place (gate/up over outputs, down over inputs, one
    all-reduce for the block); a dense one's names returned as columns and rows."""
    mlp = block.get_submodule(name)
    shared = ["shared_expert.gate_proj", "shared_expert.up_proj"]
    extra = (shared, ["shared_expert.down_proj"]) if block.shared_expert is not None else ([], [])
    if not isinstance(mlp, LLaDAMoESparseBlock):
        return [f"{name}.gate_proj", f"{name}.up_proj", *extra[0]], [f"{name}.down_proj", *extra[1]]
    if shards.expert_parallel:  # whole experts; the shared expert's part summed with theirs
        keep_experts(block, shards)
        for part in extra[0]:
            split_columns(block.get_submodule(part), shards, plan, f"{prefix}.{part}")
        for part in extra[1]:
            split_inputs(block.get_submodule(part), shards, plan, f"{prefix}.{part}")
        return [], []
    for i, expert in enumerate(mlp.experts):
        where = f"{prefix}.{name}.experts.{i}"
        split_columns(expert.gate_proj, shards, plan, f"{where}.gate_proj")
        split_columns(expert.up_proj, shards, plan, f"{where}.up_proj")
        split_inputs(expert.down_proj, shards, plan, f"{where}.down_proj")
    mlp.__class__, mlp.shards = SummedExperts, shards
    return extra


def _find(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _narrow(module: nn.Module, dim: int, lo: int, hi: int, plan: dict, name: str) -> None:
    """Replace `module`'s weight (and a column split's bias) by meta tensors of the piece."""
    for kind in ("weight", "bias"):
        p = getattr(module, kind, None)
        if p is None or (kind == "bias" and dim == 1):  # a row split keeps the whole bias
            continue
        shape = list(p.shape)
        shape[dim] = hi - lo
        setattr(module, kind, nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta")))
        plan[f"{name}.{kind}"] = (dim, lo, hi)


def unique_bytes(model: nn.Module, itemsize: int) -> int:
    """Bytes of the model's parameters at `itemsize` bytes each, tied ones counted once."""
    return sum(p.numel() for p in model.parameters()) * itemsize


def load_sharded(
    folder: Path, model: nn.Module, family: str, shards: Shards, dtype: torch.dtype, device
) -> nn.Module:
    """`model` (meta-built, checked against the folder) as this rank's shard, on `device`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    whole = unique_bytes(model, itemsize)
    groups = tied_groups(model)
    plan = split(model, family, shards)
    read_slices(folder, model, plan, dtype)
    for group in groups:
        retie(model, group)
    model.to(device)
    model.eval()
    model.fuse_projections()
    sum_fused_rows(model)
    model.weight_bytes = (unique_bytes(model, itemsize), whole)
    return model


def read_slices(folder: Path, model: nn.Module, plan: dict, dtype: torch.dtype) -> None:
    """Each tensor's slice for this rank, read from its shard file (never the whole tensor)."""
    from safetensors import safe_open

    wanted = model.state_dict(keep_vars=True)
    read: dict[str, torch.Tensor] = {}
    for f in weight_files(folder):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name not in wanted:
                    continue
                t = _read(st, name, plan.get(name), wanted[name])
                read[name] = t.to(dtype) if t.is_floating_point() else t
        model.load_state_dict(read, strict=False, assign=True)
        read.clear()


def _read(st, name: str, piece: Slice | str, like: torch.Tensor) -> torch.Tensor:
    if piece == ZERO:
        return torch.zeros(like.shape)
    if piece is None:
        return st.get_tensor(name)
    tensor = st.get_slice(name)
    if piece[0] == ROWS:  # a fused projection: several row ranges of it
        return read_rows(tensor, piece[1])
    dim, lo, hi = piece
    return tensor[lo:hi] if dim == 0 else tensor[:, lo:hi]


def sum_fused_rows(model: nn.Module) -> None:
    """After fusing: a fused group of row-parallel linears sums its output too (blocks call
    the fused group, not the linear)."""
    for module in model.modules():
        fusion = getattr(module, "fusion", None)
        if fusion is None:
            continue
        for name, group in list(fusion.groups.items()):
            if all(isinstance(lin, RowLinear) for lin in group.linears):
                fusion.groups[name] = _summed(group, group.linears[0].shards)


def _summed(group: Callable, shards: Shards) -> Callable:
    def run(x: torch.Tensor) -> torch.Tensor:
        return shards.all_reduce(group(x))

    return run
