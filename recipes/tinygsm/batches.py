"""Training batches for TinyGSM: AR sequences for the guide, masked canvases for the diffusion LM.

The diffusion batches follow LLaDA's SFT objective (arXiv 2502.09992): prompt tokens are never
masked, answer tokens are masked with probability t ~ U(eps, 1) and the loss is CE / t,
normalised by the answer length; the answer is padded with EOS to fill the canvas, so the
model learns to end. Half of the rows instead get inference-aligned block masks (PUMA, arXiv
2602.10314): earlier blocks clean, the current block masked with rate t, later blocks fully
masked, which is what semi-autoregressive decoding shows the model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from recipes.tinygsm.data import Problem, few_shot_prompt, random_fact, train_stream
from recipes.tinygsm.splits import mixed_stream
from recipes.tinygsm.wide import wide_fact

MASK_EPS = 1e-3


@dataclass(frozen=True)
class TokenIds:
    """The ids the batch builders need."""

    bos: int
    eos: int
    eot: int
    mask: int


class Encoder:
    """Problem -> (prompt ids, answer ids), memoising the fixed chat-template pieces."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        v = tokenizer.get_vocab()
        self.ids = TokenIds(
            bos=tokenizer.bos_token_id,
            eos=tokenizer.eos_token_id,
            eot=v["<|eot_id|>"],
            mask=tokenizer.mask_token_id,
        )

        self.answer_open = [v["Answer"], v[":"]]
        self.newline = v["\n"]
        self.equals, self.period = v["▁="], v["."]

    def prompt(self, question: str, shots) -> list[int]:
        msg = [{"role": "user", "content": few_shot_prompt(question, shots)}]
        text = self.tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)
        return self.tok(text, add_special_tokens=False).input_ids

    def answer(self, solution: str) -> list[int]:
        """Solution tokens then end-of-turn (EOS padding is added by the canvas builder)."""
        return [*self.tok(solution, add_special_tokens=False).input_ids, self.ids.eot]

    def shot_solutions(self, prompt: list[int]) -> list[bool]:
        """True on the solution tokens of the in-context examples (after `Answer:`)."""
        return _mark_after(prompt, self.answer_open, self.newline)

    def drill(
        self, rng: random.Random, length: int, wide_frac: float = 0.0
    ) -> tuple[list[int], list[bool]]:
        """BOS + equations `a op b = c.` filling `length` tokens; True on the results."""
        ids = [self.ids.bos]
        while len(ids) < length:
            fact = wide_fact(rng) if rng.random() < wide_frac else random_fact(rng)
            ids += self.tok(" " + fact, add_special_tokens=False).input_ids
        ids = ids[:length]
        marks = _mark_after(ids, [self.equals], self.period)
        return ids, marks


def _mark_after(ids: list[int], opener: list[int], closer: int) -> list[bool]:
    """Mark tokens after each `opener` run up to and including the next `closer`."""
    marks = [False] * len(ids)
    inside, n = False, len(opener)
    for i, t in enumerate(ids):
        if inside:
            marks[i] = True
            inside = t != closer
        elif ids[max(0, i - n + 1) : i + 1] == opener:
            inside = True
    return marks


@dataclass
class Example:
    prompt: list[int]
    answer: list[int]
    shot_marks: list[bool]  # True on the in-context solutions inside the prompt


class ExampleSource:
    """Deterministic k-shot examples from the training stream (shots are training problems).

    `wide_frac` / `rich_frac` > 0 mix in the wide and rich generators (and skip every held-out
    set); both 0 is the first release's narrow stream.
    """

    def __init__(self, encoder: Encoder, seed: int, wide_frac: float = 0.0, rich_frac: float = 0.0):
        self.encoder = encoder
        mixed = wide_frac > 0 or rich_frac > 0
        self.stream = mixed_stream(seed, wide_frac, rich_frac) if mixed else train_stream(seed)

    def take(self, k: int) -> Example:
        shots = [next(self.stream) for _ in range(k)]
        prob: Problem = next(self.stream)
        enc = self.encoder
        prompt = enc.prompt(prob.question, shots)
        return Example(prompt, enc.answer(prob.solution), enc.shot_solutions(prompt))


@dataclass
class MaskedBatch:
    """A diffusion training batch: noisy canvas, clean targets, and per-token loss weights."""

    noisy: torch.Tensor  # (B, T) with mask ids at masked answer positions
    target: torch.Tensor  # (B, T) clean tokens
    weight: torch.Tensor  # (B, T) 1/t (or 1) on masked positions, 0 elsewhere; rows sum-normalised


def ar_rows(items: list[Example], enc: Encoder) -> list[tuple[list[int], list[bool]]]:
    """Causal-LM rows with loss on every token: modelling the questions too teaches the token
    representations that copying operands needs (answer-only loss learned that far slower)."""
    rows = []
    for e in items:
        ids = [*e.prompt, *e.answer, enc.ids.eos]
        rows.append((ids, [True] * len(ids)))
    return rows


