"""Tensor parallelism: one model split over the ranks of a torchrun job (Megatron's layout).

Each block's query, key and value projections and its MLP's gate and up projections are split
over their outputs (column-parallel: a rank holds its share of the heads and of the MLP's
columns), the attention output and the MLP's down projection over their inputs (row-parallel:
each rank's partial product is summed by one all-reduce). The embedding and the LM head are
split over the vocabulary: a rank looks up only the ids in its range (one all-reduce sums the
rows) and computes only its range of the logits. The KV cache holds only the rank's KV heads.
LLaDA-MoE's experts are split as dense MLPs are (the router replicated), their routed sum
reduced once per layer. Per forward: two all-reduces per layer plus one for the embedding (a
shared expert adds one per layer).

The logits are never gathered: `ShardedSampler` reduces each rank's (rows, columns, own
vocabulary) shard to a few numbers per column (its best logit and id, its sum of exp, its top
candidates) and one all-gather of those gives every rank the same greedy drafts and
confidences, so every rank takes the same decisions and runs the same collectives in the same
order; what a rule draws at random, every rank draws alike (the same seed). Sampled drafts
and the settings that need the whole distribution are refused (`refuse_unsupported`).

Each rank reads only its slices of every tensor from the safetensors files (`get_slice`).
Under R x N processes, ranks rN .. rN + N - 1 form replica r (its own process group).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dllm_cli.decoding.row_sampling import RowDraws, uniform
from dllm_cli.errors import SettingsError
from dllm_cli.models.moe import LLaDAMoESparseBlock
from dllm_cli.models.weights import retie, tied_groups, weight_files

Slice = tuple[int, int, int] | None  # (dim, start, stop) of a checkpoint tensor; None: whole
ZERO = "zero"  # a row-parallel bias on ranks other than 0: added once, after the sum


@dataclass(frozen=True)
class Layout:
    """Where a family's parallel pieces are: names inside a block, and at the model's level."""

    sizes: Callable[[object], dict[str, int]]  # config -> what must divide by the degree
    attention: str  # the block's submodule holding n_heads / n_kv ("": the block itself)
    columns: tuple[str, ...]  # linears split over their outputs
    rows: tuple[str, ...]  # linears split over their inputs, summed by an all-reduce
    vocabulary: tuple[str, ...]  # the embedding and the LM head (model-level names)
    feed_forward: str | None = None  # a block's MLP that is sparse in some layers (MoE)


def moe_sizes(c) -> dict[str, int]:
    """LLaDA-MoE: heads, KV heads, and every feed-forward width its layers have."""
    sizes = {"attention heads": c.num_attention_heads, "KV heads": c.num_key_value_heads}
    sizes["expert MLP columns"] = c.expert_intermediate_size
    if not all(c.moe_layer_freq):
        sizes["dense MLP columns"] = c.dense_intermediate_size
    if c.shared_expert_intermediate_size:
        sizes["shared expert MLP columns"] = c.shared_expert_intermediate_size
    return sizes


# Keyed by families.py names; a family absent here is refused (`layout_of`).
LAYOUTS: dict[str, Layout] = {
    "llada": Layout(
        lambda c: {"attention heads": c.n_heads, "KV heads": c.kv_heads, "MLP columns": c.ffn_size},
        "",
        ("q_proj", "k_proj", "v_proj", "ff_proj", "up_proj"),
        ("attn_out", "ff_out"),
        ("model.transformer.wte", "model.transformer.ff_out"),
    ),
    "dream": Layout(
        lambda c: {
            "attention heads": c.num_attention_heads,
            "KV heads": c.num_key_value_heads,
            "MLP columns": c.intermediate_size,
        },
        "self_attn",
        (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ),
        ("self_attn.o_proj", "mlp.down_proj"),
        ("model.embed_tokens", "lm_head"),
    ),
    # Attention as Dream's; each expert's columns split as a dense MLP's, the router replicated
    # (every rank routes the same all-reduced hidden states), one all-reduce per sparse block.
    "llada_moe": Layout(
        moe_sizes,
        "self_attn",
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("model.embed_tokens", "lm_head"),
        feed_forward="mlp",
    ),
}


@dataclass
class Counts:
    """Collectives this rank has run (tests and --stats check they stay at the minimum)."""

    all_reduce: int = 0
    all_gather: int = 0
    forwards: int = 0


@dataclass
class Shards:
    """This rank's place in a tensor-parallel group of `world` ranks."""

    rank: int
    world: int
    replica: int = 0  # which group of `world` ranks (data parallelism on top)
    replicas: int = 1
    backend: str = "gloo"  # nccl on CUDA (the default group is gloo, for the job's messages)
    counts: Counts = field(default_factory=Counts)

    @cached_property
    def group(self) -> dist.ProcessGroup | None:
        """The group collectives run in, made at the first one (every rank reaches it there);
        None: the whole job (one replica on gloo)."""
        if self.replicas == 1 and self.backend == "gloo":
            return None
        if self.replicas == 1:
            return dist.new_group(backend=self.backend)
        return self.connect()

    def join(self) -> dist.ProcessGroup | None:
        """Make this rank's group now, before any rank decodes (every rank makes every
        replica's group, in the same order)."""
        return self.group

    def connect(self) -> dist.ProcessGroup:
        """Every replica's group, made by every rank in the same order (as new_group needs);
        this rank's own."""
        n = self.world
        groups = [
            dist.new_group(list(range(r * n, (r + 1) * n)), backend=self.backend)
            for r in range(self.replicas)
        ]
        return groups[self.replica]

    def even(self, size: int) -> tuple[int, int]:
        """This rank's equal piece [start, stop) of `size` (the size divides by the world)."""
        piece = size // self.world
        return self.rank * piece, (self.rank + 1) * piece

    def vocabulary(self, size: int) -> tuple[int, int]:
        """This rank's contiguous range of `size` ids (the last rank's may be shorter)."""
        piece = math.ceil(size / self.world)
        return min(size, self.rank * piece), min(size, (self.rank + 1) * piece)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        self.counts.all_reduce += 1
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(world, *x.shape): every rank's `x`, in rank order."""
        self.counts.all_gather += 1
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.stack(parts)


