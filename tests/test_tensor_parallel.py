"""--tensor-parallel: a model split over torchrun ranks (CPU, gloo, 127.0.0.1) decodes the
tokens one process decodes, every cache policy, LLaDA, Dream and LLaDA-MoE, float, int8 and
int4, under --compile's recorder and from one prompt; each rank holds about half the weights;
the collectives per forward stay at two per layer plus the embedding's (int8: one MAX more per
row-parallel layer), one gather per draft; what is not supported is refused in one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import write_dream, write_llada, write_llada_moe
from cli_fixtures import error_lines, invoke, isolated_fixture  # noqa: F401
from test_distributed import LAUNCH_TIMEOUT, loopback_env

from dllm_cli.distributed.tensor import place
from dllm_cli.errors import SettingsError
from dllm_cli.models.dream import DreamConfig
from dllm_cli.models.llada import LLaDAConfig
from dllm_cli.models.loading import load_model
from dllm_cli.models.quantize import weight_bytes
from dllm_cli.models.sharding import Shards, check_degree

HERE = Path(__file__).resolve().parent
DOWN = {  # a row-parallel weight: split over its inputs
    "llada": "model.transformer.blocks.0.ff_out.weight",
    "dream": "model.layers.0.mlp.down_proj.weight",
    "llada_moe": "model.layers.0.mlp.experts.3.down_proj.weight",  # (summed once per block)
}
LINES = ["how many apples", "tom has 3 pens", "what is 2 + 2 ?"]
WIDE = {"d_model": 64, "mlp_hidden_size": 128}  # int4: each rank's inputs whole groups of 32


@pytest.fixture(scope="module", name="folders")
def folders_fixture(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    return {
        "llada": write_llada(root / "llada", seed=1, max_sequence_length=64).folder,
        "dream": write_dream(root / "dream", seed=1).folder,
        "llada_moe": write_llada_moe(root / "llada_moe", seed=1).folder,
    }


def launch(
    command: list[str], stdin: str = "", ranks: int = 2, nodes: int = 1
) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node RANKS COMMAND` on the loopback interface; with NODES, one
    torchrun a "machine" (`--nnodes`, `--node-rank`: the multi-node rendezvous), RANKS over
    them all, stdin to node 0's (node 0's result, every node's stderr)."""
    env = loopback_env()
    runs = [
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks // nodes),
            "--nnodes", str(nodes), "--node-rank", str(node), "--master-addr",
            env["MASTER_ADDR"], "--master-port", env["MASTER_PORT"], *command,
        ]
        for node in range(nodes)
    ]  # fmt: skip
    if nodes == 1:
        return subprocess.run(
            runs[0], input=stdin, capture_output=True, text=True, env=env, timeout=LAUNCH_TIMEOUT
        )
    pipe = subprocess.PIPE
    started = [
        subprocess.Popen(run, stdin=pipe, stdout=pipe, stderr=pipe, text=True, env=env)
        for run in runs
    ]
    outs = [
        p.communicate(stdin if i == 0 else "", timeout=LAUNCH_TIMEOUT)
        for i, p in enumerate(started)
    ]
    stderr = "".join(err for _, err in outs)
    code = next((p.returncode for p in started if p.returncode), 0)
    return subprocess.CompletedProcess(runs[0], code, outs[0][0], stderr)


