"""dllm beside llama.cpp's `llama-diffusion-cli` on the same checkpoint and the same work.

Both run as fresh processes, alternating, on the same chat-wrapped prompt and the same
threads, with the work llama.cpp can do: no cache, every step forwards the whole sequence
(prompt + canvas), Dream's timestep schedule with one step per generated token, confidence
ranking, all steps (no early stop). Each reports its own decode time (llama.cpp: the
`total time` line of `diffusion_generate`; dllm: `generate --json`'s `seconds`); wall time
is the whole process, start-up included. Before each pair of runs (one of each tool) the
1-minute load average is awaited, up to LOAD_WAIT_S, until it falls below LOAD_QUIET (each run
leaves its own threads' load behind: 2 threads read about 2 just after); a pair whose load stayed
above `LOAD_LIMIT` is marked not comparable (under load llama.cpp's spinning OpenMP threads slow
down far more than dllm's). docs/cpu.md has the recipe and numbers.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dllm_cli.errors import DllmError, UsageError
from dllm_cli.omp import user_environment

# A prompt that is ordinary text for any tokenizer.
PEER_PROMPT = (
    "Tom has 3 apples and buys 4 more. Then he gives 2 apples to his sister and eats one. "
    "How many apples does Tom have now? Explain each step."
)
DREAM_EPS = 1e-3  # Dream's timestep schedule ends at t = eps (its generation_utils default)

# A pair of runs measured above this 1-minute load average is not comparable.
LOAD_LIMIT = 1.5
LOAD_QUIET = 1.0  # before each pair, wait for the load average to fall below this ...
LOAD_WAIT_S = 60.0  # ... for at most this long (it decays by e in a minute) ...
LOAD_POLL_S = 5.0  # ... reading it this often (the kernel updates it every 5 s)


@dataclass(frozen=True)
class Precision:
    """A GGUF precision (`--peer-quant`) and the `--quantize` dllm runs against it."""

    gguf: str
    quantize: str
    what: str


PRECISIONS: dict[str, Precision] = {
    "f32": Precision("f32", "none", "float32"),
    "q8_0": Precision("q8_0", "int8", "8-bit: Q8_0 against --quantize int8"),
    "q4_0": Precision("q4_0", "int4", "4-bit: Q4_0 against --quantize int4"),
}

# diffusion.cpp: LOG_INF("\ntotal time: %0.2fms, time per step: %0.2fms, sampling time ...")
TOTAL_TIME = re.compile(r"total time: ([0-9]+(?:\.[0-9]+)?)ms, time per step: ([0-9.]+)ms")


@dataclass(frozen=True)
class Work:
    """What both sides decode: the prompt, its chat-wrapped length, answer length, threads."""

    prompt: str
    prompt_tokens: int
    gen: int
    threads: int
    quantize: str = "none"  # dllm's --quantize (the GGUF's precision: PRECISIONS)

    @property
    def total(self) -> int:
        """Prompt + canvas: llama.cpp's batch, micro-batch and context size."""
        return self.prompt_tokens + self.gen


@dataclass(frozen=True)
class Timed:
    """One process: its decode seconds (its own timer) and wall seconds (the whole process)."""

    decode_s: float
    wall_s: float


@dataclass(frozen=True)
class LoadGate:
    """Waits, bounded, for a quiet machine before each pair of runs; reads and sleeps are
    injected so the waiting is tested without time passing."""

    quiet: float
    patience_s: float
    poll_s: float
    read: Callable[[], float] = lambda: os.getloadavg()[0]
    sleep: Callable[[float], None] = time.sleep
    say: Callable[[str], None] = lambda _: None

    def wait(self) -> float:
        """Sleep until the load is below `quiet` or `patience_s` have passed; the load last read."""
        load, waited = self.read(), 0.0
        if load < self.quiet:
            return load
        self.say(
            f"load average {load:.2f}: waiting up to {self.patience_s:.0f} s for it to fall "
            f"below {self.quiet}"
        )
        while load >= self.quiet and waited < self.patience_s:
            step = min(self.poll_s, self.patience_s - waited)
            self.sleep(step)
            waited += step
            load = self.read()
        verdict = "quiet" if load < self.quiet else "still high"
        self.say(f"load average {load:.2f} after {waited:.0f} s: {verdict}")
        return load


def load_gate(say: Callable[[str], None] = lambda _: None) -> LoadGate:
    """The gate `dllm bench --peer` waits at (this module's limits, read when called)."""
    return LoadGate(LOAD_QUIET, LOAD_WAIT_S, LOAD_POLL_S, say=say)


