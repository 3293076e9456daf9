"""Held-out accuracy during training: greedy AR for the guide, the real engine for a diffusion LM."""

from __future__ import annotations

from functools import partial

import torch

from dllm_cli.decoding import answer_tokens
from dllm_cli.evaluate import Task, score
from dllm_cli.models.loading import SpecialIds
from dllm_cli.settings import DecodeSettings
from recipes.tinygsm.batches import Encoder
from recipes.tinygsm.data import is_correct
from recipes.tinygsm.splits import SPLITS


def _prompts(enc: Encoder, n: int, shots: int, split: str) -> tuple[list[list[int]], list[int]]:
    chosen = SPLITS[split]
    probs = chosen.problems()[:n]
    prompts = [enc.prompt(p.question, chosen.shots(i, shots)) for i, p in enumerate(probs)]
    return prompts, [p.answer for p in probs]


def _text(enc: Encoder, ids: list[int]) -> str:
    return enc.tok.decode(answer_tokens(ids, (enc.ids.eos, enc.ids.eot)), skip_special_tokens=True)


def eval_ar(
    model, enc: Encoder, n: int, shots: int = 0, max_new: int = 96, split: str = "narrow"
) -> float:
    """Greedy decoding with the causal LM, left-padded batch."""
    prompts, answers = _prompts(enc, n, shots, split)  # fewer than n when the split is smaller
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), enc.ids.eos, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        att[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=att,
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=enc.ids.eos,
        eos_token_id=[enc.ids.eos, enc.ids.eot],
    )
    texts = [_text(enc, row[width:].tolist()) for row in out]
    return sum(is_correct(t, a) for t, a in zip(texts, answers, strict=True)) / len(answers)


def eval_mdm(
    model,
    enc: Encoder,
    n: int,
    shots: int = 0,
    gen_length: int = 64,
    block_length: int = 32,
    split: str = "narrow",
) -> float:
    """Reference decoding through the real engine: blocks, one token per step (LLaDA's linear
    schedule for both families), no cache."""
    prompts, answers = _prompts(enc, n, shots, split)
    tasks = [Task(i, p, a) for i, (p, a) in enumerate(zip(prompts, answers, strict=True))]
    special = SpecialIds(
        mask=enc.ids.mask,
        eos=enc.ids.eos,
        pad=enc.ids.eos,
        bos=enc.ids.bos,
        eot=enc.ids.eot,
        vocab=len(enc.tok),
    )
    settings = DecodeSettings(gen_length=gen_length, block_length=block_length, schedule="linear")
    return score(model, special, tasks, settings, partial(_text, enc), batch_size=n).accuracy
