"""A tokenizer folder -> FastTokenizer, built as transformers 5.24's `from_pretrained` builds it.

The steps are transformers' (tokenization_utils_base `_from_pretrained`, tokenization_utils_tokenizers
`TokenizersBackend.__init__`, models/qwen2 `Qwen2Tokenizer.__init__`), in its order and with
the same calls into the `tokenizers` backend; each tokenizer class's backend is a `RECIPES`
record. Any other class, a remote class (but Dream's, loaded as Qwen2's), several templates,
legacy token files or `fix_mistral_regex` raise `NotFast` with the reason, and
models/loading.py loads transformers' tokenizer instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers.models import BPE

from dllm_cli.models.tokenizer import NAMED, FastTokenizer

# Files transformers reads, without added_tokens_decoder, in ways not repeated here.
LEGACY_FILES = ("special_tokens_map.json", "added_tokens.json")
# transformers' Qwen2 pre-tokenizer split (models/qwen2/tokenization_qwen2.py).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class NotFast(Exception):
    """This folder's tokenizer needs transformers (the message says why)."""


@dataclass(frozen=True)
class Recipe:
    """How transformers builds one tokenizer class's backend."""

    # (folder, tokenizer.json or None, config) -> (backend, post-processor to set or None)
    backend: Callable[[Path, Path | None, dict], tuple[Tokenizer, Any]]
    needs_json: bool  # tokenizer.json required (else vocab.json + merges.txt)
    defaults: dict[str, str] = field(default_factory=dict)  # the class signature's named tokens
    readds_specials: bool = False  # the class adds every special token once more at the end


def saved_backend(folder: Path, file: Path | None, cfg: dict) -> tuple[Tokenizer, Any]:
    """tokenizer.json exactly as saved (TokenizersBackend)."""
    try:
        backend = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own Exception type
        raise NotFast(f"tokenizer.json does not load ({e})") from None
    return backend, None


def qwen2_backend(folder: Path, file: Path | None, cfg: dict) -> tuple[Tokenizer, Any]:
    """Qwen2Tokenizer's byte-level BPE around the folder's vocabulary and merges."""
    processor = None
    if file is not None:  # transformers takes vocab, merges and the post-processor from it
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
            model = raw["model"]
            vocab = model["vocab"]
            merges = [
                tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]
            ]
            shell = dict(raw, model=dict(model, vocab={}, merges=[]), added_tokens=[])
            processor = Tokenizer.from_str(json.dumps(shell)).post_processor
        except Exception as e:  # JSON, keys or tokenizers' own errors
            raise NotFast(f"tokenizer.json is not a BPE file transformers reads ({e})") from None
        if model.get("type") != "BPE" or not isinstance(vocab, dict):
            raise NotFast("tokenizer.json holds no BPE vocabulary")
    else:
        vocab, merges = str(folder / "vocab.json"), str(folder / "merges.txt")
    prefix = cfg.get("add_prefix_space")
    backend = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    backend.decoder = decoders.ByteLevel()
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=bool(prefix), use_regex=False),
        ]
    )
    return backend, processor


ENDOFTEXT = dict.fromkeys(("unk_token", "eos_token", "pad_token"), "<|endoftext|>")
QWEN2 = Recipe(qwen2_backend, needs_json=False, defaults=ENDOFTEXT, readds_specials=True)
RECIPES = {
    "PreTrainedTokenizerFast": Recipe(saved_backend, needs_json=True),
    "TokenizersBackend": Recipe(saved_backend, needs_json=True),
    "Qwen2Tokenizer": QWEN2,
    "Qwen2TokenizerFast": QWEN2,
    "DreamTokenizer": QWEN2,  # remote code never runs: loading.py has always used Qwen2's
}


def refusal(folder: Path) -> str | None:
    """Why `load_fast` would refuse this folder (None: it loads it)."""
    try:
        read_settings(folder)
    except NotFast as e:
        return str(e)
    return None