def ar_batch(
    rows: list[tuple[list[int], list[bool]]], pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded causal-LM batch: ids (B, T), attention mask, labels (-100: no loss)."""
    t = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), t), pad, dtype=torch.long)
    att = torch.zeros((len(rows), t), dtype=torch.long)
    labels = torch.full((len(rows), t), -100, dtype=torch.long)
    for i, (seq, marks) in enumerate(rows):
        row = torch.tensor(seq)
        ids[i, : len(seq)] = row
        att[i, : len(seq)] = 1
        labels[i, : len(seq)] = row.masked_fill(~torch.tensor(marks), -100)
    return ids, att, labels


def drill_batch(
    rows: list[tuple[list[int], list[bool]]], mask_id: int, rng: random.Random
) -> MaskedBatch:
    """Arithmetic drills for the diffusion LM: results masked at rate t, operands visible."""
    b, t_len = len(rows), len(rows[0][0])
    noisy = torch.empty((b, t_len), dtype=torch.long)
    target = torch.empty((b, t_len), dtype=torch.long)
    weight = torch.zeros((b, t_len), dtype=torch.float32)
    for i, (seq, marks) in enumerate(rows):
        t = rng.uniform(MASK_EPS, 1.0)
        masked = [m and rng.random() < t for m in marks]
        target[i] = noisy[i] = torch.tensor(seq)
        noisy[i][torch.tensor(masked)] = mask_id
        weight[i] = torch.tensor([1.0 / t if m else 0.0 for m in masked]) / max(1, sum(marks))
    return MaskedBatch(noisy, target, weight)


def _uniform_mask(rng: random.Random, n: int, content: int) -> tuple[list[bool], list[float]]:
    """LLaDA SFT: every answer token masked with probability t, weight 1/t."""
    del content  # uniform masking ignores where the answer ends
    t = rng.uniform(MASK_EPS, 1.0)
    masked = [rng.random() < t for _ in range(n)]
    return masked, [1.0 / t if m else 0.0 for m in masked]


def _block_mask(rng: random.Random, n: int, content: int) -> tuple[list[bool], list[float]]:
    """Inference-aligned: blocks before the current one clean, current at rate t, rest masked."""
    block = rng.choice((8, 16, 32, 32))
    n_blocks = -(-n // block)
    cur = rng.randint(0, min(n_blocks - 1, content // block + 1))
    lo, hi = cur * block, min(n, (cur + 1) * block)
    t = rng.uniform(MASK_EPS, 1.0)
    inside = [rng.random() < t for _ in range(lo, hi)]
    if not any(inside):
        inside[rng.randrange(hi - lo)] = True
    masked = [False] * lo + inside + [True] * (n - hi)
    weight = [0.0] * lo + [1.0 / t if m else 0.0 for m in inside] + [1.0] * (n - hi)
    return masked, weight


def _shot_masks(
    rng: random.Random, marks: list[bool], prob: float
) -> tuple[list[bool], list[float]]:
    """Mask each in-context solution (with probability `prob`) at its own rate t, weight 1/t.

    The shots are independent solved problems, so their solutions are extra supervision for
    the same skill at no extra forward cost; each is normalised by its own length.
    """
    masked, weight = [False] * len(marks), [0.0] * len(marks)
    i = 0
    while i < len(marks):
        if not marks[i]:
            i += 1
            continue
        j = i
        while j < len(marks) and marks[j]:
            j += 1
        if rng.random() < prob:
            t = rng.uniform(MASK_EPS, 1.0)
            for k in range(i, j):
                if rng.random() < t:
                    masked[k], weight[k] = True, 1.0 / t / (j - i)
        i = j
    return masked, weight


def masked_batch(
    items: list[Example],
    length: int,
    ids: TokenIds,
    rng: random.Random,
    aligned_frac: float = 0.5,
    shot_mask_prob: float = 0.0,
) -> MaskedBatch:
    """Canvases of exactly `length` tokens: prompt, answer, EOS padding; then mask the answer.

    The answer's weights are normalised by its unpadded length (LLaDA divides by the padded
    length, which lets hundreds of EOS tokens drown a 20-token answer on long canvases).
    """
    b = len(items)
    noisy = torch.empty((b, length), dtype=torch.long)
    target = torch.empty((b, length), dtype=torch.long)
    weight = torch.zeros((b, length), dtype=torch.float32)
    for i, e in enumerate(items):
        p, n = len(e.prompt), length - len(e.prompt)
        if n < len(e.answer):
            raise ValueError(f"canvas of {length} too short for prompt {p}")
        row = torch.tensor(e.prompt + e.answer + [ids.eos] * (n - len(e.answer)))
        scheme = _block_mask if rng.random() < aligned_frac else _uniform_mask
        masked, w = scheme(rng, n, len(e.answer))
        shot_masked, shot_w = _shot_masks(rng, e.shot_marks, shot_mask_prob)
        target[i] = noisy[i] = row
        noisy[i][torch.tensor(shot_masked + masked)] = ids.mask
        weight[i] = torch.tensor(shot_w + [x / len(e.answer) for x in w])
    return MaskedBatch(noisy, target, weight)