# --- the degree ----------------------------------------------------------------------------


def place(rank: int, world: int, degree: int) -> Shards:
    """Rank `rank` of `world` processes under --tensor-parallel `degree`: ranks r N .. r N + N
    - 1 hold replica r."""
    if degree < 1:
        raise SettingsError(f"--tensor-parallel must be at least 1 (got {degree})")
    if world % degree:
        raise SettingsError(
            f"--tensor-parallel {degree} needs {degree} processes or a multiple (this run has "
            f"{world}): launch with torchrun --nproc-per-node {degree}"
        )
    return Shards(rank % degree, degree, rank // degree, world // degree)


def layout_of(family: str) -> Layout:
    """The family's layout, or a one-line refusal."""
    if family not in LAYOUTS:
        raise SettingsError(
            f"--tensor-parallel does not support {family} models yet "
            f"(supported: {', '.join(LAYOUTS)})"
        )
    return LAYOUTS[family]


def check_degree(family: str, config, world: int) -> None:
    """Refuse a degree that does not divide the heads, the KV heads or an MLP's width."""
    sizes = layout_of(family).sizes(config)
    every = ", ".join(f"{count} {what}" for what, count in sizes.items())
    for what, count in sizes.items():
        if count % world:
            raise SettingsError(
                f"--tensor-parallel {world} does not divide the model's {count} {what} ({every})"
            )


# --- loading a rank's slices ---------------------------------------------------------------


class VocabEmbedding(nn.Embedding):
    """An embedding holding ids [start, stop) of the table; other ids' rows come from other
    ranks through one all-reduce. `num_embeddings` stays the whole table's size."""

    shards: Shards
    start: int

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start  # (B, T)
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, d)
        return self.shards.all_reduce(rows.masked_fill_(outside[..., None], 0.0))


class RowLinear(nn.Linear):
    """A linear over this rank's share of its inputs: partial products summed over ranks."""

    shards: Shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shards.all_reduce(super().forward(x))


class ShardedLM:
    """Mixed in before a DiffusionLM class: a KV cache of this rank's heads, its own sampler,
    forwards counted."""

    shards: Shards
    local_kv: int
    vocab_start: int  # the first id of this rank's logits
    vocab_smallest: int  # the shortest rank's count of logits
    weight_bytes: tuple[int, int]  # (this rank's, the whole model's)

    def kv_shape(self) -> tuple[int, int, int]:
        layers, _, head_dim = super().kv_shape()
        return layers, self.local_kv, head_dim

    def draft_sampler(self, settings, family, vocab_size: int, mask_id: int) -> ShardedSampler:
        """The engine's sampler (decoding/engine.py asks the model for one)."""
        start, smallest = self.vocab_start, self.vocab_smallest
        return ShardedSampler(self.shards, start, smallest, settings, family, vocab_size, mask_id)

    def forward(self, *args, **kwargs):
        self.shards.counts.forwards += 1
        return super().forward(*args, **kwargs)


