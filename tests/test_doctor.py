"""`dllm doctor`: the CPU-sized run CI can do, the skips it reports, and the guards around it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_fixtures import invoke, isolated_fixture  # noqa: F401

from dllm_cli.decoding import Decoder
from dllm_cli.doctor import correctness, fixtures, speed
from dllm_cli.doctor.checks import Deadline, Outcome, attempt
from dllm_cli.doctor.report import JSON_NAME, MARKDOWN_NAME, Report

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(name="no_cuda")
def no_cuda_fixture(monkeypatch):
    """The CPU path even on a machine with a GPU (CI has none; this keeps the test CPU-sized)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="module", name="tiny")
def tiny_fixture(tmp_path_factory) -> dict[str, fixtures.Fixture]:
    return fixtures.make_fixtures(tmp_path_factory.mktemp("doctor"))


def test_gpu_check_without_a_gpu_runs_the_cpu_parts_and_names_every_skip(tmp_path, no_cuda):
    out = tmp_path / "report"
    result = invoke("doctor", "--gpu", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert f"report: {out / MARKDOWN_NAME}" in result.stdout
    data = json.loads((out / JSON_NAME).read_text())
    assert data["mode"] == "cpu"
    assert data["environment"]["why_cpu"] == "no CUDA device"
    assert data["environment"]["torch"] == torch.__version__
    checks = {c["name"]: c for c in data["checks"]}
    assert {c["status"] for c in checks.values()} <= {"pass", "skip", "info"}
    for kind in fixtures.KINDS:  # what needs CUDA is skipped, and says so
        for name in ("cuda == cpu", "guided: cuda == cpu", "compile == eager"):
            assert checks[f"{name} ({kind})"]["status"] == "skip"
        assert checks[f"batch == single, continuous == alone ({kind})"]["status"] == "pass"
        assert checks[f"bfloat16 end to end ({kind})"]["status"] == "pass"
    # The CPU references of the device matrix were decoded, every cell with no mask left.
    cells = checks["cuda == cpu (llada)"]["data"]["cells"]
    assert len(cells) == len(correctness.MATRIX)
    assert all(c["result"] == "cpu only" and c["cpu_masks_left"] == 0 for c in cells)
    assert checks["llada-8b: all"]["status"] == "skip"
    timed = checks["small: gen 64 dual+threshold"]["data"]
    assert timed["forwards"] == timed["steps"] > 0 and timed["cached_steps"] > 0
    assert 0 <= timed["outside_model"] < 1
    batching = checks["small: 4 slots static vs continuous"]["data"]
    assert batching["identical"] == batching["prompts"] == 8
    md = (out / MARKDOWN_NAME).read_text()
    assert "## Skipped here" in md and "compile == eager (dream): CPU run" in md
    assert "Random weights measure cost, not accuracy" in md
    assert "| small | 64 | dual+threshold | 64 |" in md


def test_a_spent_budget_skips_the_rest_and_still_writes_the_report(tmp_path, no_cuda):
    out = tmp_path / "r"
    result = invoke("doctor", "--out", str(out), "--budget", "1")
    assert result.exit_code == 0, result.output
    checks = json.loads((out / JSON_NAME).read_text())["checks"]
    spent = [c for c in checks if c["detail"] == "the time budget was spent before this check"]
    assert spent and checks[-1] in spent
    assert "--gpu not given" in (out / MARKDOWN_NAME).read_text()


def test_bad_input_is_one_line_and_exit_4(tmp_path):
    result = invoke("doctor", "--shapes", "llada-9b", "--out", str(tmp_path / "x"))
    assert result.exit_code == 4
    assert result.stderr.startswith("dllm: error: --shapes: unknown shape 'llada-9b'")
    assert not (tmp_path / "x").exists()


def test_a_check_that_raises_is_an_error_row_not_a_crash():
    def broken() -> Outcome:
        raise RuntimeError("CUDA error: an illegal memory access\nmore")

    freed = []
    check = attempt("speed", "x", broken, Deadline(60), after=freed.append)
    assert (check.status, check.detail) == (
        "error",
        "RuntimeError: CUDA error: an illegal memory access",
    )
    assert "Traceback" in check.data["traceback"] and freed == [RuntimeError]
    late = attempt("speed", "y", broken, Deadline(0))
    assert late.status == "skip"


def test_an_error_row_reaches_both_files_with_its_traceback(tmp_path):
    report = Report(tmp_path, "cuda", 10)
    check = attempt("correctness", "cuda == cpu (llada)", lambda: 1 / 0, Deadline(60))
    report.add(check, 1.0)
    assert json.loads((tmp_path / JSON_NAME).read_text())["summary"]["error"] == 1
    md = (tmp_path / MARKDOWN_NAME).read_text()
    assert "| cuda == cpu (llada) | error | ZeroDivisionError: division by zero |" in md
    assert "Traceback" in md


def test_the_float64_rerun_runs_and_agrees_on_one_device(tiny):
    s = fixtures.settings("dual", "threshold", True)
    assert "near-tie" in correctness.float64_verdict(tiny["dream"], "cpu", s, None)
    assert "near-tie" in correctness.float64_verdict(tiny["llada"], "cpu", s, "topk:3")


def test_the_tiny_folders_end_some_answers_early_and_commit_in_parallel(tiny):
    """Early stop and the confidence rules have something to do on these folders."""
    for kind in fixtures.KINDS:
        loaded = tiny[kind].load("cpu")
        s = fixtures.settings("dual", "threshold", True)
        run = Decoder(loaded.model, loaded.special, s).run(tiny[kind].batch)
        widest = max(len(c.positions) for event in run for c in event.commits)
        ends = [[t in loaded.special.stop for t in row[:-1]] for row in run.result().tokens]
        assert 0 < sum(map(any, ends)) < len(ends)  # some answers end early, not all
        assert widest > 1  # some step committed several tokens of one row


def test_the_memory_formula_matches_the_docs_at_llada_8b_shape():
    """Built on the meta device: LLaDA-8B's 8.0 B parameters and 384.5 MiB per slot (gen 256)."""
    model = speed.build(speed.SHAPES["llada-8b"], torch.device("meta"))
    mem = speed.memory(model, 16, 512 + 256 + 1, True, None)
    assert mem["kv_per_slot_bytes"] == 384.5 * 2**20
    assert round(mem["weights_bytes"] / 2 / 1e9, 2) == 8.02
    assert "384.5 MiB per slot, 6.0 GiB for 16 slots" in (ROOT / "docs" / "decoding.md").read_text()
    assert 16 * mem["kv_per_slot_bytes"] == pytest.approx(6.0 * 2**30, rel=0.01)


def test_importing_the_command_does_not_import_torch():
    code = "import sys, dllm_cli.commands.doctor; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


# --- the CUDA paths' logic, run with the "CUDA" half on the CPU ------------------------------


def replaying(run):
    """CPU stand-in for a CUDA graph recorder: a replay reruns the call into the same buffer."""
    out, static = run(), run()
    return out, lambda: static.copy_(run()), static


@pytest.fixture(name="cuda_on_cpu")
def cuda_on_cpu_fixture(monkeypatch):
    """Every "cuda" load lands on the CPU and --compile replays on the CPU: the comparison code
    of each CUDA check runs end to end (it proves the checks, not CUDA)."""
    real_load, real_enable = fixtures.Fixture.load, correctness.enable_compile

    def load(self, device, dtype="float32"):
        return real_load(self, "cpu", dtype)

    monkeypatch.setattr(fixtures.Fixture, "load", load)
    for module in (correctness, speed):
        monkeypatch.setattr(module, "enable_compile", lambda m: real_enable(m, replaying))


def test_device_comparisons_pass_when_the_devices_agree(tiny, cuda_on_cpu):
    matrix = correctness.check_matrix(tiny["dream"], "cuda")
    assert matrix.status == "pass", matrix.detail
    results = {c["result"] for c in matrix.data["cells"]}
    assert results == {"equal", "deterministic on device"}
    guided = correctness.check_guided(tiny["llada"], "cuda")
    assert guided.status == "pass", guided.detail
    compiled = correctness.check_compile(tiny["dream"], "cuda")
    assert compiled.status == "pass", compiled.detail
    assert compiled.data["replays"] > 0


def test_a_device_that_decodes_differently_fails_and_is_not_called_a_tie(tiny, monkeypatch):
    real_load = fixtures.Fixture.load

    def load(self, device, dtype="float32"):
        loaded = real_load(self, "cpu", dtype)
        if device != "cpu":  # a "device" whose LM head is off
            with torch.no_grad():
                loaded.model.lm_head.weight.mul_(-1)
        return loaded

    monkeypatch.setattr(fixtures.Fixture, "load", load)
    out = correctness.check_matrix(tiny["dream"], "cuda")
    assert out.status == "fail"
    assert "not a rounding tie" in out.detail and "answer position" in out.detail


def test_compile_that_replays_wrong_outputs_fails(tiny, monkeypatch):
    real_enable = correctness.enable_compile

    def zeros(run):
        out, static = run(), run()
        return out, lambda: static.zero_(), static

    real_load = fixtures.Fixture.load
    monkeypatch.setattr(fixtures.Fixture, "load", lambda s, d, t="float32": real_load(s, "cpu", t))
    monkeypatch.setattr(correctness, "enable_compile", lambda m: real_enable(m, zeros))
    out = correctness.check_compile(tiny["llada"], "cuda")
    assert out.status == "fail" and "answer position" in out.detail


def test_timed_compile_counts_replays_and_leaves_the_model_eager(cuda_on_cpu):
    shape = speed.SHAPES["small"]
    model = speed.build(shape, torch.device("cpu"))
    variant = next(v for v in speed.VARIANTS if v.compile)
    out = speed.time_variant(model, shape, variant, 32, torch.device("cpu"), Deadline(60))
    assert out.status == "info" and out.data["graph_replays"] > 0
    assert "forward" not in model.__dict__  # the class's eager forward again