@pytest.mark.slow
def test_two_ranks_decode_the_one_process_tokens_under_every_cache_policy(folders, tmp_path):
    out = tmp_path / "seen.json"
    script = str(HERE / "tensor_parallel_rank.py")
    result = launch([script, str(out), *map(str, folders.values())])
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(out.read_text())
    for name in folders:
        layers = seen[name]["layers"]
        runs = {k: v for k, v in seen[name].items() if k not in ("layers", "bytes", "expert_bytes")}
        # 4 cache policies, prefix, fixed, origin, credit, wino rules, 4 sampled runs (wino,
        # credit), eb and klass (greedy and sampled)
        assert len(runs) == 17, runs.keys()
        for cache, run in runs.items():
            assert run["split"] == run["whole"], (name, cache)
            # two all-reduces per layer (attention, MLP or experts) and the embedding's; one
            # gather per draft
            assert run["all_reduce"] == run["forwards"] * (2 * layers + 1), (name, cache)
            # (top-p gathers more candidates when the first do not reach its mass: at most
            # twice more here, the last holding a tiny vocabulary shard's every score)
            # (the credit rule: one gather more a step, the fused distribution's summaries)
            rounds = 2 if " credit " in cache else 3 if "entropy sampled" in cache else 1
            assert run["forwards"] <= run["all_gather"] <= rounds * run["forwards"], (name, cache)
        mine, whole = seen[name]["bytes"]
        assert mine <= whole * (1 / 2 + 0.05), name
    for case in seen["drafts"]:
        assert case["tokens"], case["case"]
        assert case["difference"] < 1e-6, case["case"]
        assert case["probs"] < 1e-6, case["case"]


@pytest.mark.slow
def test_two_ranks_decode_the_one_process_int8_int4_and_compiled_tokens(folders, tmp_path):
    out = tmp_path / "seen.json"
    wide = write_llada(tmp_path / "wide", seed=1, max_sequence_length=64, **WIDE).folder
    script = str(HERE / "tensor_parallel_rank.py")
    schemes = ["--quantize=int8", str(folders["llada"]), "--quantize=int4", str(wide)]
    result = launch([script, str(out), "--compile", *schemes])
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(out.read_text())
    # --compile on the shard (a CPU stand-in recorder): replayed steps decode the one-process
    # tokens; a recording failing on rank 1 only leaves both ranks eager, with those tokens
    replayed, failed = seen["compiled"]["replayed"], seen["compiled"]["failed on rank 1"]
    assert replayed["equal"] and replayed["replays"] > 0 and replayed["failed"] is None
    assert failed["equal"] and failed["recordings"] == failed["replays"] == 0
    assert (
        failed["failed"]
        == "--compile: CUDA graph recording failed (on another rank); decoding eagerly"
    )
    for name, maxima in (("llada", 1), ("wide", 0)):
        layers = seen[name]["layers"]
        runs = {k: v for k, v in seen[name].items() if isinstance(v, dict)}
        assert len(runs) == 17, runs.keys()  # 11 greedy, 6 sampled
        for cache, run in runs.items():
            assert run["split"] == run["whole"], (name, cache)
            assert run["all_reduce"] == run["forwards"] * (2 * layers + 1), (name, cache)
            # int8: one MAX of the activations' row peaks per row-parallel int8 layer (the
            # first block's MLP output stays float); int4 quantizes no activations
            assert run["all_reduce_max"] == maxima * run["forwards"] * (2 * layers - 1)
        mine, whole = seen[name]["quantized_bytes"]
        assert mine <= whole * (1 / 2 + 0.05), name


def generate_twice(
    folder: Path, ranks: int, lines: list[str], extra: tuple[str, ...] = (), nodes: int = 1
) -> subprocess.CompletedProcess:
    """`dllm generate - --tensor-parallel 2` under RANKS processes, its records checked
    against one process's (logprobs: close); the launch returned."""
    args = [
        "--model", str(folder), "--device", "cpu", "--dtype", "float32",
        "--gen-length", "16", "--block-length", "8", "--cache", "dual", "--unmask", "threshold",
        "--threshold", "0.9", "--json", "--batch-size", "2", *extra,
    ]  # fmt: skip
    text = "".join(f"{line}\n" for line in lines)
    expected = invoke("generate", "-", *args, input=text)
    assert expected.exit_code == 0, expected.output
    command = ["-m", "dllm_cli", "generate", "-", *args, "--tensor-parallel", "2", "--stats"]
    result = launch(command, text, ranks, nodes)
    assert result.returncode == 0, result.stderr[-3000:]
    fields = ("line", "text", "token_ids", "forwards", "steps")
    records = [{k: json.loads(line)[k] for k in fields} for line in result.stdout.splitlines()]
    wanted = [{k: json.loads(line)[k] for k in fields} for line in expected.stdout.splitlines()]
    assert records == wanted
    if "--logprobs" in extra:
        for line, want in zip(
            result.stdout.splitlines(), expected.stdout.splitlines(), strict=True
        ):
            mine, theirs = (_flat(json.loads(x)["logprobs"]) for x in (line, want))
            assert mine and len(mine) == len(theirs)
            for a, b in zip(mine, theirs, strict=True):
                assert a == (pytest.approx(b, abs=1e-5) if isinstance(b, float) else b)
    return result


