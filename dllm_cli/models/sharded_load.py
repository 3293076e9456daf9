"""Tensor parallelism's loading: a meta-built model shrunk to this rank's pieces, and only those
slices of every tensor read from the safetensors files (`get_slice`, never the whole tensor);
with --quantize, those slices quantized to the integers and scales one process gives them
(`quantized_layers`, `QuantizedInputs`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch
from torch import nn

from dllm_cli.errors import SettingsError
from dllm_cli.models import quantize as quant
from dllm_cli.models.expert_parallel import keep_experts
from dllm_cli.models.fused import FusedLinear
from dllm_cli.models.int4 import Int4Linear, Narrowed
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
    narrow,
    split_columns,
    split_inputs,
    split_rows,
    split_swiglu,
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
            BLOCK_SPLITS[family](block, shards, plan, prefix)
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
        try:
            module = model.get_submodule(name)
        except AttributeError:  # a tied head (LLaDA's weight_tying) reads the embedding
            continue
        table = module.weight.shape[0]
        lo, hi = shards.vocabulary(table)
        model.vocab_start, model.vocab_width = lo, table
        narrow(module, 0, lo, hi, plan, name)
        if isinstance(module, nn.Embedding):
            module.__class__, module.shards, module.start = VocabEmbedding, shards, lo
        else:
            module.out_features = hi - lo
    cls = type(model)
    model.__class__ = type(f"Sharded{cls.__name__}", (ShardedLM, cls), {})
    model.shards, model.local_kv = shards, kv // shards.world
    return plan


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
        split_swiglu(expert, shards, plan, f"{prefix}.{name}.experts.{i}", split_inputs)
    mlp.__class__, mlp.shards = SummedExperts, shards
    return extra


def load_sharded(
    folder: Path,
    model: nn.Module,
    family: str,
    shards: Shards,
    dtype: torch.dtype,
    device,
    scheme: quant.Scheme = quant.SCHEMES["none"],
) -> nn.Module:
    """`model` (meta-built, checked against the folder) as this rank's shard, on `device`;
    `scheme`: its projections quantized from this rank's slices, as one process quantizes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    whole = sum(p.numel() for p in model.parameters()) * itemsize  # tied ones counted once
    groups = tied_groups(model)
    plan = split(model, family, shards)
    inputs = {  # name -> a linear of which this rank holds some inputs (weight split on dim 1)
        name.removesuffix(".weight"): model.get_submodule(name.removesuffix(".weight"))
        for name, piece in plan.items()
        if name.endswith(".weight") and isinstance(piece, tuple) and piece[0] == 1
    }
    check_split_groups(inputs, scheme, shards)
    per_row = scheme.bits and not scheme.group  # one scale a row: the whole row's peak
    peaks: dict[str, torch.Tensor] | None = {} if per_row else None
    read_slices(folder, model, plan, quant.load_dtype(scheme, dtype, weight_files(folder)), peaks)
    for group in groups:
        retie(model, group)
    model.to(device)
    model.eval()
    if scheme.bits:
        held = {id(lin): (peaks or {}).get(f"{name}.weight") for name, lin in inputs.items()}
        quant.quantize_loaded(model, scheme, dtype, quantized_layers(scheme, shards, held))
    else:
        model.fuse_projections()
    sum_fused_rows(model)
    model.weight_bytes = (quant.weight_bytes(model), whole)
    return model


def check_split_groups(inputs: dict[str, nn.Linear], scheme: quant.Scheme, shards: Shards):
    """Refuse, naming the numbers, int4 groups that would straddle two ranks, and int4 experts
    split over their columns (their parts would round before the block's sum)."""
    for name, lin in inputs.items():
        if scheme.group and not isinstance(lin, RowLinear):
            raise SettingsError(
                f"--tensor-parallel does not support --quantize {scheme.name} for experts split "
                f"over their columns yet ({name}); use --quantize int8"
            )
        if scheme.group and lin.in_features % scheme.group:
            raise SettingsError(
                f"--tensor-parallel {shards.world} gives each rank {lin.in_features} of "
                f"{name}'s {lin.in_features * shards.world} inputs, not a multiple of "
                f"--quantize {scheme.name}'s group of {scheme.group}"
            )


