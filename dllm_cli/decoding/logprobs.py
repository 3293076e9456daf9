"""Per-token log-probabilities of a request's answer, for the requests that ask (opt-in).

Each token's log-probability, and its `k` most likely alternatives, come from the distribution
of the step that committed it (not an autoregressive left-to-right probability): the sampler's
(LLaDA's softmax of the raw logits, Dream's of its tempered and filtered logits); a token a
filter removed has -9999.0, as OpenAI writes one. Nothing is computed unless a live request
asked; values are scattered into the request's own device buffers and read with its tokens.
Under --tensor-parallel a step that keeps each rank's slice of the distributions records
through its `part` (shard_summaries.VocabPart.pick: one all-gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOOR = -9999.0  # log-probability written for a token of probability 0


@dataclass
class Buffers:
    """One request's answer columns (+1 scratch column for slots that committed nothing)."""

    chosen: torch.Tensor  # (G + 1,) the committed token's log-probability
    top_ids: torch.Tensor  # (G + 1, K) the step's K most likely tokens
    top_values: torch.Tensor  # (G + 1, K) their log-probabilities

    @classmethod
    def empty(cls, length: int, k: int, device) -> Buffers:
        k = max(k, 1)
        return cls(
            torch.full((length + 1,), FLOOR, dtype=torch.float64, device=device),
            torch.zeros((length + 1, k), dtype=torch.long, device=device),
            torch.full((length + 1, k), FLOOR, dtype=torch.float64, device=device),
        )

    def read(self, k: int) -> tuple[list[float], list[list[int]], list[list[float]]]:
        """(chosen, top ids, top values) per answer column, read from the device."""
        return (
            self.chosen[:-1].tolist(),
            self.top_ids[:-1, :k].tolist(),
            self.top_values[:-1, :k].tolist(),
        )


def record(canvas, live, probs: torch.Tensor | None, commit, tokens, columns, part=None) -> None:
    """Write each asking live row's commits of this step into its request's buffers."""
    if probs is None:  # a decode without distributions (guided drafts): nothing to record
        return
    write(live, probs, commit, tokens, columns - canvas.prompt_width, part)


def write(requests, probs: torch.Tensor, commit, tokens, positions, part=None) -> None:
    """Row i of (N, L) `commit`, `tokens`, answer `positions` and (N, L, V) `probs` into the
    buffers of `requests[i]` if it asked; `part` (a VocabPart): `probs` are a rank's slice."""
    asking = [i for i, r in enumerate(requests) if r.logprobs is not None]
    for i in asking:
        r = requests[i]
        if r.logprob_buffers is None:
            r.logprob_buffers = Buffers.empty(r.sampling.gen_length, r.logprobs, probs.device)
    picked = {}
    if part is not None and asking:  # every rank's share of the asking rows, gathered once
        index = torch.tensor(asking, device=probs.device)
        lp = torch.log(probs[index].double()).nan_to_num(neginf=FLOOR)  # (R, L, V_r)
        k = max(requests[i].logprob_buffers.top_ids.shape[1] for i in asking)
        picked = dict(zip(asking, zip(*part.pick(lp, tokens[index], k), strict=True), strict=True))
    for i in asking:
        r = requests[i]
        g, buf = r.sampling.gen_length, r.logprob_buffers  # its own answer's columns
        k = buf.top_ids.shape[1]
        if i in picked:
            chosen, values, ids = picked[i]
            values, ids = values[:, :k], ids[:, :k]
        else:
            lp = torch.log(probs[i].double()).nan_to_num(neginf=FLOOR)  # (L, V)
            chosen = lp.gather(-1, tokens[i][:, None]).squeeze(-1)  # (L,)
            values, ids = lp.topk(k, dim=-1)  # (L, K)
        at = torch.where(commit[i], positions[i], g).clamp(0, g)  # (L,): scratch when not
        buf.chosen.scatter_(0, at, chosen)
        buf.top_ids.scatter_(0, at[:, None].expand_as(ids), ids)
        buf.top_values.scatter_(0, at[:, None].expand_as(values), values)
