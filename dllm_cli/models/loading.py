"""Local checkpoint folder -> (model, tokenizer, special ids), with one clear error per failure.

We never execute code from a model folder: `auto_map` entries are ignored, the architecture is
picked from config.json's `model_type` in our own table, and the tokenizer is loaded with
`trust_remote_code=False` (Dream's remote tokenizer class is Qwen2's BPE, which transformers has).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from dllm_cli.errors import DeviceError, ModelLoadError
from dllm_cli.models import ARCHITECTURES, DiffusionLM

BUILTIN_PREFIX = "builtin:"
BUILTIN_DIR = Path(__file__).resolve().parent.parent / "tinygsm" / "weights"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Token strings that name the special roles in the folders we know.
MASK_NAMES = ("<|mdm_mask|>", "<|mask|>", "[MASK]", "<mask>")
EOT_NAMES = ("<|eot_id|>", "<|im_end|>")


@dataclass(frozen=True)
class SpecialIds:
    """Token ids with a role in decoding; read from the folder, overridable by a profile."""

    mask: int
    eos: int
    pad: int
    bos: int | None = None
    eot: int | None = None

    @property
    def stop(self) -> tuple[int, ...]:
        """Tokens that end an answer (EOS, and end-of-turn where the format has one)."""
        return tuple(t for t in (self.eos, self.eot) if t is not None)


@dataclass
class LoadedModel:
    """A ready-to-decode diffusion model and everything the decoder needs to know about it."""

    model: DiffusionLM
    tokenizer: PreTrainedTokenizerBase
    special: SpecialIds
    path: Path
    architecture: str
    device: torch.device
    dtype: torch.dtype
    extra: dict = field(default_factory=dict)


def quiet_transformers() -> None:
    """No progress bars or advisory warnings from transformers on our stderr."""
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def resolve_path(path: str | os.PathLike) -> Path:
    """`builtin:NAME` -> the shipped folder; otherwise an expanded local path."""
    text = str(path)
    if text.startswith(BUILTIN_PREFIX):
        name = text[len(BUILTIN_PREFIX) :]
        folder = BUILTIN_DIR / name
        if not folder.is_dir():
            known = sorted(p.name for p in BUILTIN_DIR.iterdir()) if BUILTIN_DIR.is_dir() else []
            raise ModelLoadError(
                f"no built-in model {name!r} (built-in: {', '.join(known) or 'none'})"
            )
        return folder
    return Path(os.path.expandvars(os.path.expanduser(text)))


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """auto -> cuda when present, else cpu; a missing GPU is an error, not a silent fallback."""
    text = str(device).strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise DeviceError(f"unknown device {device!r} (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {device!r} asked for, but no CUDA GPU is available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            n = torch.cuda.device_count()
            raise DeviceError(f"device {device!r} asked for, but this machine has {n} GPU(s)")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceError("device 'mps' asked for, but MPS is not available here")
    elif dev.type != "cpu":
        raise DeviceError(f"unsupported device {device!r} (use auto, cpu, cuda or cuda:N)")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto -> bfloat16 on a GPU that has it, float32 on CPU (bf16 matmuls are slow there)."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r} (use auto, {', '.join(DTYPES)})")
    return DTYPES[dtype]


def read_config(folder: Path):
    """config.json -> our config object; errors name the file and the problem."""
    if not folder.exists():
        raise ModelLoadError(f"model folder not found: {folder}")
    if not folder.is_dir():
        raise ModelLoadError(f"model path is not a folder: {folder}")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"no config.json in {folder} (is this a model folder?)")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_file} is not valid JSON: {e}") from None
    kind = raw.get("model_type")
    if kind not in ARCHITECTURES:
        known = ", ".join(ARCHITECTURES)
        raise ModelLoadError(f"unknown architecture {kind!r} in {cfg_file} (supported: {known})")
    cfg_cls, model_cls = ARCHITECTURES[kind]
    raw = {k: v for k, v in raw.items() if k not in ("auto_map", "model_type")}
    try:
        config = cfg_cls(**raw)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{cfg_file}: {e}") from None
    why = config.unsupported()
    if why:
        raise ModelLoadError(f"{cfg_file}: unsupported {kind} variant: {why}")
    return config, model_cls


def weight_files(folder: Path) -> list[Path]:
    """The safetensors shards of a folder (via the index when there is one)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from None
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shard(s) named in the index are missing: {missing}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(
        f"no weights in {folder} (expected model.safetensors or an index + shards)"
    )


