"""Per-request decoding settings (the "sampling params" of this tool), validated in one place:
when they are built. A DecodeSettings is immutable and valid by construction, so the code that
receives one (the decoder, the benchmark) never checks it again; change one with
`dataclasses.replace`, which builds (and validates) a new one.

How the numbers combine (`split_blocks` below; `adjustments()` says it in words):
- The answer is cut into blocks of `block_length` decoded left to right (LLaDA's semi-
  autoregressive remasking). A `block_length` above `gen_length` means one block; when
  `gen_length` is not a multiple of `block_length`, the last block is shorter.
- `steps` is split over the blocks as LLaDA splits tokens over steps: every block gets
  `steps // blocks`, the first `steps % blocks` blocks one more, and no block gets more steps
  than it has tokens (extra steps would commit nothing). `steps=None` is one token per step.
  So LLaDA's divisible settings behave exactly as in its reference code, and other settings
  are adjusted rather than refused, except `steps` below the number of blocks (an error).
- `steps` means one thing everywhere: steps over the whole answer, split over its blocks as
  above. On the masked families it drives the `fixed` and `origin` schedules only;
  `threshold`, `factor`, `eb`, `klass` and `wino` commit by confidence and run each block
  until it has no masks left (`wino` at most block_length steps: see decoding/wino.py). On
  SDAR and LLaDA2.x a block's share is the references' own per-block `steps`: exactly the
  tokens each step commits under `fixed`, the least it commits under `threshold`
  (decoding/block_rules.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dllm_cli.errors import SettingsError

CACHES = ("none", "prefix", "dual", "freecache")
UNMASKS = ("fixed", "threshold", "factor", "origin", "eb", "klass", "wino", "prefix", "credit")
CONFIDENCES = ("low_confidence", "random", "margin", "entropy")
SCHEDULES = ("family", "linear", "dream")
STEP_RULES = ("fixed", "origin")  # the unmask rules that follow a step schedule
BATCHINGS = ("continuous", "static")  # batch mode: refill finished slots, or whole batches
ON_REJECT = ("guide", "draft")  # guided decoding: whose token a rejection commits
# Threshold and factor compare a confidence with a probability; negative entropy is not one.
PROBABILITY_CONFIDENCES = ("low_confidence", "random", "margin")

# Beyond these, float32 logits over- or underflow to inf/NaN (a temperature of 1e300 drafted
# nothing but [MASK] and never ended; 1e-40 or a cfg_scale of 1e300 drafted token 0 throughout),
# and sampling is greedy or uniform long before.
TEMPERATURE_RANGE = (1e-6, 1e6)
MAX_CFG_SCALE = 100.0

INT_FIELDS = (
    "gen_length", "block_length", "refresh_interval", "suffix_window", "seed", "kl_history",
    "max_post_steps",
)  # fmt: skip
FLOAT_FIELDS = (
    "threshold", "factor", "temperature", "cfg_scale", "eps", "alg_temp", "eb_gamma",
    "kl_threshold", "wino_verify", "jump_threshold", "credit_alpha", "credit_boost",
    "credit_decay",
)  # fmt: skip
# DiffusionGemma's own knobs (transformers' generation config names); None: the checkpoint's value.
GEMMA_FIELDS = ("t_min", "t_max", "entropy_bound", "stability_threshold", "confidence_threshold")


@dataclass(frozen=True)
class DecodeSettings:
    """How to turn a canvas of masks into text; every field has a validated range."""

    gen_length: int = 256
    block_length: int = 32
    steps: int | None = None  # None: one token per step (steps = gen_length)
    cache: str = "none"  # none | prefix | dual | freecache
    refresh_interval: int = 0  # cached policies: extra full refresh every N steps in a block
    suffix_window: int = 0  # keep only W canvas columns past the current block (0: off; DPad)
    unmask: str = (
        "fixed"  # fixed | threshold | factor | origin | eb | klass | wino | prefix | credit
    )
    schedule: str = "family"  # fixed rule's tokens per step: family | linear (LLaDA) | dream
    confidence: str = "low_confidence"  # low_confidence | random | margin | entropy
    threshold: float = 0.9
    factor: float = 1.0
    eb_gamma: float = 0.1  # eb (EB-Sampler): entropy budget of one step's commits, >= 0
    kl_threshold: float = 0.01  # klass: a mask is stable while its step-to-step KL is below
    kl_history: int = 2  # klass: ... for this many consecutive steps
    wino_verify: float = 0.9  # wino: earlier commits whose shadow probability falls below go back
    jump_threshold: float = 1.0  # prefix: masks past the left run committed above this (1: none)
    credit_alpha: float = 0.7  # credit (dInfer): weight of log(1 + credit) added to the logits
    credit_boost: float = 0.2  # credit: a step's top-1 token gains its probability ** this
    credit_decay: float = 0.8  # credit: credits are multiplied by this each step
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None  # None: the family's default (families.py); 0: no top-k
    cfg_scale: float = 0.0
    seed: int = 0
    early_stop: bool = False
    batching: str = "continuous"  # batch mode: continuous (refill slots) | static (whole batches)
    eps: float = 1e-3  # Dream's final timestep
    alg_temp: float = 0.0  # Dream: sample positions with softmax(conf / alg_temp) when > 0
    t_min: float | None = None  # DiffusionGemma: temperature at the last denoising step
    t_max: float | None = None  # DiffusionGemma: temperature at the first denoising step
    entropy_bound: float | None = None  # DiffusionGemma: entropy budget of accepted tokens
    stability_threshold: int | None = None  # DiffusionGemma: steps the draft must hold still
    confidence_threshold: float | None = None  # DiffusionGemma: mean entropy to stop below
    edit_threshold: float | None = None  # LLaDA2.1 T2T: replace committed tokens above this p
    max_post_steps: int = 16  # LLaDA2.1: editing steps a block may take after its last mask

    def __post_init__(self) -> None:
        self.validate()

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def num_blocks(self) -> int:
        """Blocks the answer is cut into (the last one may be shorter)."""
        return math.ceil(self.gen_length / min(self.block_length, self.gen_length))

    @property
    def total_steps(self) -> int:
        """Steps the schedule plans: `steps` (None: one token per step) under fixed and origin;
        threshold and factor commit by confidence, so `steps` does not apply to them."""
        if self.steps is None or self.unmask not in STEP_RULES:
            return self.gen_length
        return self.steps

    def block_plan(self) -> list[tuple[int, int]]:
        """(tokens, steps) per block: see `split_blocks`."""
        return split_blocks(self.gen_length, self.block_length, self.total_steps)

    def adjustments(self) -> list[str]:
        """How the decoder adapts blocks and steps that do not divide (empty when they do)."""
        notes = []
        size = min(self.block_length, self.gen_length)
        if self.block_length > self.gen_length:
            notes.append(f"block_length {self.block_length} > gen_length: one block of {size}")
        if self.gen_length % size:
            notes.append(f"the last block has {self.gen_length % size} tokens, not {size}")
        n, steps = self.num_blocks, self.total_steps
        if self.unmask not in STEP_RULES:  # confidence rules: no step plan to explain
            return notes
        if steps % n:
            base, extra = divmod(steps, n)
            notes.append(
                f"steps {steps} over {n} blocks: {base + 1} for the first {extra}, {base} after"
            )
        planned = sum(k for _, k in self.block_plan())
        if planned < steps:
            notes.append(f"{planned} steps, not {steps}: no block takes more steps than tokens")
        return notes

    def validate(self) -> DecodeSettings:
        """Raise SettingsError with a one-line reason for any out-of-range value."""
        self._check_types()
        self._check_ranges()
        self._check_combinations()
        return self

    def _check_types(self) -> None:
        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in INT_FIELDS:
            if not is_int(getattr(self, name)):
                _bad(f"{name} must be an integer (got {getattr(self, name)!r})")
        for name in ("steps", "top_k"):
            value = getattr(self, name)
            if value is not None and not is_int(value):
                _bad(f"{name} must be an integer or unset (got {value!r})")
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                _bad(f"{name} must be a number (got {value!r})")
            if not math.isfinite(value):
                _bad(f"{name} must be finite (got {value!r})")
        if self.top_p is not None and (
            isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float)
        ):
            _bad(f"top_p must be a number or unset (got {self.top_p!r})")
        for name in GEMMA_FIELDS:
            value = getattr(self, name)
            wanted = int if name == "stability_threshold" else int | float
            if value is not None and (isinstance(value, bool) or not isinstance(value, wanted)):
                _bad(f"{name} must be {'an integer' if wanted is int else 'a number'} or unset")
            if isinstance(value, float) and not math.isfinite(value):
                _bad(f"{name} must be finite (got {value!r})")
        if not isinstance(self.early_stop, bool):
            _bad(f"early_stop must be true or false (got {self.early_stop!r})")
        for name, choices in (
            ("cache", CACHES),
            ("unmask", UNMASKS),
            ("confidence", CONFIDENCES),
            ("schedule", SCHEDULES),
            ("batching", BATCHINGS),
        ):
            if getattr(self, name) not in choices:
                got = getattr(self, name)
                _bad(f"{name} must be one of {', '.join(choices)} (got {got!r})")

    def _check_ranges(self) -> None:
        if self.gen_length < 1:
            _bad(f"gen_length must be >= 1 (got {self.gen_length})")
        if self.block_length < 1:
            _bad(f"block_length must be >= 1 (got {self.block_length})")
        if self.steps is not None and self.steps < 1:
            _bad(f"steps must be >= 1 (got {self.steps})")
        if self.unmask in ("threshold", "credit") and not 0.0 < self.threshold <= 1.0:
            _bad(f"threshold must be in (0, 1] (got {self.threshold})")
        if self.kl_threshold <= 0:
            _bad(f"kl_threshold must be > 0 (got {self.kl_threshold})")
        if self.kl_history < 1:
            _bad(f"kl_history must be >= 1 (got {self.kl_history})")
        if self.unmask == "klass" and not 0.0 <= self.threshold < 1.0:
            _bad(f"klass commits confidences above threshold, in [0, 1) (got {self.threshold})")
        if self.unmask == "wino" and not 0.0 <= self.threshold < 1.0:
            _bad(f"wino drafts confidences above threshold, in [0, 1) (got {self.threshold})")
        if self.unmask == "prefix" and not 0.0 <= self.threshold < 1.0:
            _bad(f"prefix commits confidences above threshold, in [0, 1) (got {self.threshold})")
        if not 0.0 <= self.threshold <= 1.0:  # a rule that ignores it too
            _bad(f"threshold must be in [0, 1] (got {self.threshold})")
        if not 0.0 <= self.jump_threshold <= 1.0:
            _bad(f"jump_threshold must be in [0, 1] (got {self.jump_threshold})")
        if not 0.0 <= self.wino_verify <= 1.0:
            _bad(f"wino_verify must be in [0, 1] (got {self.wino_verify})")
        if self.credit_alpha < 0:
            _bad(f"credit_alpha must be >= 0 (got {self.credit_alpha})")
        if self.credit_boost < 0:
            _bad(f"credit_boost must be >= 0 (got {self.credit_boost})")
        if not 0.0 <= self.credit_decay <= 1.0:
            _bad(f"credit_decay must be in [0, 1] (got {self.credit_decay})")
        if self.eb_gamma < 0:
            _bad(f"eb_gamma must be >= 0 (got {self.eb_gamma})")
        if self.factor <= 0:
            _bad(f"factor must be > 0 (got {self.factor})")
        low, high = TEMPERATURE_RANGE
        if self.temperature != 0 and not low <= self.temperature <= high:
            _bad(
                f"temperature must be 0 (greedy) or in [{low:g}, {high:g}] (got {self.temperature})"
            )
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            _bad(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k is not None and self.top_k < 0:
            _bad(f"top_k must be >= 0 (0 turns it off; got {self.top_k})")
        if not 0 <= self.cfg_scale <= MAX_CFG_SCALE:
            _bad(f"cfg_scale must be in [0, {MAX_CFG_SCALE:g}] (got {self.cfg_scale})")
        if self.refresh_interval < 0:
            _bad(f"refresh_interval must be >= 0 (0 turns it off; got {self.refresh_interval})")
        if self.suffix_window < 0:
            _bad(f"suffix_window must be >= 0 (0 turns it off; got {self.suffix_window})")
        if not 0.0 < self.eps < 1.0:
            _bad(f"eps must be in (0, 1) (got {self.eps})")
        if self.alg_temp < 0:
            _bad(f"alg_temp must be >= 0 (got {self.alg_temp})")
        if self.seed < 0 or self.seed >= 2**63:
            _bad(f"seed must be in [0, 2**63) (got {self.seed})")
        if self.edit_threshold is not None and not (
            not isinstance(self.edit_threshold, bool)
            and isinstance(self.edit_threshold, int | float)
            and 0.0 <= self.edit_threshold < 1.0
        ):
            _bad(f"edit_threshold must be in [0, 1) or unset (got {self.edit_threshold!r})")
        if self.max_post_steps < 0:
            _bad(f"max_post_steps must be >= 0 (got {self.max_post_steps})")
        self._check_gemma_ranges()

    def _check_gemma_ranges(self) -> None:
        """The ranges transformers' DiffusionGemmaGenerationConfig.validate accepts."""
        if self.t_min is not None and self.t_min < 0:
            _bad(f"t_min must be >= 0 (got {self.t_min})")
        if self.t_max is not None and self.t_max < 0:
            _bad(f"t_max must be >= 0 (got {self.t_max})")
        if self.t_min is not None and self.t_max is not None and self.t_max <= self.t_min:
            _bad(f"t_max must be above t_min (got t_max {self.t_max}, t_min {self.t_min})")
        if self.entropy_bound is not None and self.entropy_bound <= 0:
            _bad(f"entropy_bound must be > 0 (got {self.entropy_bound})")
        if self.stability_threshold is not None and self.stability_threshold < 0:
            _bad(f"stability_threshold must be >= 0 (got {self.stability_threshold})")
        if self.confidence_threshold is not None and self.confidence_threshold <= 0:
            _bad(f"confidence_threshold must be > 0 (got {self.confidence_threshold})")

    def _check_combinations(self) -> None:
        if self.unmask == "wino" and self.cfg_scale > 0:
            _bad(
                "unmask=wino does not combine with cfg_scale > 0: its shadow block verifies "
                "against one (conditional) forward; use cfg_scale 0 or another rule"
            )
        if self.unmask in STEP_RULES and self.total_steps < self.num_blocks:
            _bad(
                f"steps ({self.total_steps}) is fewer than the number of blocks "
                f"({self.num_blocks} = ceil(gen_length {self.gen_length} / block_length "
                f"{self.block_length})): every block needs at least one step; use steps >= "
                f"{self.num_blocks} or a longer block_length"
            )
        if (
            self.unmask in ("threshold", "factor", "klass", "wino", "prefix", "credit")
            and self.confidence not in PROBABILITY_CONFIDENCES
        ):
            _bad(
                f"unmask={self.unmask} compares confidences with a probability, which "
                f"confidence={self.confidence} is not (use {', '.join(PROBABILITY_CONFIDENCES)})"
            )