def _flat(value) -> list:
    """Every number (or string) in a nested logprobs value, in order."""
    if isinstance(value, list):
        return [x for v in value for x in _flat(v)]
    if isinstance(value, dict):
        return [x for k in sorted(value) for x in [k, *_flat(value[k])]]
    return [value]


@pytest.mark.slow
def test_generate_under_torchrun_writes_the_one_process_answers(folders):
    result = generate_twice(folders["llada"], 2, LINES)
    for rank in (0, 1):
        assert f"tensor parallel rank {rank} of 2:" in result.stderr
    assert "all-reduces" in result.stderr


@pytest.mark.slow
def test_two_machines_split_one_model_through_torchruns_rendezvous(folders):
    # two torchruns, one rank each (--nnodes 2, --node-rank 0 and 1): the job's rendezvous and
    # the model's collectives go between "machines" as they would over a network
    result = generate_twice(folders["dream"], 2, LINES[:2], nodes=2)
    for rank in (0, 1):
        assert f"tensor parallel rank {rank} of 2:" in result.stderr


@pytest.mark.slow
def test_one_prompt_under_torchrun_is_the_one_process_answer_int8_compiled(folders):
    args = [
        "how many apples", "--model", str(folders["llada"]), "--device", "cpu", "--dtype",
        "float32", "--gen-length", "16", "--block-length", "8", "--cache", "dual",
        "--unmask", "threshold", "--threshold", "0.9", "--quantize", "int8", "--json",
    ]  # fmt: skip
    expected = invoke("generate", *args)
    assert expected.exit_code == 0, expected.output
    command = ["-m", "dllm_cli", "generate", *args, "--compile", "--tensor-parallel", "2"]
    result = launch(command)
    assert result.returncode == 0, result.stderr[-3000:]
    fields = ("prompt", "text", "token_ids", "forwards", "steps")
    [record] = [json.loads(line) for line in result.stdout.splitlines()]  # rank 0's alone
    assert {k: record[k] for k in fields} == {k: json.loads(expected.stdout)[k] for k in fields}
    assert result.stderr.count("--compile: CUDA graphs need a CUDA device") == 1  # rank 0's
    assert "tensor parallel rank 1 of 2: " in result.stderr
    assert "of int8 weights (" in result.stderr


@pytest.mark.slow
def test_sampled_answers_and_their_logprobs_are_the_one_process_ones(folders):
    sampled = ("--temperature", "0.8", "--top-p", "0.9", "--seed", "4", "--logprobs", "3")
    generate_twice(folders["dream"], 2, LINES[:2], sampled)


@pytest.mark.slow
@pytest.mark.parametrize(
    "rule",
    [
        ("--unmask", "wino", "--threshold", "0.0", "--wino-verify", "0.05"),
        ("--unmask", "credit", "--temperature", "0.8", "--seed", "4", "--logprobs", "2"),
    ],
)
def test_wino_and_credit_under_torchrun_write_the_one_process_answers(folders, rule):
    generate_twice(folders["llada"], 2, LINES[:2], rule)


@pytest.mark.slow
def test_logprobs_under_a_grammar_are_the_one_process_ones(folders, tmp_path):
    schema = tmp_path / "schema.json"
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    schema.write_text(json.dumps({"type": "object", "properties": {"n": digit},
                                  "required": ["n"], "additionalProperties": False}))  # fmt: skip
    extra = ("--json-schema", str(schema), "--logprobs", "2", "--temperature", "0.7")
    result = generate_twice(folders["dream"], 2, LINES[:2], extra)
    assert all(json.loads(json.loads(line)["text"])["n"] in range(10)
               for line in result.stdout.splitlines())  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("llada", ("--unmask", "klass", "--threshold", "0.02", "--kl-threshold", "0.5")),
        ("dream", ("--unmask", "eb", "--eb-gamma", "6", "--temperature", "0.8", "--seed", "4")),
    ],
)
def test_eb_and_klass_answers_and_their_logprobs_are_the_one_process_ones(folders, name, rule):
    generate_twice(folders[name], 2, LINES[:2], (*rule, "--logprobs", "3"))


