"""The fit check (fit.py) on configs of real sizes, written as JSON only (tests/fixtures/fit/):
LLaDA-8B-Instruct (docs/reference.md section 1) and LLaDA2.0-flash (inclusionAI/dFactory
configs/model_configs/llada2_flash/config.json, model_type given as the hub release's).

The reference sizes are those of the real tensors: the families' own modules (dllm_cli/models/)
built from each config on the meta device, every tensor of the state dict counted, int8 as
quantize.py stores it (its rule applied to the module tree). The meta LLaDA-8B holds 8,015,581,184
values and LLaDA2.0-flash 102,889,705,216 (the hub cards: 8B and 100B).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import block_checkpoints
import checkpoints
import pytest
import torch
from cli_fixtures import invoke
from torch import nn

from dllm_cli import fit, fit_sizes
from dllm_cli.families import family_for_config
from dllm_cli.models import quantize as q
from dllm_cli.models.loading import config_from_json
from dllm_cli.models.weights import meta_skeleton

CONFIGS = Path(__file__).parent / "fixtures" / "fit"
MODELS = ("llada-8b-instruct", "llada2.0-flash")
CPU_24GB, GPU_80GB = 24 * 10**9, 80 * 10**9


def config(name: str) -> tuple[dict, str]:
    path = CONFIGS / f"{name}.json"
    raw = json.loads(path.read_text())
    return raw, family_for_config(raw, path).name


@pytest.fixture(scope="module", params=MODELS)
def meta(request) -> tuple[str, nn.Module]:
    """The family's module built from the real config, on the meta device (no memory)."""
    path = CONFIGS / f"{request.param}.json"
    cfg, cls = config_from_json(json.loads(path.read_text()), path)
    with meta_skeleton():
        return request.param, cls(cfg)


def reference_bytes(model: nn.Module, precision: str) -> int:
    """Bytes of the real tensors at `precision` (float: every tensor at that width; int8/int4:
    the linears quantize.py quantizes, on a bfloat16 load, the rest in bfloat16)."""
    tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    if precision in fit.FLOAT_BYTES:
        return sum(t.numel() for t in tensors.values()) * fit.FLOAT_BYTES[precision]
    quantized = {id(m.weight): m for m in quantized_linears(model)}
    heads = {id(m.weight) for m in q.output_heads(model)}  # int8 under int4 too
    total = 0
    for key, t in tensors.items():
        if key not in quantized:
            total += t.numel() * 2
        elif precision == "int8" or key in heads:
            total += t.numel() + t.shape[0] * fit.INT8_SCALE_BYTES
        else:
            groups = t.shape[0] * math.ceil(t.shape[1] / fit.INT4_GROUP)
            total += t.numel() / 2 + groups * (fit.INT4_SCALE_BYTES + fit.INT4_ZERO_BYTES)
    return round(total)


