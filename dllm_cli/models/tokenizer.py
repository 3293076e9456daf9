"""A checkpoint's tokenizer on the `tokenizers` library: transformers' tokenizer surface.

`AutoTokenizer` costs transformers' package import (0.7-1.1 s of a start-up, issue 30) for a
tokenizer.json `tokenizers` reads by itself. `FastTokenizer` is the part of transformers 5.24's
`TokenizersBackend` dllm uses, each a call into the same `tokenizers.Tokenizer` transformers
would make (models/tokenizer_files.py builds it; tests/test_fast_tokenizer.py compares them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

# transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order (ids of new tokens follow it).
NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers' apply_chat_template options that dllm never passes (they are not template data).
UNSUPPORTED_TEMPLATE_OPTIONS = frozenset(
    {
        "continue_final_message",
        "sanitize_control_tokens",
        "return_assistant_tokens_mask",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)


@dataclass(frozen=True)
class Encoding:
    """What `tokenizer(text)` returns that dllm reads (transformers' BatchEncoding fields)."""

    input_ids: list[int]
    offset_mapping: list[tuple[int, int]] | None = None

    def __getitem__(self, key: str):
        """`enc["input_ids"]`, as a BatchEncoding reads."""
        value = getattr(self, key, None) if key in ("input_ids", "offset_mapping") else None
        if value is None:
            raise KeyError(key)
        return value


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
        clean = clean_up_tokenization_spaces
        clean = self.clean_up_tokenization_spaces if clean is None else clean
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
        """The conversation through the folder's chat template (models/chat_template.py);
        transformers' options that change the output are refused, not template variables."""
        from dllm_cli.models import chat_template as ct

        unsupported = sorted(set(kwargs) & UNSUPPORTED_TEMPLATE_OPTIONS)
        if unsupported:
            raise TypeError(f"apply_chat_template: {', '.join(unsupported)} not supported here")
        source = chat_template or self.chat_template
        if source is None:
            raise ValueError("this tokenizer has no chat template")
        prompt = {"add_generation_prompt": add_generation_prompt}
        text = ct.render(source, conversation, self.special, **prompt, **kwargs)
        return self(text, add_special_tokens=False).input_ids if tokenize else text


def clean_up_spaces(text: str) -> str:
    """transformers' `clean_up_tokenization`: spaces before punctuation and contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'")):
        text = text.replace(before, after)
    for suffix in ("n't", "'m", "'s", "'ve", "'re"):
        text = text.replace(" " + suffix, suffix)
    return text