def split(model: nn.Module, family: str, shards: Shards) -> dict[str, Slice | str]:
    """Shrink a meta-built model's parameters to this rank's pieces, in place; returns each
    checkpoint tensor's slice (None: read whole; ZERO: this rank adds no bias)."""
    layout = layout_of(family)
    sizes = layout.sizes(model.config)
    heads, kv = sizes["attention heads"], sizes["KV heads"]
    check_degree(family, model.config, shards.world)
    plan: dict[str, Slice | str] = {}
    names = {id(m): name for name, m in model.named_modules()}
    for block in model.blocks():
        prefix = names[id(block)]
        columns, rows = list(layout.columns), list(layout.rows)
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
        last = Shards(shards.world - 1, shards.world).vocabulary(table)
        model.vocab_start, model.vocab_smallest = lo, last[1] - last[0]
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


class SummedExperts(LLaDAMoESparseBlock):
    """A sparse block whose experts hold this rank's share of their columns: the routed sum of
    partial expert outputs is summed over ranks once (not once per expert)."""

    shards: Shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shards.all_reduce(super().forward(x))


def split_feed_forward(block, name: str, shards: Shards, plan: dict, prefix: str):
    """A MoE layer's experts split in place (gate/up over outputs, down over inputs, one
    all-reduce for the block); a dense one's names returned as columns and rows."""
    mlp = block.get_submodule(name)
    shared = ["shared_expert.gate_proj", "shared_expert.up_proj"]
    extra = (shared, ["shared_expert.down_proj"]) if block.shared_expert is not None else ([], [])
    if not isinstance(mlp, LLaDAMoESparseBlock):
        return [f"{name}.gate_proj", f"{name}.up_proj", *extra[0]], [f"{name}.down_proj", *extra[1]]
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
    dim, lo, hi = piece
    tensor = st.get_slice(name)
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


# --- sampling from vocabulary shards -------------------------------------------------------

UNMASKS = ("fixed", "threshold", "factor", "prefix", "origin")  # no whole distributions
CONFIDENCES = ("low_confidence", "margin", "random")


def refuse_unsupported(settings, *, guided: bool = False, compiled: bool = False) -> None:
    """One line for what tensor parallelism does not compute yet (rather than computing it
    wrong): sampled drafts, top-p, classifier-free guidance, rules that read distributions."""
    why = None
    if settings.temperature > 0:
        why = "sampled drafts (--temperature above 0)"
    elif settings.top_p is not None and settings.top_p < 1.0:
        why = "top-p filtering (--top-p)"
    elif settings.cfg_scale > 0:
        why = "classifier-free guidance (--cfg-scale)"
    elif settings.alg_temp > 0:
        why = "sampled positions (alg_temp)"
    elif settings.unmask not in UNMASKS:
        why = f"--unmask {settings.unmask} (supported: {', '.join(UNMASKS)})"
    elif settings.confidence not in CONFIDENCES:
        why = f"--confidence {settings.confidence} (supported: {', '.join(CONFIDENCES)})"
    elif guided:
        why = "a guide model (use --no-guide)"
    elif compiled:
        why = "--compile"
    if why:
        raise SettingsError(f"--tensor-parallel does not support {why} yet")


