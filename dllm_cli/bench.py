"""Benchmark decoding strategies on one held-out problem set, in one process.

Every strategy starts from LLaDA's reference decoding (`REFERENCE`: no cache, one token per
step, blocks of 32, no early stop) and changes only what its name says: Fast-dLLM's
PrefixCache / DualCache and confident parallel decoding (threshold and factor rules, arXiv
2505.22618), FlashDLM's FreeCache and guided diffusion (arXiv 2505.21467), and early stop.
The profile keeps what is not a strategy choice (temperature, top-p/k, seed, Dream's eps).

Each record is one (strategy, gen_length): the numbers of `Score.summary()` (accuracy, answer
tokens per second, forwards, ...; definitions in evaluate.py) and `speedup`, the
reference strategy's wall seconds over the strategy's on the same problems at the same
gen_length in the same run (a latency ratio; the reference, `baseline` unless chosen, always
runs, first). Timing starts after a warm-up decode of one problem and one block with each
strategy, so one-off setup costs nobody.

Strategies whose name ends in `prune` add suffix pruning (DPad, Streaming-dLLM): every forward
stops `suffix_window` columns past the current block (the plan's window, 64 unless chosen).

Guided decoding ends a row at its first committed stop token whatever `early_stop` says
(FlashDLM), so `freecache+guided` and `freecache+guided+early-stop` decode alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dllm_cli.errors import DllmError, SettingsError, UsageError
from dllm_cli.families import FAMILIES
from dllm_cli.settings import DecodeSettings

if TYPE_CHECKING:  # the strategy table is read by `dllm bench --help`: no torch at import
    from dllm_cli.evaluate import Score, Task
    from dllm_cli.runtime import Runtime

REFERENCE: dict[str, object] = {
    "steps": None,
    "cache": "none",
    "refresh_interval": 0,
    "suffix_window": 0,
    "unmask": "fixed",
    "confidence": "low_confidence",
    "threshold": 0.9,
    "factor": 1.0,
    "early_stop": False,
}
PARALLEL = {"unmask": "threshold", "threshold": 0.9}
FACTOR = {"unmask": "factor", "factor": 1.0}
STOP = {"early_stop": True}
SUFFIX_WINDOW = 64  # W of the +prune strategies unless the plan says otherwise


@dataclass(frozen=True)
class Strategy:
    """Settings changed from REFERENCE, whether the AR guide verifies the drafts, and whether
    the suffix is pruned (to the plan's window)."""

    settings: dict
    guided: bool = False
    pruned: bool = False


STRATEGIES: dict[str, Strategy] = {
    "baseline": Strategy({}),
    "prefix": Strategy({"cache": "prefix"}),
    "dual": Strategy({"cache": "dual"}),
    "parallel": Strategy(PARALLEL),
    "prefix+parallel": Strategy({"cache": "prefix", **PARALLEL}),
    "dual+parallel": Strategy({"cache": "dual", **PARALLEL}),
    "dual+factor": Strategy({"cache": "dual", **FACTOR}),
    "freecache": Strategy({"cache": "freecache"}),
    "freecache+parallel": Strategy({"cache": "freecache", **PARALLEL}),
    "guided": Strategy({}, guided=True),
    "freecache+guided": Strategy({"cache": "freecache"}, guided=True),
    "dual+parallel+early-stop": Strategy({"cache": "dual", **PARALLEL, **STOP}),
    "freecache+parallel+early-stop": Strategy({"cache": "freecache", **PARALLEL, **STOP}),
    "freecache+guided+early-stop": Strategy({"cache": "freecache", **STOP}, guided=True),
    "dual+guided+early-stop": Strategy({"cache": "dual", **STOP}, guided=True),
    "prefix+parallel+early-stop": Strategy({"cache": "prefix", **PARALLEL, **STOP}),
    "prune": Strategy({}, pruned=True),
    "prefix+parallel+early-stop+prune": Strategy(
        {"cache": "prefix", **PARALLEL, **STOP}, pruned=True
    ),
    "dual+parallel+early-stop+prune": Strategy({"cache": "dual", **PARALLEL, **STOP}, pruned=True),
    "freecache+guided+early-stop+prune": Strategy(
        {"cache": "freecache", **STOP}, guided=True, pruned=True
    ),
}
BASELINE = "baseline"
# What applies to block-causal models (SDAR, LLaDA2.x): the baseline recomputes every earlier
# block each step (LLaDA2.x's own loop); `prefix` is their exact block KV cache.
BLOCK_STRATEGIES = (
    "baseline",
    "prefix",
    "parallel",
    "prefix+parallel",
    "prefix+parallel+early-stop",
)


@dataclass(frozen=True)
class BenchPlan:
    """What to run: strategies (baseline first) at each gen_length, and how."""

    strategies: tuple[str, ...]
    lengths: tuple[int, ...]
    shots: int
    block_length: int = 32
    batch_size: int = 1
    warmup: bool = True
    reference: str = BASELINE  # speedups are its seconds over each strategy's
    suffix_window: int = SUFFIX_WINDOW  # W of the +prune strategies

    @classmethod
    def make(cls, strategies: Sequence[str], lengths: Sequence[int], **kw) -> BenchPlan:
        """Checked names, the reference prepended when missing, duplicates dropped."""
        reference = kw.get("reference", BASELINE)
        unknown = [s for s in [reference, *strategies] if s not in STRATEGIES]
        if unknown:
            raise UsageError(
                f"unknown strategy {unknown[0]!r} (available: {', '.join(STRATEGIES)})"
            )
        if not lengths or any(n < 1 for n in lengths):
            raise UsageError("--gen-length needs positive lengths, e.g. 256,512")
        if kw.get("suffix_window", SUFFIX_WINDOW) < 1:
            raise UsageError(f"--suffix-window must be at least 1 (got {kw['suffix_window']})")
        names = dict.fromkeys([reference, *strategies])
        return cls(tuple(names), tuple(dict.fromkeys(lengths)), **kw)


def settings_for(
    base: DecodeSettings, name: str, gen_length: int, block: int, window: int = SUFFIX_WINDOW
) -> DecodeSettings:
    """The profile's settings with REFERENCE, then the strategy's changes, applied (and so
    validated: a DecodeSettings checks itself when it is built)."""
    strategy = STRATEGIES[name]
    changes = {**REFERENCE, "gen_length": gen_length, "block_length": block}
    changes.update(strategy.settings)
    if strategy.pruned:
        changes["suffix_window"] = window
    return replace(base, **changes)


def run_bench(
    runtime: Runtime,
    tasks: Sequence[Task],
    plan: BenchPlan,
    on_record: Callable[[dict], None] | None = None,
    measure: Callable | None = None,
) -> list[dict]:
    """Every (gen_length, strategy) of the plan on `tasks`; one record each, in run order;
    `measure` times one pass (default: TinyGSM accuracy; throughput.measure: synthetic)."""
    from dllm_cli.evaluate import warm_up

    measure = measure or measure_accuracy
    guided = [n for n in plan.strategies if STRATEGIES[n].guided]
    if guided and runtime.guide is None:
        raise UsageError(f"strategy {guided[0]!r} needs a guide model ([guide] in the profile)")
    check_family(runtime, plan)
    records, warmed = [], set()
    for length in plan.lengths:
        baseline = None
        for name in plan.strategies:
            settings = settings_for(
                runtime.settings, name, length, plan.block_length, plan.suffix_window
            )
            committer = runtime.committer() if STRATEGIES[name].guided else None
            if plan.warmup and name not in warmed:
                warm_up(runtime.loaded.model, runtime.loaded.special, tasks[0], settings, committer)
                warmed.add(name)
            result = measure(runtime, tasks, settings, committer, plan.batch_size)
            baseline = result if name == plan.reference else baseline
            record = {
                "strategy": name,
                "gen_length": length,
                **result.summary(),
                "speedup": baseline.seconds / result.seconds if result.seconds > 0 else 0.0,
                "guided": STRATEGIES[name].guided,
                "shots": plan.shots,
                "batch_size": plan.batch_size,
                "settings": settings.to_dict(),
            }
            records.append(record)
            if on_record is not None:
                on_record(record)
    return records


def check_family(runtime: Runtime, plan: BenchPlan) -> None:
    """Refuse a strategy the model's family cannot run (a guide, a setting it refuses) before
    any decode, as `generate` would refuse its flags."""
    from dllm_cli.runtime import check_family as check_settings

    family = FAMILIES[runtime.loaded.family]
    for name in plan.strategies:
        try:
            if STRATEGIES[name].guided and not family.traits.frontier:
                raise SettingsError(f"a guide model does not apply to {family.title}")
            settings = settings_for(
                runtime.settings, name, plan.lengths[0], plan.block_length, plan.suffix_window
            )
            check_settings(runtime.loaded, settings)
        except SettingsError as e:
            raise SettingsError(f"strategy {name!r}: {e}") from None


def measure_accuracy(
    runtime: Runtime, tasks: Sequence[Task], settings, committer, batch_size: int
) -> Score:
    """One timed pass over the tasks (a fresh guide cache per decode)."""
    from dllm_cli.evaluate import score

    model, special = runtime.loaded.model, runtime.loaded.special
    return score(
        model, special, tasks, settings, runtime.text, committer=committer, batch_size=batch_size
    )


Columns = tuple[tuple[str, str, str], ...]  # (title, record key, format) per column
MARKDOWN_COLUMNS: Columns = (
    ("strategy", "strategy", "{}"),
    ("gen", "gen_length", "{}"),
    ("accuracy", "accuracy", "{:.1%}"),
    ("tok/s", "tokens_per_second", "{:.1f}"),
    ("NFE", "forwards", "{}"),
    ("tok/NFE", "tokens_per_forward", "{:.2f}"),
    ("guide NFE", "guide_forwards", "{}"),
    ("guide time", "guide_share", "{:.0%}"),
    ("seconds", "seconds", "{:.2f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("mask violations", "mask_violations", "{}"),
)


def cells(record: dict, columns: Columns = MARKDOWN_COLUMNS) -> list[str]:
    """One record's row for a table (markdown or Rich); "-" where a value is undefined."""
    return ["-" if record[key] is None else fmt.format(record[key]) for _, key, fmt in columns]


def progress_line(r: dict) -> str:
    """One finished record, as the command reports it while the bench runs."""
    accuracy = "" if r["accuracy"] is None else f"accuracy {r['accuracy']:.3f}, "
    return (
        f"{r['strategy']:>30} gen {r['gen_length']:>5}: {accuracy}"
        f"{r['tokens_per_second']:.1f} tok/s, {r['speedup']:.2f}x"
    )


def markdown_table(records: Sequence[dict], columns: Columns = MARKDOWN_COLUMNS) -> str:
    head = [title for title, _, _ in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells(r, columns)) + " |" for r in records]
    return "\n".join(lines) + "\n"


def figure(width: float, height: float):
    """A matplotlib Figure for `--plot` (bench and the frontier), or why there is none."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(
            "--plot needs matplotlib: pip install 'dllm-cli[plot]' (or matplotlib>=3.7)"
        ) from None
    return Figure(figsize=(width, height), layout="tight")


def save_figure(fig, path: Path) -> None:
    try:
        fig.savefig(path)
    except (OSError, ValueError) as e:
        raise DllmError(f"cannot write plot {path}: {e}") from None


def plot(records: Sequence[dict], path: Path) -> None:
    """Throughput against accuracy, one point per strategy, one panel per gen_length."""
    if any(r["accuracy"] is None for r in records):
        raise UsageError("--plot draws accuracy, which synthetic prompts (--prompt-length) lack")
    lengths = sorted({r["gen_length"] for r in records})
    fig = figure(6 * len(lengths), 4.5)
    axes = fig.subplots(1, len(lengths), squeeze=False)[0]
    for ax, length in zip(axes, lengths, strict=True):
        points = [r for r in records if r["gen_length"] == length]
        for r in points:
            at = (r["tokens_per_second"], 100 * r["accuracy"])
            ax.scatter(*at, marker="s" if r["strategy"] == BASELINE else "o")
            ax.annotate(r["strategy"], at, fontsize=7, xytext=(3, 3), textcoords="offset points")
        accuracies = [100 * r["accuracy"] for r in points]
        ax.set_ylim(max(0.0, min(accuracies) - 5), min(100.0, max(accuracies) + 5))
        ax.set_xscale("log")
        ax.set_xlabel("throughput (answer tokens / s, log scale)")
        ax.set_ylabel("exact-match accuracy (%)")
        ax.set_title(f"gen_length {length}")
        ax.grid(alpha=0.3)
    save_figure(fig, path)
