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
        self.row_columns = self.key_columns = 0  # tokens fed (rows x slots), query-key pairs

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
        self.count(feed.shape, attend.shape[1])
        kv = out.get("cache")
        self.kv = kv if kv is not None else out.get("past_key_values")
        return out.logits[:, -last:]

    def count(self, fed: tuple[int, int], keys: int) -> None:
        """One forward of `fed` (rows, slots) over `keys` key slots: the arithmetic it did."""
        self.forwards += 1
        self.row_columns += fed[0] * fed[1]
        self.key_columns += fed[0] * fed[1] * keys

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

    def admit(self, prompts: list[list[int]], order: torch.Tensor, pad_id: int) -> None:
        """New rows join after the current ones, then rows are reordered as `order` says.

        (Continuous batching.) Each new row's prompt but its last token is cached at once, by
        one guide forward over the new rows only, so the next verification feeds every row
        only its chunk instead of padding the whole batch to the longest new prompt.
        """
        device = self.valid.device
        longest = max(len(p) for p in prompts) - 1
        valid = torch.zeros((len(prompts), max(longest, 0)), dtype=torch.bool, device=device)
        fresh = None
        if longest > 0:
            ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long, device=device)
            for r, p in enumerate(prompts):
                ids[r, : len(p) - 1] = torch.tensor(p[:-1], device=device)
                valid[r, : len(p) - 1] = True
            ids = ids.masked_fill(ids >= self.table, pad_id)
            positions = torch.arange(longest, device=device)[None].expand_as(ids)
            out = self.model(
                input_ids=ids, attention_mask=valid.long(), position_ids=positions, use_cache=True
            )
            self.count(ids.shape, longest)
            fresh = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
        width = max(self.valid.shape[1], valid.shape[1])
        old = len(self.valid)
        self.valid = torch.cat([pad_to(self.valid, width), pad_to(valid, width)])[order]
        if self.kv is None and fresh is None:
            return
        # Row i of (current rows, then new rows) lands at row at[i]: one copy per tensor.
        at = torch.empty_like(order)
        at[order] = torch.arange(len(order), device=order.device)
        if self.kv is None:  # nothing cached before: the new rows' cache, the old rows empty
            self.kv, sources = fresh, [(at[old:], None)]  # None: the layer's own tensor
        else:
            sources = [(at[:old], None)] + ([] if fresh is None else [(at[old:], fresh)])
        for i, layer in enumerate(self.kv.layers):
            for name in ("keys", "values"):
                t = getattr(layer, name)
                out = t.new_zeros((len(order), t.shape[1], width, t.shape[3]))
                for rows, source in sources:
                    x = t if source is None else getattr(source.layers[i], name)
                    out[rows, :, : x.shape[2]] = x
                setattr(layer, name, out)

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


def pad_to(t: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    """`t` with zeros (False) appended along `dim` up to `width` slots."""
    extra = width - t.shape[dim]
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim=dim)
