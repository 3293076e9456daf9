"""load_model on real-format folders: weights, special ids, chat template, no remote code, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoints import Written, write_dream, write_json, write_llada
from safetensors.torch import load_file, save_file

from dllm_cli.errors import DeviceError, ModelLoadError
from dllm_cli.models.loading import load_model, resolve_device

WRITERS = {
    "llada": lambda p: write_llada(p),
    "llada-sharded": lambda p: write_llada(p, shards=3),
    "dream": lambda p: write_dream(p),
}


def edit_config(folder: Path, **changes) -> None:
    """Rewrite config.json; a value of ... deletes the key."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    write_json(folder / "config.json", {k: v for k, v in cfg.items() if v is not ...})


@pytest.mark.parametrize("kind", WRITERS)
def test_loads_each_format_with_the_written_weights(tmp_path, kind):
    w: Written = WRITERS[kind](tmp_path / kind)
    if kind == "llada-sharded":
        index = json.loads((w.folder / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) == 3
        assert not (w.folder / "model.safetensors").exists()
    m = load_model(w.folder, dtype="float32", device="cpu")
    assert m.architecture == w.config["model_type"]
    assert m.device == torch.device("cpu") and m.dtype == torch.float32
    assert not m.model.training
    state = m.model.state_dict()
    assert set(state) == set(w.tensors)
    for name, tensor in w.tensors.items():
        assert torch.equal(state[name], tensor.float()), name
    ids = w.ids
    assert m.special.mask == ids["mask"] and m.special.eos == ids["eos"]
    assert m.special.pad == ids["pad"] and m.special.bos == ids["bos"]
    assert m.special.eot == ids["eot"]
    assert m.special.stop == (ids["eos"], ids["eot"])


def test_special_ids_can_be_overridden(llada_ckpt):
    m = load_model(llada_ckpt.folder, device="cpu", special_overrides={"mask": 5, "eot": None})
    assert m.special.mask == 5
    assert m.special.eot == llada_ckpt.ids["eot"]  # None means "not overridden"
    assert m.special.eos == llada_ckpt.ids["eos"]


def test_special_ids_fall_back_to_the_tokenizer(tmp_path):
    w = write_llada(tmp_path / "m")
    edit_config(w.folder, mask_token_id=..., eos_token_id=..., pad_token_id=...)
    m = load_model(w.folder, device="cpu")
    # Not LLaDA-8B's built-in defaults (126336 / 126081): the folder's own tokens.
    assert m.special.mask == w.ids["mask"]
    assert m.special.eos == w.ids["eos"] == m.special.pad


def test_override_outside_vocabulary_is_an_error(llada_ckpt):
    with pytest.raises(ModelLoadError, match=r"^mask token id 9999 is outside the model's vocab"):
        load_model(llada_ckpt.folder, device="cpu", special_overrides={"mask": 9999})
    with pytest.raises(ModelLoadError, match=r"unknown special token role\(s\) \['msk'\]"):
        load_model(llada_ckpt.folder, device="cpu", special_overrides={"msk": 1})


def test_llada_chat_template(llada, llada_ckpt):
    tok = llada.tokenizer
    messages = [
        {"role": "user", "content": "how many apples"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "and pens"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nhow many apples<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n2<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nand pens<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == llada_ckpt.ids["bos"] and ids.count(llada_ckpt.ids["bos"]) == 1
    assert ids.count(llada_ckpt.ids["eot"]) == 3


def test_dream_tokenizer_without_remote_code(dream, dream_ckpt):
    tok = dream.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(dream_ckpt.ids["eot"]) == 2  # <|im_end|> is one token, not split
    assert tok.decode(tok("how many apples ?")["input_ids"]) == "how many apples ?"


def test_auto_map_is_never_executed(tmp_path):
    sentinel = tmp_path / "remote-code-ran"
    trap = f"import pathlib\npathlib.Path({str(sentinel)!r}).write_text('ran')\n"
    folders = [write_llada(tmp_path / "llada").folder, write_dream(tmp_path / "dream").folder]
    for folder in folders:
        for module in ("configuration_x", "modeling_x", "tokenization_dream"):
            (folder / f"{module}.py").write_text(trap + "class X: pass\n")
        edit_config(
            folder, auto_map={"AutoConfig": "configuration_x.X", "AutoModel": "modeling_x.X"}
        )
        load_model(folder, device="cpu")
        edit_config(folder, auto_map={"AutoModel": "no_such_module_anywhere.Nope"})
        load_model(folder, device="cpu")
    assert not sentinel.exists()


def _drop_tensor(folder: Path) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.transformer.blocks.1.ff_out.weight"]
    save_file(tensors, str(folder / "model.safetensors"))


def _wrong_shape(folder: Path) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.transformer.blocks.0.q_proj.weight"] = torch.zeros(8, 32)
    save_file(tensors, str(folder / "model.safetensors"))


def _drop_shard(folder: Path) -> None:
    (folder / "model-00002-of-00003.safetensors").unlink()


def _truncate(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


ERRORS = {
    "missing-folder": (lambda f: None, "model folder not found: {f}/nowhere", "nowhere"),
    "no-config": (lambda f: (f / "config.json").unlink(), "no config.json in {f}", ""),
    "no-weights": (lambda f: (f / "model.safetensors").unlink(), "no weights in {f}", ""),
    "missing-shard": (
        _drop_shard,
        "{f}: shard(s) named in the index are missing: ['model-00002-of-00003.safetensors']",
        "sharded",
    ),
    "missing-parameter": (
        _drop_tensor,
        "{f}: checkpoint is missing parameter model.transformer.blocks.1.ff_out.weight",
        "",
    ),
    "wrong-shape": (
        _wrong_shape,
        "{f}: parameter model.transformer.blocks.0.q_proj.weight has shape [8, 32] in the "
        "checkpoint, but the config implies [32, 32]",
        "",
    ),
    "corrupt-safetensors": (_truncate, "cannot read weights {f}/model.safetensors: ", ""),
    "invalid-json": (
        lambda f: (f / "config.json").write_text('{"model_type": "llada",'),
        "{f}/config.json is not valid JSON: ",
        "",
    ),
    "invalid-index": (
        lambda f: (f / "model.safetensors.index.json").write_text('{"weight_map": [1]}'),
        "{f}/model.safetensors.index.json has no valid weight_map",
        "sharded",
    ),
    "unknown-architecture": (
        lambda f: edit_config(f, model_type="gpt9"),
        "unknown architecture 'gpt9' with architectures ['LLaDAModelLM'] in {f}/config.json "
        "(supported: LLaDAModelLM (llada), DreamModel (Dream), ",
        "",
    ),
    "unsupported-variant": (
        lambda f: edit_config(f, block_type="sequential"),
        "{f}/config.json: unsupported llada variant: block_type 'sequential'",
        "",
    ),
    "bad-config-value": (
        lambda f: edit_config(f, d_model="wide"),
        "{f}/config.json: invalid llada config: ",
        "",
    ),
    "no-tokenizer": (
        lambda f: (f / "tokenizer.json").unlink(),
        "no tokenizer in {f} (expected tokenizer.json, or vocab.json + merges.txt)",
        "",
    ),
}


@pytest.mark.parametrize("case", ERRORS)
def test_load_errors_are_one_clear_line(tmp_path, case):
    mutate, expected, variant = ERRORS[case]
    folder = write_llada(tmp_path / "m", shards=3 if variant == "sharded" else 1).folder
    mutate(folder)
    target = folder / "nowhere" if variant == "nowhere" else folder
    with pytest.raises(ModelLoadError) as info:
        load_model(target, device="cpu")
    message = str(info.value)
    assert message.startswith(expected.format(f=folder)), message
    assert "\n" not in message and "Traceback" not in message
    err = info.value  # nothing chained from deep inside a library
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)


def test_dream_unsupported_rope_scaling(tmp_path):
    folder = write_dream(tmp_path / "m").folder
    edit_config(folder, rope_scaling={"type": "yarn", "factor": 4.0})
    with pytest.raises(ModelLoadError, match="unsupported Dream variant: rope_scaling 'yarn'"):
        load_model(folder, device="cpu")


def test_unknown_builtin_model():
    with pytest.raises(ModelLoadError, match="no built-in model 'no-such-model'"):
        load_model("builtin:no-such-model", device="cpu")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dtypes_on_cpu(llada_ckpt, dtype):
    m = load_model(llada_ckpt.folder, dtype=dtype, device="cpu")
    want = getattr(torch, dtype)
    assert m.dtype == want
    assert {p.dtype for p in m.model.parameters()} == {want}
    name = "model.transformer.blocks.0.q_proj.weight"
    assert torch.equal(m.model.state_dict()[name], llada_ckpt.tensors[name].to(want))
    logits = m.model(torch.tensor([[1, 2, 3]]))
    assert logits.dtype == want and torch.isfinite(logits).all()


def test_auto_dtype_on_cpu_is_float32(llada_ckpt):
    assert load_model(llada_ckpt.folder, device="cpu").dtype == torch.float32


def test_unknown_dtype(llada_ckpt):
    with pytest.raises(ModelLoadError, match="unknown dtype 'fp8'"):
        load_model(llada_ckpt.folder, dtype="fp8", device="cpu")


def test_devices(llada_ckpt):
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert load_model(llada_ckpt.folder, device="auto").device.type == expected
    assert resolve_device("CPU") == torch.device("cpu")
    with pytest.raises(DeviceError, match=r"^unknown device 'banana' \(use auto, cpu, cuda"):
        load_model(llada_ckpt.folder, device="banana")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_without_gpu_is_a_device_error(llada_ckpt):
    with pytest.raises(DeviceError, match="no CUDA GPU is available here"):
        load_model(llada_ckpt.folder, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.no_grad()
def test_cuda_load_matches_cpu(llada_ckpt, llada):
    m = load_model(llada_ckpt.folder, dtype="float32", device="cuda")
    assert m.device.type == "cuda" and next(m.model.parameters()).is_cuda
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    gpu = m.model(ids.cuda()).cpu()
    assert (gpu - llada.model(ids)).abs().max() < 1e-3  # TF32/kernels differ slightly
    auto = load_model(llada_ckpt.folder, device="auto")
    assert auto.device.type == "cuda" and auto.dtype in (torch.bfloat16, torch.float16)
    with pytest.raises(DeviceError, match="GPU"):
        load_model(llada_ckpt.folder, device=f"cuda:{torch.cuda.device_count()}")
