"""Per-request decoding settings (the "sampling params" of this tool), validated in one place."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from dllm_cli.errors import SettingsError

CACHES = ("none", "prefix", "dual", "freecache")
UNMASKS = ("fixed", "threshold", "factor", "origin")
CONFIDENCES = ("low_confidence", "random", "margin", "entropy")


@dataclass
class DecodeSettings:
    """How to turn a canvas of masks into text; every field has a validated range."""

    gen_length: int = 256
    block_length: int = 32
    steps: int | None = None  # None: one token per step (steps = gen_length)
    cache: str = "none"  # none | prefix | dual | freecache
    refresh_interval: int = 0  # dual/prefix: extra full refresh every N steps in a block (0: off)
    unmask: str = "fixed"  # fixed | threshold | factor | origin
    confidence: str = "low_confidence"  # low_confidence | random | margin | entropy
    threshold: float = 0.9
    factor: float = 1.0
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    cfg_scale: float = 0.0
    seed: int = 0
    early_stop: bool = False
    eps: float = 1e-3  # Dream's final timestep
    alg_temp: float = 0.0  # Dream: sample positions with softmax(conf / alg_temp) when > 0

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def to_dict(self) -> dict:
        return asdict(self)

    def validate(self) -> DecodeSettings:
        """Raise SettingsError with a one-line reason for any out-of-range value."""

        def bad(msg: str) -> None:
            raise SettingsError(msg)

        if self.gen_length < 1:
            bad(f"gen_length must be >= 1 (got {self.gen_length})")
        if self.block_length < 1:
            bad(f"block_length must be >= 1 (got {self.block_length})")
        if self.steps is not None and self.steps < 1:
            bad(f"steps must be >= 1 (got {self.steps})")
        if self.cache not in CACHES:
            bad(f"cache must be one of {', '.join(CACHES)} (got {self.cache!r})")
        if self.unmask not in UNMASKS:
            bad(f"unmask must be one of {', '.join(UNMASKS)} (got {self.unmask!r})")
        if self.confidence not in CONFIDENCES:
            bad(f"confidence must be one of {', '.join(CONFIDENCES)} (got {self.confidence!r})")
        if not 0.0 < self.threshold <= 1.0 and self.unmask == "threshold":
            bad(f"threshold must be in (0, 1] (got {self.threshold})")
        if self.factor <= 0:
            bad(f"factor must be > 0 (got {self.factor})")
        if self.temperature < 0:
            bad(f"temperature must be >= 0 (got {self.temperature})")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k is not None and self.top_k < 1:
            bad(f"top_k must be >= 1 (got {self.top_k})")
        if self.cfg_scale < 0:
            bad(f"cfg_scale must be >= 0 (got {self.cfg_scale})")
        if self.refresh_interval < 0:
            bad(f"refresh_interval must be >= 0 (got {self.refresh_interval})")
        if not 0.0 < self.eps < 1.0:
            bad(f"eps must be in (0, 1) (got {self.eps})")
        return self
