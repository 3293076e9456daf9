"""Shared fixtures: tiny checkpoints in the real formats, written and loaded once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# Tiny models: one thread is faster than several, and immune to other processes on the cores.
torch.set_num_threads(1)

# Tests import the checkout's package even when it is not pip-installed.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from checkpoints import Written, write_dream, write_llada  # noqa: E402

from dllm_cli.models.loading import LoadedModel, load_model  # noqa: E402


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Each test starts on the suite's one thread, whatever the test before it set (--threads,
    a profile's `threads`): under xdist the order varies, and numbers that hold on one thread
    need not hold on two (int8 DiffusionGemma rows of one length differ from their single runs
    at two threads on this CPU)."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def llada_ckpt(tmp_path_factory) -> Written:
    return write_llada(tmp_path_factory.mktemp("ckpt") / "llada")


@pytest.fixture(scope="session")
def dream_ckpt(tmp_path_factory) -> Written:
    return write_dream(tmp_path_factory.mktemp("ckpt") / "dream")


@pytest.fixture(scope="session")
def llada(llada_ckpt) -> LoadedModel:
    return load_model(llada_ckpt.folder, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def dream(dream_ckpt) -> LoadedModel:
    return load_model(dream_ckpt.folder, dtype="float32", device="cpu")


@pytest.fixture(params=["llada", "dream"])
def loaded(request) -> LoadedModel:
    """Each architecture in turn, float32 on CPU."""
    return request.getfixturevalue(request.param)
