"""The TinyGSM tokenizer: word level, one token per digit, LLaDA's special tokens and chat format.

Spaces become a `▁` prefix on the following word, digit or symbol (so `12` is `▁1`, `2` and
decoding restores the exact text); a newline is its own token. Every word either generator
writes is one token; any other ASCII word is spelled: WordPiece (the longest known prefix,
then `##`-prefixed pieces down to single letters), so a name the model never saw is still
text it can copy, never `<|unk|>`. Ids are append-only: the first 167 are the first release's
(narrow words), then the wide generator's words, then the letter and symbol pieces.
"""

from __future__ import annotations

import json
import string
from functools import cache
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from recipes.tinygsm.data import vocabulary_text
from recipes.tinygsm.scenes import rich_vocabulary_text
from recipes.tinygsm.wide import wide_vocabulary_text

BOS, EOS, EOT = "<|startoftext|>", "<|endoftext|>", "<|eot_id|>"
MASK, HEADER_START, HEADER_END = "<|mdm_mask|>", "<|start_header_id|>", "<|end_header_id|>"
UNK = "<|unk|>"
SPECIALS = (EOS, BOS, EOT, MASK, HEADER_START, HEADER_END, UNK)
ROLES = ("system", "user", "assistant")

# LLaDA's chat format: BOS once, then `<|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>`.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' "
    "+ message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

_PIECE = Regex(r"▁?[0-9]|▁?[A-Za-z]+|▁?[^\sA-Za-z0-9▁]|\n|▁")


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Split(_PIECE, behavior="isolated")


def _normalizer() -> normalizers.Normalizer:
    """Tabs count as spaces; a space becomes `▁` on the piece after it."""
    return normalizers.Sequence([normalizers.Replace("\t", " "), normalizers.Replace(" ", "▁")])


CONTINUE = "##"  # WordPiece prefix of a piece that continues a word
LETTERS = string.ascii_letters
SYMBOLS = "".join(c for c in string.punctuation if c != "▁")


def corpus_pieces(lines: list[str]) -> set[str]:
    norm, pre = _normalizer(), _pre_tokenizer()
    pieces: set[str] = set()
    for line in lines:
        pieces.update(p for p, _ in pre.pre_tokenize_str(norm.normalize_str(line)))
    return pieces


def spelling_pieces() -> list[str]:
    """Pieces that spell any ASCII word or symbol: `a`, `▁a`, `##a` per letter; `?`, `▁?`; `▁`."""
    letters = [f"{prefix}{c}" for c in LETTERS for prefix in ("", "▁", CONTINUE)]
    symbols = [f"{prefix}{c}" for c in SYMBOLS for prefix in ("", "▁")]
    return sorted(["▁", *letters, *symbols])


def build_vocab(*groups: list[str]) -> dict[str, int]:
    """Special tokens, then each group's pieces in its order, skipping known ones: append-only."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for group in groups:
        for piece in group:
            vocab.setdefault(piece, len(vocab))
    return vocab


def words_of(lines: list[str], *more: str) -> list[str]:
    """A corpus's pieces (and `more`), sorted: one group of build_vocab."""
    return sorted(corpus_pieces(lines) | set(more))


@cache
def tinygsm_vocab() -> tuple[tuple[str, int], ...]:
    """The release vocabulary, in the order it grew: the first release's words (narrow
    generator), the wide generator's words, the spelling pieces, the rich generator's words."""
    vocab = build_vocab(
        words_of(vocabulary_text(), "\n", *ROLES),
        words_of(wide_vocabulary_text()),
        spelling_pieces(),
        words_of(rich_vocabulary_text()),
    )
    return tuple(vocab.items())


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The TinyGSM tokenizer as a transformers fast tokenizer (loadable with AutoTokenizer)."""
    vocab = dict(tinygsm_vocab())
    tok = Tokenizer(models.WordPiece(vocab, unk_token=UNK, continuing_subword_prefix=CONTINUE))
    tok.normalizer = _normalizer()
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.Sequence(
        [decoders.Replace(CONTINUE, ""), decoders.Replace("▁", " "), decoders.Fuse()]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=UNK,
        mask_token=MASK,
        additional_special_tokens=[EOT, HEADER_START, HEADER_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    return fast


def save_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """Write tokenizer.json + tokenizer_config.json (with the chat template) into `folder`."""
    tok = build_tokenizer()
    tok.save_pretrained(str(folder))
    # Keep the template inside tokenizer_config.json too, where transformers 4.x looks for it.
    cfg_file = Path(folder) / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return tok