def split_blocks(gen_length: int, block_length: int, steps: int) -> list[tuple[int, int]]:
    """(tokens, steps) per block, left to right.

    Blocks of `block_length` (one block when it exceeds gen_length; the last may be shorter).
    Steps are split as LLaDA splits tokens over steps: `steps // n` each, the first
    `steps % n` blocks one more, capped at the block's own length (more would commit nothing).
    """
    size = min(block_length, gen_length)
    n = -(-gen_length // size)
    base, extra = divmod(steps, n)
    lengths = [min(size, gen_length - b * size) for b in range(n)]
    return [(length, min(base + (b < extra), length)) for b, length in enumerate(lengths)]


def parse_accept(accept: str) -> tuple[str, float | None]:
    """A guide's acceptance rule: ("exact", None), ("topk", K) or ("prob", P)."""
    kind, _, arg = accept.partition(":")
    try:
        if kind == "exact" and not arg:
            return "exact", None
        if kind == "topk" and int(arg) >= 1:
            return "topk", int(arg)
        if kind == "prob" and 0.0 < float(arg) <= 1.0:
            return "prob", float(arg)
    except ValueError:
        pass
    raise SettingsError(
        f"accept must be 'exact', 'topk:K' (K >= 1) or 'prob:P' (0 < P <= 1) (got {accept!r})"
    )


def guide_problem(accept: str, on_reject: str, verify_chunk: int, draft_window: int) -> str | None:
    """Why these guided-decoding settings cannot run (one line), or None."""
    try:
        parse_accept(accept)
    except SettingsError as e:
        return str(e)
    if on_reject not in ON_REJECT:
        return f"on_reject must be one of {', '.join(ON_REJECT)} (got {on_reject!r})"
    if verify_chunk < 1:
        return f"verify_chunk must be >= 1 (got {verify_chunk})"
    if draft_window < 0:
        return f"draft_window must be >= 0 (0: to the canvas end; got {draft_window})"
    return None


def _bad(msg: str) -> None:
    raise SettingsError(msg)