def check_weights(folder: Path, model: DiffusionLM) -> None:
    """Compare checkpoint tensor names and shapes with the model before loading anything."""
    from safetensors import safe_open

    found: dict[str, tuple[int, ...]] = {}
    for f in weight_files(folder):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                    found[name] = tuple(st.get_slice(name).get_shape())
        except Exception as e:  # safetensors raises several types for a damaged file
            raise ModelLoadError(f"cannot read weights {f}: {e}") from None
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = [k for k in expected if k not in found and k not in tied]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{folder}: checkpoint is missing parameter {missing[0]}{more}")
    for name, shape in expected.items():
        if name in found and found[name] != shape:
            raise ModelLoadError(
                f"{folder}: parameter {name} has shape {list(found[name])} in the checkpoint, "
                f"but the config implies {list(shape)}"
            )


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """AutoTokenizer without remote code; Dream's remote class falls back to Qwen2's BPE."""
    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as first:  # transformers raises ValueError/OSError/KeyError here
        if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            from transformers import Qwen2Tokenizer

            try:
                return Qwen2Tokenizer.from_pretrained(str(folder))
            except Exception as e:
                raise ModelLoadError(f"cannot load the tokenizer in {folder}: {e}") from None
        raise ModelLoadError(f"cannot load the tokenizer in {folder}: {first}") from None


def _token_id(tokenizer: PreTrainedTokenizerBase, names: tuple[str, ...]) -> int | None:
    vocab = tokenizer.get_vocab()
    for name in names:
        if name in vocab:
            return vocab[name]
    return None


def special_ids(config, tokenizer: PreTrainedTokenizerBase, overrides: dict | None = None):
    """Special ids from config.json, then the tokenizer, then the profile's overrides."""
    over = {k: v for k, v in (overrides or {}).items() if v is not None}

    def first(*values):
        return next((v for v in values if v is not None), None)

    eos = first(over.get("eos"), getattr(config, "eos_token_id", None), tokenizer.eos_token_id)
    if isinstance(eos, list):
        eos = eos[0]
    mask = first(
        over.get("mask"),
        getattr(config, "mask_token_id", None),
        _token_id(tokenizer, MASK_NAMES),
        tokenizer.mask_token_id,
    )
    pad = first(over.get("pad"), getattr(config, "pad_token_id", None), tokenizer.pad_token_id, eos)
    bos = first(over.get("bos"), getattr(config, "bos_token_id", None), tokenizer.bos_token_id)
    eot = first(over.get("eot"), _token_id(tokenizer, EOT_NAMES))
    if mask is None:
        raise ModelLoadError(
            "the model folder names no mask token (set special.mask in the profile)"
        )
    if eos is None:
        raise ModelLoadError("the model folder names no EOS token (set special.eos in the profile)")
    return SpecialIds(mask=int(mask), eos=int(eos), pad=int(pad), bos=bos, eot=eot)


def load_model(
    path: str | os.PathLike,
    *,
    dtype: str = "auto",
    device: str = "auto",
    special_overrides: dict | None = None,
) -> LoadedModel:
    """Load a local LLaDA/Dream folder (sharded safetensors included) ready for decoding."""
    quiet_transformers()
    folder = resolve_path(path)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    config, model_cls = read_config(folder)
    with torch.device("meta"):
        skeleton = model_cls(config)
    check_weights(folder, skeleton)
    del skeleton
    try:
        # Weights stream shard by shard onto a meta-initialised model (transformers' low-memory
        # path); device placement is a plain .to() so no accelerate dependency is needed.
        model = model_cls.from_pretrained(str(folder), config=config, dtype=torch_dtype)
        model.to(dev)
    except Exception as e:  # anything transformers raises past our checks
        raise ModelLoadError(f"cannot load weights from {folder}: {e}") from None
    model.eval()
    tokenizer = load_tokenizer(folder)
    special = special_ids(config, tokenizer, special_overrides)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        special=special,
        path=folder,
        architecture=config.model_type,
        device=dev,
        dtype=torch_dtype,
    )
