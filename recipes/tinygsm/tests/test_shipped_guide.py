"""The shipped AR guide alone keeps its held-out accuracy, measured as training measures it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dllm_cli.models.loading import load_tokenizer, resolve_path
from recipes.tinygsm.batches import Encoder
from recipes.tinygsm.quickeval import eval_ar

PROBLEMS = 24
FLOOR = 0.9  # measured when shipped: 24/24 (greedy, 96 new tokens, 0-shot, the first 24)
SHIPPED = Path(__file__).resolve().parents[3] / "dllm_cli" / "tinygsm" / "weights"


@pytest.mark.slow
@pytest.mark.skipif(
    not (SHIPPED / "tiny-gsm-ar" / "model.safetensors").is_file(),
    reason="the shipped TinyGSM weights are not in this checkout",
)
def test_shipped_guide_stays_above_its_floor():
    folder = resolve_path("builtin:tiny-gsm-ar")
    guide = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.inference_mode():
        accuracy = eval_ar(guide, Encoder(load_tokenizer(folder)), n=PROBLEMS, shots=0)
    assert accuracy >= FLOOR, accuracy
