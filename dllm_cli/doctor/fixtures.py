"""The tiny folders and prompts every correctness check decodes, and one way to decode them.

Decoding goes through the public entry points only (`Decoder(...).run(prompts).result()`,
the engine, `GuidedCommitter`), as `dllm generate` does, so the checks keep meaning the
same thing whatever happens inside the engine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from dllm_cli.decoding import Decoder, GuidedCommitter
from dllm_cli.decoding.guided import GuideRules
from dllm_cli.doctor.folders import write_diffusion, write_guide
from dllm_cli.models.guide import GuideModel, load_guide
from dllm_cli.models.loading import LoadedModel, load_model
from dllm_cli.settings import DecodeSettings
from dllm_cli.throughput import ordinary_ids

KINDS = ("llada", "dream")
GEN, BLOCK = 16, 4  # four blocks of four: every policy refreshes, caches and moves on
PROMPT_LENGTHS = (5, 9, 12, 3)  # left padding differs per row
THRESHOLD = 0.6  # low enough that the tiny models commit several tokens in some steps


@dataclass(frozen=True)
class Fixture:
    """One family's tiny diffusion folder, its guide folder and the prompts to decode."""

    kind: str
    folder: Path
    guide: Path
    prompts: tuple[tuple[int, ...], ...]

    def load(self, device: str, dtype: str = "float32") -> LoadedModel:
        return load_model(self.folder, dtype=dtype, device=device)

    def load_guide(self, loaded: LoadedModel) -> GuideModel:
        return load_guide(self.guide, loaded)

    @property
    def batch(self) -> list[list[int]]:
        return [list(p) for p in self.prompts]


def make_fixtures(root: Path) -> dict[str, Fixture]:
    """Write both families' folders under `root` and draw their prompts (seeded)."""
    out = {}
    for seed, kind in enumerate(KINDS):
        folder = write_diffusion(root / kind, kind, seed=seed)
        guide = write_guide(root / f"{kind}-guide", folder, seed=seed + 10)
        words = ordinary_ids(load_model(folder, dtype="float32", device="cpu"))
        rng = random.Random(seed)
        prompts = tuple(tuple(rng.choice(words) for _ in range(n)) for n in PROMPT_LENGTHS)
        out[kind] = Fixture(kind, folder, guide, prompts)
    return out


def settings(cache: str, unmask: str, early_stop: bool, **extra) -> DecodeSettings:
    """The checks' settings: GEN tokens in blocks of BLOCK, greedy."""
    rule = {"cache": cache, "unmask": unmask, "early_stop": early_stop, "threshold": THRESHOLD}
    return DecodeSettings(gen_length=GEN, block_length=BLOCK, **rule, **extra)


def committer(loaded: LoadedModel, guide: GuideModel, accept: str) -> GuidedCommitter:
    """A guided committer as `Runtime.committer` builds one (rule `exact` or `topk:K`)."""
    kind, _, arg = accept.partition(":")
    vocab = loaded.special.real_vocab(loaded.model.vocab_size)
    rules = GuideRules(kind, float(arg) if arg else None)
    return GuidedCommitter(guide.model, vocab, loaded.special, rules)


def decode(
    loaded: LoadedModel, s: DecodeSettings, prompts: list[list[int]], guided=None
) -> list[list[int]]:
    """Answer tokens (gen_length per prompt) of one decode of `prompts` together."""
    return Decoder(loaded.model, loaded.special, s, guided).run(prompts).result().tokens


def first_difference(a: list[list[int]], b: list[list[int]]) -> str | None:
    """Where two decodes first differ ("row 1, answer position 3: 17 vs 20"), or None."""
    for r, (x, y) in enumerate(zip(a, b, strict=True)):
        for p, (s, t) in enumerate(zip(x, y, strict=True)):
            if s != t:
                return f"row {r}, answer position {p}: {s} vs {t}"
    return None


def masks_left(loaded: LoadedModel, rows: list[list[int]]) -> int:
    """Mask tokens in finished answers (always 0 for a correct decoder)."""
    return sum(row.count(loaded.special.mask) for row in rows)
