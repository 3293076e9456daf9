"""Profiles: strict keys, clear errors, CLI > profile > default with provenance, lookup order."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest
import tomli

from dllm_cli import profiles
from dllm_cli.errors import ProfileError, SettingsError
from dllm_cli.profiles import list_profiles, load_profile, resolve
from dllm_cli.settings import DecodeSettings

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted((ROOT / "profiles").glob("*.toml"))


def write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No user profile folders leak in; cwd is an empty temp folder."""
    monkeypatch.delenv(profiles.ENV_DIR, raising=False)
    monkeypatch.delenv("DLLM_MODELS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)


# --- shipped profiles -----------------------------------------------------------------------


def test_every_expected_profile_ships():
    names = {p.stem for p in SHIPPED}
    assert {"tiny-gsm", "llada-8b-instruct", "llada-1.5", "dream-7b-instruct"} <= names
    assert "dream-7b-base" in names
    assert [(i.name, i.source) for i in list_profiles()] == [(n, "built-in") for n in sorted(names)]


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_profile_parses_and_validates(path, monkeypatch, tmp_path):
    profile = load_profile(path.stem)
    assert profile.name == path.stem and profile.source == path.resolve()
    assert profile.description and "\n" not in profile.description
    assert "edit" in path.read_text().lower()  # comments say what to change
    monkeypatch.setenv("DLLM_MODELS_DIR", str(tmp_path / "models"))
    resolved, _ = resolve(path.stem, {})
    for p in (resolved.model.path, resolved.guide.path if resolved.guide else ""):
        assert "$" not in p and (p.startswith("builtin:") or p.startswith(str(tmp_path)) or not p)


def test_default_profile_is_the_guided_tiny_dream_model():
    profile, provenance = resolve(None, {})
    assert profile.name == "tiny-gsm-dream"
    assert profile.model.path == "builtin:tiny-gsm-dream"
    assert profile.guide is not None and profile.guide.path == "builtin:tiny-gsm-ar"
    assert (profile.guide.accept, profile.guide.draft_window) == ("exact", 32)
    d = profile.decode
    assert (d.gen_length, d.block_length, d.cache, d.unmask) == (256, 32, "freecache", "sdlm")
    assert (d.threshold, d.jump_threshold) == (0.8, 0.99)  # unguided: docs/decoding-rules.md
    assert d.early_stop is True
    assert provenance["decode.cache"].startswith("profile ")
    assert provenance["decode.seed"] == "default"


def test_model_profiles_use_the_papers_settings(monkeypatch):
    monkeypatch.setenv("DLLM_MODELS_DIR", "/models")
    for name, folder in [
        ("llada-8b-instruct", "LLaDA-8B-Instruct"),
        ("llada-1.5", "LLaDA-1.5"),
        ("dream-7b-instruct", "Dream-v0-Instruct-7B"),
        ("dream-7b-base", "Dream-v0-Base-7B"),
    ]:
        profile, _ = resolve(name, {})
        d = profile.decode
        assert profile.model.path == f"/models/{folder}"
        assert (d.gen_length, d.block_length, d.cache, d.unmask, d.threshold) == (
            256,
            32,
            "dual",
            "threshold",
            0.9,
        )
    instruct, _ = resolve("dream-7b-instruct", {})
    assert instruct.guide.path == "/models/Qwen2.5-0.5B-Instruct"


def test_unset_models_dir_is_named(tmp_path):
    assert load_profile("llada-8b-instruct").model.path.startswith("${DLLM_MODELS_DIR}")
    with pytest.raises(ProfileError, match=r"uses \$DLLM_MODELS_DIR, which is not set"):
        resolve("llada-8b-instruct", {})
    profile, provenance = resolve("llada-8b-instruct", {"model": str(tmp_path)})
    assert profile.model.path == str(tmp_path) and provenance["model.path"] == "cli"


# --- strict keys and types ------------------------------------------------------------------

BAD = {
    "decode-typo": (
        "[decode]\ngen_lenght = 64\n",
        "unknown key 'gen_lenght' in [decode] (did you mean 'gen_length'?)",
    ),
    "model-typo": ("[model]\ndtyp = 'float32'\n", "unknown key 'dtyp' in [model] (did you mean"),
    "special-typo": (
        "[model.special]\nmsk = 3\n",
        "unknown key 'msk' in [model.special] (did you mean 'mask'?)",
    ),
    "guide-typo": (
        "[guide]\npath = 'g'\nacept = 'exact'\n",
        "unknown key 'acept' in [guide] (did you mean 'accept'?)",
    ),
    "top-level-typo": ("nmae = 'x'\n", "unknown top-level key 'nmae' (did you mean 'name'?)"),
    "section-typo": (
        "[decoder]\ngen_length = 1\n",
        "unknown top-level section 'decoder' (did you mean 'decode'?)",
    ),
    "string-for-int": (
        "[decode]\ngen_length = '256'\n",
        "gen_length in [decode] must be an integer (got string '256')",
    ),
    "int-for-bool": (
        "[decode]\nearly_stop = 1\n",
        "early_stop in [decode] must be true or false (got integer 1)",
    ),
    "bool-for-float": (
        "[decode]\nthreshold = true\n",
        "threshold in [decode] must be a number (got boolean true)",
    ),
    "string-for-optional": (
        "[decode]\ntop_k = 'ten'\n",
        "top_k in [decode] must be an integer (got string 'ten')",
    ),
    "bool-as-string": (
        "[model]\nchat_template = 'yes'\n",
        "chat_template in [model] must be true or false (got string 'yes')",
    ),
    "section-not-table": ("model = 'x'\n", "model must be a [model] table"),
    "name-not-string": ("name = 3\n", "name must be a string (got integer 3)"),
    "out-of-range": ("[decode]\ngen_length = 0\n", "[decode] gen_length must be >= 1 (got 0)"),
    "bad-choice": ("[decode]\ncache = 'dul'\n", "[decode] cache must be one of none, prefix,"),
    "bad-dtype": ("[model]\ndtype = 'fp8'\n", "dtype in [model] must be one of auto, float32"),
    "bad-architecture": (
        "[model]\narchitecture = 'gpt9'\n",
        "architecture in [model] must be one of llada, dream, llada_moe, diffusion_gemma, sdar, llada2 (got 'gpt9')",
    ),
    "negative-id": ("[model.special]\nmask = -1\n", "mask in [model.special] must be >= 0"),
    "guide-no-path": ("[guide]\naccept = 'exact'\n", "[guide] needs a path"),
    "bad-accept": ("[guide]\npath = 'g'\naccept = 'topk:0'\n", "accept in [guide] must be 'exact'"),
    "bad-on-reject": (
        "[guide]\npath = 'g'\non_reject = 'both'\n",
        "on_reject in [guide] must be one of guide, draft (got 'both')",
    ),
    "bad-chunk": (
        "[guide]\npath = 'g'\nverify_chunk = 0\n",
        "verify_chunk in [guide] must be >= 1",
    ),
    "chunk-type": (
        "[guide]\npath = 'g'\nverify_chunk = 'all'\n",
        "verify_chunk in [guide] must be an integer (got string 'all')",
    ),
    "bad-window": (
        "[guide]\npath = 'g'\ndraft_window = -1\n",
        "draft_window in [guide] must be >= 0",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_profile_is_one_line_naming_file_and_key(tmp_path, case):
    text, expected = BAD[case]
    path = write(tmp_path / "p", "bad", text)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    assert message.startswith(f"{path.resolve()}: ") and expected in message, message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        ("name = 'x'\n[decode]\ngen_length = \n", 3, "Invalid value"),
        ("[decode]\nseed = 1\nseed = 2\n", 3, "Cannot overwrite a value"),
        ("name = 'x'\n[decode\ngen_length = 1\n", 2, "Expected ']'"),
    ],
)
def test_bad_toml_names_file_and_line(tmp_path, text, line, what):
    path = write(tmp_path, "broken", text)
    with pytest.raises(ProfileError, match=r"^[^\n]+$") as info:
        load_profile(path)
    assert str(info.value).startswith(f"{path.resolve()}:{line}: invalid TOML: {what}")


def test_non_utf8_profile(tmp_path):
    path = tmp_path / "latin.toml"
    path.write_bytes(b"name = '\xe9'\n")
    with pytest.raises(ProfileError, match="not a UTF-8 text file"):
        load_profile(path)


def test_every_decode_field_is_a_profile_key(tmp_path):
    """Keys come from DecodeSettings' fields, so a field added there is accepted here too."""
    values = {f.name: getattr(DecodeSettings(), f.name) for f in dataclasses.fields(DecodeSettings)}
    values |= {"steps": 64, "top_p": 0.5, "top_k": 4, "gen_length": 64, "threshold": 1}
    values |= {"t_min": 0.4, "t_max": 0.8, "entropy_bound": 0.1, "stability_threshold": 1}
    values |= {"confidence_threshold": 0.005}  # DiffusionGemma's knobs (unset by default)
    values |= {"edit_threshold": 0.5}  # LLaDA2.1 token editing (unset by default)
    lines = "\n".join(f"{k} = {_toml(v)}" for k, v in values.items())
    profile = load_profile(write(tmp_path, "all", f"[decode]\n{lines}\n"))
    assert dataclasses.asdict(profile.decode) == values | {"threshold": 1.0}
    assert isinstance(profile.decode.threshold, float)  # an integer widens to a float


def _toml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


def test_cli_settings_are_built_once_from_the_profiles():
    """CLI overrides build new settings (validated then); the profile's own are never changed."""
    plain, _ = resolve("tiny-gsm", {})
    changed, _ = resolve("tiny-gsm", {"gen_length": 64, "threshold": 0.5})
    assert (plain.decode.gen_length, plain.decode.threshold) == (256, 0.7)
    assert (changed.decode.gen_length, changed.decode.threshold) == (64, 0.5)
    assert dataclasses.replace(changed.decode, gen_length=256, threshold=0.7) == plain.decode


# --- precedence and provenance --------------------------------------------------------------

MINE = """\
    name = "mine"
    description = "test profile"
    [model]
    path = "models/m"
    device = "cpu"
    [model.special]
    eot = 7
    [decode]
    gen_length = 64
    cache = "prefix"
"""


def test_cli_beats_profile_beats_default(tmp_path):
    path = write(tmp_path / "cfg", "mine", MINE)
    cli = {"gen_length": 32, "cache": None, "decode.threshold": 0.5, "dtype": "float32"}
    profile, prov = resolve(str(path), cli | {"mask": 3})
    d = profile.decode
    assert (d.gen_length, d.cache, d.threshold, d.block_length) == (32, "prefix", 0.5, 32)
    assert profile.model.dtype == "float32" and profile.model.device == "cpu"
    assert profile.model.special.mask == 3 and profile.model.special.eot == 7
    here = f"profile {path.resolve()}"
    assert prov["decode.gen_length"] == "cli"
    assert prov["decode.cache"] == here  # None means "flag not given"
    assert prov["decode.threshold"] == "cli" and prov["model.dtype"] == "cli"
    assert prov["decode.block_length"] == "default"
    assert prov["model.device"] == here and prov["model.path"] == here
    assert prov["model.special.mask"] == "cli" and prov["model.special.eot"] == here
    assert prov["model.special.bos"] == "default"
    assert not any(k.startswith("guide.") for k in prov)
    assert profile.special_overrides() == {
        "mask": 3,
        "eos": None,
        "pad": None,
        "bos": None,
        "eot": 7,
    }


def test_cli_guide_added_and_removed(tmp_path):
    path = write(tmp_path, "mine", MINE)
    profile, prov = resolve(str(path), {"guide": "ar-model"})
    assert profile.guide.path == str(tmp_path / "ar-model")  # CLI paths start at the cwd
    assert prov["guide.path"] == "cli" and prov["guide.accept"] == "default"
    profile, prov = resolve("tiny-gsm-dream", {"guide": "none"})
    assert profile.guide is None and "guide.path" not in prov


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (
            {"gen_lenght": 3},
            ProfileError,
            "unknown setting 'gen_lenght' (did you mean 'gen_length'?)",
        ),
        (
            {"path": "x"},
            ProfileError,
            "ambiguous setting 'path' (use one of model.path, guide.path)",
        ),
        ({"gen_length": "many"}, ProfileError, "command-line value for decode.gen_length must be"),
        ({"dtype": "fp8"}, ProfileError, "--dtype must be one of auto, float32"),
        ({"accept": "prob:2"}, ProfileError, "--accept must be 'exact', 'topk:K' (K >= 1)"),
        ({"gen_length": 0}, SettingsError, "gen_length must be >= 1 (got 0)"),
    ],
)
def test_bad_cli_overrides(overrides, error, message):
    with pytest.raises(error) as info:
        resolve("tiny-gsm-dream", overrides)  # a profile with a guide
    assert message in str(info.value)


