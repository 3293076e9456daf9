"""The family matrix's rows: one tiny random folder per model family (written once a session),
the rows parametrised from families.py's FAMILIES (plus LLaDA2.1's token editing, a settings
variant of the llada2 row), and what the family table says about a setting's value.

A family row without a writer here fails every cell of its row loudly: a new family cannot
join the table without a tiny folder that proves every feature on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest
from block_checkpoints import write_llada2, write_sdar
from checkpoints import Written, write_dream, write_llada, write_llada_moe
from gemma_checkpoint import write_gemma

from dllm_cli.families import FAMILIES
from dllm_cli.family_settings import refusal

GEN = 16  # tokens per answer: one or two blocks on every family, a canvas on DiffusionGemma
PROMPTS = ("how many apples", "tom has 3 pens and 4 books", "what is 2 + 2 ?")

# family name -> writer of its tiny random folder (seeds chosen so greedy answers are words)
WRITERS: dict[str, Callable[[Path], Written]] = {
    "llada": partial(write_llada, seed=1),
    "dream": write_dream,
    "llada_moe": write_llada_moe,
    "diffusion_gemma": write_gemma,
    "sdar": write_sdar,
    "llada2": write_llada2,
}
# tests/checkpoints.py's word-level tokenizers (LLaDA2.x's folder takes LLaDA-MoE's): every
# token decodes with a leading space
WORD_LEVEL = ("llada", "llada_moe", "llada2")
EDITING = {"edit_threshold": 0.0, "threshold": 0.5, "max_post_steps": 2}


@dataclass(frozen=True)
class Row:
    """One matrix row: a family's folder and the settings every cell of the row adds."""

    name: str  # the test id
    family: str  # FAMILIES key
    settings: dict[str, object] = field(default_factory=dict)

    def flags(self) -> list[str]:
        """The row's settings as CLI flags."""
        return [f for k, v in self.settings.items() for f in (f"--{k.replace('_', '-')}", str(v))]


ROWS = [Row(name, name) for name in FAMILIES] + [Row("llada2.1-editing", "llada2", EDITING)]
ROW_IDS = [row.name for row in ROWS]


def folder_for(tmp_path_factory, cache: dict[str, Path], family: str) -> Path:
    """The family's tiny folder, written on first use."""
    if family not in cache:
        if family not in WRITERS:
            pytest.fail(f"family {family!r} has no tiny-folder writer in tests/family_matrix.py")
        cache[family] = WRITERS[family](tmp_path_factory.mktemp("matrix") / family).folder
    return cache[family]


@pytest.fixture(scope="session", name="matrix_folders")
def matrix_folders_fixture() -> dict[str, Path]:
    """family -> folder, filled as rows ask (one folder per family a session)."""
    return {}


@pytest.fixture(scope="session", name="row", params=ROWS, ids=ROW_IDS)
def row_fixture(request) -> Row:
    return request.param


@pytest.fixture(scope="session", name="folder")
def folder_fixture(row, matrix_folders, tmp_path_factory) -> Path:
    return folder_for(tmp_path_factory, matrix_folders, row.family)


def model_args(row: Row, folder: Path) -> list[str]:
    """`--model FOLDER` (the family's reference settings), GEN tokens, the row's settings."""
    return ["--model", str(folder), "--gen-length", str(GEN), *row.flags()]


def expected_refusal(row: Row, key: str, value: object) -> str | None:
    """Why the row's family table refuses `key` = `value` (None: it decodes with it)."""
    return refusal(FAMILIES[row.family], key, value)
