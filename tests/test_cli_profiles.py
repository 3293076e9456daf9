"""`dllm profiles` and `dllm profiles show`: what exists, and where every value comes from."""

from __future__ import annotations

from cli_fixtures import (  # noqa: F401
    cli_ckpt_fixture,
    invoke,
    isolated_fixture,
    profile_file_fixture,
)

from dllm_cli import __version__


def rows(output: str) -> dict[str, list[str]]:
    """Table rows keyed by their first cell."""
    out = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(cells) >= 2:
            out[cells[0]] = cells[1:]
    return out


def test_lists_shipped_and_user_profiles(profile_file, monkeypatch):
    monkeypatch.setenv("DLLM_PROFILES_DIR", str(profile_file.parent))
    result = invoke("profiles")
    assert result.exit_code == 0, result.output
    table = rows(result.stdout)
    assert table["tiny-gsm-dream (default)"][1] == "built-in"
    assert table["tiny-gsm"][1] == "built-in"
    assert table["llada-8b-instruct"][1] == "built-in"
    assert table["test-llada"] == ["tiny test model", str(profile_file)]


def test_show_gives_value_and_origin(profile_file):
    result = invoke("profiles", "show", str(profile_file))
    assert result.exit_code == 0, result.output
    table = rows(result.stdout)
    assert table["decode.gen_length"] == ["16", "profile"]
    assert table["decode.seed"] == ["0", "default"]
    assert table["model.architecture"] == ["unset", "default"]
    assert str(profile_file) in result.stdout


def test_show_keeps_unset_variables_visible():
    result = invoke("profiles", "show", "llada-8b-instruct")
    assert result.exit_code == 0, result.output
    value, origin = rows(result.stdout)["model.path"]
    assert value.startswith("${DLLM_MODELS_DIR}/LLaDA-8B-Instruct") and origin == "profile"
    assert "$DLLM_MODELS_DIR is not set" in result.stdout


def test_show_resolves_set_variables_and_flags_missing_folders(monkeypatch, tmp_path):
    monkeypatch.setenv("DLLM_MODELS_DIR", str(tmp_path / "models"))
    result = invoke("profiles", "show", "llada-8b-instruct")
    value, _ = rows(result.stdout)["model.path"]
    assert value == f"{tmp_path}/models/LLaDA-8B-Instruct (not found)"


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"dllm {__version__}"


def test_show_names_the_family_default(monkeypatch, tmp_path):
    monkeypatch.setenv("DLLM_MODELS_DIR", str(tmp_path))
    result = invoke("profiles", "show", "dream-7b-instruct")
    assert result.exit_code == 0, result.output
    assert rows(result.stdout)["decode.top_k"] == ["50", "family default (dream)"]
    result = invoke("profiles", "show", "llada-1.5")
    assert rows(result.stdout)["decode.top_k"] == ["unset", "default"]
    assert "family is unknown here" in result.stdout  # no LLaDA-1.5 folder in tmp_path
