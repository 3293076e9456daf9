"""The shipped models keep their held-out accuracy: a floor per model on a small fixed set.

Each floor sits a few points under the accuracy measured when the weights were shipped, on the
first PROBLEMS held-out problems, 0-shot. Retrained weights that do better: raise the floor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dllm_cli.models.loading import load_tokenizer, resolve_path
from dllm_cli.tinygsm.batches import Encoder
from dllm_cli.tinygsm.quickeval import eval_ar

PROBLEMS = 24
# measured: tiny-gsm 10/24 = 0.417 (dual cache, threshold 0.9, early stop, gen 96, no guide);
# tiny-gsm-ar 22/24 = 0.917 (greedy, 96 new tokens)
FLOORS = {"tiny-gsm": 0.35, "tiny-gsm-ar": 0.85}

SHIPPED = Path(__file__).resolve().parent.parent / "dllm_cli" / "tinygsm" / "weights"
needs_shipped = pytest.mark.skipif(
    not all((SHIPPED / name / "model.safetensors").is_file() for name in FLOORS),
    reason="the shipped TinyGSM weights are not in this checkout",
)


@pytest.mark.slow
@needs_shipped
def test_shipped_diffusion_model_stays_above_its_floor():
    """Through `dllm eval` as a user runs it: the default profile's fast settings, no guide."""
    from typer.testing import CliRunner

    from dllm_cli.cli import app

    args = ["--n", str(PROBLEMS), "--shots", "0", "--batch-size", str(PROBLEMS), "--no-guide"]
    args += ["--gen-length", "96", "--device", "cpu", "--no-warmup", "--json"]
    result = CliRunner().invoke(app, ["eval", "-p", "tiny-gsm", *args])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["n"] == PROBLEMS and report["mask_violations"] == 0
    assert report["settings"]["cache"] == "dual" and report["settings"]["early_stop"]
    assert report["accuracy"] >= FLOORS["tiny-gsm"], report["correct"]


@pytest.mark.slow
@needs_shipped
def test_shipped_guide_stays_above_its_floor():
    """The AR guide alone, greedy, as training measures it."""
    folder = resolve_path("builtin:tiny-gsm-ar")
    guide = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.inference_mode():
        accuracy = eval_ar(guide, Encoder(load_tokenizer(folder)), n=PROBLEMS, shots=0)
    assert accuracy >= FLOORS["tiny-gsm-ar"], accuracy
