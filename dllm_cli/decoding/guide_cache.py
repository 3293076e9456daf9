"""The AR guide's KV cache in a batch: each row's committed tokens, and nothing else.

A guide forward feeds every live row a run of tokens (rows that have nothing to verify feed
padding); afterwards each row keeps some of its fed tokens (those now committed, minus the
last one, which is fed again to judge the next draft) and the rest become holes that the
attention mask hides. Trailing slots no row keeps are cropped at once; at the end of a step
the cache is repacked so every row's tokens sit left-aligned and holes do not pile up.
Positions are explicit, so a row's tokens keep their true positions wherever they sit.
"""

from __future__ import annotations

import inspect

import torch


class GuideCache:
    """Per-row committed-token cache of a transformers causal LM (DynamicCache underneath)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.keyword = cache_keyword(model)
        self.trims = accepts(model, "logits_to_keep")
        self.table = model.get_input_embeddings().num_embeddings
        self.kv = None  # the transformers Cache
        self.valid: torch.Tensor | None = None  # (B, T) bool: slots holding a row's token
        self.forwards = 0

    def reset(self, batch: int, device) -> None:
        self.kv = None
        self.valid = torch.zeros((batch, 0), dtype=torch.bool, device=device)

    @property
    def cached(self) -> torch.Tensor:
        """(B,) tokens cached per row: its first `cached` real tokens."""
        return self.valid.sum(dim=1)

    def forward(
        self, feed: torch.Tensor, positions: torch.Tensor, pad_id: int, last: int
    ) -> torch.Tensor:
        """Logits (B, last, V) of the last `last` fed slots, on top of each row's cached tokens.

        Every fed slot may be attended (causally), so padding at the end of a short row only
        ever attends to itself and what precedes it, never the other way round.
        """
        feed = feed.masked_fill(feed >= self.table, pad_id)  # ids the guide cannot embed
        attend = torch.cat([self.valid, torch.ones_like(feed, dtype=torch.bool)], dim=1)
        extra = {"logits_to_keep": last} if self.trims else {}
        out = self.model(
            input_ids=feed,
            attention_mask=attend.long(),
            position_ids=positions.clamp(min=0),
            use_cache=True,
            **{self.keyword: self.kv},
            **extra,
        )
        self.forwards += 1
        kv = out.get("cache")
        self.kv = kv if kv is not None else out.get("past_key_values")
        return out.logits[:, -last:]

    def keep(self, counts: torch.Tensor, fed: int) -> None:
        """Each row keeps the first `counts[r]` of the `fed` slots just added."""
        slots = torch.arange(fed, device=counts.device)[None] < counts[:, None]  # (B, F)
        self.valid = torch.cat([self.valid, slots], dim=1)
        drop = fed - int(counts.max()) if counts.numel() else fed
        if drop > 0:
            self.kv.crop(-drop)  # negative: remove that many slots from the end
            self.valid = self.valid[:, :-drop]

    def compact(self) -> None:
        """Move every row's cached tokens to the front (holes left only at the end)."""
        v = self.valid
        if v.numel() == 0 or bool(v.all()):
            return
        n = v.sum(dim=1)  # (B,)
        width = int(n.max())
        if bool((v[:, :width] == (torch.arange(width, device=v.device)[None] < n[:, None])).all()):
            if width < v.shape[1]:  # already packed: only trailing holes to drop
                self.kv.crop(-(v.shape[1] - width))
                self.valid = v[:, :width]
            return
        order = torch.sort((~v).to(torch.int8), dim=1, stable=True).indices[:, :width]  # (B, W)
        for layer in self.kv.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, index)
            layer.values = layer.values.gather(2, index)
        self.valid = torch.arange(width, device=v.device)[None] < n[:, None]

    def admit(self, new: int, order: torch.Tensor) -> None:
        """`new` rows with nothing cached join after the current ones; then rows `order`.

        (Continuous batching: a newly admitted request's row, its prompt fed on its first
        verification; the engine keeps canvas rows in slot order, and so does this cache.)
        """
        v = self.valid
        self.valid = torch.cat([v, v.new_zeros((new, v.shape[1]))])[order]
        if self.kv is None:
            return
        for layer in self.kv.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                fresh = t.new_zeros((new, *t.shape[1:]))
                setattr(layer, name, torch.cat([t, fresh])[order])

    def select(self, keep: torch.Tensor) -> None:
        """Only rows `keep` go on."""
        self.valid = self.valid[keep]
        if self.kv is not None:
            self.kv.batch_select_indices(keep)


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward's cache argument: `cache` in recent transformers 5, `past_key_values` before."""
    for name in ("cache", "past_key_values"):
        if accepts(model, name):
            return name
    return "past_key_values"


def accepts(model: torch.nn.Module, name: str) -> bool:
    """Whether the model's forward takes argument `name` (looking past wrappers' **kwargs)."""
    for cls in type(model).__mro__:
        if "forward" in vars(cls):
            params = inspect.signature(cls.forward).parameters
            if name in params:
                return True
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                return False
    return False