def quantized_layers(
    scheme: quant.Scheme, shards: Shards, inputs: dict[int, torch.Tensor | None]
) -> quant.Maker:
    """The quantized layer of a group of this rank's linears; one holding some of its inputs
    (`inputs`: id -> int8's whole-row peaks) is a QuantizedInputs layer of one process's scales."""

    def make(linears, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        first = linears[0]
        if id(first) not in inputs:  # its outputs split, or replicated: one process's rows
            return scheme.make(weight, bias)
        if scheme.group:  # int4: groups of inputs, each rank's own; multiplied in float32
            layer = Int4Linear.of(weight, bias, scheme.group, kernel="dequant")
        else:  # int8: one process's row scales
            layer = quant.Int8Linear.of(weight, bias, inputs[id(first)])
        return split_inputs_of(layer, shards, summed=isinstance(first, RowLinear))

    return make


class QuantizedInputs:
    """Mixed in before a quantized layer holding this rank's share of its inputs: int8 scales
    each row of x by its whole row's max |x| (one MAX all-reduce); `summed` (row-parallel) sums
    the partial products over ranks, int4's in float32, rounded to bfloat16 once after the sum
    as one process's GEMM rounds once (docs/tensor-parallel.md)."""

    shards: Shards
    summed: bool

    def peaks(self, flat: torch.Tensor) -> torch.Tensor:
        return self.shards.all_reduce_max(quant.row_peaks(flat))

    def products(self, flat: torch.Tensor) -> torch.Tensor:
        if not self.summed:
            return super().products(flat)
        weight = self.dequantized(torch.bfloat16).float()  # (out, in): the bfloat16 values
        return torch.mm(flat.to(torch.bfloat16).float(), weight.t())  # (N, out) float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if not self.summed:
            return out
        out = self.shards.all_reduce(out)
        return out.bfloat16().to(x.dtype) if isinstance(self, Int4Linear) else out

    def part(self, start: int, stop: int) -> nn.Module:
        view = super().part(start, stop)  # a Narrowed view calls this layer: reduced already
        return (
            view if isinstance(view, Narrowed) else split_inputs_of(view, self.shards, self.summed)
        )


@cache
def _quantized_inputs(cls: type) -> type:
    return type(f"Split{cls.__name__}", (QuantizedInputs, cls), {})


def split_inputs_of(layer: nn.Module, shards: Shards, summed: bool) -> nn.Module:
    """`layer` (quantized from this rank's share of its inputs) as a QuantizedInputs layer."""
    layer.__class__ = _quantized_inputs(type(layer))
    layer.shards, layer.summed = shards, summed
    return layer


# Rows of a row-parallel weight read at once to find their peaks (whole rows: this many bytes
# at most in flight, whatever the tensor's size).
PEAK_CHUNK_BYTES = 64 << 20


def read_slices(
    folder: Path,
    model: nn.Module,
    plan: dict,
    dtype: torch.dtype,
    peaks: dict[str, torch.Tensor] | None = None,
) -> None:
    """Each tensor's slice for this rank, read from its shard file (never the whole tensor);
    with `peaks` (int8) an input-split weight's whole rows' max |w| is kept there too."""
    from safetensors import safe_open

    wanted = model.state_dict(keep_vars=True)
    read: dict[str, torch.Tensor] = {}
    for f in weight_files(folder):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name not in wanted:
                    continue
                piece = plan.get(name)
                if peaks is not None and isinstance(piece, tuple) and piece[0] == 1:
                    read[name], peaks[name] = _read_with_peaks(st.get_slice(name), piece, dtype)
                    continue
                t = _read(st, name, piece, wanted[name])
                read[name] = t.to(dtype) if t.is_floating_point() else t
        model.load_state_dict(read, strict=False, assign=True)
        read.clear()


def _read_with_peaks(tensor, piece: Slice, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Columns lo..hi of a 2-D checkpoint slice, and its whole rows' max |w| (out, 1), from
    chunks of whole rows in `dtype` (the values one process quantizes)."""
    _, lo, hi = piece
    rows, width = tensor.get_shape()
    step = max(1, PEAK_CHUNK_BYTES // (4 * width))
    parts, peaks = [], []
    for start in range(0, rows, step):
        chunk = tensor[start : start + step].to(dtype)  # (step, in): whole rows
        peaks.append(quant.row_peaks(chunk))
        parts.append(chunk[:, lo:hi].clone())
    return torch.cat(parts), torch.cat(peaks)


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
    """After fusing: a fused group of row-parallel linears sums its output (blocks call it)."""
    for module in model.modules():
        fusion = getattr(module, "fusion", None)
        if fusion is None:
            continue
        for name, group in list(fusion.groups.items()):
            if not isinstance(group, FusedLinear):  # quantized: QuantizedInputs sums it
                continue
            if all(isinstance(lin, RowLinear) for lin in group.linears):
                fusion.set(name, _summed(group, group.linears[0].shards))


def _summed(group: Callable, shards: Shards) -> Callable:
    def run(x: torch.Tensor) -> torch.Tensor:
        return shards.all_reduce(group(x))

    return run