class ShardedSampler:
    """Greedy drafts and confidences from every rank's vocabulary shard, one all-gather of a
    few numbers per column (decoding/sampling.py's Sampler computes them from whole logits).

    Each rank sends per column: its best logit and that token's id (its first maximum), its
    sum of exp(logit - best), its `k` largest logits and how many of its logits reach its
    top-k-th (ties). From these every rank gets the global first maximum and the softmax
    denominator of the whole distribution, or of the top-k filtered one (Dream's confidence).
    """

    def __init__(self, shards: Shards, start: int, smallest: int, settings, family, vocab, mask):
        refuse_unsupported(settings)
        self.shards, self.start, self.family = shards, start, family
        self.vocab_size, self.mask_id = vocab, mask
        self.confidence, self.given_top_k = settings.confidence, settings.top_k
        self.margin = settings.confidence == "margin"
        self.top_k = (settings.top_k or 0) if family.tempered_confidence else 0
        self.k = max(self.top_k, 2 if self.margin else 1)  # candidates each rank sends
        if self.k > smallest:
            raise SettingsError(
                f"--tensor-parallel {shards.world}: top_k {self.k} exceeds a rank's "
                f"{smallest} vocabulary ids"
            )

    def __call__(self, logits: torch.Tensor, generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, confidence, _ = self.draft(logits, generator)
        return tokens, confidence

    def draft(self, logits: torch.Tensor, generator):
        """(B, L, own vocabulary) logits -> drafts (B, L), confidences (B, L), no distribution."""
        self.check_rows(generator)
        dtype = self.family.dtype or (logits.dtype if logits.dtype.itemsize >= 4 else None)
        s = self.gather(self.working(logits, dtype or torch.float32), self.k)
        if self.top_k:
            denominator, second = self.filtered(s)
        else:
            denominator, second = s.denominator(), s.second()
        if self.confidence == "random":  # LLaDA's random remasking: every rank draws the same
            return s.tokens, uniform(generator, s.tokens.shape, s.best.dtype, s.best.device), None
        if not self.margin:
            return s.tokens, 1.0 / denominator, None
        return s.tokens, (1.0 - torch.exp(second - s.best)) / denominator, None

    def check_rows(self, generator) -> None:
        """Refuse rows whose own sampling (a --json-input line's) differs from the run's."""
        if not isinstance(generator, RowDraws):
            return
        for s in generator.samplings:
            own = (s.top_p is not None and s.top_p < 1.0) or s.confidence != self.confidence
            if not s.greedy or own or s.top_k not in (None, self.given_top_k):
                raise SettingsError(
                    "--tensor-parallel does not support per-request temperature, top_p, top_k "
                    "or confidence yet"
                )

    def argmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafts and their probability under softmax(raw logits), at least float32."""
        dtype = logits.dtype if logits.dtype.itemsize >= 4 else torch.float32
        s = self.gather(self.working(logits, dtype), 1)
        return s.tokens, 1.0 / s.denominator()

    def working(self, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This rank's logits in `dtype`, ids past the real vocabulary and [MASK] at -inf (as
        Sampler.working_logits drops and masks them)."""
        ids = torch.arange(self.start, self.start + logits.shape[-1], device=logits.device)
        dropped = (ids >= self.vocab_size) | (ids == self.mask_id)  # (V_r,)
        return logits.to(dtype).masked_fill(dropped, -math.inf)

    def gather(self, work: torch.Tensor, k: int) -> Summaries:
        """Every rank's summary of its (B, L, V_r) shard, in one all-gather."""
        best, index = work.max(dim=-1)  # (B, L): the first maximum
        shift = torch.where(torch.isfinite(best), best, 0.0)  # a shard of padding ids only
        total = (work - shift[..., None]).exp().sum(dim=-1)  # (B, L)
        top = work.topk(k, dim=-1).values  # (B, L, k)
        kth = top[..., (self.top_k or 1) - 1 : self.top_k or 1]
        ties = (work >= kth).sum(dim=-1).to(work.dtype)  # (B, L)
        ids = (index + self.start).to(work.dtype)  # exact: ids < 2^24
        columns = [best[..., None], ids[..., None], total[..., None], ties[..., None], top]
        every = self.shards.all_gather(torch.cat(columns, dim=-1))  # (world, B, L, 4 + k)
        return Summaries(every)

    def filtered(self, s: Summaries) -> tuple[torch.Tensor, torch.Tensor]:
        """Dream: the softmax denominator over the global top-k (ties with the k-th kept, as
        top_k_filter keeps them), and the second largest kept logit (-inf: none)."""
        k = self.top_k
        mine = s.top[..., :k]  # (world, B, L, k)
        union = mine.permute(1, 2, 0, 3).flatten(2)  # (B, L, world k)
        kth = union.topk(k, dim=-1).values[..., -1]  # (B, L)
        kept = torch.where(union >= kth[..., None], torch.exp(union - s.best[..., None]), 0.0)
        # A rank whose own k-th equals the global k-th may hold more ties than it sent.
        more = torch.where(mine[..., -1] == kth, s.ties - k, 0.0).sum(dim=0)  # (B, L)
        denominator = kept.sum(dim=-1) + more * torch.exp(kth - s.best)
        second = s.second()
        return denominator, torch.where(second >= kth, second, -math.inf)


class Summaries:
    """The gathered per-column summaries, (world, B, L, 4 + k): best, id, sum, ties, top k."""

    def __init__(self, every: torch.Tensor):
        self.bests, ids, self.totals, self.ties = every.unbind(-1)[:4]
        self.top = every[..., 4:]  # (world, B, L, k)
        self.best, rank = self.bests.max(dim=0)  # (B, L): the lowest rank among equals
        self.tokens = ids.gather(0, rank[None])[0].long()  # so the lowest id, as argmax's

    def denominator(self) -> torch.Tensor:
        """sum of exp(logit - best) over the whole vocabulary (empty shards add 0)."""
        scale = torch.exp(self.bests - self.best)  # (world, B, L); a -inf shard: 0
        return (self.totals * scale).sum(dim=0)

    def second(self) -> torch.Tensor:
        """The second largest logit of the whole vocabulary (B, L)."""
        union = self.top.permute(1, 2, 0, 3).flatten(2)  # (B, L, world k)
        return union.topk(2, dim=-1).values[..., 1]