def quantized_linears(model: nn.Module) -> list[nn.Linear]:
    """quantize.py's choice: every nn.Linear but routers, a tied head and block 0's MLP out."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    first = next(iter(model.blocks()))
    kept = {id(m) for n, m in first.named_modules() if n.rpartition(".")[2] in q.MLP_OUT}
    return [
        child
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and name not in q.KEEP_FLOAT
        and id(child.weight) not in embeddings
        and id(child) not in kept
    ]


@pytest.mark.parametrize("precision", fit.PRECISIONS)
def test_weight_bytes_within_2_percent_of_the_real_tensors(meta, precision):
    name, model = meta
    raw, family = config(name)
    got = fit.precision_bytes(fit.read_arch(raw, family), precision)
    expected = reference_bytes(model, precision)
    assert abs(got - expected) <= 0.02 * expected, (name, precision, got, expected)


def test_parameter_counts_are_the_modules():
    for name, values in (("llada-8b-instruct", 8_015_581_184), ("llada2.0-flash", 102_889_705_216)):
        raw, family = config(name)
        assert fit.parameters(fit.read_arch(raw, family)) == values


def verdict(name: str, free: int, device: str, dtype: str, quantize: str = "none") -> str:
    raw, family = config(name)
    a = fit.read_arch(raw, family)
    return fit.need(a, free, dtype, quantize, slots=8, answer=256).verdict


def test_verdicts_on_a_24gb_cpu_and_an_80gb_gpu():
    # LLaDA-8B: 32 GB in float32 (CPU's default) cannot fit 24 GB; 16 GB bfloat16 and int8 can.
    assert verdict("llada-8b-instruct", CPU_24GB, "cpu", "float32") == "will not fit"
    assert verdict("llada-8b-instruct", CPU_24GB, "cpu", "bfloat16") in ("fits", "tight")
    assert verdict("llada-8b-instruct", CPU_24GB, "cpu", "float32", "int8") == "fits"
    assert verdict("llada-8b-instruct", GPU_80GB, "cuda:0", "bfloat16") == "fits"
    # LLaDA2.0-flash: 206 GB in bfloat16; int4 (65 GB) fits 80 GB, nothing fits 24 GB.
    assert verdict("llada2.0-flash", GPU_80GB, "cuda:0", "bfloat16") == "will not fit"
    assert verdict("llada2.0-flash", GPU_80GB, "cuda:0", "bfloat16", "int8") == "will not fit"
    assert verdict("llada2.0-flash", GPU_80GB, "cuda:0", "bfloat16", "int4") == "fits"
    for quantize in ("none", "int8", "int4"):
        assert verdict("llada2.0-flash", CPU_24GB, "cpu", "float32", quantize) == "will not fit"


def test_refusal_says_the_numbers_and_what_would_fit():
    raw, family = config("llada2.0-flash")
    with pytest.raises(fit.FitError) as caught:
        fit.check(raw, family, "cuda:0", "bfloat16", "none", 8, 256, free=GPU_80GB)
    message = str(caught.value)
    assert "\n" not in message and "weights 205.8 GB in bfloat16" in message
    assert "80.0 GB is free" in message and "--quantize int4" in message
    assert f"{fit.TENSOR_PARALLEL_FLAG} 4" in message and "--force" in message
    assert caught.value.exit_code == 3
    raw, family = config("llada-8b-instruct")
    with pytest.raises(fit.FitError, match=r"try --dtype bfloat16"):
        fit.check(raw, family, "cpu", "float32", "none", 8, 256, free=CPU_24GB)
    assert fit.check(raw, family, "cuda:0", "bfloat16", "none", 8, 256, free=GPU_80GB).total > 16e9


def test_fewer_slots_is_offered_when_the_cache_is_what_does_not_fit():
    raw, family = config("llada-8b-instruct")
    a = fit.read_arch(raw, family)
    free = fit.need(a, 0, "bfloat16", "none", 4, 256).total / fit.TIGHT + 1  # 4 slots just fit
    offers = fit.alternatives(a, int(free), "bfloat16", "none", 64, 256, gpu=False)
    assert "--batch-size 4" in offers


@pytest.mark.parametrize(
    "write",
    [
        lambda p: checkpoints.write_dream(p, dtype=torch.float32, intermediate_size=64),
        lambda p: checkpoints.write_llada(p, dtype=torch.float32, mlp_hidden_size=64),
    ],
    ids=["dream", "llada"],
)
def test_the_counted_bytes_are_the_loaded_model_s_at_each_quantization(write, tmp_path):
    """fit.py's count equals the bytes a real folder holds once loaded and quantized: int4's
    groups, bfloat16 pairs and int8 head as models/int4.py and quantize.py store them."""
    from dllm_cli.models.int4 import DEFAULT_GROUP
    from dllm_cli.models.loading import load_model

    assert fit.INT4_GROUP == DEFAULT_GROUP
    folder = write(tmp_path / "m").folder
    raw = json.loads((folder / "config.json").read_text())
    arch = fit.read_arch(raw, family_for_config(raw, folder).name)
    for quantize in ("none", "int8", "int4"):
        lm = load_model(folder, device="cpu", dtype="float32", quantize=quantize)
        assert fit.weight_bytes(arch, "float32", quantize) == q.weight_bytes(lm.model), quantize


def test_free_memory_on_this_machine():
    assert fit.available_ram() > 0
    if torch.cuda.is_available():
        assert fit.free_memory("cuda:0") > 0


def test_profiles_show_lists_the_weights_at_each_precision(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "llada-8b-instruct.json").read_text())
    result = invoke("profiles", "show", "--model", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "weights: float32 32.1 GB, bfloat16 16.0 GB, int8 8.6 GB, int4 6.0 GB" in result.stdout


WRITERS = {
    "llada": lambda folder: checkpoints.write_llada(folder),
    "dream": lambda folder: checkpoints.write_dream(folder),
    "llada_moe": lambda folder: checkpoints.write_llada_moe(folder),
    "sdar": lambda folder: block_checkpoints.write_sdar(folder),
    "llada2": lambda folder: block_checkpoints.write_llada2(folder),
}


@pytest.mark.parametrize("family", list(WRITERS))
def test_every_sized_family_counts_the_tensors_a_checkpoint_holds(family, tmp_path):
    """Each reader against the tensors of a real checkpoint folder of that family (tiny)."""
    assert {*WRITERS, "diffusion_gemma"} == set(fit_sizes.READERS)  # (its own test below)
    written = WRITERS[family](tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert family_for_config(raw, tmp_path).name == family
    on_disk = sum(t.numel() for t in written.tensors.values())
    assert fit.parameters(fit.read_arch(raw, family)) == on_disk


def test_diffusion_gemma_is_counted_from_its_headers_as_it_loads(tmp_path):
    """DiffusionGemma's weights, from its safetensors headers, are the loaded model's stored
    tensors at each quantization (the encoder and decoder share them, and a linear of both
    stays one quantized layer); its KV count is what transformers' cache holds once the
    encoder has read a prompt longer than the sliding window."""
    from gemma_checkpoint import write_gemma

    from dllm_cli.models.loading import load_model

    folder = write_gemma(tmp_path / "g").folder
    raw = json.loads((folder / "config.json").read_text())
    arch = fit.read_arch(raw, family_for_config(raw, folder).name, folder)
    assert fit.read_arch(raw, "diffusion_gemma") is None  # no folder, no headers: not sized
    for quantize in ("none", "int8", "int4"):
        model = load_model(folder, device="cpu", dtype="float32", quantize=quantize).model
        stored = model.state_dict(keep_vars=True).values()
        unique = {t.untyped_storage().data_ptr(): t for t in stored}
        held = sum(t.numel() * t.element_size() for t in unique.values())
        assert fit.weight_bytes(arch, "float32", quantize) == held, quantize
    prompt = 3 * raw["text_config"]["sliding_window"]
    cache = model._prepare_cache_for_generation(
        generation_config=model.generation_config, batch_size=2, max_length=prompt
    )
    ids = torch.randint(5, 100, (2, prompt))
    with torch.no_grad():
        model.model.encoder(
            input_ids=ids, attention_mask=torch.ones_like(ids, dtype=torch.bool), cache=cache,
            position_ids=torch.arange(prompt)[None],
        )  # fmt: skip
    kept = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    held = sum(t.numel() * t.element_size() for t in kept)
    assert fit.kv_bytes(arch, 2, prompt, "float32") == held
    assert not arch.splits and fit.need(arch, 10**12, "bfloat16", "none", 1, 40).canvas == 512 + 48


# Gemma 4 26B-A4B's text shape (its published text config), the checkpoint DiffusionGemma's is
GEMMA_26B_TEXT = {
    "hidden_size": 2816,
    "intermediate_size": 2112,
    "moe_intermediate_size": 704,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "global_head_dim": 512,
    "num_global_key_value_heads": 2,
    "attention_k_eq_v": True,
    "num_hidden_layers": 30,
    "num_experts": 128,
    "top_k_experts": 8,
    "sliding_window": 1024,
    "vocab_size": 262144,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
}


def write_headers_only(folder: Path, model: nn.Module) -> None:
    """model.safetensors holding only the header of `model`'s stored tensors (no data)."""
    stored = model.state_dict(keep_vars=True)
    names = {id(t): n for n, t in stored.items()}  # one name a tensor: its last (the tied
    # embedding is stored as lm_head.weight, a name that must still count as an embedding)
    header = {
        name: {"dtype": "BF16", "shape": list(stored[name].shape), "data_offsets": [0, 0]}
        for name in names.values()
    }
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)


