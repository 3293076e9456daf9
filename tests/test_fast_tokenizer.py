"""The tokenizer on `tokenizers` + jinja2 (models/tokenizer.py) is transformers' own, id for id.

Each folder family dllm ships or tests (the three shipped models, LLaDA's word-level and
byte-level formats, LLaDA-MoE / LLaDA2's, a folder with every config feature the fast path
repeats) is loaded both ways, `load_tokenizer` (the fast path) and transformers' AutoTokenizer
(`load_with_transformers`, what dllm used before), and compared: vocabulary, added tokens and
their flags, special roles, ids and offsets both ways (chat-wrapped and plain, special token
strings in the text split and not, unicode, empty, long), decoding (special tokens kept and
skipped) and chat templates. Folders the fast path does not express load transformers'.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jinja2
import pytest
from block_checkpoints import write_sdar
from checkpoints import (
    BYTE_LEVEL_SPECIALS,
    write_byte_level_llada,
    write_dream_tokenizer,
    write_llada_moe_tokenizer,
    write_llada_tokenizer,
)
from gemma_checkpoint import write_gemma_tokenizer
from tokenizers import AddedToken

from dllm_cli.models.loading import load_tokenizer, load_with_transformers
from dllm_cli.models.tokenizer import FastTokenizer
from dllm_cli.models.tokenizer_files import refusal

WEIGHTS = Path(__file__).resolve().parents[1] / "dllm_cli" / "tinygsm" / "weights"
SPECIALS = [*BYTE_LEVEL_SPECIALS, "<|mask|>", "<|im_end|>", "<|role_end|>"]
SPECIALS += ["<role>", "</role>", "<|im_start|>"]
TEXTS = [
    "",
    " ",
    "Tom has 3 apples and buys 4 more. How many apples does he have?",
    "apples <|eot_id|> and<|mdm_mask|>pears <|im_end|>\n<|im_start|>assistant\n",
    "<role>HUMAN</role>x<|role_end|><|startoftext|><|endoftext|><|start_header_id|>",
    "héllo wörld, 日本語 🍎🍏 naïve café — “quotes” \u00a0nbsp",
    "cafe\u0301 n\u0303 \ufb01 Å\u212b",  # decomposed accents, ligature: NFC changes them
    "a  b\n\n c\t\td   \n",
    "don't , . ? ! I'm it's we've they're ' x ' n't",
    "apples pears " * 400,
    "<|eot_id",
    "<unk> [UNK] unknownword",
]
MESSAGES = [[{"role": "user", "content": t}] for t in TEXTS if t.strip()] + [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "how many apples"},
        {"role": "assistant", "content": "3 <|eot_id|>"},
        {"role": "user", "content": "  and pears? "},
    ]
]
# A template with each environment feature transformers sets up (tojson, namespace, loop
# controls, dict, generation blocks, trimmed blocks, raise_exception on a bad role).
FEATURE_TEMPLATE = """
{%- set ns = namespace(n=0) %}
{%- for m in messages %}
    {%- if m['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('bad role ' + m['role']) }}
    {%- endif %}
    {%- set ns.n = ns.n + 1 %}
    {%- if loop.index > 9 %}{% break %}{% endif %}
    {{ bos_token if loop.first }}<|start_header_id|>{{ m['role'] }}<|end_header_id|>
    {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}{% endgeneration %}
    {%- else %}{{ m['content'] }}{% endif %}<|eot_id|>
{% endfor %}
{{- dict(n=ns.n, eos=eos_token) | tojson }}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""


def byte_level_folder(folder: Path, **config) -> None:
    """A save_pretrained folder like LLaDA's own (byte-level BPE, extra special tokens)."""
    write_byte_level_llada(folder, FEATURE_TEMPLATE, **config)


def features_folder(folder: Path) -> None:
    """Word-level pieces with every config feature the fast path repeats: a token the config
    names that tokenizer.json lacks (added, special), a model-specific named token, an added
    non-special token with lstrip, space clean-up on decode, padding in tokenizer.json, a
    chat_template.jinja that wins over the config's template."""
    write_llada_tokenizer(folder)
    raw = json.loads((folder / "tokenizer.json").read_text())
    raw["padding"] = {
        "strategy": "BatchLongest",
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 2,
        "pad_type_id": 0,
        "pad_token": "<|endoftext|>",
    }
    (folder / "tokenizer.json").write_text(json.dumps(raw))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("pad_token")
    lead = {"content": "<|lead|>", "lstrip": True, "normalized": False, "rstrip": False}
    cfg["added_tokens_decoder"]["900"] = lead | {"single_word": False, "special": False}
    cfg |= {"mask_token": "<|brand_new_mask|>", "image_token": "<|image|>"}
    cfg |= {"clean_up_tokenization_spaces": True, "extra_special_tokens": ["<|extra|>"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").write_text(FEATURE_TEMPLATE)


def sdar_folder(folder: Path) -> None:
    """SDAR's: Dream's BPE files under `Qwen2Tokenizer` (tests/block_checkpoints.py)."""
    write_sdar(folder)


def qwen2_json_folder(folder: Path) -> None:
    """A Qwen2Tokenizer folder with tokenizer.json (what save_pretrained writes for Qwen2)."""
    from transformers import Qwen2Tokenizer

    source = folder / "bpe"
    source.mkdir()
    write_dream_tokenizer(source)
    Qwen2Tokenizer.from_pretrained(str(source)).save_pretrained(str(folder))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert cfg.pop("tokenizer_class") == "Qwen2Tokenizer" and (folder / "tokenizer.json").is_file()
    cfg.pop("auto_map")  # Dream's, carried over
    (folder / "tokenizer_config.json").write_text(
        json.dumps(cfg | {"tokenizer_class": "Qwen2Tokenizer"})
    )


def shipped(name: str):
    return lambda folder: WEIGHTS / name


FAMILIES = {
    "tiny-gsm": shipped("tiny-gsm"),
    "tiny-gsm-dream": shipped("tiny-gsm-dream"),
    "tiny-gsm-ar": shipped("tiny-gsm-ar"),
    "llada": write_llada_tokenizer,
    "llada-moe-llada2": write_llada_moe_tokenizer,  # LLaDA2 folders reuse it (block_checkpoints)
    "llada-byte-level": byte_level_folder,
    "llada-byte-level-cleanup": lambda f: byte_level_folder(f, clean_up_tokenization_spaces=True),
    "features": features_folder,
    "dream": write_dream_tokenizer,  # vocab.json + merges.txt, remote DreamTokenizer
    "sdar": sdar_folder,
    "qwen2-tokenizer-json": qwen2_json_folder,
}
QWEN2_FAMILIES = ("dream", "sdar", "qwen2-tokenizer-json")


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok") / request.param
    folder.mkdir()
    made = FAMILIES[request.param](folder)
    folder = made if isinstance(made, Path) else folder
    fast = load_tokenizer(folder)
    assert isinstance(fast, FastTokenizer), refusal(folder)
    ref = load_with_transformers(folder)
    qwen2 = request.param in QWEN2_FAMILIES
    assert type(ref).__name__ == ("Qwen2Tokenizer" if qwen2 else "TokenizersBackend")
    return fast, ref


def flags(t: AddedToken) -> tuple:
    return (t.content, t.special, t.lstrip, t.rstrip, t.normalized, t.single_word)


def test_vocabulary_added_and_special_tokens(pair):
    fast, ref = pair
    assert fast.get_vocab() == ref.get_vocab()
    assert len(fast) == len(ref) and fast.vocab_size == ref.vocab_size
    assert {i: flags(t) for i, t in fast.added_tokens_decoder.items()} == {
        i: flags(t) for i, t in ref.added_tokens_decoder.items()
    }
    assert fast.special_tokens_map == ref.special_tokens_map
    assert fast.all_special_tokens == ref.all_special_tokens
    assert fast.all_special_ids == ref.all_special_ids
    for role in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"):
        assert getattr(fast, f"{role}_token") == getattr(ref, f"{role}_token"), role
        assert getattr(fast, f"{role}_token_id") == getattr(ref, f"{role}_token_id"), role
    words = [*fast.get_vocab(), "not-a-token", *SPECIALS]
    assert fast.convert_tokens_to_ids(words) == ref.convert_tokens_to_ids(words)
    ids = list(range(len(ref)))
    for skip in (False, True):
        assert fast.convert_ids_to_tokens(ids, skip) == ref.convert_ids_to_tokens(ids, skip)
    assert fast.chat_template == ref.chat_template


@pytest.mark.parametrize("add", [True, False], ids=["specials", "no-specials"])
@pytest.mark.parametrize("split", [None, False, True], ids=["default", "read", "split"])
def test_ids_and_offsets(pair, add, split):
    fast, ref = pair
    for text in TEXTS:
        kw = {"add_special_tokens": add, "return_offsets_mapping": True}
        if split is not None:
            kw["split_special_tokens"] = split
        ours, theirs = fast(text, **kw), ref(text, **kw)
        assert ours.input_ids == theirs.input_ids, text
        assert ours.offset_mapping == [tuple(o) for o in theirs.offset_mapping], text
        assert fast.encode(text, add_special_tokens=add) == ref.encode(text, add_special_tokens=add)


def test_decode(pair):
    fast, ref = pair
    rng = random.Random(0)
    runs = [list(range(len(ref))), [], *(ref(t).input_ids for t in TEXTS)]
    runs += [[rng.randrange(len(ref)) for _ in range(rng.randrange(1, 60))] for _ in range(50)]
    for ids in runs:
        for skip in (False, True):
            assert fast.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip
            ), ids
        for clean in (False, True):
            kw = {"clean_up_tokenization_spaces": clean}
            assert fast.decode(ids, **kw) == ref.decode(ids, **kw)
    assert [fast.decode([i]) for i in range(len(ref))] == [ref.decode([i]) for i in range(len(ref))]


@pytest.mark.parametrize("generation", [True, False], ids=["gen-prompt", "no-gen-prompt"])
def test_chat_templates(pair, generation):
    fast, ref = pair
    for messages in MESSAGES:
        kw = {"add_generation_prompt": generation}
        text = fast.apply_chat_template(messages, tokenize=False, **kw)
        assert text == ref.apply_chat_template(messages, tokenize=False, **kw)
        assert fast.apply_chat_template(messages, **kw) == ref.apply_chat_template(
            messages, return_dict=False, **kw
        )


def test_template_errors_are_transformers_errors(tmp_path):
    """raise_exception raises jinja2's TemplateError in both; sandbox refusals match too."""
    byte_level_folder(tmp_path)
    fast, ref = load_tokenizer(tmp_path), load_with_transformers(tmp_path)
    bad = [{"role": "robot", "content": "hi"}]
    for tok in (fast, ref):
        with pytest.raises(jinja2.TemplateError, match="bad role robot"):
            tok.apply_chat_template(bad, tokenize=False)
    sneaky = "{% set ns = namespace() %}{% set ns._x = 1 %}{{ messages[0].__class__ }}"
    for tok in (fast, ref):
        with pytest.raises(jinja2.exceptions.SecurityError):
            tok.apply_chat_template(bad, tokenize=False, chat_template=sneaky)
    clock = "{{ strftime_now('%Y') }}|{{ messages | tojson(indent=1) }}|{{ 'é<>' | tojson }}"
    msgs = [{"role": "user", "content": "<b>é</b>", "tool_calls": None}]
    assert fast.apply_chat_template(msgs, tokenize=False, chat_template=clock) == (
        ref.apply_chat_template(msgs, tokenize=False, chat_template=clock)
    )


def test_options_that_are_not_template_data_are_refused():
    """continue_final_message & co. change transformers' output: refused, not rendered as data."""
    fast = load_tokenizer(WEIGHTS / "tiny-gsm-dream")
    msgs = [{"role": "user", "content": "hi"}]
    for option in ("continue_final_message", "return_assistant_tokens_mask", "padding"):
        with pytest.raises(TypeError, match=option):
            fast.apply_chat_template(msgs, **{option: True})
    assert fast.apply_chat_template(msgs, tokenize=False, some_flag=True) == (
        load_with_transformers(WEIGHTS / "tiny-gsm-dream").apply_chat_template(
            msgs, tokenize=False, some_flag=True
        )
    )


def test_other_folders_load_transformers_tokenizer(tmp_path):
    """DiffusionGemma's GemmaTokenizer (a class with its own pipeline), a remote class, a folder
    without tokenizer_config.json or tokenizer files, legacy token files, several templates:
    transformers' tokenizer, with the reason on record."""
    gemma = tmp_path / "gemma"
    gemma.mkdir()
    write_gemma_tokenizer(gemma)
    cases = {"gemma": gemma}
    for name, change in (
        (
            "legacy",
            lambda cfg, f: (cfg.pop("added_tokens_decoder"), touch(f / "added_tokens.json")),
        ),
        (
            "templates",
            lambda cfg, f: cfg.update(chat_template=[{"name": "default", "template": "x"}]),
        ),
        ("mistral", lambda cfg, f: cfg.update(fix_mistral_regex=True)),
        ("no-json", lambda cfg, f: (f / "tokenizer.json").unlink()),
    ):
        cases[name] = tmp_path / name
        cases[name].mkdir()
        write_llada_tokenizer(cases[name])
        cfg = json.loads((cases[name] / "tokenizer_config.json").read_text())
        change(cfg, cases[name])
        (cases[name] / "tokenizer_config.json").write_text(json.dumps(cfg))
    remote = tmp_path / "remote"
    remote.mkdir()
    write_llada_tokenizer(remote)
    cfg = json.loads((remote / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["tok.MyTokenizer", None]}
    (remote / "tokenizer_config.json").write_text(json.dumps(cfg))
    bare = tmp_path / "bare"
    bare.mkdir()
    write_llada_tokenizer(bare)
    (bare / "tokenizer_config.json").unlink()
    reasons = {name: refusal(folder) for name, folder in (cases | {"remote": remote}).items()}
    assert reasons == {
        "gemma": "tokenizer_class 'GemmaTokenizer' (its class may rebuild the pipeline)",
        "legacy": "special_tokens_map.json / added_tokens.json without added_tokens_decoder",
        "templates": "several named chat templates",
        "mistral": "fix_mistral_regex (transformers patches the pre-tokenizer)",
        "no-json": "no tokenizer.json",
        "remote": "auto_map names a remote tokenizer class",
    }
    assert refusal(bare) == "no tokenizer_config.json (transformers picks the class by model type)"
    for name in ("gemma", "legacy", "templates"):
        assert not isinstance(load_tokenizer(cases[name]), FastTokenizer)


def touch(path: Path) -> None:
    path.write_text("{}")


def test_no_family_model_type_picks_another_tokenizer_class():
    """AutoTokenizer overrides tokenizer_config.json's class for model types it registers; none
    of the families the fast path serves is one (DiffusionGemma's GemmaTokenizer is declined)."""
    from transformers.models.auto import tokenization_auto as auto

    from dllm_cli.families import FAMILIES

    served = {t for f in FAMILIES.values() if f.name != "diffusion_gemma" for t in f.model_types}
    registered = set(auto.TOKENIZER_MAPPING_NAMES) | auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    assert served and not served & registered
