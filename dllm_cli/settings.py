"""Per-request decoding settings (the "sampling params" of this tool), validated in one place:
when they are built. A DecodeSettings is immutable and valid by construction, so the code that
receives one (the decoder, the benchmark) never checks it again; change one with
`dataclasses.replace`, which builds (and validates) a new one. Each field is declared once,
with `setting(default, ...)` (setting_spec.py): its flag's help, lifetime, choices, ranges, the
unmask rules that read it and the decoders that refuse it; the CLI flags, `LIFETIMES`, the
families' refusals and the server's fields are made from these declarations.

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
  above, and a step's share of its block is the family's schedule (LLaDA's even split, Dream's
  timesteps; on SDAR and LLaDA2.x the references' own per-block `steps`). `fixed` and `origin`
  commit exactly that share; `threshold` commits at least it (the masks past the threshold
  when at least that many pass, else the most confident: decoding/ranking.confident_columns),
  so `steps` None is one token a step at least, Fast-dLLM's rule. `factor`, `eb`, `klass`,
  `wino`, `prefix` and `credit` commit by confidence and run each block until it has no masks
  left (`wino` at most block_length steps: see decoding/wino.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dllm_cli import setting_spec as spec
from dllm_cli.setting_spec import RULES, STEP_RULES, UNMASKS, Lifetime, Range, setting

CACHES = ("none", "prefix", "dual", "freecache")
CONFIDENCES = ("low_confidence", "random", "margin", "entropy")
SCHEDULES = ("family", "linear", "dream")
BATCHINGS = ("continuous", "static")  # batch mode: refill finished slots, or whole batches
ON_REJECT = ("guide", "draft")  # guided decoding: whose token a rejection commits

OFF_AT_0 = Range(0, note="0 turns it off")
# Beyond these, float32 logits over- or underflow to inf/NaN (a temperature of 1e300 drafted
# nothing but [MASK] and never ended; 1e-40 or a cfg_scale of 1e300 drafted token 0 throughout),
# and sampling is greedy or uniform long before.
TEMPERATURE_RANGE = Range(1e-6, 1e6, off="greedy")
MAX_CFG_SCALE = 100.0


def rule_param(rule: str, default: float, range: Range, help: str) -> Any:
    """A parameter of one unmask rule (DiffusionGemma has none: it refuses every one)."""
    return setting(default, help=help, range=range, rules=(rule,), refused=spec.RULE_ONLY)


def gemma_knob(help: str, range: Range) -> Any:
    """A DiffusionGemma knob (transformers' name), unset: the checkpoint's own value."""
    kind = {"panel": spec.GEMMA, "lifetime": Lifetime.GEMMA, "refused": spec.GEMMA_ONLY}
    return setting(None, help=help, range=range, **kind)


@dataclass(frozen=True)
class DecodeSettings:
    """How to turn a canvas of masks into text; every field declares its range (setting_spec)."""

    gen_length: int = setting(  # per request: each row's canvas ends at its own length
        256, help="Tokens to generate.", range=Range(1), lifetime=Lifetime.REQUEST
    )
    block_length: int = setting(32, help="Semi-autoregressive block size.", range=Range(1))
    steps: int | None = setting(  # None: one token per step (steps = gen_length)
        None,
        help="Denoising steps over the answer, split over its blocks: fixed/origin take exactly "
        "these; threshold commits at least a step's share; default one per token.",
        range=Range(1),
        rules=STEP_RULES,
    )
    cache: str = setting(
        "none",
        help="KV cache: {choices}.",
        choices=CACHES,
        lifetime=Lifetime.ENGINE,
        refused={"gemma": spec.GEMMA_CACHE},
    )
    refresh_interval: int = setting(
        0,
        help="Cached policies: also recompute the whole canvas every N steps of a block (0: off).",
        range=OFF_AT_0,
        lifetime=Lifetime.ENGINE,
        refused={
            "block": "the block cache is exact: nothing to refresh",
            "gemma": spec.GEMMA_CACHE,
        },
    )
    suffix_window: int = setting(  # keep only W canvas columns past the current block (DPad)
        0,
        help="Suffix pruning: compute and attend only W columns past the current block (0: off).",
        range=OFF_AT_0,
        lifetime=Lifetime.ENGINE,
        refused={
            "block": "a block never attends to later blocks: there is no suffix to prune",
            "gemma": "it decodes one canvas at a time and attends to no masked suffix past it",
        },
    )
    unmask: str = setting(
        "fixed", help="Commit rule: {choices}.", choices=UNMASKS, refused=spec.GEMMA_ACCEPTS
    )
    schedule: str = setting(
        "family",
        help="fixed rule's tokens per step: family | linear (LLaDA) | dream.",
        choices=SCHEDULES,
        rules=("fixed", "klass"),
        refused={
            "block": "a block's steps split it evenly, as the references do",
            **spec.GEMMA_ACCEPTS,
        },
    )
    confidence: str = setting(
        "low_confidence",
        help="{choices}.",
        choices=CONFIDENCES,
        lifetime=Lifetime.REQUEST,  # validated with the engine's rule (threshold: a p)
        refused=spec.GEMMA_ACCEPTS,
    )
    threshold: float = setting(
        0.9,
        help="threshold rule: commit tokens at least this confident, in (0, 1].",
        range=Range(0, 1),  # a rule that ignores it too
        ranges={
            "threshold": Range(0.0, 1.0, open_low=True),
            "credit": Range(0.0, 1.0, open_low=True),
            "klass": Range(0, 1, open_high=True),  # commits confidences above it
            "wino": Range(0, 1, open_high=True),  # drafts confidences above it
            "sdlm": Range(0, 1, open_high=True),  # commits confidences above it
        },
        rules=("threshold", "klass", "wino", "sdlm", "credit"),
        refused=spec.GEMMA_ACCEPTS,
    )
    factor: float = setting(
        1.0,
        help="factor rule: commit the largest n with (n+1)(1-c_n) < f.",
        range=Range(0, open_low=True),
        rules=("factor",),
        refused=spec.GEMMA_ACCEPTS,
    )
    eb_gamma: float = rule_param(
        "eb",
        0.1,
        Range(0),
        "eb rule (EB-Sampler): commit the most confident masks while their entropies, all "
        "but the largest, sum to <= gamma.",
    )
    kl_threshold: float = rule_param(
        "klass",
        0.01,
        Range(0, open_low=True),
        "klass rule: a mask is ready when above --threshold and its step-to-step KL stayed "
        "below this for --kl-history steps.",
    )
    kl_history: int = rule_param(
        "klass", 2, Range(1), "klass rule: steps a mask's KL must stay low."
    )
    wino_verify: float = rule_param(
        "wino",
        0.9,
        Range(0, 1),
        "wino rule (WINO): drafts above --threshold are committed; an earlier commit of the "
        "block whose shadow-block probability falls below this is masked again.",
    )
    jump_threshold: float = rule_param(
        "sdlm",
        1.0,
        Range(0, 1),
        "sdlm rule (SDLM's longest prefix): the run of masks from the block's leftmost above --threshold "
        "is committed; a mask past it only when more confident than this (1: never).",
    )
    credit_alpha: float = rule_param(
        "credit",
        0.7,
        Range(0),
        "credit rule (dInfer): the threshold rule on logits + alpha * log(1 + credit), where "
        "a mask's top-1 token earns credit each step it stays the favourite.",
    )
    credit_boost: float = rule_param(
        "credit", 0.2, Range(0), "credit rule: a step's top-1 token earns its probability ** this."
    )
    credit_decay: float = rule_param(
        "credit", 0.8, Range(0, 1), "credit rule: credits are multiplied by this each step."
    )
    temperature: float = setting(
        0.0,
        help="0 = greedy.",
        range=TEMPERATURE_RANGE,
        lifetime=Lifetime.REQUEST,
        refused={"gemma": "its temperature follows a schedule from t_max down to t_min"},
    )
    top_p: float | None = setting(
        None,
        help="Nucleus sampling mass.",
        range=Range(0.0, 1.0, open_low=True),
        lifetime=Lifetime.REQUEST,
        refused={"gemma": spec.GEMMA_WHOLE},
    )
    top_k: int | None = setting(  # None: the family's default (families.py); 0: no top-k
        None,
        help="Keep the top K tokens (0: off; default: the family's, 50 for Dream).",
        range=OFF_AT_0,
        lifetime=Lifetime.REQUEST,
        refused={"gemma": spec.GEMMA_WHOLE},
    )
    cfg_scale: float = setting(
        0.0,
        help="Classifier-free guidance scale (0 = off).",
        range=Range(0, MAX_CFG_SCALE),
        lifetime=Lifetime.ENGINE,
        why="guidance doubles every row of the engine's forward",
        refused={
            "block": "no classifier-free guidance in the block-causal references",
            "gemma": "it has no classifier-free guidance",
        },
    )
    seed: int = setting(
        0, help="Random seed.", range=Range(0, 2**63, open_high=True), lifetime=Lifetime.REQUEST
    )
    early_stop: bool = setting(
        False,
        help="Stop a row once its answer has ended (same text, fewer forwards).",
        lifetime=Lifetime.ENGINE,
        why="the engine decides once how rows leave",
    )
    batching: str = setting(  # batch mode: continuous (refill slots) | static (whole batches)
        "continuous",
        help="Batch mode: continuous (a finished prompt's slot takes the next one) | static "
        "(whole batches).",
        choices=BATCHINGS,
        panel=spec.INPUT,
        group="batch",
        lifetime=Lifetime.ENGINE,
        why="admission is the engine's policy",
        served=False,
    )
    eps: float = setting(
        1e-3,
        help="Dream's timestep schedule: its last timestep (steps walk linspace(1, eps, steps + 1)).",
        range=Range(0.0, 1.0, open_low=True, open_high=True),
        rules=("fixed", "origin", "klass"),
        refused=dict.fromkeys(("block", "gemma"), "it is a timestep setting of Dream's schedule"),
    )
    alg_temp: float = setting(
        0.0,
        help="fixed rule: sample the positions from softmax(confidence / this) (Dream's alg_temp; "
        "0: the most confident).",
        range=Range(0),
        rules=("fixed",),
        refused=dict.fromkeys(("block", "gemma"), "it is a setting of Dream's position sampling"),
    )
    # DiffusionGemma's own knobs (transformers' names); None: the checkpoint's value
    t_min: float | None = gemma_knob("Temperature at the last denoising step.", Range(0))
    t_max: float | None = gemma_knob("Temperature at the first denoising step.", Range(0))
    entropy_bound: float | None = gemma_knob(
        "Accept the lowest-entropy tokens whose summed entropy, less the largest, is within this.",
        Range(0, open_low=True),
    )
    stability_threshold: int | None = gemma_knob(
        "Stop a canvas once its draft held still this many steps.", Range(0)
    )
    confidence_threshold: float | None = gemma_knob(
        "Stop a canvas once its mean token entropy is below this.", Range(0, open_low=True)
    )
    edit_threshold: float | None = setting(  # LLaDA2.1 T2T: replace committed tokens above p
        None,
        help="LLaDA2.1 token editing: replace a committed token whose new draft is more likely "
        "than this (unset: no editing).",
        range=Range(0, 1, open_high=True),
        refused=spec.EDIT_ONLY,
    )
    max_post_steps: int = setting(
        16,
        help="LLaDA2.1: editing steps a block may take after its last mask.",
        range=Range(0),
        refused=spec.EDIT_ONLY,
    )

    def __post_init__(self) -> None:
        self.validate()

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def num_blocks(self) -> int:
        """Blocks the answer is cut into (the last one may be shorter)."""
        return -(-self.gen_length // min(self.block_length, self.gen_length))

    @property
    def total_steps(self) -> int:
        """Steps the schedule plans: `steps` (None: one token per step) under fixed, origin and
        threshold (the least a step commits); the other rules commit by confidence alone."""
        if self.steps is None or self.unmask not in STEP_RULES:
            return self.gen_length
        return self.steps

    @property
    def one_per_step(self) -> bool:
        """Every block plans a step per token (`steps` None: one token a step at least), so the
        threshold rule's least per step is one token."""
        return self.steps is None or all(n == k for n, k in self.block_plan())

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
        if self.unmask not in STEP_RULES or (self.steps is None and RULES[self.unmask].least):
            return notes  # confidence rules, or one token a step at least: no plan to explain
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
        spec.check_fields(self, self.unmask)
        self._check_combinations()
        return self

    def _check_combinations(self) -> None:
        rule = RULES[self.unmask]
        if rule.one_forward and self.cfg_scale > 0:
            spec.bad(
                f"unmask={self.unmask} does not combine with cfg_scale > 0: its shadow block "
                "verifies against one (conditional) forward; use cfg_scale 0 or another rule"
            )
        if rule.follows_steps and self.total_steps < self.num_blocks:
            spec.bad(
                f"steps ({self.total_steps}) is fewer than the number of blocks "
                f"({self.num_blocks} = ceil(gen_length {self.gen_length} / block_length "
                f"{self.block_length})): every block needs at least one step; use steps >= "
                f"{self.num_blocks} or a longer block_length"
            )
        if rule.probability and self.confidence not in spec.PROBABILITY_CONFIDENCES:
            spec.bad(
                f"unmask={self.unmask} compares confidences with a probability, which "
                f"confidence={self.confidence} is not (use {', '.join(spec.PROBABILITY_CONFIDENCES)})"
            )
        if self.t_min is not None and self.t_max is not None and self.t_max <= self.t_min:
            spec.bad(f"t_max must be above t_min (got t_max {self.t_max}, t_min {self.t_min})")


def split_blocks(gen_length: int, block_length: int, steps: int) -> list[tuple[int, int]]:
    """(tokens, steps) per block, left to right, as the module docstring says."""
    size = min(block_length, gen_length)
    n = -(-gen_length // size)
    lengths = [min(size, gen_length - b * size) for b in range(n)]
    return [
        (length, min(k, length)) for length, k in zip(lengths, even_split(steps, n), strict=True)
    ]


def even_split(total: int, parts: int) -> list[int]:
    """LLaDA's split of tokens over steps: `total // parts` each, the first `total % parts` one
    more (steps over blocks here; a block over its steps on SDAR and LLaDA2.x)."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]
