"""Guided-diffusion fixtures: real tiny Llama guides and diffusion models steered by position.

A `Pointed*` diffusion model and a `PointedGuide` are real models (real KV caches, masks,
positions) whose logits get a large bias toward a token chosen by the position they predict.
The diffusion model always drafts `TARGET(p)` at answer position p; the guide's preference is
set by its mode, so tests know exactly which drafts a guide accepts:

agree: TARGET(p).  never: OTHER(p) (never a draft).  second: OTHER(p) first, TARGET(p) second.
even: both equally (the draft gets probability ~0.5).  every3: TARGET(p) unless p % 3 == 0.
"""

from __future__ import annotations

import shutil
from functools import cache
from pathlib import Path

import torch
from decode_fixtures import EOS, SPECIAL, dream_config, llada_config, randomize
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from dllm_cli.decoding.guided import GuidedCommitter, GuideRules
from dllm_cli.folders import BUILTIN_DIR
from dllm_cli.models import DreamModel, LLaDAConfig, LLaDAModelLM
from dllm_cli.models.loading import load_tokenizer, quiet_transformers

VOCAB = 40
BIAS = 50.0


def target(positions: torch.Tensor) -> torch.Tensor:
    """The token a pointed diffusion model drafts at each position (ordinary ids 4..33)."""
    return 4 + (positions * 7) % 30


def other(positions: torch.Tensor) -> torch.Tensor:
    """A token that is never the draft at that position."""
    return target(positions) + 1


def llama_config(vocab: int = VOCAB) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        pad_token_id=EOS,
        eos_token_id=EOS,
        bos_token_id=2,
        tie_word_embeddings=False,
    )


