"""A checkpoint's tokenizer on the `tokenizers` library, built as transformers 5 builds it.

`AutoTokenizer` costs transformers' package import (0.7-1.1 s of a start-up, issue 30) for a
tokenizer.json that the `tokenizers` library reads by itself. `load_fast` repeats what
transformers 5.24 does for a folder whose tokenizer_config.json names `PreTrainedTokenizerFast`
or `TokenizersBackend` (tokenization_utils_base `_from_pretrained`, tokenization_utils_tokenizers
`TokenizersBackend.__init__`), with the same calls into the same backend, so ids, offsets,
added tokens and decoded text are transformers' own (tests/test_fast_tokenizer.py proves it
family by family). Any folder it cannot express exactly raises `NotFast` with the reason, and
the caller loads transformers' tokenizer instead (models/loading.py): a declared check, never
a silent difference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

# transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order (ids of new tokens follow it).
NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_class values that transformers loads as the plain tokenizers backend.
BACKEND_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
# Files transformers would read in ways this module does not repeat.
LEGACY_FILES = ("special_tokens_map.json", "added_tokens.json")


class NotFast(Exception):
    """This folder's tokenizer needs transformers (the message says why)."""


@dataclass(frozen=True)
class Encoding:
    """What `tokenizer(text)` returns that dllm reads (transformers' BatchEncoding fields)."""

    input_ids: list[int]
    offset_mapping: list[tuple[int, int]] | None = None


def refusal(folder: Path) -> str | None:
    """Why `load_fast` would refuse this folder (None: it loads it)."""
    try:
        read_settings(folder)
    except NotFast as e:
        return str(e)
    return None


