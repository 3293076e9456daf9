"""The shipped models keep their held-out accuracy: a floor per model on a small fixed set.

Each floor sits a few points under the accuracy measured when the weights were shipped, on the
first PROBLEMS held-out problems, 0-shot. Retrained weights that do better: raise the floor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllm_cli.profiles import DEFAULT_PROFILE

PROBLEMS = 24
# measured when shipped (0-shot, gen 96, 24 problems, batch 24): unguided with the profile's
# dual cache, threshold 0.9 and early stop, tiny-gsm 10/24 = 0.417, tiny-gsm-dream 16/24 =
# 0.667; the default profile (tiny-gsm-dream guided by tiny-gsm-ar, exact) 24/24 (the guide
# alone: recipes/tinygsm/tests/test_shipped_guide.py)
FLOORS = {"tiny-gsm": 0.35, "tiny-gsm-dream": 0.58, "default": 0.9}
MODELS = ("tiny-gsm", "tiny-gsm-ar", "tiny-gsm-dream")

SHIPPED = Path(__file__).resolve().parent.parent / "dllm_cli" / "tinygsm" / "weights"
needs_shipped = pytest.mark.skipif(
    not all((SHIPPED / name / "model.safetensors").is_file() for name in MODELS),
    reason="the shipped TinyGSM weights are not in this checkout",
)


def eval_report(profile: str, *extra: str) -> dict:
    """`dllm eval` as a user runs it, on the first PROBLEMS held-out problems, 0-shot."""
    from typer.testing import CliRunner

    from dllm_cli.cli import app

    args = ["--n", str(PROBLEMS), "--shots", "0", "--batch-size", str(PROBLEMS), *extra]
    args += ["--gen-length", "96", "--device", "cpu", "--no-warmup", "--json"]
    result = CliRunner().invoke(app, ["eval", "-p", profile, *args])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["n"] == PROBLEMS and report["mask_violations"] == 0
    return report


@pytest.mark.slow
@needs_shipped
@pytest.mark.parametrize("profile", ["tiny-gsm", "tiny-gsm-dream"])
def test_shipped_diffusion_model_stays_above_its_floor(profile):
    """Each diffusion model with dual cache, threshold 0.9 and early stop, no guide."""
    rule = (
        "--unmask",
        "threshold",
        "--threshold",
        "0.9",
    )  # the floors' rule, whatever the profile's
    report = eval_report(profile, "--no-guide", "--cache", "dual", *rule)
    assert report["settings"]["cache"] == "dual" and report["settings"]["early_stop"]
    assert report["accuracy"] >= FLOORS[profile], report["correct"]


@pytest.mark.slow
@needs_shipped
def test_default_profile_stays_above_its_floor():
    """The default profile as the README's first command runs it (guide included)."""
    report = eval_report(DEFAULT_PROFILE)
    assert report["accuracy"] >= FLOORS["default"], report["correct"]