def read_settings(folder: Path) -> tuple[dict[str, Any], Recipe]:
    """tokenizer_config.json as transformers' `_from_pretrained` hands it to the class."""
    cfg_file = folder / "tokenizer_config.json"
    if not cfg_file.is_file():
        raise NotFast("no tokenizer_config.json (transformers picks the class by model type)")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NotFast(f"unreadable tokenizer_config.json ({e})") from None
    if not isinstance(cfg, dict):
        raise NotFast("tokenizer_config.json is not an object")
    kind = cfg.get("tokenizer_class")
    recipe = RECIPES.get(kind)
    if recipe is None:
        raise NotFast(f"tokenizer_class {kind!r} (its class may rebuild the pipeline)")
    has_json = (folder / "tokenizer.json").is_file()
    has_bpe = (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()
    if not has_json and (recipe.needs_json or not has_bpe):
        raise NotFast("no tokenizer.json")
    auto = cfg.get("auto_map")
    remote = isinstance(auto, list | tuple) or (isinstance(auto, dict) and "AutoTokenizer" in auto)
    if remote and kind != "DreamTokenizer":
        raise NotFast("auto_map names a remote tokenizer class")
    if kind == "DreamTokenizer" and not has_bpe:
        raise NotFast("DreamTokenizer without vocab.json + merges.txt")
    if (folder / "additional_chat_templates").is_dir() or not isinstance(
        cfg.get("chat_template"), str | None
    ):
        raise NotFast("several named chat templates")
    if "fix_mistral_regex" in cfg:
        raise NotFast("fix_mistral_regex (transformers patches the pre-tokenizer)")
    if "added_tokens_decoder" not in cfg and any((folder / f).is_file() for f in LEGACY_FILES):
        raise NotFast("special_tokens_map.json / added_tokens.json without added_tokens_decoder")
    cfg = {k: v for k, v in cfg.items() if k not in ("tokenizer_class", "init_inputs")}
    if has_json:  # transformers drops both when there is a tokenizer.json
        cfg.pop("add_bos_token", None)
        cfg.pop("add_eos_token", None)
    template = folder / "chat_template.jinja"  # the file wins over the config's string
    if template.is_file():
        cfg["chat_template"] = template.read_text(encoding="utf-8")
    if "additional_special_tokens" in cfg and not cfg.get("extra_special_tokens"):
        cfg["extra_special_tokens"] = cfg.pop("additional_special_tokens")
    return as_added_tokens(cfg), recipe


def as_added_tokens(obj: Any) -> Any:
    """Serialized AddedTokens ({"__type": "AddedToken", ...}) back to objects, anywhere."""
    if isinstance(obj, dict) and obj.get("__type") == "AddedToken":
        return AddedToken(**{k: v for k, v in obj.items() if k != "__type"})
    if isinstance(obj, list | tuple):
        return [as_added_tokens(o) for o in obj]
    if isinstance(obj, dict):
        return {k: as_added_tokens(v) for k, v in obj.items()}
    return obj


def added_decoder(cfg: dict, file: Path | None) -> dict[int, AddedToken]:
    """The `added_tokens_decoder` transformers passes on: the config's, else tokenizer.json's."""
    if "added_tokens_decoder" in cfg:
        entries = cfg["added_tokens_decoder"].items()
        return {int(i): t if isinstance(t, AddedToken) else AddedToken(**t) for i, t in entries}
    if file is None:
        return {}
    added = json.loads(file.read_text(encoding="utf-8")).get("added_tokens", [])
    return {t["id"]: AddedToken(**{k: v for k, v in t.items() if k != "id"}) for t in added}


def special_roles(cfg: dict) -> tuple[dict[str, str | AddedToken], list]:
    """(named special tokens in transformers' order, extra special tokens) from the config."""
    named: dict[str, str | AddedToken] = {k: cfg[k] for k in NAMED if cfg.get(k) is not None}
    for key, value in named.items():
        if not isinstance(value, str | AddedToken):
            raise NotFast(f"{key} is neither a string nor an AddedToken")
    extra = cfg.get("extra_special_tokens") or []
    specific = {
        k: v
        for k, v in cfg.items()
        if k not in NAMED and k.endswith("_token") and isinstance(v, str | AddedToken)
    }
    if isinstance(extra, dict):  # model-specific named tokens (e.g. image_token)
        specific |= extra
        extra = []
    if not isinstance(extra, list):
        raise NotFast("extra_special_tokens is neither a list nor a dict")
    return named | specific, list(extra)


def load_fast(folder: Path) -> FastTokenizer:
    """The folder's tokenizer without transformers, or NotFast with the reason."""
    cfg, recipe = read_settings(folder)
    file = folder / "tokenizer.json" if (folder / "tokenizer.json").is_file() else None
    decoder = added_decoder(cfg, file)
    by_text = {str(t): t for t in decoder.values()}
    for key in NAMED:  # a named token that is an added token carries its flags
        if cfg.get(key) is not None:
            cfg[key] = by_text.get(str(cfg[key]), cfg[key])
    for key, value in recipe.defaults.items():
        cfg.setdefault(key, value)
    backend, processor = recipe.backend(folder, file, cfg)
    padding = backend.padding
    if padding is not None:  # a padded tokenizer.json names the pad token when the config does not
        cfg.setdefault("pad_token", padding["pad_token"])
    backend.no_truncation()  # transformers turns both off for every unpadded, untruncated call
    backend.no_padding()
    explicit = "add_bos_token" in cfg or "add_eos_token" in cfg
    add_bos, add_eos = bool(cfg.get("add_bos_token")), bool(cfg.get("add_eos_token"))
    if processor is not None:
        backend.post_processor = processor
    rewrite = explicit or backend.post_processor is None
    named, extra = special_roles(cfg)
    tok = FastTokenizer(backend, cfg, named, extra, folder)
    backend.encode_special_tokens = tok.split_special_tokens
    add_declared_tokens(backend, decoder, named, extra)
    if rewrite or backend.post_processor is None:
        backend.post_processor = bos_eos_processor(tok, add_bos, add_eos)
    if recipe.readds_specials:
        backend.add_tokens([AddedToken(t, special=True) for t in tok.all_special_tokens])
    return tok


def add_declared_tokens(backend: Tokenizer, decoder: dict, named: dict, extra: list) -> None:
    """TokenizersBackend.__init__'s one `add_tokens` call: every config-declared added token
    (transformers re-adds them all), then named and extra special tokens it does not know yet."""
    to_add: list = [t for _, t in sorted(decoder.items(), key=lambda kv: kv[0])]
    known = [t.content for t in backend.get_added_tokens_decoder().values()]
    known += [str(t) for t in to_add]
    for token in [*named.values(), *extra]:
        if str(token) not in known and token not in to_add:
            to_add.append(token)
    if not to_add:
        return
    roles = [str(t) for t in named.values() if t]
    tokens = []
    for token in to_add:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and str(token) in roles:
            token.special = True
        tokens.append(token)
    backend.add_tokens(tokens)


def bos_eos_processor(tok: FastTokenizer, add_bos: bool, add_eos: bool):
    """transformers' `update_post_processor`: BOS and EOS around a text where the config asks."""
    bos, eos = tok.bos_token, tok.eos_token
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    special = [(bos, tok.bos_token_id)] if add_bos else []
    special += [(eos, tok.eos_token_id)] if add_eos else []
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
