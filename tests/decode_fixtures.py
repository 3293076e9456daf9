"""Tiny in-memory LLaDA and Dream models for the decoding tests (no files, CPU, float32).

`tiny(kind)` is a random model; `head_scale` sharpens its softmax (a "peaked", confident model);
`eos_after` adds a large EOS logit at every position from a given one on, so the model ends its
answers confidently (for early-stop tests).
"""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest
import torch

from dllm_cli.models import DreamConfig, DreamModel, LLaDAConfig, LLaDAModelLM
from dllm_cli.models.llada_moe import LLaDAMoEConfig, LLaDAMoEModelLM
from dllm_cli.models.loading import LoadedModel, SpecialIds
from dllm_cli.settings import DecodeSettings

MASK, EOS, BOS, EOT = 39, 1, 2, 3
SPECIAL = SpecialIds(mask=MASK, eos=EOS, pad=EOS, bos=BOS, eot=EOT)
KINDS = ("llada", "dream")


def llada_config(layers: int = 2) -> LLaDAConfig:
    return LLaDAConfig(
        d_model=32,
        n_heads=4,
        n_layers=layers,
        mlp_hidden_size=64,
        vocab_size=40,
        embedding_size=48,
        max_sequence_length=512,
        mask_token_id=MASK,
        eos_token_id=EOS,
        pad_token_id=EOS,
        bos_token_id=BOS,
    )


def dream_config(layers: int = 2) -> DreamConfig:
    return DreamConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as in Dream-7B
        max_position_embeddings=512,
        mask_token_id=MASK,
        pad_token_id=EOS,
        eos_token_id=EOS,
        bos_token_id=BOS,
    )


def llada_moe_config(layers: int = 2) -> LLaDAMoEConfig:
    """Several experts per token (3 of 8), q/k norms, no shared expert: 7B-A1B's layout."""
    return LLaDAMoEConfig(
        vocab_size=40,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        expert_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=3,
        max_position_embeddings=512,
        mask_token_id=MASK,
        pad_token_id=EOS,
        eos_token_id=EOS,
        bos_token_id=BOS,
    )


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and this machine's cores are shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class EosAfter:
    """Mixed in before a model class: its predictions for positions >= eos_from strongly
    favour EOS."""

    eos_from = 10**9
    eos_bias = 0.0

    def forward(self, input_ids, positions=None, cache=None, key_mask=None, columns=None, **kw):
        logits = super().forward(input_ids, positions, cache, key_mask, columns, **kw)
        return add_eos_bias(self, logits, input_ids, positions, kw.get("logits_slice"))


class EosAfterLLaDA(EosAfter, LLaDAModelLM):
    pass


class EosAfterDream(EosAfter, DreamModel):
    pass


class EosAfterLLaDAMoE(EosAfter, LLaDAMoEModelLM):
    pass


def add_eos_bias(model, logits, input_ids, positions, logits_slice):
    """Raise the EOS logit where the predicted position (output position + shift) is late."""
    if positions is None:
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    if isinstance(logits_slice, torch.Tensor):  # (B, T') per-row picks
        positions = positions.gather(1, logits_slice)
    elif logits_slice is not None:
        positions = positions[:, logits_slice]
    late = (positions + model.logit_shift >= model.eos_from).to(logits.dtype)  # (B, T)
    logits = logits.clone()
    logits[..., EOS] += model.eos_bias * late
    return logits


CLASSES = {
    "llada": (llada_config, LLaDAModelLM, EosAfterLLaDA),
    "dream": (dream_config, DreamModel, EosAfterDream),
    "llada_moe": (llada_moe_config, LLaDAMoEModelLM, EosAfterLLaDAMoE),  # not in KINDS: opt-in
}


def randomize(model: torch.nn.Module, seed: int, head_scale: float) -> None:
    """Weights ~ N(0, 1/fan_in) so context matters; the LM head scaled by head_scale."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        head = model.model.transformer.ff_out if isinstance(model, LLaDAModelLM) else model.lm_head
        head.weight.mul_(head_scale)


@cache
def tiny(
    kind: str,
    seed: int = 0,
    head_scale: float = 1.0,
    layers: int = 2,
    eos_from: int | None = None,
    eos_bias: float = 30.0,
) -> LoadedModel:
    """A tiny random model wrapped as the decoder expects it (cached: models are read-only)."""
    make_config, plain, biased = CLASSES[kind]
    cls = plain if eos_from is None else biased
    model = cls(make_config(layers))
    if eos_from is not None:
        model.eos_from, model.eos_bias = eos_from, eos_bias
    randomize(model, seed, head_scale)
    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=None,
        special=SPECIAL,
        path=Path("memory"),
        architecture=model.config.model_type,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )


def peaked(kind: str, seed: int = 0) -> LoadedModel:
    """A confident model: max probabilities mostly between 0.5 and 1."""
    return tiny(kind, seed, head_scale=6.0)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Random prompts of ordinary tokens (no special ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(4, MASK) for _ in range(n)] for n in lengths]


def settings(**kw) -> DecodeSettings:
    """Small defaults for tests: 16 tokens in blocks of 4, one token per step."""
    base = {"gen_length": 16, "block_length": 4}
    base.update(kw)
    return DecodeSettings(**base)
