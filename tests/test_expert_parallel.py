"""--expert-parallel: LLaDA-MoE's and LLaDA2.x's experts shared out whole over 2 gloo ranks (CPU,
127.0.0.1) decode the tokens one process decodes, under every cache policy (both block caches
and LLaDA2.1's editing for LLaDA2.x), with and without a shared expert and a dense layer; each
rank holds half the expert bytes; one all-reduce per sparse layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from block_checkpoints import write_llada2
from checkpoints import write_llada, write_llada_moe
from cli_fixtures import error_lines, invoke, isolated_fixture  # noqa: F401
from test_tensor_parallel import launch

from dllm_cli.errors import SettingsError
from dllm_cli.models.collectives import Shards
from dllm_cli.models.llada2 import LLaDA2MoE, LLaDA2MoeConfig
from dllm_cli.models.llada_moe import LLaDAMoEConfig
from dllm_cli.models.loading import load_model
from dllm_cli.models.sharding import check_degree

HERE = Path(__file__).resolve().parent
EXPERT = "model.layers.{layer}.mlp.experts.{i}.down_proj.weight"


@pytest.fixture(scope="module", name="folders")
def folders_fixture(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ep")
    shared = {"shared_expert_intermediate_size": 24, "moe_layer_freq": [0, 1]}
    return {
        "plain": write_llada_moe(root / "plain", seed=1).folder,
        "shared": write_llada_moe(root / "shared", seed=2, **shared).folder,
    }


@pytest.mark.slow
def test_two_ranks_of_whole_experts_decode_the_one_process_tokens(folders, tmp_path):
    out = tmp_path / "seen.json"
    script = str(HERE / "tensor_parallel_rank.py")
    result = launch([script, str(out), "--expert-parallel", *map(str, folders.values())])
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(out.read_text())
    for name in folders:
        layers = seen[name]["layers"]
        runs = {k: v for k, v in seen[name].items() if k not in ("layers", "bytes", "expert_bytes")}
        assert len(runs) == 17, runs.keys()  # (with 6 sampled runs; wino, credit, eb, klass)
        for cache, run in runs.items():
            assert run["split"] == run["whole"], (name, cache)
            # attention's and the feed-forward's (experts + shared expert: one) per layer
            assert run["all_reduce"] == run["forwards"] * (2 * layers + 1), (name, cache)
        mine, whole = seen[name]["expert_bytes"]
        assert mine * 2 == whole, name
        mine, whole = seen[name]["bytes"]
        assert mine <= whole * (1 / 2 + 0.05), name


def test_each_rank_holds_its_own_experts_whole(folders):
    whole = load_model(folders["plain"], dtype="float32", device="cpu").model.state_dict()
    for rank in (0, 1):
        shards = Shards(rank, 2, expert_parallel=True)
        mine = load_model(folders["plain"], dtype="float32", device="cpu", shards=shards)
        held = mine.model.state_dict()
        names = [EXPERT.format(layer=0, i=i) for i in range(8)]
        kept = [n for n in names if n in held]
        assert kept == names[4 * rank : 4 * rank + 4]
        assert all(torch.equal(held[n], whole[n]) for n in kept)  # all columns
        gate = "model.layers.0.mlp.gate.weight"
        assert torch.equal(held[gate], whole[gate])  # the router: replicated


def test_a_degree_that_does_not_divide_the_experts_is_refused_with_its_numbers(tmp_path):
    config = LLaDAMoEConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4)
    config.num_experts, config.expert_intermediate_size = 6, 16
    with pytest.raises(
        SettingsError, match="--tensor-parallel 4 with --expert-parallel does not divide the "
        "model's 6 experts",
    ):  # fmt: skip
        check_degree("llada_moe", config, 4, experts=True)
    check_degree("llada_moe", config, 2, experts=True)
    folder = write_llada(tmp_path / "llada").folder
    with pytest.raises(
        SettingsError,
        match=r"--expert-parallel supports llada_moe, llada2 models only \(this is llada\)",
    ):
        load_model(folder, dtype="float32", device="cpu", shards=Shards(0, 2, expert_parallel=True))


@pytest.mark.slow
def test_generate_with_expert_parallel_writes_the_one_process_answers(folders):
    args = ["--model", str(folders["shared"]), "--device", "cpu", "--dtype", "float32"]
    args += ["--gen-length", "16", "--block-length", "8", "--cache", "dual", "--json"]
    text = "hello there\nthe cat\n"
    expected = invoke("generate", "-", *args, input=text)
    assert expected.exit_code == 0, expected.output
    command = ["-m", "dllm_cli", "generate", "-", *args, "--tensor-parallel", "2"]
    result = launch([*command, "--expert-parallel", "--stats"], text)
    assert result.returncode == 0, result.stderr[-3000:]
    ids = [json.loads(line)["token_ids"] for line in result.stdout.splitlines()]
    assert ids == [json.loads(line)["token_ids"] for line in expected.stdout.splitlines()]
    # 2 layers: attention's and the feed-forward's all-reduce each, and the embedding's
    assert "16 forwards, 80 all-reduces" in result.stderr


def test_expert_parallel_without_tensor_parallel_is_refused_in_one_line(folders):
    result = invoke("generate", "hi", "--model", str(folders["plain"]), "--expert-parallel")
    assert result.exit_code == 2
    assert error_lines(result) == [
        "dllm: error: --expert-parallel shares the experts out over the --tensor-parallel "
        "ranks: give --tensor-parallel N too"
    ]


@pytest.mark.parametrize("grouped", [True, False])
def test_the_ranks_parts_of_a_sparse_block_sum_to_its_output(monkeypatch, grouped):
    import copy

    from torch import nn

    from dllm_cli.models import expert_parallel, moe
    from dllm_cli.models.moe import LLaDAMoESparseBlock

    monkeypatch.setattr(moe, "grouped_kernel", lambda rows: grouped)
    torch.manual_seed(0)
    block = LLaDAMoESparseBlock(32, 8, 3, 16, expert_bias=True)
    for p in [*block.parameters(), block.expert_bias]:
        nn.init.normal_(p, std=0.2)
    whole = copy.deepcopy(block)
    whole.stack_experts()
    x = torch.randn(2, 7, 32)
    parts = []
    for rank in (0, 1):
        mine = copy.deepcopy(block)
        layer = nn.Module()
        layer.mlp = mine
        expert_parallel.keep_experts(layer, Shards(rank, 2))
        mine.stack_experts()
        assert list(mine.experts) == [str(i) for i in range(4 * rank, 4 * rank + 4)]
        parts.append(mine(x))
    torch.testing.assert_close(parts[0] + parts[1], whole(x), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module", name="llada2")
def llada2_fixture(tmp_path_factory) -> Path:
    return write_llada2(tmp_path_factory.mktemp("ep") / "llada2").folder


@pytest.mark.slow
def test_two_ranks_of_whole_llada2_experts_decode_the_one_process_tokens(llada2, tmp_path):
    out = tmp_path / "seen.json"
    script = str(HERE / "tensor_parallel_block_rank.py")
    result = launch([script, str(out), "--expert-parallel", str(llada2)])
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(out.read_text())["llada2"]
    mine, whole = runs.pop("expert_bytes")
    assert mine * 2 == whole
    assert len(runs) == 8, runs.keys()  # both block caches x (threshold, fixed, sampled, editing)
    for name, run in runs.items():
        assert run["split"] == run["whole"], name
        # 3 layers (1 dense): attention's and the feed-forward's all-reduce each, the embedding's
        assert run["all_reduce"] == run["forwards"] * (2 * 3 + 1), name
    assert all(runs[f"{cache} editing"]["edited"] > 0 for cache in ("prefix", "none"))


def test_each_rank_holds_its_own_llada2_experts_whole(llada2):
    whole = load_model(llada2, dtype="float32", device="cpu").model.state_dict()
    expert = "model.layers.1.mlp.experts.{i}.down_proj.weight"
    for rank in (0, 1):
        shards = Shards(rank, 2, expert_parallel=True)
        held = load_model(llada2, dtype="float32", device="cpu", shards=shards).model.state_dict()
        names = [expert.format(i=i) for i in range(8)]
        kept = [n for n in names if n in held]
        assert kept == names[4 * rank : 4 * rank + 4]
        assert all(torch.equal(held[n], whole[n]) for n in kept)  # all columns
        for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.expert_bias"):
            assert torch.equal(held[name], whole[name])  # the router: replicated
        shared = "model.layers.1.mlp.shared_experts.down_proj.weight"
        assert torch.equal(held[shared], whole[shared][:, 6 * rank : 6 * rank + 6])


def test_a_degree_that_does_not_divide_llada2s_experts_is_refused_with_its_numbers():
    config = LLaDA2MoeConfig(num_attention_heads=4, num_key_value_heads=4, intermediate_size=48)
    config.num_experts, config.moe_intermediate_size = 6, 12
    with pytest.raises(
        SettingsError, match="--tensor-parallel 4 with --expert-parallel does not divide the "
        "model's 6 experts",
    ):  # fmt: skip
        check_degree("llada2", config, 4, experts=True)
    check_degree("llada2", config, 2, experts=True)


def test_the_ranks_parts_of_a_llada2_moe_sum_to_its_output(monkeypatch):
    import copy

    from torch import nn

    from dllm_cli.models.sharded_llada2 import keep_llada2_experts

    monkeypatch.setattr(Shards, "all_reduce", lambda self, x: x)  # each rank's part, unsummed
    config = LLaDA2MoeConfig(hidden_size=32, num_experts=8, n_group=4, topk_group=2)
    config.num_experts_per_tok, config.moe_intermediate_size, config.num_shared_experts = 3, 16, 0
    torch.manual_seed(0)
    block = LLaDA2MoE(config)
    for p in [*block.parameters(), block.gate.expert_bias]:
        nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 7, 32)
    parts = []
    for rank in (0, 1):
        mine = copy.deepcopy(block)
        keep_llada2_experts(mine, Shards(rank, 2))
        assert list(mine.experts) == [str(i) for i in range(4 * rank, 4 * rank + 4)]
        parts.append(mine(x))
    torch.testing.assert_close(parts[0] + parts[1], block(x), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_generate_with_expert_parallel_writes_the_one_process_llada2_answers(llada2):
    args = ["--model", str(llada2), "--device", "cpu", "--dtype", "float32", "--temperature", "0"]
    args += ["--gen-length", "8", "--block-length", "4", "--json", "--batch-size", "2"]
    text = "one two\nthree four five\n"
    expected = invoke("generate", "-", *args, input=text)
    assert expected.exit_code == 0, expected.output
    command = ["-m", "dllm_cli", "generate", "-", *args, "--tensor-parallel", "2"]
    result = launch([*command, "--expert-parallel"], text)
    assert result.returncode == 0, result.stderr[-3000:]
    ids = [json.loads(line)["token_ids"] for line in result.stdout.splitlines()]
    assert ids == [json.loads(line)["token_ids"] for line in expected.stdout.splitlines()]