def test_accept_rules_parse():
    assert profiles.GuideSection("g", "exact").acceptance() == ("exact", None)
    assert profiles.GuideSection("g", "topk:5").acceptance() == ("topk", 5)
    assert profiles.GuideSection("g", "prob:0.25").acceptance() == ("prob", 0.25)


# --- lookup and paths -----------------------------------------------------------------------


def test_lookup_order_env_then_cwd_then_builtin(tmp_path, monkeypatch):
    builtin = tmp_path / "builtin"
    monkeypatch.setattr(profiles, "builtin_dir", lambda: builtin)
    for where in ("env2", "env", "cwd/profiles", "builtin"):
        write(tmp_path / where, "p", f'description = "{where}"\n')
    write(tmp_path / "builtin", "only-builtin", 'description = "b"\n')
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv(profiles.ENV_DIR, f"{tmp_path / 'env'}:{tmp_path / 'env2'}")
    assert load_profile("p").description == "env"
    infos = {i.name: i for i in list_profiles()}
    assert infos["p"].source == str((tmp_path / "env" / "p.toml").resolve())
    assert infos["only-builtin"].source == "built-in"
    monkeypatch.delenv(profiles.ENV_DIR)
    assert load_profile("p").description == "cwd/profiles"
    monkeypatch.chdir(tmp_path)
    assert load_profile("p").description == "builtin"
    explicit = write(tmp_path / "elsewhere", "p", 'description = "explicit"\n')
    assert load_profile(str(explicit)).description == "explicit"
    assert load_profile(explicit).description == "explicit"


