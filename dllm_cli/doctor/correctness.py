"""Correctness on the device: the same tokens as the CPU, as eager, as alone, in float32.

Each check takes one family's `Fixture` and the device under test ("cuda", or "cpu" when there
is no GPU: the checks that compare with CUDA then decode their CPU half and report a skip).
Greedy decoding is deterministic, so every comparison asks for identical tokens, except:

- `origin` (Dream's random reveal order) draws from the device's own generator, and CPU and
  CUDA generators give different streams; there the check is that two CUDA decodes of the same
  seed agree and leave no mask.
- A float32 difference may be a near-tie between two logits that rounding resolves differently
  on each device. A differing cell is decoded again in float64 on both devices: equal there
  means a rounding tie (reported as such, still a failure to look at), different means a bug.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from itertools import product

import torch

from dllm_cli.decoding import Decoder
from dllm_cli.doctor.checks import Outcome, one_line, verdict
from dllm_cli.doctor.fixtures import (
    Fixture,
    committer,
    decode,
    first_difference,
    masks_left,
    settings,
)
from dllm_cli.doctor.timing import engine_events
from dllm_cli.models.compiled import enable_compile
from dllm_cli.settings import CACHES, UNMASKS

RANDOM_RULES = ("origin",)  # draw from the device's generator
MAX_RERUNS = 3  # differing cells decoded again in float64 (the first ones)
MATRIX = list(product(CACHES, UNMASKS, (False, True)))
GUIDED = list(product(CACHES, ("exact", "topk:3")))
# Each policy with early stop (rows retire at different steps) and a rule; two without.
DETERMINISTIC = [
    ("none", "fixed", True),
    ("prefix", "threshold", True),
    ("dual", "factor", True),
    ("freecache", "threshold", True),
    ("dual", "threshold", False),
    ("freecache", "fixed", False),
]
COMPILED = [
    ("dual", "threshold", False, {}),
    ("prefix", "fixed", False, {}),
    ("freecache", "factor", True, {}),
    ("dual", "threshold", True, {"suffix_window": 4}),
]


def label(cache: str, unmask: str, early_stop: bool | None = None, **extra) -> str:
    parts = [cache, unmask] + (["early-stop"] if early_stop else [])
    return "+".join(parts + [f"{k}={v}" for k, v in extra.items()])


def float64_verdict(fx: Fixture, target: str, s, guided: str | None) -> str:
    """Decode one differing cell in float64 on both devices: tie (equal) or bug (different)."""
    runs = []
    for device in ("cpu", target):
        loaded = fx.load(device)
        loaded.model.double()
        c = None
        if guided is not None:
            guide = fx.load_guide(loaded)
            guide.model.double()
            c = committer(loaded, guide, guided)
        runs.append(decode(loaded, s, fx.batch, c))
    if runs[0] == runs[1]:
        return "float64 agrees on both devices: a float32 rounding near-tie"
    return f"float64 differs too ({first_difference(*runs)}): not a rounding tie"


def compare_devices(
    fx: Fixture, target: str, cells: list[tuple[str, dict]], guided: bool
) -> Outcome:
    """Every cell decoded on the CPU and on `target` (token-identical), or skipped on CPU."""
    cpu = fx.load("cpu")
    dev = fx.load(target) if target != "cpu" else None
    guides = {}
    if guided:
        guides = {"cpu": fx.load_guide(cpu)} | ({target: fx.load_guide(dev)} if dev else {})
    rows, failures = [], []
    for name, kw in cells:
        accept = kw.pop("accept", None)
        s = settings(**kw)

        def run(loaded, device, s=s, accept=accept):
            c = committer(loaded, guides[device], accept) if accept else None
            return decode(loaded, s, fx.batch, c)

        row = {"cell": name}
        try:
            reference = run(cpu, "cpu")
            row["cpu_masks_left"] = masks_left(cpu, reference)
            if dev is None:
                row["result"] = "cpu only"
            elif s.unmask in RANDOM_RULES:
                first, again = run(dev, target), run(dev, target)
                same = first == again and masks_left(dev, first) == 0
                row["result"] = "deterministic on device" if same else "not reproducible"
                if not same:
                    failures.append(f"{name}: two {target} decodes differ")
            else:
                where = first_difference(reference, run(dev, target))
                row["result"] = "equal" if where is None else f"differs: {where}"
                if where is not None:
                    reruns = sum("float64" in r for r in rows)
                    if reruns < MAX_RERUNS:
                        row["float64"] = float64_verdict(fx, target, s, accept)
                    failures.append(f"{name}: {where} ({row.get('float64', 'not rerun')})")
        except Exception as e:  # one cell's failure is one row of the table
            row["result"] = f"error: {one_line(e)}"
            failures.append(f"{name}: {row['result']}")
        rows.append(row)
    data = {"cells": rows}
    if dev is None:
        errors = [f for f in failures if "error" in f]
        if errors:
            return Outcome("fail", "; ".join(errors[:3]), data)
        why = f"CPU run: decoded the {len(rows)} CPU references only, no CUDA to compare"
        return Outcome("skip", why, data)
    return verdict(failures, f"{len(rows)} cells token-identical on {target} and cpu", data)


def check_matrix(fx: Fixture, target: str) -> Outcome:
    """Every cache policy x unmask rule x early stop."""
    cells = [(label(c, u, e), {"cache": c, "unmask": u, "early_stop": e}) for c, u, e in MATRIX]
    return compare_devices(fx, target, cells, guided=False)


def check_guided(fx: Fixture, target: str) -> Outcome:
    """Guided decoding with a tiny random Llama guide, every cache policy, two accept rules."""
    cells = [
        (f"guided+{c}+{a}", {"cache": c, "unmask": "fixed", "early_stop": False, "accept": a})
        for c, a in GUIDED
    ]
    return compare_devices(fx, target, cells, guided=True)


def check_compile(fx: Fixture, target: str) -> Outcome:
    """`--compile` (CUDA-graph replay of cached block steps) gives eager's tokens."""
    if target == "cpu":
        return Outcome("skip", "CPU run: --compile records CUDA graphs on CUDA only")
    eager, graphs = fx.load(target), fx.load(target)
    why = enable_compile(graphs.model)
    if why:
        return Outcome("fail", f"enable_compile refused a CUDA model: {why}")
    rows, failures = [], []
    for cache, unmask, stop, extra in COMPILED:
        s, name = settings(cache, unmask, stop, **extra), label(cache, unmask, stop, **extra)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            want, got = decode(eager, s, fx.batch), decode(graphs, s, fx.batch)
        where = first_difference(want, got)
        rows.append({"cell": name, "result": "equal" if where is None else f"differs: {where}"})
        failures += [f"{name}: {where}"] if where else []
        failures += [f"{name}: {w.message}" for w in caught if "CUDA graph" in str(w.message)]
    replays = getattr(graphs.model.forward, "replays", None)
    recordings = getattr(graphs.model.forward, "recordings", None)
    data = {"cells": rows, "recordings": recordings, "replays": replays}
    if not replays:
        failures.append(f"no cached step was replayed from a CUDA graph (replays: {replays})")
    passed = f"{len(rows)} cells equal eager; {recordings} recordings, {replays} replays"
    return verdict(failures, passed, data)


