"""Per-row sampling: every request samples with its own values and draws from its own generator.

Row r draws from its request's generator (seeded at admission) exactly `lengths[r]` slots of its
own span, and only on steps where it has something to decode, so a sampled answer is the same
alone, in a static batch or beside other traffic; alone it draws what one generator draws for
the whole (1, L, ...) batch (the references' replays). Values are host data: per-row
temperatures, top-p and top-k become (B, 1, 1) tensors only when rows differ.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dllm_cli.lifetimes import Sampling


@dataclass(frozen=True)
class RowDraws:
    """A step's rows: their generators, sampling values, span lengths and who draws."""

    generators: tuple[torch.Generator, ...]
    samplings: tuple[Sampling, ...]
    lengths: tuple[int, ...]  # real slots of each row's span (the rest is padding)
    on: tuple[bool, ...]  # the row draws this step (an idle row in lockstep does not)

    def subset(self, rows: list[int]) -> RowDraws:
        """Only rows `rows` (a forward that serves some rows)."""
        every = (self.generators, self.samplings, self.lengths, self.on)
        return RowDraws(*(tuple(xs[r] for r in rows) for xs in every))

    def without(self, rows: list[int]) -> RowDraws:
        """The same rows, `rows` drawing nothing (their drafts are replaced by a later forward)."""
        skip = set(rows)
        return replace(self, on=tuple(o and r not in skip for r, o in enumerate(self.on)))

    def sampled(self) -> RowDraws:
        """The same rows, greedy ones drawing nothing (alone they draw no Gumbel noise)."""
        on = tuple(o and not s.greedy for o, s in zip(self.on, self.samplings, strict=True))
        return replace(self, on=on)

    def uniform(self, shape, dtype=torch.float32, device=None, law=None) -> torch.Tensor:
        """(B, L, ...) uniforms in [0, 1) (or `law`'s draws): row r's first lengths[r] slots
        from its generator, 0.5 elsewhere (padding and rows that do not draw)."""
        law, rest = law or uniforms, tuple(shape[2:])
        if all(self.on) and all(n == shape[1] for n in self.lengths):  # every row, whole spans
            rows = [law((n, *rest), g, dtype, device)
                    for g, n in zip(self.generators, self.lengths, strict=True)]  # fmt: skip
            return torch.stack(rows)
        out = torch.full(tuple(shape), 0.5, dtype=dtype, device=device)
        for r, (g, n, on) in enumerate(zip(self.generators, self.lengths, self.on, strict=True)):
            n = min(n, shape[1])
            if on and n > 0:
                out[r, :n] = law((n, *rest), g, dtype, device)
        return out

    def value(self, name: str):
        """One sampling value when every row has it (a float or None), else the per-row list."""
        if len(self.samplings) == 1:  # (one row, the common case: no list to compare)
            return getattr(self.samplings[0], name)
        values = [getattr(s, name) for s in self.samplings]
        return values[0] if all(v == values[0] for v in values) else values

    @property
    def all_greedy(self) -> bool:
        return all(s.greedy for s in self.samplings)

    @property
    def any_greedy(self) -> bool:
        return any(s.greedy for s in self.samplings)

    def greedy_rows(self, device) -> torch.Tensor:
        """(B, 1) bool: rows that take the argmax."""
        return torch.tensor([[s.greedy] for s in self.samplings], device=device)


def uniforms(shape, generator, dtype, device) -> torch.Tensor:
    return torch.rand(shape, generator=generator, dtype=dtype, device=device)


def exponentials(shape, generator, dtype, device) -> torch.Tensor:
    """Exp(1) draws as torch.multinomial's one-sample path draws them (its q)."""
    return torch.empty(shape, dtype=dtype, device=device).exponential_(1, generator=generator)


def uniform(generator, shape, dtype=torch.float32, device=None, law=None) -> torch.Tensor:
    """Uniform (or `law`'s) draws from a RowDraws (per row) or a plain torch.Generator."""
    if isinstance(generator, RowDraws):
        return generator.uniform(shape, dtype, device, law)
    return (law or uniforms)(shape, generator, dtype, device)


def per_row(values: list, like: torch.Tensor, fill: float) -> torch.Tensor:
    """(B, 1, ..., 1) tensor of per-row values in `like`'s dtype (None -> `fill`)."""
    column = [fill if v is None else v for v in values]
    shape = (len(column),) + (1,) * (like.dim() - 1)
    return torch.tensor(column, dtype=like.dtype, device=like.device).view(shape)


def temperatures(values, logits: torch.Tensor):
    """Each row's divisor: its temperature, 1 for greedy rows (a scalar when rows agree)."""
    if not isinstance(values, list):
        return values if values > 0 else 1.0
    return per_row([t if t > 0 else 1.0 for t in values], logits, 1.0)
