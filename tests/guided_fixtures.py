"""AR guides for the guided-diffusion tests: real tiny Llama models, some with steered opinions.

`SteeredGuide` is a real `LlamaForCausalLM` (real KV cache, masks and positions) whose logits
get a large bias toward a chosen token at each output: the next token it was fed (it agrees
with every draft), the mask id (no draft is ever the mask, so it never agrees), or a mix. So
tests know exactly which drafts a guide accepts while the cache machinery runs for real.
"""

from __future__ import annotations

from pathlib import Path

import torch
from decode_fixtures import EOS, MASK
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from dllm_cli.decoding.guided import GuidedCommitter
from dllm_cli.models.loading import quiet_transformers
from dllm_cli.tinygsm.architectures import ar_to_llada, build_ar, build_llada
from dllm_cli.tinygsm.tokenizer import build_tokenizer
from dllm_cli.tinygsm.train import PRESETS

VOCAB = 40
BIAS = 50.0


def llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
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


class SteeredGuide(LlamaForCausalLM):
    """A Llama whose output at each position is pushed toward tokens chosen by `mode`.

    agree: the next fed token.  never: the mask id.  second: the mask id first, the next
    fed token second.  even: equal push to both (the next token gets probability ~0.5).
    every3: agree unless the predicted position is a multiple of 3, then the mask id.
    """

    mode = "agree"

    def forward(self, input_ids=None, position_ids=None, **kw):
        out = super().forward(input_ids=input_ids, position_ids=position_ids, **kw)
        nxt = torch.roll(input_ids, -1, dims=1)  # (B, T): the token fed after each position
        nudge = torch.zeros_like(out.logits)
        agree = torch.nn.functional.one_hot(nxt, out.logits.shape[-1]).to(nudge.dtype)
        mask = torch.zeros_like(nudge)
        mask[..., MASK] = 1.0
        if self.mode == "every3":
            on = ((position_ids + 1) % 3 != 0)[..., None].to(nudge.dtype)
            nudge = BIAS * (on * agree + (1 - on) * mask)
        else:
            weights = {"agree": (1, 0), "never": (0, 1), "second": (1, 2), "even": (1, 1)}
            a, m = weights[self.mode]
            nudge = BIAS * (a * agree + m * mask)
        out.logits = out.logits + nudge
        return out


def steered(mode: str, seed: int = 0) -> SteeredGuide:
    torch.manual_seed(seed)
    model = SteeredGuide(llama_config()).double().eval()
    model.mode = mode
    return model


def committer(guide, rule: str = "exact", arg: float | None = None) -> GuidedCommitter:
    """A guided committer for the decode_fixtures models (40 ids, EOS padding)."""
    return GuidedCommitter(guide, vocab_size=VOCAB, pad_id=EOS, rule=rule, arg=arg)


_WRITTEN: dict[str, tuple[Path, Path]] = {}


def shared_tinygsm_pair(tmp_path_factory) -> tuple[Path, Path]:
    """One micro pair per test session, whichever module asks first (the tokenizer takes 3 s)."""
    if "pair" not in _WRITTEN:
        _WRITTEN["pair"] = write_tinygsm_pair(tmp_path_factory.mktemp("tinygsm"))
    return _WRITTEN["pair"]


def write_tinygsm_pair(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """Untrained micro TinyGSM models: a LLaDA-format diffusion LM and its Llama guide."""
    quiet_transformers()
    tok = build_tokenizer()
    cfg = PRESETS["micro"]
    torch.manual_seed(seed)
    ar = build_ar(cfg, tok)
    mdm = build_llada(cfg, tok)
    mdm.load_state_dict(ar_to_llada(ar.state_dict()))  # AR initialisation, as training does
    folders = (root / "tiny-gsm", root / "tiny-gsm-ar")
    for model, folder in zip((mdm, ar), folders, strict=True):
        folder.mkdir(parents=True)
        model.config.save_pretrained(str(folder))
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(str(folder))
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