def singles(loaded, s, prompts) -> list[list[int]]:
    return [decode(loaded, s, [p])[0] for p in prompts]


def continuous(loaded, s, prompts, slots: int) -> list[list[int]]:
    """Answers of a continuous run with `slots` slots, in prompt order."""
    out: list = [None] * len(prompts)
    for _ in engine_events(Decoder(loaded.model, loaded.special, s), prompts, slots, out):
        pass
    return out


def check_batching(fx: Fixture, target: str) -> Outcome:
    """batch == single and continuous (2 slots) == alone on the device under test."""
    loaded, prompts, rows, failures = fx.load(target), fx.batch, [], []
    for cache, unmask, stop in DETERMINISTIC:
        s, name = settings(cache, unmask, stop), label(cache, unmask, stop)
        alone = singles(loaded, s, prompts)
        for mode, run in (("batch", decode), ("continuous", partial(continuous, slots=2))):
            where = first_difference(alone, run(loaded, s, prompts))
            rows.append({"cell": name, "mode": mode, "result": where or "equal"})
            failures += [f"{name} {mode}: {where}"] if where else []
    passed = f"{len(DETERMINISTIC)} cells: batch and continuous equal single decodes on {target}"
    return verdict(failures, passed, {"cells": rows})


def check_bfloat16(fx: Fixture, target: str) -> Outcome:
    """A bfloat16 decode runs to the end; its agreement with float32 is reported, not asserted."""
    full, half = fx.load(target), fx.load(target, "bfloat16")
    rows, failures = [], []
    for cache, unmask, stop in (("dual", "threshold", True), ("none", "fixed", False)):
        s, name = settings(cache, unmask, stop), label(cache, unmask, stop)
        want, got = decode(full, s, fx.batch), decode(half, s, fx.batch)
        pairs = zip(want, got, strict=True)
        same = sum(a == b for x, y in pairs for a, b in zip(x, y, strict=True))
        total = sum(len(x) for x in want)
        left = masks_left(half, got)
        rows.append({"cell": name, "agreement": same / total, "masks_left": left})
        failures += [f"{name}: {left} mask tokens left in bfloat16 answers"] if left else []
    agree = ", ".join(f"{r['cell']} {r['agreement']:.0%}" for r in rows)
    passed = f"bfloat16 ran on {target}; tokens equal to float32: {agree}"
    return verdict(failures, passed, {"cells": rows})


# name -> check; the run makes one report row per (check, family)
CHECKS: dict[str, Callable[[Fixture, str], Outcome]] = {
    "cuda == cpu": check_matrix,
    "guided: cuda == cpu": check_guided,
    "compile == eager": check_compile,
    "batch == single, continuous == alone": check_batching,
    "bfloat16 end to end": check_bfloat16,
}


def exact_matmuls() -> Callable[[], None]:
    """float32 matmuls in full precision (no TF32) for the comparisons; returns the undo."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    return lambda: torch.set_float32_matmul_precision(before)
