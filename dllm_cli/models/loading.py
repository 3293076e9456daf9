"""Local checkpoint folder -> (model, tokenizer, special ids), with one clear error per failure.

We never execute code from a model folder: `auto_map` entries are ignored, the architecture is
picked from config.json's `architectures`, then `model_type`, in our own table (families.py),
and the tokenizer is loaded with `trust_remote_code=False` (Dream's is Qwen2's BPE).
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dllm_cli.errors import DeviceError, ModelLoadError, SettingsError
from dllm_cli.families import Family, family_for_config
from dllm_cli.family_settings import refuse_feature
from dllm_cli.folders import read_config_json, resolve_path
from dllm_cli.models import DiffusionLM
from dllm_cli.models import quantize as quant
from dllm_cli.models.weights import check_weights, meta_skeleton, read_weights, weight_files

if TYPE_CHECKING:  # transformers is imported where a tokenizer needs it, not at start-up
    from transformers import PreTrainedTokenizerBase

    from dllm_cli.models.sharding import Shards
    from dllm_cli.models.tokenizer import FastTokenizer

    AnyTokenizer = FastTokenizer | PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Token strings that name the special roles in the folders we know.
MASK_NAMES = ("<|mdm_mask|>", "<|mask|>", "[MASK]", "<mask>")
EOT_NAMES = ("<|eot_id|>", "<|im_end|>", "<|role_end|>")  # LLaDA, Qwen/Dream, LLaDA-MoE


@dataclass(frozen=True)
class SpecialIds:
    """Token ids with a role in decoding; read from the folder, overridable by a profile."""

    mask: int | None  # None: the family has no mask token (DiffusionGemma)
    eos: int
    pad: int
    bos: int | None = None
    eot: int | None = None
    vocab: int | None = None  # tokenizer size: ids at or above it are embedding padding rows
    extra_stop: tuple[int, ...] = ()  # further stop tokens a checkpoint lists (DiffusionGemma)

    def real_vocab(self, model_vocab: int) -> int:
        """How many ids can be real tokens: a draft or a guide's token is always below this."""
        return model_vocab if self.vocab is None else min(model_vocab, self.vocab)

    @property
    def stop(self) -> tuple[int, ...]:
        """Tokens that end an answer (EOS, end-of-turn where the format has one, and extras)."""
        return tuple(t for t in (self.eos, self.eot, *self.extra_stop) if t is not None)


@dataclass
class LoadedModel:
    """A ready-to-decode diffusion model and everything the decoder needs to know about it."""

    model: DiffusionLM
    tokenizer: AnyTokenizer
    special: SpecialIds
    path: Path
    architecture: str  # config.json's model_type
    device: torch.device
    dtype: torch.dtype
    family: str = ""  # the families.py key ("llada", "dream", "llada_moe", "diffusion_gemma")


def quiet_transformers() -> None:
    """No progress bars or advisory warnings from transformers on our stderr."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """auto -> cuda when present, else cpu; a missing GPU is an error, not a silent fallback
    (no such device name: SettingsError, exit 2; a device this machine lacks: DeviceError, 5)."""
    text = str(device).strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise SettingsError(f"unknown device {device!r} (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {device!r} asked for, but no CUDA GPU is available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            n = torch.cuda.device_count()
            raise DeviceError(f"device {device!r} asked for, but this machine has {n} GPU(s)")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError("device 'mps' asked for, but MPS is not available here")
    elif dev.type not in ("cpu", "mps"):
        raise SettingsError(f"unsupported device {device!r} (use auto, cpu, cuda or cuda:N)")
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


def config_from_json(raw: dict, cfg_file: Path, family: Family | None = None):
    """A config.json dict -> (our config object, model class); auto_map is dropped unread. The
    family picks the classes, so a LLaDA-MoE folder (model_type "llada") never builds LLaDA's."""
    family = family or family_for_config(raw, cfg_file)
    cfg_cls, model_cls = family.classes()
    kind = raw.get("model_type", family.name)  # errors name the folder's own word
    raw = {k: v for k, v in raw.items() if k not in ("auto_map", "model_type")}
    try:
        config = cfg_cls(**raw)
        why = config.unsupported()
    except Exception as e:  # transformers' config validation raises several types
        raise ModelLoadError(f"{cfg_file}: invalid {kind} config: {_one_line(e)}") from None
    if why:
        raise ModelLoadError(f"{cfg_file}: unsupported {kind} variant: {why}")
    return config, model_cls