def test_a_diffusion_gemma_26b_load_that_cannot_fit_is_refused_before_reading_weights(tmp_path):
    """The 26B-A4B shape, its config and its headers only: `profiles show` lists its weights at
    each precision, and a float32 CPU load is refused in one line (exit 3) with no
    --tensor-parallel offered (it has no split layout)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    folder = tmp_path / "dg"
    config = DiffusionGemmaConfig(text_config=GEMMA_26B_TEXT)
    with torch.device("meta"):
        model = DiffusionGemmaForBlockDiffusion(config)
    config.save_pretrained(folder)
    write_headers_only(folder, model)
    raw = json.loads((folder / "config.json").read_text())
    arch = fit.read_arch(raw, "diffusion_gemma", folder)
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    assert fit.parameters(arch) == sum(t.numel() for t in unique.values()) > 25 * 10**9
    shown = invoke("profiles", "show", "--model", str(folder))
    weights = "weights: float32 101.7 GB, bfloat16 50.8 GB, int8 49.2 GB, int4 48.6 GB"
    assert shown.exit_code == 0 and weights in shown.stdout, shown.output
    result = invoke(
        "generate", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "hi"
    )
    assert result.exit_code == 3, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("dllm: error: dg needs ") and "weights 101.7 GB in float32" in line
    assert "--force" in line and "--tensor-parallel" not in line
