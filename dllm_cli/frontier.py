"""`dllm bench --frontier`: what each unmasking rule costs in accuracy for what it gains in speed.

Every rule of `SWEEPS` decodes the same held-out TinyGSM problems once per value of its
parameter, after the reference (one token per step, `fixed` with steps = gen_length), all with
the run's other settings (cache, early stop, suffix pruning, block length), in one process.

Speed is measured as a batch-1 user sees it, whatever `--batch-size` the pass runs with: rows
are decoded each at its own pace (`DecodeRun(lockstep=False)`, the same tokens as decoding
each problem alone) and `tokens_per_forward` is answer tokens (evaluate.py's definition) over
row-forwards (`DecodeResult.rows_served`: the forwards each row would have taken alone). That
figure does not depend on the machine's load; `tokens_per_second` is the pass's wall-clock
throughput at the batch size run (noisy on a shared machine).
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dllm_cli.bench import Columns, figure, markdown_table, save_figure
from dllm_cli.errors import SettingsError, UsageError
from dllm_cli.settings import DecodeSettings

if TYPE_CHECKING:  # `dllm bench --help` reads SWEEPS: no torch at import
    from dllm_cli.evaluate import Score, Task
    from dllm_cli.runtime import Runtime


@dataclass(frozen=True)
class Sweep:
    """The setting a rule's sweep varies and its default values."""

    param: str
    values: tuple[float, ...]


SWEEPS: dict[str, Sweep] = {
    "threshold": Sweep("threshold", (0.7, 0.8, 0.9, 0.95, 0.99)),
    "factor": Sweep("factor", (0.25, 0.5, 1.0, 2.0)),
    "eb": Sweep("eb_gamma", (0.01, 0.1, 0.3, 1.0, 3.0)),
    # KLASS at the run's confidence threshold (0.9 in the shipped profiles)
    "klass": Sweep("kl_threshold", (0.001, 0.01, 0.1, 1.0)),
    # WINO's draft threshold at the run's --wino-verify (the reference: 0.6 and 0.9)
    "wino": Sweep("threshold", (0.6, 0.7, 0.8, 0.9)),
    # SDLM's longest-prefix bar at the run's --jump-threshold
    "sdlm": Sweep("threshold", (0.8, 0.85, 0.9, 0.95)),
    # dInfer's credit decoding: its threshold at the run's --credit-alpha/-boost/-decay
    "credit": Sweep("threshold", (0.9, 0.95, 0.99)),
}
REFERENCE = "one-per-step"  # the fixed rule, one token per step


@dataclass(frozen=True)
class Point:
    """One pass: a rule at one value of its parameter (the reference has none)."""

    rule: str
    value: float | None = None


def parse_frontier(text: str) -> list[Point]:
    """'threshold,eb=0.1/0.3' -> the reference, then every rule at its values (or defaults)."""
    points = [Point(REFERENCE)]
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        rule, _, values = item.partition("=")
        if rule not in SWEEPS:
            raise UsageError(f"--frontier: unknown rule {rule!r} (choose from {', '.join(SWEEPS)})")
        try:
            chosen = [float(v) for v in values.split("/")] if values else SWEEPS[rule].values
        except ValueError:
            raise UsageError(f"--frontier: {item!r}: values are numbers like eb=0.1/0.3") from None
        points += [Point(rule, v) for v in chosen]
    if len(points) == 1:
        raise UsageError("--frontier needs at least one rule, e.g. --frontier threshold,eb")
    return points


def settings_at(base: DecodeSettings, point: Point) -> DecodeSettings:
    """The run's settings with the point's rule and value (validated when built)."""
    if point.rule == REFERENCE:
        return replace(base, unmask="fixed", steps=None)
    sweep = SWEEPS[point.rule]
    try:
        return replace(base, unmask=point.rule, **{sweep.param: point.value})
    except SettingsError as e:
        raise SettingsError(f"--frontier {point.rule}={point.value:g}: {e}") from None


