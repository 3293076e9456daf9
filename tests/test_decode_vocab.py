"""Ids past the tokenizer's vocabulary (embedding padding rows) are never drafted."""

from __future__ import annotations

import pytest
import torch

from dllm_cli.decoding import decode
from dllm_cli.models.loading import load_model
from dllm_cli.settings import DecodeSettings


@pytest.mark.parametrize("kind", ["llada", "dream"])
def test_padding_rows_are_never_drafted(kind, request):
    ckpt = request.getfixturevalue(f"{kind}_ckpt")
    loaded = load_model(ckpt.folder, dtype="float32", device="cpu")
    real = loaded.special.vocab
    m = loaded.model
    head = (m.lm_head if kind == "dream" else m.model.transformer.ff_out).weight  # (rows, d)
    assert head.shape[0] > real  # the test folders pad their tables like the 8B models do
    with torch.no_grad():
        head[real:] = 50.0 * head[:1].sign()  # padding rows would win every argmax
    prompt = loaded.tokenizer("hello world", add_special_tokens=False).input_ids or [5]
    result = decode(m, loaded.special, [prompt], DecodeSettings(gen_length=16, block_length=8))
    assert max(max(t) for t in result.tokens) < real
