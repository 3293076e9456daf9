"""`dllm eval` and `dllm bench` under `torchrun --nproc-per-node 2 ... --tensor-parallel 2` (CPU,
gloo, 127.0.0.1): rank 0 prints what one process prints (timings aside), the other rank nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkpoints import write_llada
from cli_fixtures import error_lines, invoke, isolated_fixture  # noqa: F401
from test_tensor_parallel import launch

TIMED = ("seconds", "tokens_per_second", "gen_tokens_per_second")
PROBLEMS = [
    ("tom has 3 pens and buys 2 more. how many pens?", "3 + 2 = 5\n#### 5"),
    ("ann has 5 cats and 2 dogs. how many pets?", "#### 7"),
    ("sam buys 4 books", "#### 4"),
    ("what is 2 + 2 ?", "#### 4"),
]
MODEL = ["--device", "cpu", "--dtype", "float32", "--gen-length", "16", "--block-length", "8"]


@pytest.fixture(scope="module", name="llada")
def llada_fixture(tmp_path_factory) -> Path:
    return write_llada(
        tmp_path_factory.mktemp("tp") / "llada", seed=1, max_sequence_length=256
    ).folder


def untimed(report: dict) -> dict:
    return {k: v for k, v in report.items() if k not in TIMED}


@pytest.mark.slow
def test_eval_under_two_ranks_scores_what_one_process_scores(llada, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in PROBLEMS))
    args = ["eval", "--model", str(llada), *MODEL, "--data", str(data), "--shots", "1"]
    args += ["--json", "--details", "--batch-size", "2", "--records", str(tmp_path / "r.jsonl")]
    expected = invoke(*args)
    assert expected.exit_code == 0, expected.output
    alone = (tmp_path / "r.jsonl").read_text()
    result = launch(["-m", "dllm_cli", *args, "--tensor-parallel", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    (report,) = [json.loads(line) for line in result.stdout.splitlines()]  # rank 0's alone
    wanted = json.loads(expected.stdout)
    assert untimed(report) == untimed(wanted)
    assert [p["text"] for p in report["problems"]] == [p["text"] for p in wanted["problems"]]
    assert (tmp_path / "r.jsonl").read_text() == alone  # rank 0 wrote the same records
    assert "tensor parallel rank 1 of 2:" in result.stderr


def test_eval_with_tensor_parallel_outside_torchrun_is_refused_in_one_line(llada):
    result = invoke("eval", "--model", str(llada), "--n", "1", "--tensor-parallel", "2")
    assert result.exit_code == 2
    assert error_lines(result) == [
        "dllm: error: --tensor-parallel 2 needs 2 processes or a multiple (this run has 1): "
        "launch with torchrun --nproc-per-node 2"
    ]


@pytest.mark.slow
def test_bench_under_two_ranks_counts_what_one_process_counts(llada, tmp_path):
    # (-n: torchrun's own parser would take --n for one of its flags)
    args = ["bench", "--model", str(llada), *MODEL, "-n", "2", "--shots", "1"]
    args += ["--strategies", "baseline,dual+parallel"]
    expected = invoke(*args, "--json", str(tmp_path / "one.json"))
    assert expected.exit_code == 0, expected.output
    result = launch(
        ["-m", "dllm_cli", *args, "--json", str(tmp_path / "two.json"), "--tensor-parallel", "2"]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    skip = (*TIMED, "speedup")
    assert [{k: v for k, v in r.items() if k not in skip} for r in two] == [
        {k: v for k, v in r.items() if k not in skip} for r in one
    ]
    assert result.stdout.count("dual+parallel") == 1  # rank 0's table alone


@pytest.mark.slow
def test_bench_frontier_and_batching_compare_under_two_ranks_count_what_one_process_counts(
    llada, tmp_path
):
    runs = {
        "frontier": ["--frontier", "threshold=0.5", "--batch-size", "2"],
        "batching": ["--batching-compare", "dual+parallel", "--batch-size", "2"],
    }
    skip = (*TIMED, "speedup", "prompts_per_second", "steps_per_second")
    for name, mode in runs.items():
        args = ["bench", "--model", str(llada), *MODEL, "-n", "3", "--shots", "1", *mode]
        expected = invoke(*args, "--json", str(tmp_path / f"{name}-one.json"))
        assert expected.exit_code == 0, expected.output
        two = tmp_path / f"{name}-two.json"
        result = launch(["-m", "dllm_cli", *args, "--json", str(two), "--tensor-parallel", "2"])
        assert result.returncode == 0, result.stderr[-3000:]
        one, two = (json.loads(p.read_text()) for p in (tmp_path / f"{name}-one.json", two))
        assert [{k: v for k, v in r.items() if k not in skip} for r in two] == [
            {k: v for k, v in r.items() if k not in skip} for r in one
        ]
        assert result.stdout.count("|") == expected.stdout.count("|")  # rank 0's table alone


@pytest.mark.parametrize("mode", ["--serve", "--peer"])
def test_bench_modes_that_measure_a_server_or_a_peer_are_refused_under_tensor_parallel(llada, mode):
    value = ["llama-cpp"] if mode == "--peer" else []
    result = invoke("bench", "--model", str(llada), mode, *value, "--tensor-parallel", "2")
    assert result.exit_code == 2
    assert error_lines(result) == [
        "dllm: error: --tensor-parallel runs the strategy table, --frontier and "
        f"--batching-compare, not {mode}"
    ]