@pytest.mark.slow
def test_klass_under_tensor_parallelism_frees_a_requests_shards_when_it_leaves(folders, tmp_path):
    out = tmp_path / "seen.json"
    script = str(HERE / "tensor_parallel_rank.py")
    result = launch([script, str(out), "--klass-tracks", str(folders["llada"])])
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(out.read_text())["klass"]
    assert seen["shared"] and seen["parts"]  # the sampler's shards kept in the rule's memory
    assert max(map(len, seen["held"])) == 2  # two slots: two requests' tracks at a time
    held, aborted = seen["held"], seen["rids"][1]  # (aborted after the third step)
    assert {key for step in held for key in step} == set(seen["rids"])
    assert aborted in held[2] and not any(aborted in step for step in held[3:])
    assert seen["left"] == []  # every request finished or aborted: nothing kept


@pytest.mark.slow
def test_two_replicas_of_two_ranks_share_the_lines_and_write_the_one_process_answers(folders):
    result = generate_twice(folders["dream"], 4, [*LINES, "ann has 5 cats", "sam buys 4 books"])
    for replica in (0, 1):
        assert f"tensor parallel rank 1 of 2 (replica {replica} of 2):" in result.stderr
    assert "5 prompt(s)" in result.stderr  # rank 0's --stats: both replicas' prompts


def test_each_rank_reads_about_half_the_weights(folders):
    for name, folder in folders.items():
        halves = [
            load_model(folder, dtype="float32", device="cpu", shards=Shards(r, 2)) for r in (0, 1)
        ]
        whole = load_model(folder, dtype="float32", device="cpu").model.state_dict()
        for loaded in halves:
            mine, total = loaded.model.weight_bytes
            assert mine <= total * (1 / 2 + 0.05), name
        # the two ranks' pieces, side by side, are the checkpoint's tensors
        parts = [h.model.state_dict() for h in halves]
        embed = "model.transformer.wte.weight" if name == "llada" else "model.embed_tokens.weight"
        assert torch.equal(torch.cat([p[embed] for p in parts], 0), whole[embed])
        down = DOWN[name]
        assert torch.equal(torch.cat([p[down] for p in parts], 1), whole[down])


def test_each_rank_quantizes_its_slices_with_the_one_process_row_scales(folders):
    halves = [
        load_model(folders["llada"], dtype="float32", device="cpu", shards=Shards(r, 2), quantize="int8")
        for r in (0, 1)
    ]  # fmt: skip
    whole = load_model(folders["llada"], dtype="float32", device="cpu", quantize="int8").model
    for half in halves:
        assert weight_bytes(half.model) <= weight_bytes(whole) * (1 / 2 + 0.05)
    # a row-parallel layer: each rank holds some inputs of every row, at the whole row's scale
    down = [h.model.model.transformer.blocks[1].ff_out for h in halves]
    expected = whole.model.transformer.blocks[1].ff_out
    assert torch.equal(torch.cat([d.qweight for d in down]), expected.qweight)  # (in, out)
    for part in down:
        assert torch.equal(part.scale, expected.scale)


def test_compile_on_a_shard_agrees_on_each_recording_with_the_other_ranks(folders):
    from dllm_cli.models.compiled import enable_compile

    model = load_model(folders["llada"], device="cpu", shards=Shards(0, 2)).model
    assert enable_compile(model).startswith("--compile: CUDA graphs need a CUDA device")
    assert enable_compile(model, lambda run: run()) is None  # a recorder: CUDA's path
    assert model.forward.agree == model.shards.agree