def test_unknown_profile_lists_available():
    with pytest.raises(ProfileError) as info:
        load_profile("tiny-gms")
    message = str(info.value)
    assert message.startswith("unknown profile 'tiny-gms' (did you mean 'tiny-gsm'? available: ")
    assert "dream-7b-base, dream-7b-instruct, dream-coder-7b-instruct, llada-1.5" in message
    with pytest.raises(ProfileError, match="profile file not found: "):
        load_profile("missing.toml")


def test_invalid_profile_still_listed(tmp_path, monkeypatch):
    write(tmp_path / "profiles", "broken", "name = \n")
    broken = {i.name: i for i in list_profiles()}["broken"]
    assert broken.description.startswith("(invalid: ")


def test_model_paths_expand_and_resolve(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_MODELS", "/data/models")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cases = {
        "${MY_MODELS}/llada": "/data/models/llada",
        "$MY_MODELS/dream": "/data/models/dream",
        "~/m": str(tmp_path / "home" / "m"),
        "../models/m": str((tmp_path / "models" / "m").resolve()),
        "local": str((tmp_path / "cfg" / "local").resolve()),
        "builtin:tiny-gsm": "builtin:tiny-gsm",
    }
    for text, expected in cases.items():
        path = write(tmp_path / "cfg", "p", f'[model]\npath = "{text}"\n[guide]\npath = "{text}"\n')
        profile = load_profile(path)
        assert profile.model.path == expected and profile.guide.path == expected, text


