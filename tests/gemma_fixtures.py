"""Shared DiffusionGemma test helpers: the tiny folder (written once), the loaded model, prompts.

Test modules import the fixtures by their function names (`*_fixture`, noqa F401).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from checkpoints import Written
from gemma_checkpoint import CANVAS, write_gemma

from dllm_cli.models.loading import LoadedModel, load_model
from dllm_cli.settings import DecodeSettings

TEXTS = ["how many apples", "tom has 3 pens and 4 books", "hi", "what is 2 + 2 ?"]
# Rows settle at different steps with these (stability 0: the verdict is the entropy test).
SETTLING = {"stability_threshold": 0, "confidence_threshold": 5.0}


@pytest.fixture(scope="session", name="gemma_ckpt")
def gemma_ckpt_fixture(tmp_path_factory) -> Written:
    return write_gemma(tmp_path_factory.mktemp("ckpt") / "gemma")


@pytest.fixture(scope="session", name="gemma")
def gemma_fixture(gemma_ckpt) -> LoadedModel:
    return load_model(gemma_ckpt.folder, dtype="float32", device="cpu")


def encode(loaded: LoadedModel, text: str) -> list[int]:
    """A prompt in the chat template, as the runtime encodes it."""
    tok = loaded.tokenizer
    chat = [{"role": "user", "content": text}]
    return tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
               add_special_tokens=False).input_ids  # fmt: skip


def gemma_settings(**kw) -> DecodeSettings:
    """Two canvases (the second cut at gen_length), few steps: fast on CPU."""
    return DecodeSettings(**{"gen_length": 24, "steps": 5, "block_length": CANVAS} | kw)


def gemma_profile(folder: Path, decode: str = "", extra: str = "") -> str:
    """A profile for the tiny folder (no architecture key: the family comes from config.json)."""
    return textwrap.dedent(
        f"""\
        name = "tiny-gemma"
        description = "tiny random DiffusionGemma"

        [model]
        path = "{folder}"
        dtype = "float32"
        device = "cpu"

        [decode]
        gen_length = 24
        steps = 5
        early_stop = true
        {decode}
        """
    ) + textwrap.dedent(extra)


@pytest.fixture(name="gemma_profile_file")
def gemma_profile_file_fixture(tmp_path, gemma_ckpt) -> Path:
    path = tmp_path / "tiny-gemma.toml"
    path.write_text(gemma_profile(gemma_ckpt.folder))
    return path