def test_int4_groups_straddling_ranks_and_split_int4_experts_are_refused(folders):
    said = "gives each rank 16 of model.transformer.blocks.0.attn_out's 32 inputs, not a multiple "
    with pytest.raises(SettingsError, match=re.escape(f"{said}of --quantize int4's group of 32")):
        load_model(folders["llada"], device="cpu", shards=Shards(0, 2), quantize="int4")
    experts = "--quantize int4 for experts split over their columns yet"
    with pytest.raises(SettingsError, match=experts):  # each rank's part would round alone
        load_model(folders["llada_moe"], device="cpu", shards=Shards(0, 2), quantize="int4")


def test_a_degree_that_does_not_divide_the_heads_is_refused_with_its_numbers():
    dream = DreamConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48
    )
    with pytest.raises(SettingsError, match="does not divide the model's 2 KV heads"):
        check_degree("dream", dream, 4)
    llada = LLaDAConfig(d_model=48, n_heads=6, n_layers=1, mlp_hidden_size=64)
    with pytest.raises(SettingsError, match="does not divide the model's 6 attention heads"):
        check_degree("llada", llada, 4)
    with pytest.raises(SettingsError, match="does not support diffusion_gemma models yet"):
        check_degree("diffusion_gemma", llada, 2)


def test_tensor_parallel_outside_torchrun_is_refused_in_one_line(folders):
    result = invoke(
        "generate", "-", "--model", str(folders["llada"]), "--tensor-parallel", "2", input="hi\n"
    )
    assert result.exit_code == 2
    assert error_lines(result) == [
        "dllm: error: --tensor-parallel 2 needs 2 processes or a multiple (this run has 1): "
        "launch with torchrun --nproc-per-node 2"
    ]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_split_every_rank_refuses_is_said_by_rank_0_alone(folders, monkeypatch, rank):
    # (refused at the load, before any rank talks to another: no process group needed)
    launch_env = {"WORLD_SIZE": "2", "RANK": rank, "LOCAL_RANK": rank}
    for name, value in {**launch_env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    model = ["--model", str(folders["llada"]), "--device", "cpu", "--quantize", "int4"]
    result = invoke("generate", "-", *model, "--tensor-parallel", "2", input="hi\n")
    assert result.exit_code == 2
    said = error_lines(result)
    if rank == "1":
        assert said == []
    else:
        (line,) = said
        assert line.startswith("dllm: error: ") and "--quantize int4's group of 32" in line


def test_each_rank_reads_only_its_slices_of_the_split_tensors(folders, monkeypatch):
    import safetensors

    whole: list[str] = []
    real = safetensors.safe_open

    class Counted:
        def __init__(self, *args, **kwargs):
            self.inner = real(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return self.inner.get_slice(name)

        def get_tensor(self, name):
            whole.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Counted)
    load_model(folders["llada"], dtype="float32", device="cpu", shards=Shards(1, 2))
    assert whole, "the norms are read whole"
    assert all(name.endswith(("norm.weight", "ln_f.weight")) for name in whole), whole


def test_ranks_form_replicas_of_consecutive_ranks():
    assert [(s.replica, s.rank) for s in (place(r, 4, 2) for r in range(4))] == [
        (0, 0), (0, 1), (1, 0), (1, 1),
    ]  # fmt: skip
    assert place(3, 4, 2).replicas == 2
    with pytest.raises(SettingsError, match=r"needs 2 processes or a multiple \(this run has 3\)"):
        place(0, 3, 2)
    with pytest.raises(SettingsError, match="must be at least 1"):
        place(0, 2, 0)


def test_one_prompt_over_replicas_is_refused_before_loading(folders, monkeypatch):
    launch_env = {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**launch_env, "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    model = ["--model", str(folders["llada"]), "--device", "cpu"]
    result = invoke("generate", "hi", *model, "--tensor-parallel", "2")
    assert result.exit_code == 2
    assert error_lines(result) == [
        "dllm: error: under torchrun, prompts come from stdin: give '-' and pipe them (one "
        "prompt as an argument runs under --tensor-parallel N over N processes)"
    ]