# --- packaging ------------------------------------------------------------------------------


def test_pyproject_ships_every_package_and_the_profiles():
    """A non-editable install only gets the packages pyproject lists (find can't map profiles/)."""
    setup = tomli.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "dllm_cli").rglob("*.py")
    }
    assert on_disk | {"dllm_cli.builtin_profiles"} == set(setup["packages"])
    assert setup["package-dir"]["dllm_cli.builtin_profiles"] == "profiles"
    assert "*.toml" in setup["package-data"]["dllm_cli.builtin_profiles"]


def dream_profile(folder: Path, model: Path, decode: str = "") -> Path:
    return write(folder, "d", f'[model]\npath = "{model}"\n[decode]\n{decode}\n')


def test_dream_folder_gets_the_family_top_k(tmp_path):
    """Dream's reference applies top_k 50 unasked; read from config.json, no weights loaded."""
    model = tmp_path / "dream"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "Dream"}')  # no weights needed
    path = dream_profile(tmp_path, model)
    profile, provenance = resolve(str(path), {})
    assert profile.decode.top_k == 50
    assert provenance["decode.top_k"] == "family default (dream)"
    profile, provenance = resolve(str(path), {"top_k": 0})  # the way to switch it off
    assert profile.decode.top_k == 0 and provenance["decode.top_k"] == "cli"
    profile, provenance = resolve(str(dream_profile(tmp_path, model, "top_k = 7")), {})
    assert profile.decode.top_k == 7 and provenance["decode.top_k"].startswith("profile ")


def test_family_default_needs_a_known_family(tmp_path, monkeypatch):
    llada = tmp_path / "llada"
    llada.mkdir()
    (llada / "config.json").write_text('{"model_type": "llada"}')
    profile, provenance = resolve(str(dream_profile(tmp_path, llada)), {})
    assert profile.decode.top_k is None and provenance["decode.top_k"] == "default"
    # No folder: the family is unknown, the value stays unset (the decoder fills it at load).
    profile, provenance = resolve(str(dream_profile(tmp_path, tmp_path / "gone")), {})
    assert profile.decode.top_k is None and provenance["decode.top_k"] == "default"
    # The shipped Dream profiles name their architecture, so no folder is needed.
    monkeypatch.setenv("DLLM_MODELS_DIR", str(tmp_path / "nowhere"))
    profile, provenance = resolve("dream-7b-base", {})
    assert profile.decode.top_k == 50 and provenance["decode.top_k"] == "family default (dream)"