def check_peer(binary: Path, gguf: Path) -> None:
    """Refuse a missing or non-executable binary or a missing GGUF before anything loads."""
    if not binary.is_file():
        raise UsageError(f"--peer-binary {binary}: no such file (build llama-diffusion-cli)")
    if not os.access(binary, os.X_OK):
        raise UsageError(f"--peer-binary {binary}: not executable")
    if not gguf.is_file():
        raise UsageError(f"--peer-model {gguf}: no such file (a GGUF of the --model folder)")


def parse_llamacpp(text: str) -> float:
    """Seconds of `diffusion_generate` (its every forward and sampling step) from its log."""
    found = TOTAL_TIME.findall(text)
    if not found:
        raise DllmError("llama-diffusion-cli printed no 'total time' line (see its output above)")
    return float(found[-1][0]) / 1000.0


def llamacpp_argv(binary: Path, gguf: Path, work: Work, seed: int = 0) -> list[str]:
    """The peer's flags for the work (its --temp 0 samples at temperature 1; see docs/cpu.md)."""
    n = str(work.total)
    return [
        str(binary),
        "-m", str(gguf),
        "-p", work.prompt,
        "--diffusion-steps", str(work.gen),
        "--diffusion-eps", str(DREAM_EPS),
        "--diffusion-algorithm", "4",  # confidence: Dream's maskgit_plus
        "--temp", "0", "--top-k", "0", "--top-p", "1.0", "--seed", str(seed),
        "-ub", n, "-b", n, "-c", n,
        "-t", str(work.threads), "-tb", str(work.threads),
    ]  # fmt: skip


def dllm_argv(folder: str, work: Work) -> list[str]:
    """`dllm generate` doing the same work on the CPU (float32 activations, the work's
    --quantize)."""
    g = str(work.gen)
    return [
        sys.executable, "-m", "dllm_cli", "generate", work.prompt,
        "--model", folder, "--device", "cpu", "--dtype", "float32", "--chat", "--no-guide",
        "--quantize", work.quantize,
        "--cache", "none", "--gen-length", g, "--block-length", g, "--steps", g,
        "--unmask", "fixed", "--schedule", "dream", "--confidence", "low_confidence",
        "--temperature", "0", "--no-early-stop", "--threads", str(work.threads), "--json",
    ]  # fmt: skip


def precision_for(peer_quant: str | None, quantize: object) -> Precision:
    """The precision pair to run: --peer-quant's, checked against a --quantize also given."""
    if peer_quant is None:
        by_quantize = {p.quantize: p for p in PRECISIONS.values()}
        if quantize is None:
            return PRECISIONS["f32"]
        if quantize in by_quantize:
            want = by_quantize[quantize].gguf
            raise UsageError(f"--quantize {quantize} with --peer: give --peer-quant {want}")
        raise UsageError(f"--quantize {quantize} has no llama.cpp precision to run against")
    precision = PRECISIONS.get(peer_quant)
    if precision is None:
        raise UsageError(f"--peer-quant takes one of: {', '.join(PRECISIONS)} (got {peer_quant!r})")
    if quantize is not None and quantize != precision.quantize:
        raise UsageError(
            f"--quantize {quantize} does not match --peer-quant {peer_quant} "
            f"(dllm runs --quantize {precision.quantize} against it)"
        )
    return precision


def run_process(
    argv: list[str], what: str, env: dict[str, str] | None = None
) -> tuple[float, str, str]:
    """(wall seconds, stdout, stderr) of one process; a failure is a DllmError (exit 1)."""
    t = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, errors="replace", env=env)
    except OSError as e:
        raise DllmError(f"cannot run {what}: {e.strerror or e}") from None
    wall = time.perf_counter() - t
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise DllmError(f"{what} exited {done.returncode}: {tail}")
    return wall, done.stdout, done.stderr


def run_llamacpp(binary: Path, gguf: Path, work: Work) -> Timed:
    # The peer runs in the user's environment, without dllm's own OpenMP default (omp.py).
    argv = llamacpp_argv(binary, gguf, work)
    wall, out, err = run_process(argv, "llama-diffusion-cli", env=user_environment())
    return Timed(parse_llamacpp(out + err), wall)


def run_dllm(folder: str, work: Work) -> Timed:
    wall, out, _ = run_process(dllm_argv(folder, work), "dllm generate")
    try:
        seconds = json.loads(out.strip().splitlines()[-1])["seconds"]
    except (IndexError, KeyError, ValueError):
        raise DllmError("dllm generate --json printed no record with 'seconds'") from None
    return Timed(float(seconds), wall)


