"""The doctor's two files: doctor.json (everything) and doctor.md (to read, or to commit).

Both are rewritten after every check, so a run stopped half way still leaves a report of what
it did.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from dllm_cli.doctor.checks import STATUSES, Check

JSON_NAME, MARKDOWN_NAME = "doctor.json", "doctor.md"
GIB = 2**30
RANDOM_WEIGHTS = (
    "Random weights measure cost, not accuracy: the speed models are built from a seed at the "
    "real shape, so their drafts are near-uniform, the threshold rule commits one token per "
    "step and early stop never fires. Read the time per forward and per step (what a real "
    "checkpoint of this shape costs); forward counts and tok/s are those of one token per step."
)


@dataclass
class Report:
    """Checks as they finish, and the two files they are written to."""

    folder: Path
    mode: str  # "cuda" or "cpu"
    budget: float
    environment: dict = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    elapsed: float = 0.0

    def add(self, check: Check, elapsed: float) -> None:
        self.checks.append(check)
        self.elapsed = elapsed
        self.write()

    def counts(self) -> dict[str, int]:
        seen = Counter(c.status for c in self.checks)
        return {s: seen.get(s, 0) for s in STATUSES}

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "budget_s": self.budget,
            "elapsed_s": round(self.elapsed, 1),
            "environment": self.environment,
            "summary": self.counts(),
            "checks": [c.to_dict() for c in self.checks],
        }

    def write(self) -> None:
        """Both files, each replaced whole (never half written)."""
        save(self.folder / JSON_NAME, json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        save(self.folder / MARKDOWN_NAME, markdown(self))


def save(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


def markdown(r: Report) -> str:
    why = r.environment.get("why_cpu", "no CUDA device")
    where = "CUDA" if r.mode == "cuda" else f"CPU only ({why}: the CPU-sized parts)"
    counts = ", ".join(f"{n} {s}" for s, n in r.counts().items() if n)
    out = [
        "# dllm doctor",
        "",
        f"Device under test: {where}. Budget {r.budget:.0f} s, ran {r.elapsed:.0f} s. {counts}.",
        "",
        "## Environment",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in r.environment.items()],
        "",
    ]
    skipped = [c for c in r.checks if c.status == "skip"]
    if skipped:
        out += ["## Skipped here", ""]
        out += [f"- {c.section}: {c.name}: {c.detail}" for c in skipped]
        out.append("")
    out += correctness(r.checks)
    out += speed(r.checks)
    out += several_gpus(r.checks)
    return "\n".join(out) + "\n"


def several_gpus(checks: list[Check]) -> list[str]:
    """The multi-GPU section's rows (doctor/multi_gpu.py), when it ran."""
    rows = [c for c in checks if c.section == "multi-GPU" and c.status != "skip"]
    return check_table("Multi-GPU", rows) if rows else []


def check_table(title: str, rows: list[Check]) -> list[str]:
    """A section's checks as a table: name, status, detail, seconds."""
    out = [f"## {title}", "", "| check | status | detail | s |", "|---|---|---|---|"]
    out += [f"| {c.name} | {c.status} | {cell(c.detail)} | {c.seconds:.1f} |" for c in rows]
    return [*out, ""]


def correctness(checks: list[Check]) -> list[str]:
    rows = [c for c in checks if c.section == "correctness"]
    if not rows:
        return []
    out = check_table("Correctness", rows)
    for c in rows:  # cells that were not equal, for the failing checks
        bad = [x for x in c.data.get("cells", []) if not ok(x)]
        if c.status in ("fail", "error") and bad:
            out += [f"Cells of {c.name} that differ:", ""]
            out += [
                f"- {x['cell']}: {x.get('result')} {x.get('float64', '')}".rstrip() for x in bad
            ]
            out.append("")
        if c.status == "error" and "traceback" in c.data:
            out += ["```", c.data["traceback"].rstrip(), "```", ""]
    return out


def ok(cell: dict) -> bool:
    return cell.get("result") in (None, "equal", "cpu only", "deterministic on device")


SPEED_HEAD = (
    "| shape | gen | variant | forwards | tok/s | full step ms | cached step ms | full fwd ms "
    "| cached fwd ms | outside model | peak GiB | weights + KV GiB |"
)


def speed(checks: list[Check]) -> list[str]:
    rows = [c for c in checks if c.section == "speed"]
    if not rows:
        return []
    out = ["## Speed", "", RANDOM_WEIGHTS, "", SPEED_HEAD, "|---" * 12 + "|"]
    for c in rows:
        d = c.data
        if "full_step_ms" not in d:
            continue
        shape, _, variant = c.name.partition(": ")
        m = d.get("memory", {})
        out.append(
            f"| {shape} | {d['gen_length']} | {variant.split(' ', 2)[-1]} | {d['forwards']} | "
            f"{num(d.get('tok_per_s'))} | {num(d['full_step_ms'])} | {num(d['cached_step_ms'])} | "
            f"{num(d['full_forward_ms'])} | {num(d['cached_forward_ms'])} | "
            f"{pct(d['outside_model'])} | {gib(m.get('peak_bytes'))} | "
            f"{gib(m.get('predicted_bytes'))} |" + (" cut short" if d.get("cut_short") else "")
        )
    out += ["", "| check | status | detail |", "|---|---|---|"]
    out += [f"| {c.name} | {c.status} | {cell(c.detail)} |" for c in rows if not timed(c)]
    out += ["", "Step: wall time of a whole decoding step, device synchronised; fwd: the model's "
            "forward alone (CUDA events on a GPU). Outside model = 1 - forward time / step time. "
            "Weights + KV: the per-slot formula of docs/decoding.md (2 x layers x KV heads x head dim x bytes "
            "x (prompt + gen + 1) per slot) plus the weights; peak minus it is activations "
            "(logits over the vocabulary above all).", ""]  # fmt: skip
    return out


def timed(c: Check) -> bool:
    return "full_step_ms" in c.data


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def num(x) -> str:
    return "-" if x is None else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def gib(x) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"