def _one_line(e: BaseException, limit: int = 300) -> str:
    """A third-party exception's message on one line (they are often multi-line)."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    text = text or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_tokenizer(folder: Path, config=None) -> AnyTokenizer:
    """The folder's tokenizer: on `tokenizers` alone where transformers would build the plain
    backend (models/tokenizer.py, token-identical), else AutoTokenizer without remote code;
    `config` keeps AutoTokenizer from building one by model_type (LLaDA-MoE: dense LLaDA's)."""
    bpe = (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()
    if not bpe and not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(
            f"no tokenizer in {folder} (expected tokenizer.json, or vocab.json + merges.txt)"
        )
    from dllm_cli.models.tokenizer_files import NotFast, load_fast

    try:
        return load_fast(folder)
    except NotFast:  # a folder the fast path cannot express exactly: transformers' own
        return load_with_transformers(folder, config)


def load_with_transformers(folder: Path, config=None) -> PreTrainedTokenizerBase:
    """transformers' AutoTokenizer (no remote code), else Qwen2's BPE for vocab.json + merges."""
    from transformers import AutoTokenizer

    quiet_transformers()
    try:
        extra = {"config": config} if config is not None else {}
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False, **extra)
    except Exception as e:  # transformers raises ValueError/OSError/KeyError here
        error = e
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        from transformers import Qwen2Tokenizer

        try:
            return Qwen2Tokenizer.from_pretrained(str(folder))
        except Exception as e:
            error = e
    raise ModelLoadError(f"cannot load the tokenizer in {folder}: {_one_line(error)}") from None


def _token_id(tokenizer: AnyTokenizer, names: tuple[str, ...]) -> int | None:
    vocab = tokenizer.get_vocab()
    return next((vocab[name] for name in names if name in vocab), None)


ROLES = ("mask", "eos", "pad", "bos", "eot")


def special_ids(
    config,
    tokenizer: AnyTokenizer,
    overrides: dict | None = None,
    *,
    present: Collection[str] | None = None,
    table_size: int | None = None,
    family: Family | None = None,
) -> SpecialIds:
    """Special ids: the profile's overrides, else config.json, else the tokenizer, else (the
    mask) the family table. `present` (config.json's keys) keeps our config classes' defaults
    from posing as the folder's; `table_size` (embedding rows) makes an out-of-range id a load
    error, not a mid-decode index error."""
    over = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = sorted(set(over) - set(ROLES))
    if unknown:
        raise ModelLoadError(f"unknown special token role(s) {unknown} (use {', '.join(ROLES)})")

    def cfg(key: str):
        return getattr(config, key, None) if present is None or key in present else None

    def first(*values):
        return next((v for v in values if v is not None), None)

    eos = first(over.get("eos"), cfg("eos_token_id"), tokenizer.eos_token_id)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    mask = first(
        over.get("mask"),
        cfg("mask_token_id"),
        _token_id(tokenizer, MASK_NAMES),
        tokenizer.mask_token_id,
        family.mask_id if family else None,
    )
    pad = first(over.get("pad"), cfg("pad_token_id"), tokenizer.pad_token_id, eos)
    bos = first(over.get("bos"), cfg("bos_token_id"), tokenizer.bos_token_id)
    eot = first(over.get("eot"), _token_id(tokenizer, EOT_NAMES))
    for role, name, value in (("mask", "mask", mask), ("eos", "EOS", eos)):
        if value is None:
            why = f"names no {name} token (set {role} under [model.special] in the profile)"
            raise ModelLoadError(f"the model folder {why}")
    ids = SpecialIds(mask=int(mask), eos=int(eos), pad=int(pad), bos=bos, eot=eot)
    for role in ROLES:
        value = getattr(ids, role)
        if value is not None and table_size is not None and not 0 <= value < table_size:
            raise ModelLoadError(
                f"{role} token id {value} is outside the model's vocabulary (0..{table_size - 1})"
            )
    return ids


def load_model(
    path: str | os.PathLike,
    *,
    dtype: str = "auto",
    device: str = "auto",
    special_overrides: dict | None = None,
    quantize: str = "none",
    shards: Shards | None = None,
) -> LoadedModel:
    """Load a local model folder; `quantize` (models/quantize.py) converts the projections as
    they load, `shards` (tensor parallelism, models/sharding.py) loads only this rank's slices."""
    scheme = quant.scheme_for(quantize)
    folder = resolve_path(path)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    raw = read_config_json(folder)
    family = family_for_config(raw, folder / "config.json")
    own = family.traits.own_model  # transformers' own model and sampler (DiffusionGemma)
    if scheme.bits:
        refuse_feature(family, "quantize", f"--quantize {scheme.name}")
    if shards is not None and own:
        raise SettingsError(f"--tensor-parallel does not support {family.name} models yet")
    if own:
        return load_diffusion_gemma(folder, raw, dev, torch_dtype, special_overrides, scheme)
    config, model_cls = config_from_json(raw, folder / "config.json", family)
    try:
        with meta_skeleton():
            skeleton = model_cls(config)
    except Exception as e:  # e.g. a zero or negative size in config.json
        raise ModelLoadError(
            f"{folder / 'config.json'}: cannot build a {config.model_type} model: {_one_line(e)}"
        ) from None
    check_weights(folder, skeleton)
    try:
        if shards is not None:  # this rank's slices only, fused or quantized (sharded_load.py)
            from dllm_cli.models.sharded_load import load_sharded

            model = load_sharded(folder, skeleton, family.name, shards, torch_dtype, dev, scheme)
        else:
            # Weights stream shard by shard onto the meta-built model (models/weights.py);
            # device placement is a plain .to() so no accelerate dependency is needed.
            read_as = quant.load_dtype(scheme, torch_dtype, weight_files(folder))  # int8: bf16
            model = read_weights(folder, skeleton, read_as)
            model.to(dev)
    except (ModelLoadError, SettingsError):
        raise
    except Exception as e:  # a damaged shard past our checks (safetensors raises several)
        raise ModelLoadError(f"cannot load weights from {folder}: {_one_line(e)}") from None
    model.eval()
    if scheme.bits and shards is None:
        quant.quantize_loaded(model, scheme, torch_dtype)
    elif shards is None:
        model.fuse_projections()  # one GEMM for q/k/v and for gate/up; names, memory unchanged
    tokenizer = load_tokenizer(folder, config)
    rows = model.get_input_embeddings().num_embeddings
    special = special_ids(
        config, tokenizer, special_overrides, present=raw, table_size=rows, family=family
    )
    special = replace(special, vocab=len(tokenizer))
    kind = config.model_type
    return LoadedModel(model, tokenizer, special, folder, kind, dev, torch_dtype, family.name)


def add_stop_tokens(loaded: LoadedModel, names: list[str]) -> LoadedModel:
    """The loaded model with more tokens that end an answer, named by their strings (a
    profile's `stop_tokens`: DiffuCoder fills its answer's tail with <|dlm_pad|>)."""
    vocab = loaded.tokenizer.get_vocab() if names else {}
    missing = [name for name in names if name not in vocab]
    if missing:
        raise ModelLoadError(
            f"stop token {missing[0]!r} (stop_tokens in [model]) is not in the tokenizer of "
            f"{loaded.path}"
        )
    extra = tuple(vocab[name] for name in names if vocab[name] not in loaded.special.stop)
    if not extra:
        return loaded
    special = replace(loaded.special, extra_stop=(*loaded.special.extra_stop, *extra))
    return replace(loaded, special=special)


def load_diffusion_gemma(
    folder: Path,
    raw: dict,
    dev: torch.device,
    dtype: torch.dtype,
    overrides: dict | None,
    scheme: quant.Scheme = quant.SCHEMES["none"],
) -> LoadedModel:
    """transformers' DiffusionGemma (models/diffusion_gemma.py), our tokenizer and special ids;
    no mask role (uniform-state diffusion), the checkpoint's further stop tokens; `scheme`
    quantizes its linears after the read (as the other families')."""
    from dllm_cli.models import diffusion_gemma as dg

    quiet_transformers()
    try:
        config = dg.read_config(raw)
    except Exception as e:  # strict dataclass validation raises several types
        raise ModelLoadError(
            f"{folder / 'config.json'}: invalid {dg.FAMILY} config: {_one_line(e)}"
        ) from None
    files = weight_files(folder)  # no weights at all: our one-line error before transformers'
    try:
        model = dg.load_weights(folder, config, dev, quant.load_dtype(scheme, dtype, files))
    except ModelLoadError:
        raise
    except Exception as e:  # anything transformers raises for a damaged or mismatched folder
        raise ModelLoadError(f"cannot load weights from {folder}: {_one_line(e)}") from None
    if scheme.bits:
        dg.quantize(model, scheme, dtype)
    tokenizer = load_tokenizer(folder)
    text = config.text_config
    present = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    roles = dg.role_defaults(model, tokenizer) | given
    ids = special_ids(text, tokenizer, roles, present=present, table_size=text.vocab_size)
    special = replace(
        ids, mask=None, extra_stop=dg.extra_stops(model, ids.stop), vocab=len(tokenizer)
    )
    return LoadedModel(model, tokenizer, special, folder, dg.FAMILY, dev, dtype, dg.FAMILY)