def read_settings(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json as transformers' `_from_pretrained` hands it to the class."""
    if not (folder / "tokenizer.json").is_file():
        raise NotFast("no tokenizer.json")
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
    if kind not in BACKEND_CLASSES:
        raise NotFast(f"tokenizer_class {kind!r} (its class may rebuild the pipeline)")
    auto = cfg.get("auto_map")
    if isinstance(auto, list | tuple) or (isinstance(auto, dict) and "AutoTokenizer" in auto):
        raise NotFast("auto_map names a remote tokenizer class")
    if (folder / "additional_chat_templates").is_dir() or not isinstance(
        cfg.get("chat_template"), str | None
    ):
        raise NotFast("several named chat templates")
    if "fix_mistral_regex" in cfg:
        raise NotFast("fix_mistral_regex (transformers patches the pre-tokenizer)")
    if "added_tokens_decoder" not in cfg and any((folder / f).is_file() for f in LEGACY_FILES):
        raise NotFast("special_tokens_map.json / added_tokens.json without added_tokens_decoder")
    cfg = {k: v for k, v in cfg.items() if k not in ("tokenizer_class", "init_inputs")}
    cfg.pop("add_bos_token", None)  # transformers drops both when tokenizer.json is there
    cfg.pop("add_eos_token", None)
    template = folder / "chat_template.jinja"  # the file wins over the config's string
    if template.is_file():
        cfg["chat_template"] = template.read_text(encoding="utf-8")
    if "additional_special_tokens" in cfg and not cfg.get("extra_special_tokens"):
        cfg["extra_special_tokens"] = cfg.pop("additional_special_tokens")
    return as_added_tokens(cfg)


def as_added_tokens(obj: Any) -> Any:
    """Serialized AddedTokens ({"__type": "AddedToken", ...}) back to objects, anywhere."""
    if isinstance(obj, dict) and obj.get("__type") == "AddedToken":
        return AddedToken(**{k: v for k, v in obj.items() if k != "__type"})
    if isinstance(obj, list | tuple):
        return [as_added_tokens(o) for o in obj]
    if isinstance(obj, dict):
        return {k: as_added_tokens(v) for k, v in obj.items()}
    return obj


def added_decoder(cfg: dict, tokenizer_json: Path) -> dict[int, AddedToken]:
    """The `added_tokens_decoder` transformers passes on: the config's, else tokenizer.json's."""
    if "added_tokens_decoder" in cfg:
        entries = cfg["added_tokens_decoder"].items()
        return {int(i): t if isinstance(t, AddedToken) else AddedToken(**t) for i, t in entries}
    added = json.loads(tokenizer_json.read_text(encoding="utf-8")).get("added_tokens", [])
    return {t["id"]: AddedToken(**{k: v for k, v in t.items() if k != "id"}) for t in added}


def special_roles(cfg: dict) -> tuple[dict[str, str | AddedToken], list]:
    """(named special tokens in transformers' order, extra special tokens) from the config."""
    named: dict[str, str | AddedToken] = {}
    for key in NAMED:
        value = cfg.get(key)
        if value is not None and not isinstance(value, str | AddedToken):
            raise NotFast(f"{key} is neither a string nor an AddedToken")
        if value is not None:
            named[key] = value
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


class FastTokenizer:
    """transformers' TokenizersBackend surface that dllm uses, over one `tokenizers.Tokenizer`."""

    is_fast = True

    def __init__(self, backend: Tokenizer, cfg: dict, named: dict, extra: list, path: Path):
        self.backend = backend
        self.name_or_path = str(path)
        self.special = {k: str(v) for k, v in named.items()}  # role -> token string
        self.extra = [str(t) for t in extra]
        self.chat_template = cfg.get("chat_template")
        self.clean_up_tokenization_spaces = bool(cfg.get("clean_up_tokenization_spaces", False))
        self.force_bpe_cleanup = bool(
            cfg.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
        )
        self.split_special_tokens = bool(cfg.get("split_special_tokens", False))
        self.model_max_length = cfg.get("model_max_length")

    # --- vocabulary ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self.backend.get_added_tokens_decoder()

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int | None] | None:
        if isinstance(tokens, str):
            return self.token_id(tokens)
        return [self.token_id(t) for t in tokens]

    def token_id(self, token: str) -> int | None:
        """The token's id, else the unknown token's (transformers' rule)."""
        found = self.backend.token_to_id(token)
        if found is not None:
            return found
        unk = self.special.get("unk_token")
        return None if unk is None else self.backend.token_to_id(unk)

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    # --- special tokens -----------------------------------------------------------------------
    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self.special)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys([*self.special.values(), *self.extra]))

    @property
    def all_special_ids(self) -> list[int | None]:
        return [self.token_id(t) for t in self.all_special_tokens]

    def __getattr__(self, name: str):
        """`bos_token`, `eos_token_id`, ...: None when the role is unset, as in transformers."""
        role = name.removesuffix("_id")
        if role in NAMED or role in self.__dict__.get("special", {}):
            token = self.__dict__["special"].get(role)
            if token is None or role == name:
                return token
            return self.token_id(token)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    # --- text <-> ids -------------------------------------------------------------------------
    def __call__(
        self,
        text: str,
        *,
        add_special_tokens: bool = True,
        split_special_tokens: bool | None = None,
        return_offsets_mapping: bool = False,
    ) -> Encoding:
        """One text's ids (and character spans), as transformers' `tokenizer(text)`."""
        if not isinstance(text, str):
            raise TypeError("text input must be of type `str`")
        split = self.split_special_tokens if split_special_tokens is None else split_special_tokens
        if self.backend.encode_special_tokens != split:
            self.backend.encode_special_tokens = split
        enc = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return Encoding(list(enc.ids), list(enc.offsets) if return_offsets_mapping else None)

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs) -> list[int]:
        return self(text, add_special_tokens=add_special_tokens, **kwargs).input_ids

    def decode(
        self,
        token_ids: int | list[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        """ids -> text: the backend's decoder, then transformers' space clean-up where it applies."""
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = (
            self.clean_up_tokenization_spaces
            if clean_up_tokenization_spaces is None
            else clean_up_tokenization_spaces
        )
        bpe = type(self.backend.model).__name__ == "BPE"
        if clean and (not bpe or self.force_bpe_cleanup):  # transformers skips it for BPE
            text = clean_up_spaces(text)
        return text

    def apply_chat_template(
        self,
        conversation: list[dict],
        *,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        chat_template: str | None = None,
        **kwargs,
    ):
        """The conversation through the folder's chat template (models/chat_template.py)."""
        from dllm_cli.models import chat_template as ct

        source = chat_template or self.chat_template
        if source is None:
            raise ValueError("this tokenizer has no chat template")
        text = ct.render(
            source,
            conversation,
            self.special,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        return self(text, add_special_tokens=False).input_ids if tokenize else text


def clean_up_spaces(text: str) -> str:
    """transformers' `clean_up_tokenization`: spaces before punctuation and contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'")):
        text = text.replace(before, after)
    for suffix in ("n't", "'m", "'s", "'ve", "'re"):
        text = text.replace(" " + suffix, suffix)
    return text


def load_fast(folder: Path) -> FastTokenizer:
    """The folder's tokenizer without transformers, or NotFast with the reason."""
    cfg = read_settings(folder)
    file = folder / "tokenizer.json"
    decoder = added_decoder(cfg, file)
    by_text = {str(t): t for t in decoder.values()}
    for key in NAMED:  # a named token that is an added token carries its flags
        if cfg.get(key) is not None:
            cfg[key] = by_text.get(str(cfg[key]), cfg[key])
    try:
        backend = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own Exception type
        raise NotFast(f"tokenizer.json does not load ({e})") from None
    padding = backend.padding
    if padding is not None:  # a padded tokenizer.json names the pad token when the config does not
        cfg.setdefault("pad_token", padding["pad_token"])
    backend.no_truncation()  # transformers turns both off for every unpadded, untruncated call
    backend.no_padding()
    had_processor = backend.post_processor is not None
    named, extra = special_roles(cfg)
    tok = FastTokenizer(backend, cfg, named, extra, folder)
    backend.encode_special_tokens = tok.split_special_tokens
    add_declared_tokens(backend, decoder, named, extra)
    if not had_processor:  # transformers' update_post_processor without BOS/EOS
        backend.post_processor = processors.TemplateProcessing(
            single="$A:0", pair="$A:0 $B:1", special_tokens=[]
        )
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
