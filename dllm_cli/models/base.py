"""What every diffusion architecture offers the decoder: one cache-aware forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from dllm_cli.cache import Columns, KVCache
from dllm_cli.models.fused import lay_out_transposed, worth_fusing
from dllm_cli.models.layers import RMSNorm, default_positions, rope_tables, signed_sin

if TYPE_CHECKING:
    from dllm_cli.models.sharding import Shards


class DiffusionLM(nn.Module):
    """Base of the families: embeddings -> blocks -> final norm -> LM head, a plain torch
    module (no transformers model classes: about 2 s of imports off a decode's start).

    `forward` computes only the active canvas `columns` (one slice, or (B, T) per-row columns
    whose padding aims at the cache's scratch column), writes their K/V into `cache` there and
    attends every cached column the key mask allows; RoPE sees `positions` (canvas column minus
    the row's left padding; padding at 0). It returns raw logits (B, T, V), or those
    `logits_slice` picks; `logit_shift` says whether they predict their own column (0) or the
    next one (1, Dream).
    """

    logit_shift: int = 0
    family: ClassVar[str]  # its families.py key (sampler, reference settings)
    # Tensor parallelism: this rank's place (models/sharding.py); None: the whole model here.
    shards: Shards | None = None

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config

    def post_init(self) -> None:
        """Random weights for a fresh model (tests, training); a load replaces every one."""
        self.apply(self._init_weights)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(p for p in self.parameters() if p.is_floating_point()).dtype

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, RMSNorm) and module.weight is not None:
            nn.init.ones_(module.weight)

    # --- per-architecture hooks -------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    def head(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def kv_shape(self) -> tuple[int, int, int]:
        """(n_layers, n_kv_heads, head_dim) for sizing a KVCache."""
        raise NotImplementedError

    def rope_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype queries and keys are rotated in, for activations of `dtype`."""
        raise NotImplementedError

    def output_linear(self) -> nn.Linear | None:
        """The LM head's own linear (None: tied to the embeddings, or not a plain linear)."""
        return None

    def fuse_projections(self) -> None:
        """Fuse each block's projections (models/fused.py) once after loading, where it pays,
        and store an untied LM head's weight (in, out) like the fused ones (same floats)."""
        width = self.get_input_embeddings().embedding_dim
        if worth_fusing(width, next(self.parameters()).device):
            for block in self.blocks():
                block.fuse()
            head = self.output_linear()
            if head is not None:
                lay_out_transposed(head)

    @property
    def rope_theta(self) -> float:
        return self.config.rope_theta

    @property
    def rope_dim(self) -> int:
        """Dimensions of a head RoPE rotates (LLaDA2: the first part of it)."""
        return self.kv_shape()[2]

    @property
    def context_length(self) -> int:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        """Real vocabulary size: logits past it are padding rows of the embedding."""
        return self.config.vocab_size

    def rope_at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin and signed sin (B, 1, T, D) at `positions` (signed: apply_rope's one roll),
        gathered from one `rope_tables` table per model, device and dtype (as Fast-dLLM's)."""
        table = getattr(self, "_rope_table", None)
        if table is None or table.device != positions.device or table.dtype != dtype:
            every = torch.arange(self.context_length, device=positions.device)[None]
            tables = rope_tables(every, self.rope_dim, self.rope_theta)
            cos, sin = (t[0, 0].to(dtype) for t in tables)
            table = torch.stack([cos, sin, signed_sin(sin)])  # (3, N, D)
            self._rope_table = table
        b, t = positions.shape
        rows = table.index_select(1, positions.reshape(-1))  # (3, B T, D): one gather
        return rows.view(3, b, 1, t, -1).unbind(0)

    # --- the one forward --------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        key_mask: torch.Tensor | None = None,
        columns: Columns | None = None,
        logits_slice: slice | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T', V) of the active columns (T' = T, or the `logits_slice` of them)."""
        t = input_ids.shape[1]
        if columns is None:
            columns = slice(0, t)
        if positions is None:
            positions = default_positions(input_ids, columns)
        h = self.embed(input_ids)  # (B, T, d)
        rope = self.rope_at(positions, self.rope_dtype(h.dtype))  # one for every layer
        for i, block in enumerate(self.blocks()):  # (forward directly: no hooks on blocks)
            h = block.forward(h, rope, cache=cache, layer=i, columns=columns, key_mask=key_mask)
        if isinstance(logits_slice, torch.Tensor):  # (B, T') per-row picks
            h = h.gather(1, logits_slice[..., None].expand(-1, -1, h.shape[-1]))
        elif logits_slice is not None and logits_slice != slice(0, h.shape[1]):  # (all: as is)
            h = h[:, logits_slice]
        return self.head(h)


class Backbone(nn.Module):
    """The `model.` level of a Qwen-style state dict: embeddings, the layers, the final norm."""

    def __init__(
        self,
        vocab: int,
        hidden: int,
        eps: float,
        layers: int,
        layer: Callable[[int], nn.Module],
        embeddings: str = "embed_tokens",
    ):
        super().__init__()
        setattr(self, embeddings, nn.Embedding(vocab, hidden))
        self.layers = nn.ModuleList(layer(i) for i in range(layers))
        self.norm = RMSNorm(hidden, eps)


def output_head(embeddings: nn.Embedding, tied: bool) -> nn.Linear:
    """The LM head, sharing the embedding matrix when config.json ties them."""
    vocab, hidden = embeddings.weight.shape
    head = nn.Linear(hidden, vocab, bias=False)
    if tied:
        head.weight = embeddings.weight
    return head


class QwenLayout:
    """The accessors of `model.embed_tokens / model.layers / model.norm` plus `lm_head` (Dream,
    SDAR, LLaDA-MoE, LLaDA2); listed before the DiffusionLM base so these override its own."""

    embeddings_name: ClassVar[str] = "embed_tokens"  # LLaDA2 calls them `word_embeddings`
    layer: ClassVar[Callable]  # (config, index) -> that layer (a staticmethod)

    def __init__(self, config) -> None:
        """`model` (embeddings, each `layer(config, i)`, final norm), the head, random weights."""
        super().__init__(config)
        c = self.config
        sizes = (c.vocab_size, c.hidden_size, c.rms_norm_eps, c.num_hidden_layers)
        self.model = Backbone(*sizes, lambda i: self.layer(config, i), self.embeddings_name)
        self.lm_head = output_head(self.get_input_embeddings(), c.tie_word_embeddings)
        self.post_init()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.get_input_embeddings()(input_ids)

    def blocks(self) -> nn.ModuleList:
        return self.model.layers

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(h))

    def output_linear(self) -> nn.Linear | None:
        head = self.lm_head
        tied = head.weight is self.get_input_embeddings().weight
        return head if type(head) is nn.Linear and not tied else None

    def kv_shape(self) -> tuple[int, int, int]:
        c = self.config
        return c.num_hidden_layers, c.num_key_value_heads, c.head_dim

    def rope_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype  # Qwen2 and LLaDA-MoE's reference cast cos/sin to the activations' dtype

    @property
    def context_length(self):
        return self.config.max_position_embeddings

    def get_input_embeddings(self) -> nn.Embedding:
        return getattr(self.model, self.embeddings_name)
