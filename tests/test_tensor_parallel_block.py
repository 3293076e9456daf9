"""--tensor-parallel for the block-diffusion families: SDAR's and LLaDA2.x's models split (each
rank's logits are its vocabulary range of one process's, its KV cache holds its KV heads) and
the block stepper drafts from each rank's vocabulary shard: greedy tokens == one process under
both block caches, LLaDA2.1's token editing included, and through `torchrun -m dllm_cli`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from block_checkpoints import write_llada2, write_sdar
from cli_fixtures import invoke, isolated_fixture  # noqa: F401
from test_tensor_parallel import launch

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module", name="sdar")
def sdar_fixture(tmp_path_factory) -> Path:
    return write_sdar(tmp_path_factory.mktemp("tpb") / "sdar").folder


@pytest.fixture(scope="module", name="llada2")
def llada2_fixture(tmp_path_factory) -> Path:
    return write_llada2(tmp_path_factory.mktemp("tpb") / "llada2").folder


@pytest.mark.slow
def test_two_ranks_compute_their_range_of_the_one_process_logits(sdar, llada2, tmp_path):
    out = tmp_path / "seen"
    script = str(HERE / "tensor_parallel_forward.py")
    result = launch([script, str(out), str(sdar), str(llada2)])
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("sdar", "llada2"):
        ranks = [json.loads(Path(f"{out}.{name}.{r}").read_text()) for r in (0, 1)]
        for seen in ranks:
            assert seen["difference"] < 1e-5, (name, seen)
            assert seen["keys"][1] == 1  # 2 KV heads over 2 ranks
            mine, whole = seen["bytes"]
            assert mine <= whole * (1 / 2 + 0.05), name
        (lo0, hi0, size), (lo1, hi1, _) = (s["columns"] for s in ranks)
        assert (lo0, hi0, hi1) == (0, lo1, size)  # the two ranges tile the vocabulary


@pytest.mark.slow
def test_two_ranks_decode_the_one_process_tokens_under_both_block_caches(sdar, llada2, tmp_path):
    out = tmp_path / "seen.json"
    result = launch([str(HERE / "tensor_parallel_block_rank.py"), str(out), str(sdar), str(llada2)])
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(out.read_text())
    for runs in seen.values():
        runs.pop("expert_bytes")  # the expert-parallel launch's (tests/test_expert_parallel.py)
    # caches x (two rules, sampled drafts, + editing)
    assert len(seen["sdar"]) == 6 and len(seen["llada2"]) == 8
    for name, runs in seen.items():
        for run, tokens in runs.items():
            assert tokens["split"] == tokens["whole"], (name, run)
            # one all-gather of a few numbers per column drafts each decode forward (a prefix
            # cache's one prefill forward drafts nothing): the logits are never gathered
            prefills = run.startswith("prefix")
            assert tokens["all_gather"] == tokens["forwards"] - prefills, (name, run)
    for cache in ("prefix", "none"):
        assert seen["llada2"][f"{cache} editing"]["edited"] > 0  # LLaDA2.1's edits happened


@pytest.mark.slow
def test_two_ranks_decode_the_one_process_int8_block_tokens(sdar, llada2, tmp_path):
    out = tmp_path / "seen.json"
    script = str(HERE / "tensor_parallel_block_rank.py")
    result = launch([script, str(out), "--quantize=int8", str(sdar), str(llada2)])
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(out.read_text())
    for name, runs in seen.items():
        mine, whole = runs.pop("quantized_bytes")
        assert mine <= whole * (1 / 2 + 0.05), name
        runs.pop("expert_bytes")
        for run, tokens in runs.items():
            assert tokens["split"] == tokens["whole"], (name, run)
            assert tokens["all_reduce_max"] > 0, (name, run)  # int8 activations' row peaks
    for run in seen["sdar"].values():  # 2 layers: o_proj twice, one down_proj (first: float)
        assert run["all_reduce_max"] == 3 * run["forwards"]


def both_generates(sdar, *extra: str) -> tuple[list[str], list[str]]:
    """`generate -` of two lines on one process and under two torchrun ranks: their records
    (SDAR's reference default samples at temperature 1.0: the same seed, the same tokens)."""
    args = [
        "--model", str(sdar), "--device", "cpu", "--dtype", "float32", "--seed", "3",
        "--block-length", "4", "--json", *extra,
    ]  # fmt: skip
    text = "one two\nthree four five\n"
    expected = invoke("generate", "-", *args, input=text)
    assert expected.exit_code == 0, expected.output
    result = launch(["-m", "dllm_cli", "generate", "-", *args, "--tensor-parallel", "2"], text)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tensor parallel rank 1 of 2:" in result.stderr
    return expected.stdout.splitlines(), result.stdout.splitlines()


@pytest.mark.slow
def test_json_schema_answers_under_torchrun_are_the_one_process_sdar_answers(sdar, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}
        },
        "required": ["ok", "n"], "additionalProperties": False,
    }))  # fmt: skip
    alone, split = both_generates(sdar, "--gen-length", "24", "--json-schema", str(schema))
    texts = [json.loads(line)["text"] for line in split]
    assert texts == [json.loads(line)["text"] for line in alone]
    assert all(isinstance(json.loads(t), dict) for t in texts)


@pytest.mark.slow
def test_generate_under_torchrun_writes_the_one_process_sdar_answers_and_logprobs(sdar):
    extra = ("--gen-length", "8", "--batch-size", "2", "--logprobs", "2")
    alone, split = both_generates(sdar, *extra)
    fields = ("line", "token_ids", "forwards", "steps")
    records = [{k: json.loads(line)[k] for k in fields} for line in split]
    assert records == [{k: json.loads(line)[k] for k in fields} for line in alone]
    # each token's log-probability and alternatives, from the gathered candidates
    for mine, theirs in zip(split, alone, strict=True):
        got, want = json.loads(mine)["logprobs"], json.loads(theirs)["logprobs"]
        assert [t["token"] for t in got] == [t["token"] for t in want] and got
        assert [t["logprob"] for t in got] == pytest.approx([t["logprob"] for t in want], abs=1e-4)
        for g, w in zip(got, want, strict=True):
            assert [a["token"] for a in g["top_logprobs"]] == [
                a["token"] for a in w["top_logprobs"]
            ]