def compare(
    binary: Path,
    gguf: Path,
    folder: str,
    works: Sequence[Work],
    rounds: int,
    on_run: Callable[[str, Work, Timed], None] = lambda *_: None,
    gate: LoadGate | None = None,
) -> list[dict]:
    """Medians over `rounds` alternating runs (the first contender swaps every round), each
    pair after `gate` waited for a quiet machine."""
    gate = gate or load_gate()
    contenders: dict[str, Callable[[Work], Timed]] = {
        "llama.cpp": lambda w: run_llamacpp(binary, gguf, w),
        "dllm": lambda w: run_dllm(folder, w),
    }
    records = []
    for work in works:
        runs: dict[str, list[Timed]] = {name: [] for name in contenders}
        load_start = os.getloadavg()[0]
        pair_loads = []
        for r in range(rounds):
            order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
            pair_loads.append(round(gate.wait(), 2))  # before each pair, once quiet
            for name in order:
                timed = contenders[name](work)
                runs[name].append(timed)
                on_run(name, work, timed)
        record = summary(work, runs)
        record["load_average"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
        record |= comparability(pair_loads)
        records.append(record)
    return records


def comparability(pair_loads: list[float]) -> dict:
    """The load before each pair, and whether every pair was measured at or below LOAD_LIMIT."""
    high = [x for x in pair_loads if x > LOAD_LIMIT]
    verdict = f"no: {len(high)} of {len(pair_loads)} pairs above {LOAD_LIMIT}" if high else "yes"
    return {"pair_loads": pair_loads, "comparable": not high, "comparable_note": verdict}


def summary(work: Work, runs: dict[str, list[Timed]]) -> dict:
    """One gen length's medians; ratios are llama.cpp's time over dllm's (> 1: dllm faster)."""

    def median(name: str, field: str) -> float:
        return statistics.median(getattr(t, field) for t in runs[name])

    peer_decode, ours_decode = median("llama.cpp", "decode_s"), median("dllm", "decode_s")
    peer_wall, ours_wall = median("llama.cpp", "wall_s"), median("dllm", "wall_s")
    return {
        "gen_length": work.gen,
        "quantize": work.quantize,
        "prompt_tokens": work.prompt_tokens,
        "columns": work.total,
        "threads": work.threads,
        "rounds": len(runs["dllm"]),
        "llamacpp_decode_s": significant(peer_decode),
        "dllm_decode_s": significant(ours_decode),
        "decode_ratio": round(peer_decode / ours_decode, 3),
        # One forward over every column per step: decode time per step is per forward.
        "llamacpp_step_ms": significant(peer_decode * 1e3 / work.gen),
        "dllm_step_ms": significant(ours_decode * 1e3 / work.gen),
        "llamacpp_wall_s": significant(peer_wall),
        "dllm_wall_s": significant(ours_wall),
        "wall_ratio": round(peer_wall / ours_wall, 3),
        # Every run's decode seconds, in order: on a shared machine they can be bimodal.
        "llamacpp_runs_s": [significant(t.decode_s) for t in runs["llama.cpp"]],
        "dllm_runs_s": [significant(t.decode_s) for t in runs["dllm"]],
    }


def significant(seconds: float) -> float:
    """Four significant digits: a short decode keeps its precision (0.00412 s, not 0.004)."""
    return float(f"{seconds:.4g}")


COLUMNS = (
    ("gen", "gen_length"),
    ("columns", "columns"),
    ("llama.cpp decode s", "llamacpp_decode_s"),
    ("dllm decode s", "dllm_decode_s"),
    ("decode ratio", "decode_ratio"),
    ("llama.cpp ms/step", "llamacpp_step_ms"),
    ("dllm ms/step", "dllm_step_ms"),
    ("llama.cpp wall s", "llamacpp_wall_s"),
    ("dllm wall s", "dllm_wall_s"),
    ("wall ratio", "wall_ratio"),
    ("load average (start, end)", "load_average"),
    ("comparable (load <= 1.5)", "comparable_note"),
)


def markdown(records: list[dict]) -> str:
    """The medians as a markdown table (ratio: llama.cpp's seconds / dllm's, > 1: dllm faster)."""
    lines = ["| " + " | ".join(h for h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r.get(k, "")) for _, k in COLUMNS) + " |" for r in records]
    return "\n".join(lines) + "\n"


def cell(value) -> str:
    """A table cell: a pair (the load averages) as `a, b`."""
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)