def score_alone(
    runtime: Runtime, tasks: Sequence[Task], settings: DecodeSettings, batch_size: int
) -> Score:
    """Accuracy and batch-1 cost of decoding `tasks`, `batch_size` rows at their own pace."""
    from dllm_cli.decoding import Decoder
    from dllm_cli.evaluate import Score

    model, special = runtime.loaded.model, runtime.loaded.special
    decoder = Decoder(model, special, settings)
    out = Score(gen_length=settings.gen_length)
    for first in range(0, len(tasks), batch_size):
        batch = tasks[first : first + batch_size]
        began = time.perf_counter()
        result = decoder.run([t.prompt for t in batch], lockstep=False).result()
        out.add_run(result, time.perf_counter() - began)
        out.forwards += result.rows_served - result.forwards  # count row-forwards instead
        for task, tokens in zip(batch, result.tokens, strict=True):
            out.check(task, tokens, special, runtime.text(tokens), restate=False)
    return out


def run_frontier(
    runtime: Runtime,
    tasks: Sequence[Task],
    points: Sequence[Point],
    base: DecodeSettings,
    batch_size: int,
    on_record: Callable[[dict], None] | None = None,
) -> list[dict]:
    """One record per point, in order; every point's settings are checked before any decode."""
    from dllm_cli.evaluate import warm_up

    settings = [settings_at(base, p) for p in points]
    records = []
    for point, s in zip(points, settings, strict=True):
        warm_up(runtime.loaded.model, runtime.loaded.special, tasks[0], s)
        score = score_alone(runtime, tasks, s, batch_size)
        record = {
            "rule": point.rule,
            "param": None if point.value is None else SWEEPS[point.rule].param,
            "value": point.value,
            **score.summary(),
            "batch_size": batch_size,
            "settings": s.to_dict(),
        }
        records.append(record)
        if on_record is not None:
            on_record(record)
    return records


COLUMNS: Columns = (
    ("rule", "rule", "{}"),
    ("parameter", "param", "{}"),
    ("value", "value", "{:g}"),
    ("accuracy", "accuracy", "{:.1%}"),
    ("tok/forward (batch 1)", "tokens_per_forward", "{:.2f}"),
    ("tok/s", "tokens_per_second", "{:.1f}"),
    ("row-forwards", "forwards", "{}"),
    ("mask violations", "mask_violations", "{}"),
)


def markdown(records: Sequence[dict]) -> str:
    return markdown_table(records, COLUMNS)


def progress_line(r: dict) -> str:
    at = "" if r["value"] is None else f" {r['param']}={r['value']:g}"
    return (
        f"{r['rule'] + at:>24}: accuracy {r['accuracy']:.3f}, "
        f"{r['tokens_per_forward']:.2f} tok/forward, {r['tokens_per_second']:.1f} tok/s"
    )


def plot(records: Sequence[dict], path: Path, title: str) -> None:
    """Accuracy against answer tokens per forward: one line per rule, the reference a star."""
    fig = figure(7, 5)
    ax = fig.subplots()
    for rule in dict.fromkeys(r["rule"] for r in records):
        line = sorted(
            (r for r in records if r["rule"] == rule), key=lambda r: r["tokens_per_forward"]
        )
        xs = [r["tokens_per_forward"] for r in line]
        ys = [100 * r["accuracy"] for r in line]
        if rule == REFERENCE:
            ax.scatter(xs, ys, marker="*", s=120, color="black", label=rule, zorder=3)
            continue
        ax.plot(xs, ys, marker="o", label=f"{rule} ({line[0]['param']})")
        for r, x, y in zip(line, xs, ys, strict=True):
            ax.annotate(
                f"{r['value']:g}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
    ax.set_xlabel("answer tokens per forward (batch 1)")
    ax.set_ylabel("exact-match accuracy (%)")
    ax.set_title(textwrap.fill(" ".join(title.split()), 90), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)
