"""`dllm bench --peer llama-cpp`: llama.cpp's timing line, the matching work, bad paths.

The fixture `llamacpp_diffusion_output.txt` is the real output (stdout and stderr together) of
llama.cpp's `llama-diffusion-cli` built from ggml-org/llama.cpp's sources (the unslothai
mirror, commit d32676d77426540327835040d5d3279728f0b4c8, CPU, Release, GGML_NATIVE) on a GGUF
converted by benchmarks/peer_gguf.py from a random Dream folder (hidden 512, 8 layers), gen 16
after the 125-token chat-wrapped default prompt, 1 thread, on this project's 2-core Xeon: the
command line is the fixture's first line. A test that runs the real binary
needs DLLM_PEER_BINARY, DLLM_PEER_GGUF and DLLM_PEER_FOLDER and is skipped without them.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from cli_fixtures import invoke, isolated_fixture  # noqa: F401

from dllm_cli import peer
from dllm_cli.errors import DllmError, UsageError
from dllm_cli.peer import (
    LoadGate,
    Timed,
    Work,
    comparability,
    compare,
    dllm_argv,
    llamacpp_argv,
    markdown,
    parse_llamacpp,
    precision_for,
    summary,
)

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "llamacpp_diffusion_output.txt"


def test_the_decode_time_is_read_from_llamacpp_s_real_output():
    text = FIXTURE.read_text(errors="replace")
    line = next(x for x in text.splitlines() if x.startswith("total time:"))
    ms = float(line.split("total time: ")[1].split("ms")[0])
    assert parse_llamacpp(text) == pytest.approx(ms / 1000)
    with pytest.raises(DllmError, match="no 'total time' line"):
        parse_llamacpp(text.replace("total time", "total tiem"))


def test_both_sides_get_the_same_work():
    w = Work("hi", prompt_tokens=40, gen=24, threads=3)
    peer, ours = llamacpp_argv(Path("llama"), Path("m.gguf"), w), dllm_argv("folder", w)

    def after(argv: list[str], flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert [after(peer, f) for f in ("-ub", "-b", "-c")] == ["64"] * 3  # prompt + canvas
    assert after(peer, "--diffusion-steps") == after(ours, "--steps") == "24"
    assert after(peer, "-t") == after(peer, "-tb") == after(ours, "--threads") == "3"
    assert after(peer, "--diffusion-algorithm") == "4"  # confidence: Dream's maskgit_plus
    assert after(ours, "--confidence") == "low_confidence" and after(ours, "--cache") == "none"
    assert after(ours, "--gen-length") == after(ours, "--block-length") == "24"
    assert after(ours, "--schedule") == "dream" and "--no-early-stop" in ours
    assert after(peer, "-p") == after(ours, "generate") == "hi"
    assert after(ours, "--quantize") == "none" and after(ours, "--dtype") == "float32"
    q4 = Work("hi", prompt_tokens=40, gen=24, threads=3, quantize="int4")
    assert after(dllm_argv("folder", q4), "--quantize") == "int4"


def test_each_gguf_precision_runs_its_quantize_and_a_mismatch_is_refused():
    assert precision_for(None, None).quantize == "none"
    assert precision_for("q8_0", None).quantize == "int8"
    assert precision_for("q4_0", "int4").quantize == "int4"
    refusals = [
        (("q4_0", "int8"), "--quantize int8 does not match --peer-quant q4_0"),
        ((None, "int4"), "give --peer-quant q4_0"),
        (("q5_k", None), "--peer-quant takes one of: f32, q8_0, q4_0"),
    ]
    for args, words in refusals:
        with pytest.raises(UsageError, match=words):
            precision_for(*args)


def test_a_pair_measured_above_the_load_limit_is_not_comparable():
    assert comparability([0.2, 1.5])["comparable"] is True
    verdict = comparability([0.4, 2.7, 1.6])
    assert verdict["comparable"] is False and verdict["pair_loads"] == [0.4, 2.7, 1.6]
    assert verdict["comparable_note"] == "no: 2 of 3 pairs above 1.5"


class Clock:
    """A load reader and sleeper: the load falls by `fall` per second slept (no real time)."""

    def __init__(self, load: float, fall: float = 0.0):
        self.load, self.fall, self.slept, self.said = load, fall, [], []

    def read(self) -> float:
        return self.load

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.load -= self.fall * seconds

    def gate(self, patience: float = 60.0) -> LoadGate:
        return LoadGate(1.0, patience, 5.0, self.read, self.sleep, self.said.append)


def test_the_gate_waits_for_the_load_to_fall_and_no_longer():
    """A quiet machine: no wait. A falling load: polls until it is below 1, then measures.
    A load that stays high: stops after the patience (the pair is then not comparable)."""
    quiet = Clock(0.4)
    assert quiet.gate().wait() == 0.4 and quiet.slept == [] and quiet.said == []
    falling = Clock(1.9, fall=0.04)  # below 1 after 25 s: five polls of 5 s
    assert falling.gate().wait() < 1.0 and falling.slept == [5.0] * 5
    assert "waiting up to 60 s" in falling.said[0] and "after 25 s: quiet" in falling.said[-1]
    stuck = Clock(3.0)
    assert stuck.gate(patience=12).wait() == 3.0 and stuck.slept == [5.0, 5.0, 2.0]
    assert "after 12 s: still high" in stuck.said[-1]


def test_each_pair_is_measured_after_the_gate_and_judged_on_its_load(monkeypatch):
    """compare() waits before every pair; a pair is not comparable only if the load stayed
    high: after the gate, the load its own previous runs left is gone."""
    clock = Clock(2.0, fall=0.1)  # every run leaves 2.0 behind (a 2-thread run)

    def run(*_):
        clock.load = 2.0
        return Timed(1.0, 1.5)

    monkeypatch.setattr(peer, "run_llamacpp", run)
    monkeypatch.setattr(peer, "run_dllm", run)
    work = Work("hi", prompt_tokens=8, gen=4, threads=2)
    (record,) = compare(Path("b"), Path("g"), "f", [work], rounds=3, gate=clock.gate())
    assert record["comparable"] is True and all(x < 1.0 for x in record["pair_loads"])
    assert len(record["pair_loads"]) == 3 and sum(clock.slept) == 3 * 15.0
    stuck = Clock(2.0)
    (record,) = compare(Path("b"), Path("g"), "f", [work], rounds=2, gate=stuck.gate(10))
    assert record["comparable"] is False and record["pair_loads"] == [2.0, 2.0]


def test_the_summary_gives_medians_per_step_and_the_ratio():
    w = Work("hi", prompt_tokens=64, gen=128, threads=2)
    runs = {
        "llama.cpp": [Timed(6.4, 6.5), Timed(5.12, 5.2), Timed(9.0, 9.1)],
        "dllm": [Timed(3.84, 8.0), Timed(4.0, 8.2), Timed(3.2, 7.5)],
    }
    record = summary(w, runs)
    assert record["columns"] == 192 and record["rounds"] == 3
    assert record["llamacpp_decode_s"] == 6.4 and record["dllm_decode_s"] == 3.84
    assert record["llamacpp_step_ms"] == 50.0 and record["dllm_step_ms"] == 30.0
    assert record["decode_ratio"] == pytest.approx(6.4 / 3.84, abs=1e-3)
    assert record["llamacpp_runs_s"] == [6.4, 5.12, 9.0] and record["dllm_runs_s"][0] == 3.84
    record["load_average"] = [0.1, 1.5]
    record |= comparability([0.1, 0.9, 1.2])
    row = markdown([record]).splitlines()[2]
    assert row.startswith("| 128 | 192 | 6.4 | 3.84 |") and row.endswith("| 0.1, 1.5 | yes |")


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda d: d / "absent", "--peer-binary"),
        (lambda d: (d / "plain.txt", (d / "plain.txt").write_text("x"))[0], "not executable"),
    ],
    ids=["missing", "not-executable"],
)
def test_a_bad_binary_is_one_line_and_exit_2_before_loading(make, words, tmp_path, dream_ckpt):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    args = ["--peer-binary", str(make(tmp_path)), "--peer-model", str(gguf)]
    result = invoke("bench", "--peer", "llama-cpp", "--model", str(dream_ckpt.folder), *args)
    assert result.exit_code == 2, result.output
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("dllm: error: ") and words in lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--peer", "vllm"], "--peer takes one of: llama-cpp"),
        (["--peer", "llama-cpp", "--peer-model", "m.gguf"], "--peer needs --peer-binary"),
        (["--peer", "llama-cpp", "--peer-binary", "BIN", "--peer-model", "none.gguf"], "none.gguf"),
        (["--peer", "llama-cpp", "--peer-quant", "q2_k"], "--peer-quant takes one of"),
        (["--peer", "llama-cpp", "--peer-quant", "q4_0", "--quantize", "int8"], "does not match"),
    ],
    ids=["unknown-peer", "no-binary", "missing-gguf", "unknown-quant", "mismatched-quant"],
)
def test_peer_usage_errors(extra, words, tmp_path, dream_ckpt):
    binary = executable(tmp_path / "llama-diffusion-cli", "#!/bin/sh\nexit 0\n")
    extra = [str(binary) if x == "BIN" else x for x in extra]
    result = invoke("bench", "--model", str(dream_ckpt.folder), *extra)
    assert result.exit_code == 2, result.output
    assert words in result.stderr and result.stderr.count("dllm: error:") == 1


@pytest.mark.slow
def test_a_run_against_a_binary_replaying_llamacpp_s_output(tmp_path, dream_ckpt, monkeypatch):
    """The whole pipeline (both processes, medians, table, JSON) with the fixture as the peer
    (no waiting for a quiet machine: the gate's own test covers it)."""
    monkeypatch.setattr(peer, "LOAD_WAIT_S", 0.0)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    replay = executable(tmp_path / "replay", f"#!/bin/sh\ncat '{FIXTURE}' >&2\n")
    out = tmp_path / "peer.json"
    args = ["--peer-binary", str(replay), "--peer-model", str(gguf), "--json", str(out)]
    result = invoke(
        "bench", "--peer", "llama-cpp", "--model", str(dream_ckpt.folder), "--threads", "1",
        "--gen-length", "8", "--rounds", "2", *args,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (record,) = json.loads(out.read_text())
    assert record["gen_length"] == 8 and record["rounds"] == 2 and record["threads"] == 1
    assert record["llamacpp_decode_s"] == pytest.approx(
        parse_llamacpp(FIXTURE.read_text(errors="replace")), 1e-3
    )
    assert record["dllm_decode_s"] > 0 and record["dllm_wall_s"] > record["dllm_decode_s"]
    assert record["decode_ratio"] == pytest.approx(
        record["llamacpp_decode_s"] / record["dllm_decode_s"], rel=0.01, abs=1e-3
    )
    assert record["llamacpp_step_ms"] == pytest.approx(record["llamacpp_decode_s"] * 1e3 / 8, 1e-3)
    assert len(record["load_average"]) == 2 and len(record["pair_loads"]) == 2
    assert record["quantize"] == "none" and isinstance(record["comparable"], bool)
    assert "| 8 |" in result.stdout and "load average" in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(
    not all(os.environ.get(k) for k in ("DLLM_PEER_BINARY", "DLLM_PEER_GGUF", "DLLM_PEER_FOLDER")),
    reason="needs a built llama-diffusion-cli and a converted GGUF (docs/cpu.md)",
)
def test_the_real_llamacpp_binary(tmp_path):
    out = tmp_path / "peer.json"
    env = os.environ
    result = invoke(
        "bench", "--peer", "llama-cpp", "--peer-binary", env["DLLM_PEER_BINARY"],
        "--peer-model", env["DLLM_PEER_GGUF"], "--model", env["DLLM_PEER_FOLDER"],
        "--threads", "1", "--gen-length", "8", "--json", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (record,) = json.loads(out.read_text())
    assert record["llamacpp_decode_s"] > 0 and record["dllm_decode_s"] > 0