def random_guide(seed: int = 0, scale: float = 3.0) -> LlamaForCausalLM:
    """A random tiny Llama in float64 (no near-ties flip between cached and full forwards)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config()).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, dtype=p.dtype) * p.shape[1] ** -0.5)
        model.lm_head.weight.mul_(scale)
    return model


def one_hot(tokens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(tokens, like.shape[-1]).to(like.dtype)


class PointedGuide(LlamaForCausalLM):
    """A Llama whose output at position p leans toward a token for position p + 1 (by mode)."""

    mode = "agree"
    eos_at: int | None = None  # a position where it wants EOS instead
    loves: tuple[int, ...] = ()  # ids it prefers above all, everywhere

    def forward(self, input_ids=None, position_ids=None, **kw):
        if position_ids is None:  # a plain forward from position 0
            position_ids = torch.arange(input_ids.shape[1])[None].expand_as(input_ids)
        out = super().forward(input_ids=input_ids, position_ids=position_ids, **kw)
        logits = out.logits
        keep = logits.shape[1]  # logits_to_keep may have kept only the last outputs
        nxt = (position_ids + 1)[:, -keep:]  # (B, T): the position each output predicts
        agree, differ = one_hot(target(nxt), logits), one_hot(other(nxt), logits)
        if self.mode == "every3":
            on = (nxt % 3 != 0)[..., None].to(logits.dtype)
            nudge = on * agree + (1 - on) * differ
        else:
            a, d = {"agree": (1, 0), "never": (0, 1), "second": (1, 2), "even": (1, 1)}[self.mode]
            nudge = a * agree + d * differ
        if self.eos_at is not None:
            at = (nxt == self.eos_at)[..., None].to(logits.dtype)
            nudge = (1 - at) * nudge + at * one_hot(torch.full_like(nxt, EOS), logits)
        for token in self.loves:
            nudge[..., token] += 4.0
        out.logits = logits + BIAS * nudge
        return out


def pointed_guide(
    mode: str, seed: int = 0, eos_at: int | None = None, vocab: int = VOCAB, loves=()
) -> PointedGuide:
    torch.manual_seed(seed)
    model = PointedGuide(llama_config(vocab)).double().eval()
    model.mode, model.eos_at, model.loves = mode, eos_at, tuple(loves)
    return model


def point(model, logits, input_ids, positions, logits_slice):
    """Add BIAS to TARGET(p) where the output predicts position p (LLaDA p, Dream p + 1)."""
    if isinstance(logits_slice, torch.Tensor):
        positions = positions.gather(1, logits_slice)
    elif logits_slice is not None:
        positions = positions[:, logits_slice]
    return logits + BIAS * one_hot(target(positions + model.logit_shift), logits)


class PointedLLaDA(LLaDAModelLM):
    def forward(self, input_ids, positions=None, cache=None, key_mask=None, columns=None, **kw):
        logits = super().forward(input_ids, positions, cache, key_mask, columns, **kw)
        return point(self, logits, input_ids, positions, kw.get("logits_slice"))


class PointedDream(DreamModel):
    def forward(self, input_ids, positions=None, cache=None, key_mask=None, columns=None, **kw):
        logits = super().forward(input_ids, positions, cache, key_mask, columns, **kw)
        return point(self, logits, input_ids, positions, kw.get("logits_slice"))


@cache
def pointed(kind: str, seed: int = 0):
    """A tiny diffusion model (LLaDA or Dream) that drafts TARGET(p) at every position."""
    config, cls = {"llada": (llada_config, PointedLLaDA), "dream": (dream_config, PointedDream)}[
        kind
    ]
    model = cls(config(2))
    randomize(model, seed, 1.0)
    return model.eval()


def committer(guide, rule: str = "exact", arg: float | None = None, **kw) -> GuidedCommitter:
    """A guided committer for the decode_fixtures models (40 ids, [MASK] = 39)."""
    return GuidedCommitter(guide, VOCAB, SPECIAL, GuideRules(rule, arg, **kw))


_WRITTEN: dict[str, tuple[Path, Path]] = {}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def shared_tinygsm_pair(tmp_path_factory) -> tuple[Path, Path]:
    """One micro pair per test session, whichever module asks first (the tokenizer takes 3 s)."""
    if "pair" not in _WRITTEN:
        _WRITTEN["pair"] = write_tinygsm_pair(tmp_path_factory.mktemp("tinygsm"))
    return _WRITTEN["pair"]


def write_tinygsm_pair(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """Untrained micro models with the shipped TinyGSM tokenizer: a LLaDA-format diffusion LM
    and its Llama guide (d_model 32, 2 layers, 2 heads: the recipe's micro preset)."""
    quiet_transformers()
    tok = load_tokenizer(BUILTIN_DIR / "tiny-gsm-dream")
    rows = -(-len(tok) // 8) * 8  # the embedding padded to a multiple of 8, as shipped
    shape = {"vocab_size": rows, "hidden_size": 32, "intermediate_size": 64}
    shape |= {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2}
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    torch.manual_seed(seed)
    ar = LlamaForCausalLM(
        LlamaConfig(
            **shape,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            bos_token_id=tok.bos_token_id,
            eos_token_id=[tok.eos_token_id, eot],
            pad_token_id=tok.eos_token_id,
        )
    )
    llada = LLaDAConfig(
        d_model=32, n_heads=2, n_kv_heads=2, n_layers=2, mlp_hidden_size=64, mlp_ratio=4,
        max_sequence_length=2048, vocab_size=len(tok), embedding_size=rows,
        mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
        architectures=["LLaDAModelLM"],
    )  # fmt: skip
    mdm = LLaDAModelLM(llada)
    folders = (root / "tiny-gsm", root / "tiny-gsm-ar")
    for model, folder in zip((mdm, ar), folders, strict=True):
        folder.mkdir(parents=True)
        model.config.save_pretrained(str(folder))
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        for name in TOKENIZER_FILES:  # the shipped tokenizer, as the files it loads from
            shutil.copy(BUILTIN_DIR / "tiny-gsm-dream" / name, folder / name)
    return folders


def tinygsm_profile(path: Path, model: Path, guide: Path | None, decode: str = "") -> Path:
    """A profile file for the micro pair: float32 on CPU, short answers."""
    text = f"""name = "{path.stem}"
[model]
path = "{model}"
dtype = "float32"
device = "cpu"
[decode]
gen_length = 32
block_length = 16
{decode}
"""
    if guide is not None:
        text += f'[guide]\npath = "{guide}"\n'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
