"""Answer logprobs and echo scores: engine records and estimates -> OpenAI's logprobs shapes.

Answer logprobs (decoding/logprobs.py) are each answer token's log-probability under the step
that committed it. Echo scores (scoring.py) give token j of a prompt L(j) - L(j + 1), L(c)
the estimate for context ids[:c] and continuation ids[c:], so the values from any split to
the end sum to that split's estimate; alternatives at j are the k most likely tokens with the
tokens before j given and the rest masked, re-based so the token itself carries its value
(lm-eval's greedy check then reads "the argmax of a left-to-right decode"). docs/scoring.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm_cli import scoring
from dllm_cli.decoding.answer import answer_tokens
from dllm_cli.errors import InputError
from dllm_cli.families import FAMILIES
from dllm_cli.family_settings import refuse_feature
from dllm_cli.runtime import Runtime


@dataclass
class TokenLogprob:
    """One answer token: its text, log-probability, and the alternatives of its step."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass
class Scored:
    """A scored prompt: per token its text and score, and per position its alternatives."""

    tokens: list[str]
    values: list[float | None]  # None before the first split scored (the first token always)
    top: list[dict[str, float] | None]
    prompt_tokens: int
    forwards: int
    seconds: float


def check_logprobs(runtime: Runtime) -> None:
    """Answer logprobs come from the masked-diffusion engine's sampler only."""
    refuse_feature(FAMILIES[runtime.loaded.family], "logprobs", "logprobs", InputError)


def piece(runtime: Runtime, token: int) -> str:
    """A token's own text (special tokens as their strings)."""
    return runtime.loaded.tokenizer.decode([token], skip_special_tokens=False)


def answer_logprobs(runtime: Runtime, buffers, k: int, tokens: list[int], text: str):
    """Per token of the answer's text (through its last token before a stop): its logprob and
    k alternatives, from the request's logprobs.Buffers (none recorded: empty)."""
    special = runtime.loaded.special
    answer = [t for t in answer_tokens(tokens, special.stop) if t != special.mask]
    return token_entries(runtime, buffers, k, answer, 0, covered(runtime, answer, 0, text))


def covered(runtime: Runtime, tokens: list[int], start: int, text: str) -> int:
    """How many leading tokens (at least `start`) have their text within `text`."""
    n = start
    while n < len(tokens) and len(runtime.text(tokens[: n + 1])) <= len(text):
        n += 1
    return n


def token_entries(runtime: Runtime, buffers, k: int, tokens: list[int], lo: int, hi: int):
    """TokenLogprobs of answer tokens lo..hi (answer columns, as the engine records them)."""
    if buffers is None or hi <= lo:
        return []
    chosen, ids, values = buffers.read(k)

    def top(i: int) -> list[tuple[str, float]]:
        return [(piece(runtime, a), v) for a, v in zip(ids[i], values[i], strict=True)]

    return [TokenLogprob(piece(runtime, tokens[i]), chosen[i], top(i)) for i in range(lo, hi)]


def check_scoring(runtime: Runtime, ids: list[int], generate: bool) -> None:
    """A prompt echo scoring can estimate, or InputError saying why not."""
    model = runtime.loaded.model
    scoring.estimator_for(runtime.loaded.family)
    if len(ids) < 2:
        raise InputError("echo scoring needs a prompt of at least two tokens")
    if max(ids) >= model.get_input_embeddings().num_embeddings:
        raise InputError(f"prompt token id {max(ids)} is outside the vocabulary")
    room = model.context_length - generate
    if len(ids) > room:
        raise InputError(f"prompt too long to score: {len(ids)} tokens > {room}")


def first_split(length: int, splits: int | None) -> int:
    """The first context length scored: 1, or the last `splits` splits of the prompt."""
    return 1 if splits is None else max(1, length - splits)


@dataclass(frozen=True)
class Split:
    """One estimate of a scoring job: L(c) of its prompt `ids`; the last one also runs the
    alternatives' forwards (what every rank of --tensor-parallel runs with rank 0)."""

    ids: list[int]
    c: int
    score: object  # protocol.Score
    settings: object  # DecodeSettings

    @classmethod
    def next(cls, ticket) -> Split:
        """A scoring ticket's next estimate (the splits it has scored come first)."""
        job, ids = ticket.job, ticket.ids
        c = first_split(len(ids), job.score.splits) + len(ticket.totals)
        return cls(ids, c, job.score, job.settings)

    @property
    def last(self) -> bool:
        return self.c == len(self.ids) - 1

    def estimate(self, runtime: Runtime) -> float:
        """L(c): the estimate for context ids[:c] and continuation ids[c:]."""
        loaded, ids, c, score, s = runtime.loaded, self.ids, self.c, self.score, self.settings
        return scoring.estimate(
            loaded.model, loaded.special.mask, loaded.model.family, ids[:c], ids[c:],
            samples=score.samples, batch=score.batch, seed=s.seed, cfg=s.cfg_scale,
            eos=loaded.special.eos,
        ).total  # fmt: skip


def final_forwards(runtime: Runtime, ids: list[int], score):
    """The alternatives' log-probabilities (n - first, V) and, max tokens 1, the token a
    one-token decode commits after the prompt with its row (V,)."""
    loaded = runtime.loaded
    model, mask, family = loaded.model, loaded.special.mask, loaded.model.family
    first = first_split(len(ids), score.splits)
    _, logp = scoring.greedy_flags(model, mask, family, ids, start=first)
    after = scoring.next_token(model, mask, family, ids) if score.generate else None
    return logp, after


def scored(runtime: Runtime, ids: list[int], totals: list[float], score, seconds: float):
    """Per-token scores from the splits' estimates, alternatives re-based on them, and (max
    tokens 1) the token a one-token decode commits after the prompt."""
    first = first_split(len(ids), score.splits)
    ends = [*totals, 0.0]
    values: list[float | None] = [None] * first
    values += [ends[i] - ends[i + 1] for i in range(len(totals))]
    logp, after = final_forwards(runtime, ids, score)  # (n - first, V)
    top: list[dict[str, float] | None] = [None] * first
    for j in range(first, len(ids)):
        base = values[j] - float(logp[j - first, ids[j]])  # the token carries its score
        top.append(alternatives(runtime, logp[j - first], score.top, base, ids[j]))
    tokens = [piece(runtime, t) for t in ids]
    forwards = sum(estimate_forwards(runtime, score, ids, c) for c in range(first, len(ids)))
    forwards += 1
    if after is not None:
        token, row = after
        tokens.append(piece(runtime, token))
        values.append(float(row[token]))
        top.append(alternatives(runtime, row, score.top, 0.0, token))
        forwards += 1
    return Scored(tokens, values, top, len(ids), forwards, seconds)


def estimate_forwards(runtime: Runtime, score, ids: list[int], c: int) -> int:
    """Model forwards the estimate of context ids[:c] takes."""
    model = runtime.loaded.model
    rule = scoring.estimator_for(model.family)
    samples = score.samples or rule.samples
    batch = min(score.batch or rule.batch, samples)
    return scoring.forwards(rule, model, c, len(ids) - c, samples, batch)


def alternatives(runtime: Runtime, logp: torch.Tensor, k: int, base: float, own: int):
    """The token itself and the `k` most likely at its position, each `base` + log-prob."""
    best = logp.topk(k).indices.tolist() if k else []
    out = {piece(runtime, own): base + float(logp[own])}
    for t in best:
        out.setdefault(piece(runtime, t), base + float(logp[t]))
    return out
