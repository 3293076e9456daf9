"""lm-evaluation-harness (PyPI lm-eval) against a real `dllm serve` on a loopback port, offline:
a multiple-choice task over a local JSONL through `local-completions` (echo scoring), and a
generate_until task through `local-chat-completions`, both at num_concurrent=4."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_fixtures import invoke
from served import launch

from dllm_cli.runtime import open_runtime
from dllm_cli.serve.conversation import Message, encode_messages

ROOT = Path(__file__).resolve().parent.parent
HELDOUT = ROOT / "dllm_cli" / "tinygsm" / "heldout"
RICH, NARROW = HELDOUT / "rich.jsonl", HELDOUT / "narrow.jsonl"  # worked solutions; short ones
FOLDER = ROOT / "dllm_cli" / "tinygsm" / "weights" / "tiny-gsm"
PROFILE = "tiny-gsm"
QUESTIONS = 8
GEN = 64
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

MC_TASK = """task: dllm_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: " "
metric_list:
  - metric: acc
"""
GEN_TASK = """task: dllm_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: []
  max_gen_toks: {gen}
filter_list:
  - name: number
    filter:
      - function: regex
        regex_pattern: "The answer is (\\\\d+)"
      - function: take_first
metric_list:
  - metric: exact_match
"""


def rows(path: Path = RICH) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[:QUESTIONS]]


def mc_docs() -> list[dict]:
    """The chat prompt and the worked solution up to its last number; the choices are the true
    answer and three near misses, the true one at a rotating place."""
    tok = open_runtime(PROFILE, {}).loaded.tokenizer
    docs = []
    for i, r in enumerate(rows()):
        prompt = tok.decode(encode_messages(tok, [Message("user", r["question"])]))
        solution, answer = r["solution"], r["answer"]
        context = prompt + solution[: solution.rindex(f" {answer}")]
        wrong = [answer + 1, answer + 10, answer + 2]
        gold = i % 4
        choices = [str(n) for n in [*wrong[:gold], answer, *wrong[gold:]]]
        docs.append({"context": context, "choices": choices, "gold": gold})
    return docs


def start_server(*flags: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "dllm_cli", "serve", "-p", PROFILE, "--port", "0", *flags]
    return launch(args, env)


def lm_eval(tmp: Path, model: str, model_args: str, task: str, *extra: str) -> tuple[dict, str]:
    """`lm_eval` as a user runs it; its results JSON and its log."""
    out = tmp / f"out-{task}"
    args = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args]
    args += ["--tasks", task, "--include_path", str(tmp), "--output_path", str(out)]
    args += ["--log_samples", *extra]
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900, cwd=tmp)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    return results, log


@pytest.fixture(scope="module")
def served():
    proc, url = start_server(
        "--gen-length", str(GEN), "--score-samples", "8", "--score-splits", "4"
    )
    yield url
    proc.terminate()
    proc.wait(timeout=60)


@pytest.mark.slow
def test_multiple_choice_by_echo_scoring(served, tmp_path):
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in mc_docs()))
    (tmp_path / "mc.yaml").write_text(MC_TASK.format(data=data))
    args = f"base_url={served}/v1/completions,model={PROFILE},tokenizer={FOLDER},"
    args += "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1"
    results, log = lm_eval(tmp_path, "local-completions", args, "dllm_tiny_mc", "--batch_size", "2")
    acc = results["results"]["dllm_tiny_mc"]["acc,none"]
    print(f"lm-eval multiple-choice acc {acc} over {QUESTIONS} questions")
    assert acc >= 0.5, acc  # chance is 0.25
    assert "API request failed" not in log and "ServerDisconnectedError" not in log


@pytest.mark.slow
def test_generate_until_by_chat_matches_generate(served, tmp_path):
    data = tmp_path / "gen.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(NARROW)))
    (tmp_path / "gen.yaml").write_text(GEN_TASK.format(data=data, gen=GEN))
    args = f"base_url={served}/v1/chat/completions,model={PROFILE},num_concurrent=4,max_retries=1"
    results, log = lm_eval(
        tmp_path, "local-chat-completions", args, "dllm_tiny_gen", "--apply_chat_template"
    )
    assert "API request failed" not in log and "ServerDisconnectedError" not in log
    samples = [json.loads(x) for x in next(tmp_path.rglob("samples_dllm_tiny_gen*.jsonl")).open()]
    got = {s["doc"]["question"]: s["resps"][0][0] for s in samples}
    questions = [r["question"] for r in rows(NARROW)]
    cli = invoke("generate", "-p", PROFILE, "--json", "--gen-length", str(GEN), "-",
                 input="\n".join(questions) + "\n")  # fmt: skip
    assert cli.exit_code == 0, cli.output
    want = [json.loads(line)["text"] for line in cli.stdout.splitlines()]
    assert [got[q] for q in questions] == want
    right = sum(
        f"The answer is {r['answer']}" in w for r, w in zip(rows(NARROW), want, strict=True)
    )
    print(f"lm-eval generate_until exact_match {right / QUESTIONS} over {QUESTIONS} questions")
    assert results["results"]["dllm_tiny_gen"]["exact_match,number"] == right / QUESTIONS > 0
