"""The recipe trains dllm's own model classes: their inference forward carries no training
branch, and its in-place arithmetic gives the textbook formulas' gradients, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dllm_cli.models import dream, layers, llada
from recipes.tinygsm.architectures import build_dream, build_llada
from recipes.tinygsm.tokenizer import build_tokenizer
from recipes.tinygsm.train import PRESETS


def textbook_rope(x, cos, sin, full_precision, signed=None):  # (signed: our roll's table)
    dtype = x.dtype
    if full_precision:
        x = x.float()
    else:
        cos, sin = cos.to(dtype), sin.to(dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(dtype)


def gradients(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    logits = model(ids)  # (B, T, V)
    F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("build", [build_llada, build_dream])
def test_in_place_forward_trains_like_the_textbook_formulas(build, monkeypatch):
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = build(PRESETS["micro"], tok).train()
    ids = torch.randint(5, len(tok), (2, 24), generator=torch.Generator().manual_seed(1))
    ours = gradients(model, ids)
    assert all(g.abs().sum() > 0 for g in ours.values())  # every parameter learns
    monkeypatch.setattr(layers, "apply_rope", textbook_rope)
    monkeypatch.setattr(layers, "swiglu", lambda gate, up: F.silu(gate) * up)
    monkeypatch.setattr(layers, "residual", lambda x, branch: x + branch)
    for module in (llada, dream):  # the names each family imported from layers
        for name in ("swiglu", "residual"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, getattr(layers, name))
    reference = gradients(model, ids)
    assert ours.keys() == reference.keys()
    for name, grad in ours.items():
        assert torch.equal(grad, reference[name]), name
