"""The family table: dispatch by architectures then model_type, and `--model PATH` starting from
the family's own reference settings (never from the shipped tiny model's profile)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from checkpoints import write_dream, write_llada
from cli_fixtures import error_lines, invoke, isolated_fixture  # noqa: F401
from test_decode_reference import dream_generate, llada_generate

from dllm_cli.decoding import gemma
from dllm_cli.decoding.sampling import SAMPLERS
from dllm_cli.errors import ModelLoadError, SettingsError
from dllm_cli.families import (
    FAMILIES,
    family_for_config,
    reference_settings,
    with_family_defaults,
)
from dllm_cli.profiles import resolve
from dllm_cli.runtime import open_runtime
from dllm_cli.settings import DecodeSettings

PROMPT = "how many apples"


@pytest.fixture(scope="module")
def llada_folder(tmp_path_factory):
    return write_llada(tmp_path_factory.mktemp("fam") / "llada", dtype=torch.float32, seed=1)


@pytest.fixture(scope="module")
def dream_folder(tmp_path_factory):
    return write_dream(tmp_path_factory.mktemp("fam") / "dream", dtype=torch.float32, seed=2)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- the table ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if not f.traits.own_model])
def test_each_entry_agrees_with_its_classes(name):
    family = FAMILIES[name]
    config_cls, model_cls = family.classes()
    assert model_cls.family == name and model_cls.config_class is config_cls
    assert model_cls.logit_shift == family.logit_shift
    assert family.sampler in SAMPLERS  # the block-causal families' is "block"
    assert config_cls.model_type in family.model_types
    reference_settings(family).validate()  # the declared reference values are valid settings


def test_diffusion_gemma_refuses_what_its_sampler_does_not_use():
    family = FAMILIES["diffusion_gemma"]
    assert not set(family.refuses) & set(gemma.USED) and family.traits.own_model
    gemma.check_settings(reference_settings(family), canvas=256)  # its reference runs


def test_a_cannot_table_must_name_known_features():
    with pytest.raises(ValueError, match="lengths"):
        replace(FAMILIES["llada"], cannot={"lengths": "why"})


WHY = "its reference has no such thing"


@pytest.fixture
def cannot(monkeypatch):
    """Patch the LLaDA row to say it cannot run `feature` (every family runs these today; each
    feature's guard at its start is for the next row that cannot: family_settings.FEATURES)."""

    def patch(feature: str) -> None:
        monkeypatch.setitem(FAMILIES, "llada", replace(FAMILIES["llada"], cannot={feature: WHY}))

    return patch


@pytest.mark.parametrize(
    "feature, flags",
    [
        ("quantize", ["--quantize", "int8"]),
        ("logprobs", ["--logprobs", "2"]),
        ("grammar", ["--grammar", "GRAMMAR"]),
    ],
)
def test_a_feature_the_table_says_a_family_cannot_run_is_refused_in_one_line(
    feature, flags, llada_folder, cannot, tmp_path
):
    cannot(feature)
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "a"\n')
    flags = [str(grammar) if f == "GRAMMAR" else f for f in flags]
    folder = str(llada_folder.folder)
    result = invoke("generate", PROMPT, "--model", folder, "--gen-length", "8", *flags)
    assert result.exit_code == 2, result.output
    (line,) = error_lines(result)
    assert f"error: {flags[0]}" in line and f"does not apply to LLaDA: {WHY}" in line, line


def test_the_api_and_the_server_refuse_a_grammar_the_table_says_a_family_cannot_run(
    llada_folder, cannot
):
    from dllm_cli.api import LLM
    from dllm_cli.serve.engines import checked
    from dllm_cli.serve.protocol import ApiError, Job

    llm = LLM(model=str(llada_folder.folder), gen_length=8)
    cannot("grammar")
    with pytest.raises(SettingsError, match=f"json_schema does not apply to LLaDA: {WHY}"):
        llm.generate(PROMPT, json_schema={"type": "integer"})
    job = Job(kind="chat", prompt=PROMPT, structure=("json_schema", "{}"))
    with pytest.raises(ApiError, match=f"response_format does not apply to LLaDA: {WHY}") as e:
        checked(llm.runtime, job)
    assert e.value.status == 400


def test_dispatch_reads_architectures_before_model_type():
    dense = {"architectures": ["LLaDAModelLM"], "model_type": "llada"}
    assert family_for_config(dense, "c").name == "llada"
    assert family_for_config({"model_type": "llada"}, "c").name == "llada"  # no architectures
    assert family_for_config({"architectures": ["DreamModel"]}, "c").name == "dream"
    assert family_for_config({"model_type": "Dream"}, "c").name == "dream"


@pytest.mark.parametrize(
    "raw",
    [
        {"architectures": ["GPT9Model"], "model_type": "llada"},  # known type, unknown class
        {"architectures": ["DreamModel"], "model_type": "llada"},  # the two disagree
        {"architectures": ["LLaDAModelLM"], "model_type": "gpt9"},
        {"model_type": "gpt9"},
    ],
)
def test_an_unknown_pair_is_refused_naming_both(raw):
    with pytest.raises(ModelLoadError) as info:
        family_for_config(raw, "x/config.json")
    message = str(info.value)
    assert repr(raw["model_type"]) in message and "x/config.json" in message
    assert str(raw.get("architectures")) in message


def test_the_engine_fills_only_unset_values_from_the_family():
    s = DecodeSettings()
    assert with_family_defaults(s, "dream").top_k == 50
    assert with_family_defaults(replace(s, top_k=0), "dream").top_k == 0
    assert with_family_defaults(s, "llada") == s  # LLaDA's reference has no unset values


# --- --model PATH without --profile ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["llada", "dream"])
def test_model_alone_starts_from_the_family_reference(kind, llada_folder, dream_folder):
    folder = {"llada": llada_folder, "dream": dream_folder}[kind].folder
    profile, provenance = resolve(None, {"model.path": str(folder)})
    family = FAMILIES[kind]
    assert profile.decode == reference_settings(family)
    assert profile.guide is None
    for key in family.reference_keys():
        assert provenance[f"decode.{key}"] == f"family default ({kind})", key
    assert provenance["model.path"] == "cli"
    # not the default profile's tuning for the shipped tiny model
    assert profile.decode.suffix_window == 0 and profile.decode.cache == "none"
    assert profile.decode.top_k == (50 if kind == "dream" else None)


@pytest.mark.parametrize("kind", ["llada", "dream"])
def test_flags_change_only_themselves(kind, llada_folder, dream_folder):
    """`--cache dual --unmask threshold`: nothing else moves (no suffix pruning, no top_k 0)."""
    folder = {"llada": llada_folder, "dream": dream_folder}[kind].folder
    flags = {"model.path": str(folder), "decode.cache": "dual", "decode.unmask": "threshold"}
    profile, provenance = resolve(None, flags)
    want = replace(reference_settings(FAMILIES[kind]), cache="dual", unmask="threshold")
    assert profile.decode == want
    assert provenance["decode.cache"] == provenance["decode.unmask"] == "cli"
    shorter, _ = resolve(None, {"model.path": str(folder), "decode.gen_length": 24})
    whole = FAMILIES[kind].whole_answer  # Dream's single block follows the answer's length
    assert shorter.decode.block_length == (24 if whole else 32)


def generate_json(folder, *flags: str) -> dict:
    result = invoke("generate", "--model", str(folder), "--json", *flags, PROMPT)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def loaded_and_prompt(folder):
    """The loaded model and the prompt's ids as `dllm generate` encodes them (chat format)."""
    runtime = open_runtime(None, {"model.path": str(folder)})
    return runtime.loaded, runtime.encode(PROMPT)


def test_llada_folder_decodes_as_llada_generate(llada_folder):
    """No decoding flag: LLaDA's own generate (128 tokens, 128 steps, blocks of 32)."""
    record = generate_json(llada_folder.folder)
    lm, prompt = loaded_and_prompt(llada_folder.folder)
    vocab = lm.special.real_vocab(lm.model.vocab_size)
    want = llada_generate(lm.model, prompt, 128, 32, 128, mask=lm.special.mask, vocab=vocab)
    assert record["token_ids"] == want


def test_dream_folder_decodes_as_diffusion_generate(dream_folder):
    """No decoding flag: Dream's own defaults (alg origin, top_k 50, one block, a step per token).

    origin reveals masks at random; the reference's draws are replayed from the generator dllm
    seeds with the run's seed (one uniform per answer column each step), so the two make the
    same random choices and the tokens must agree exactly.
    """
    gen = 48  # a shorter answer keeps this fast; block_length follows it (one block)
    record = generate_json(dream_folder.folder, "--gen-length", str(gen))
    lm, prompt = loaded_and_prompt(dream_folder.folder)
    generator = torch.Generator().manual_seed(0)

    def replay(mask_index: torch.Tensor) -> torch.Tensor:
        draws = torch.rand((1, gen), generator=generator)  # (B, block columns)
        return draws[mask_index[:, len(prompt) :]]

    vocab = lm.special.real_vocab(lm.model.vocab_size)
    want = dream_generate(
        lm.model, prompt, gen, gen, "origin", top_k=50, mask=lm.special.mask, vocab=vocab,
        uniform=replay,
    )  # fmt: skip
    assert record["token_ids"] == want


# --- dllm profiles --------------------------------------------------------------------------


def cells(output: str) -> dict[str, list[str]]:
    out = {}
    for line in output.splitlines():
        row = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(row) >= 2 and row[0]:
            out[row[0]] = row[1:]
    return out


def test_profiles_show_model_gives_the_effective_settings_and_their_origin(dream_folder):
    result = invoke("profiles", "show", "--model", str(dream_folder.folder))
    assert result.exit_code == 0, result.output
    table = cells(result.stdout)
    assert table["decode.unmask"] == ["origin", "family default (dream)"]
    assert table["decode.top_k"] == ["50", "family default (dream)"]
    assert table["decode.suffix_window"] == ["0", "default"]
    assert table["model.path"][1] == "cli"
    assert "guide.path" not in table
    flagged = invoke("profiles", "show", "--model", str(dream_folder.folder), "tiny-gsm-dream")
    assert cells(flagged.stdout)["decode.cache"] == ["freecache", "profile"]  # a profile wins


def test_profiles_show_model_refuses_an_unknown_folder(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt9", "architectures": ["GPT9"]}')
    result = invoke("profiles", "show", "--model", str(folder))
    assert result.exit_code == 3
    assert "unknown architecture 'gpt9' with architectures ['GPT9']" in result.stderr


def test_guided_and_plain_profiles_show_the_continuous_batches_they_run():
    result = invoke("profiles", "show", "tiny-gsm-dream")
    guided = cells(result.stdout)["decode.batching"][0]
    assert guided == "continuous"  # the guide's cache takes rows as they come
    plain = cells(invoke("profiles", "show", "tiny-gsm").stdout)["decode.batching"][0]
    assert plain == "continuous"


def test_profile_list_at_80_columns_keeps_descriptions_and_whole_names(monkeypatch, tmp_path):
    long_name = "a-rather-long-profile-name-for-testing"
    (tmp_path / f"{long_name}.toml").write_text('description = "mine, for the test"\n')
    monkeypatch.setenv("DLLM_PROFILES_DIR", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "80")
    result = invoke("profiles")
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if "Name" in line)
    assert "Description" in header and "Source" in header
    assert any(long_name in line for line in lines)  # not cut
    assert any("tiny-gsm-dream (default)" in line for line in lines)
    description = cells(result.stdout)[long_name][0]
    assert description.startswith("mine, for") and "(invalid" not in description  # wrapped


# --- the code models' and LLaDA-MoE's profiles ----------------------------------------------

CARDS = {
    "llada-moe-7b-a1b-instruct": (
        "llada_moe",
        {"gen_length": 128, "steps": 128, "block_length": 32, "cache": "none", "top_k": None},
    ),
    "diffucoder-7b-instruct": (
        "dream",
        {"gen_length": 256, "steps": 256, "confidence": "entropy", "temperature": 0.4,
         "top_p": 0.95, "top_k": 50, "block_length": 256},
    ),
    "dream-coder-7b-instruct": (
        "dream",
        {"gen_length": 768, "steps": 768, "confidence": "entropy", "temperature": 0.1,
         "top_p": 0.95, "top_k": 50, "block_length": 768},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CARDS))
def test_model_card_profiles(name, monkeypatch, tmp_path):
    monkeypatch.setenv("DLLM_MODELS_DIR", str(tmp_path))
    profile, provenance = resolve(name, {})
    family, want = CARDS[name]
    assert profile.model.architecture == family and profile.model.path.startswith(str(tmp_path))
    assert {k: getattr(profile.decode, k) for k in want} == want
    if family == "dream":  # top_k is the family's hidden 50, not written in the file
        assert provenance["decode.top_k"] == "family default (dream)"
    assert profile.guide is None


def test_stop_tokens_end_the_answer(dream_folder, tmp_path):
    """A profile's stop_tokens (DiffuCoder: <|dlm_pad|>) cut the answer like EOS does."""
    path = tmp_path / "stops.toml"
    path.write_text(
        f'[model]\npath = "{dream_folder.folder}"\ndevice = "cpu"\n'
        'stop_tokens = ["<|beginoftext|>"]\n[decode]\ngen_length = 8\n'
    )
    runtime = open_runtime(str(path), {})
    stop = dream_folder.ids["bos"]  # <|beginoftext|>
    assert stop in runtime.loaded.special.stop
    words = runtime.loaded.tokenizer.encode("apples", add_special_tokens=False)
    assert runtime.text([*words, stop, *words]) == "apples"
    path.write_text(path.read_text().replace("<|beginoftext|>", "<|dlm_pad|>"))
    result = invoke("generate", "-p", str(path), "hi")
    assert result.exit_code == 3
    assert "stop token '<|dlm_pad|>' (stop_tokens in [model]) is not in the tokenizer" in (
        result.stderr
    )


def test_summary_lines_name_what_each_family_uses():
    """eval's settings line: DiffusionGemma's own knobs (unset: the checkpoint's), LLaDA2.1's
    edit_threshold when set, the masked families' rule and cache."""
    from dllm_cli.family_settings import summary_line

    gemma = DecodeSettings(gen_length=32, block_length=16, t_min=0.4).to_dict()
    line = summary_line(FAMILIES["diffusion_gemma"], gemma)
    assert line == (
        "block_length=16 steps=checkpoint t_min=0.4 t_max=checkpoint entropy_bound=checkpoint "
        "early_stop=False"
    )
    assert "unmask" not in line and "cache" not in line
    edit = DecodeSettings(cache="prefix", unmask="threshold", edit_threshold=0.0).to_dict()
    line = summary_line(FAMILIES["llada2"], edit)
    assert line.endswith("edit_threshold=0.0 max_post_steps=16")
    assert "threshold=0.9" in line and "steps=256" in line
    masked = summary_line(FAMILIES["llada"], DecodeSettings(suffix_window=8).to_dict())
    assert (
        masked
        == "cache=none unmask=fixed block_length=32 steps=256 early_stop=False suffix_window=8"
    )
