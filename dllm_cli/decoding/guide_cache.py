"""The AR guide's KV cache in a batch: each row's committed tokens, and nothing else.

A guide forward feeds every live row a run of tokens (rows that have nothing to verify feed
padding); afterwards each row keeps some of its fed tokens (those now committed, minus the
last one, which is fed again to judge the next draft) and the rest become holes that the
attention mask hides. Trailing slots no row keeps are cropped at once; at the end of a step
the cache is repacked (every row's tokens left-aligned) once holes would otherwise widen it
by a quarter, so they never pile up (a repack copies the whole cache).
Positions are explicit, so a row's tokens keep their true positions wherever they sit.
The cache is the model's own: our guide's (models/causal.py) is a `KVCache` (cache.py), a
transformers causal LM's its DynamicCache; both are reshaped here a tensor at a time (`_map`),
and only the DynamicCache is cropped (our forward writes over the columns past `valid`).

Continuous batching: a request keeps one cache row for its whole life (`rows` maps canvas
rows to cache rows), so rows joining or the canvas reordering never move cached tokens; a
new request's prompt is written into the row a finished one left. A finished row that no
request takes is dropped just before the next forward.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from dllm_cli.cache import KVCache

HOLES = 4  # repack once that narrows the cache by over 1/HOLES of its width


class GuideCache:
    """Per-row committed-token cache of our guide or a transformers causal LM."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.keyword = cache_keyword(model)
        self.trims = accepts(model, "logits_to_keep")
        self.table = model.get_input_embeddings().num_embeddings
        self.kv = None  # the model's cache (KVCache or a transformers Cache), a row per cache row
        self.valid: torch.Tensor | None = None  # (R, T) bool: slots holding a row's token
        self.rows: list[int] = []  # canvas row -> cache row (fixed for a request's life)
        self.forwards = 0
        self.row_columns = self.key_columns = 0  # tokens fed (rows x slots), query-key pairs

    def reset(self, batch: int, device) -> None:
        self.kv = None
        self.valid = torch.zeros((batch, 0), dtype=torch.bool, device=device)
        self.rows = list(range(batch))

    @property
    def cached(self) -> torch.Tensor:
        """(B,) tokens cached per canvas row: its first `cached` real tokens."""
        return self.valid.sum(dim=1)[self._index()]

    def _index(self) -> torch.Tensor:
        """(B,) each canvas row's cache row."""
        return torch.tensor(self.rows, dtype=torch.long, device=self.valid.device)

    def forward(
        self, feed: torch.Tensor, positions: torch.Tensor, pad_id: int, last: int
    ) -> torch.Tensor:
        """Logits (B, last, V) of the last `last` fed slots, on top of each row's cached tokens;
        fed slots attend causally, so a short row's end padding is never attended by its tokens."""
        self._drop_unused()
        at = self._index()  # canvas row r is fed as cache row at[r] (a permutation now)
        feed, positions = scatter_rows(feed, self.rows), scatter_rows(positions, self.rows)
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
        logits = out.logits[:, -last:]
        return logits if self.rows == list(range(len(self.rows))) else logits[at]

    def count(self, fed: tuple[int, int], keys: int) -> None:
        """One forward of `fed` (rows, slots) over `keys` key slots: the arithmetic it did."""
        self.forwards += 1
        self.row_columns += fed[0] * fed[1]
        self.key_columns += fed[0] * fed[1] * keys

    def keep(self, counts: torch.Tensor, fed: int) -> None:
        """Each canvas row r keeps the first `counts[r]` of the `fed` slots just added."""
        counts = scatter_rows(counts, self.rows)
        slots = torch.arange(fed, device=counts.device)[None] < counts[:, None]  # (R, F)
        self.valid = torch.cat([self.valid, slots], dim=1)
        drop = fed - int(counts.max()) if counts.numel() else fed
        if drop > 0:
            self.valid = self.valid[:, :-drop]
            self._crop()

    def compact(self) -> None:
        """Move every row's cached tokens to the front once that narrows the cache by a
        quarter (a repack copies it all, as a transformers forward's append does; until then
        holes cost only the attention over them, which the mask zeroes)."""
        v = self.valid
        if v.numel() == 0:
            return
        n = v.sum(dim=1)  # (R,)
        width = int(n.max())
        if (v.shape[1] - width) * HOLES < v.shape[1]:  # repacking would save too little
            return
        if bool((v[:, :width] == (torch.arange(width, device=v.device)[None] < n[:, None])).all()):
            if width < v.shape[1]:  # already packed: only trailing holes to drop
                self.valid = v[:, :width]
                self._crop()
            return
        order = torch.sort((~v).to(torch.int8), dim=1, stable=True).indices[:, :width]  # (R, W)
        order = order[:, None, :, None]  # (R, 1, W, 1)
        self._map(lambda t, j: t.gather(2, order.expand(-1, t.shape[1], -1, t.shape[3])))
        self.valid = torch.arange(width, device=v.device)[None] < n[:, None]

    def admit(self, prompts: list[list[int]], order: torch.Tensor, pad_id: int) -> None:
        """New canvas rows join after the current ones, then rows are reordered as `order` says.

        Each new request takes a free cache row (a finished request's, else a new one) and keeps
        it; its prompt but the last token is cached at once by a guide forward over that prompt
        alone, so the next verification feeds every row only its chunk. Other rows stay put.
        """
        taken = set(self.rows)
        free = [i for i in range(len(self.valid)) if i not in taken][: len(prompts)]
        grow = len(prompts) - len(free)
        free += range(len(self.valid), len(self.valid) + grow)
        self.rows = [(self.rows + free)[i] for i in order.tolist()]
        width = max(self.valid.shape[1], max(len(p) for p in prompts) - 1)
        self.valid = pad_to(pad_rows(self.valid, grow), width)
        for row, p in zip(free, prompts, strict=True):
            self.valid[row] = False
            if len(p) > 1:
                self._write(row, self._prefill(p[:-1], pad_id), width)
                self.valid[row, : len(p) - 1] = True

    def _prefill(self, ids: list[int], pad_id: int):
        """The guide's cache (one row) of `ids` alone."""
        x = torch.tensor([ids], dtype=torch.long, device=self.valid.device)
        x = x.masked_fill(x >= self.table, pad_id)
        positions = torch.arange(len(ids), device=x.device)[None]
        # no attention mask: one row, every token real (a causal LM then masks causally alone)
        out = self.model(input_ids=x, position_ids=positions, use_cache=True)
        self.count(x.shape, len(ids))
        return out.get("cache") if out.get("cache") is not None else out.get("past_key_values")

    def _write(self, row: int, fresh, width: int) -> None:
        """Cache row `row` starts with `fresh`'s one row (the cache widened to `width` slots,
        grown to every row `valid` has, when it is narrower or shorter)."""
        rows, new, first = len(self.valid), tensors(fresh), self.kv is None
        if first:  # nothing cached before: every other row empty
            self.kv = fresh

        def place(t: torch.Tensor, j: int) -> torch.Tensor:
            x = new[j]  # (1, H_kv, L, D)
            if first:
                t = x.new_zeros((rows, x.shape[1], width, x.shape[3]))
            else:
                t = pad_to(pad_rows(t, rows - t.shape[0]), width, dim=2)
            t[row, :, : x.shape[2]] = x[0]
            return t

        self._map(place)

    def _crop(self) -> None:
        """A transformers cache loses the slots past `valid` (ours keeps its columns: the next
        forward writes over them, attending only the columns the attention mask covers)."""
        if not isinstance(self.kv, KVCache):
            width = self.valid.shape[1]
            self._map(lambda t, j: t[:, :, :width])

    def _map(self, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
        """Tensor j of `tensors(self.kv)` becomes fn(it, j), one at a time (one tensor's copy
        in memory at once, as transformers' own cache calls reshape it)."""
        kv = self.kv
        n = len(kv.k) if isinstance(kv, KVCache) else len(kv.layers)
        for j in range(2 * n):
            if isinstance(kv, KVCache):
                store = kv.v if j >= n else kv.k
                store[j % n] = fn(store[j % n], j)
            else:
                layer, name = kv.layers[j % n], "values" if j >= n else "keys"
                setattr(layer, name, fn(getattr(layer, name), j))

    def select(self, keep: torch.Tensor) -> None:
        """Only canvas rows `keep` go on; the cache rows of the others wait for a new
        request (`admit`) or are dropped at the next forward."""
        self.rows = [self.rows[i] for i in keep.tolist()]

    def _drop_unused(self) -> None:
        """Cache rows no canvas row uses go (one copy), so a forward feeds live rows only."""
        if len(self.rows) == len(self.valid):
            return
        live = sorted(self.rows)
        self.rows = [live.index(r) for r in self.rows]
        index = torch.tensor(live, dtype=torch.long, device=self.valid.device)
        self.valid = self.valid[index]
        if self.kv is not None:
            self._map(lambda t, j: t[index])


def tensors(kv) -> list[torch.Tensor]:
    """Every layer's keys, then every layer's values (R, H_kv, S, D), of either cache type."""
    if isinstance(kv, KVCache):
        return [*kv.k, *kv.v]
    return [layer.keys for layer in kv.layers] + [layer.values for layer in kv.layers]


def scatter_rows(t: torch.Tensor, at: list[int]) -> torch.Tensor:
    """`t` with row i moved to row at[i] (`at` a permutation of range(len(t)))."""
    if at == list(range(len(at))):
        return t
    out = torch.empty_like(t)
    out[torch.tensor(at, dtype=torch.long, device=t.device)] = t
    return out


def pad_rows(t: torch.Tensor, extra: int) -> torch.Tensor:
    """`t` with `extra` rows of zeros (False) appended."""
    return pad_to(t, t.shape[0] + extra, dim=0)


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
