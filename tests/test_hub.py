"""Models by name: `dllm pull` through a Hugging Face Hub on a loopback port (tests/hub_server.py)
that drops the connection mid-file once, then the pulled folder found offline (HF_HUB_OFFLINE=1,
the endpoint unreachable) by `--model ORG/NAME` and by a profile's `hub` key; `dllm list`,
`dllm rm`; and the fit check refusing a load before any weight is read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import write_json, write_llada
from cli_fixtures import invoke
from hub_server import Hub

ROOT = Path(__file__).resolve().parent.parent
REPO = "tiny-org/tiny-llada"
CHUNK = 10 * 1024 * 1024  # huggingface_hub writes (and so resumes) in chunks of 10 MiB
# float32, 3.4M values: 13.6 MB of weights, so the drop comes after one chunk is on disk
SIZE = {"d_model": 256, "n_heads": 4, "n_kv_heads": 4, "n_layers": 4, "mlp_hidden_size": 768}
FIT = Path(__file__).parent / "fixtures" / "fit"


def dllm(*args: str, env: dict) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    cmd = [sys.executable, "-m", "dllm_cli", *args]
    return subprocess.run(cmd, env=full, capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.slow
def test_pull_resumes_a_dropped_download_then_loads_offline(tmp_path, monkeypatch):
    source = write_llada(tmp_path / "src", dtype=torch.float32, **SIZE).folder
    weights = (source / "model.safetensors").stat().st_size
    assert weights > CHUNK + 2**20
    hub = Hub(REPO, source, drop="model.safetensors", drop_at=CHUNK + 2**19).start()
    home = tmp_path / "hf"
    try:
        env = {"HF_HOME": str(home), "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_loopback"}
        pulled = dllm("pull", REPO, env=env)
        unknown = dllm("pull", "tiny-org/missing", env=env)
    finally:
        hub.stop()
    assert pulled.returncode == 0, pulled.stderr
    assert unknown.returncode == 2 and "no hub repo 'tiny-org/missing'" in unknown.stderr
    folder = Path(pulled.stdout.strip())
    assert sorted(p.name for p in folder.iterdir()) == hub.files()
    for name in hub.files():
        assert (folder / name).read_bytes() == (source / name).read_bytes(), name
    gets = [r for m, p, r in hub.log if m == "GET" and p.endswith("/model.safetensors")]
    assert gets == ["", f"bytes={CHUNK}-"]  # dropped once, resumed from the chunk on disk
    assert "Bearer hf_loopback" in hub.tokens  # HF_TOKEN reached the hub
    assert "Trying to resume" in pulled.stderr and "100%" in pulled.stderr  # the progress bar

    offline = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    answer = dllm("generate", "--model", REPO, "--gen-length", "8", "--json", "hello", env=offline)
    assert answer.returncode == 0, answer.stderr
    assert len(json.loads(answer.stdout)["token_ids"]) == 8

    monkeypatch.setenv("HF_HOME", str(home))
    profile = tmp_path / "tiny.toml"
    profile.write_text(f'[model]\npath = "${{DLLM_MODELS_DIR}}/x"\nhub = "{REPO}"\n')
    monkeypatch.delenv("DLLM_MODELS_DIR", raising=False)
    by_profile = invoke("generate", "-p", str(profile), "--gen-length", "8", "--json", "hello")
    assert by_profile.exit_code == 0, by_profile.output
    monkeypatch.delenv("COLUMNS", raising=False)  # piped: rows stay whole, never folded at 80
    listed = invoke("list")
    rows = {line.split("│")[1].strip(): line for line in listed.stdout.splitlines() if "│" in line}
    assert listed.exit_code == 0 and "pulled" in rows[REPO] and "fits" in rows[REPO]
    assert "local" in rows["tiny-gsm"] and "not downloaded" in rows["llada-8b-instruct"]

    removed = invoke("rm", REPO)
    assert removed.exit_code == 0 and not (home / "hub" / "models--tiny-org--tiny-llada").exists()
    missing = invoke("generate", "--model", REPO, "hello")
    assert missing.exit_code == 3
    assert missing.stderr.strip().splitlines() == [
        f"dllm: error: {REPO} (revision main) is not downloaded in {home / 'hub'} "
        "(nor is it a folder here): "
        f"run `dllm pull {REPO}`"
    ]
    again = invoke("rm", REPO)
    assert again.exit_code == 1 and "not downloaded" in again.stderr


def test_pull_refuses_names_it_cannot_pull(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    for name, words in (("tiny-gsm", "names no hub repo"), ("nope", "neither a profile")):
        result = invoke("pull", name)
        assert result.exit_code == 2 and words in result.stderr
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = invoke("pull", REPO)
    assert offline.exit_code == 2 and "HF_HUB_OFFLINE is set" in offline.stderr


def test_profile_without_its_folder_says_to_pull(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("DLLM_MODELS_DIR", raising=False)
    unset = invoke("generate", "-p", "llada-8b-instruct", "hello")  # a profile error: exit 2
    assert unset.exit_code == 2 and "or run `dllm pull llada-8b-instruct`" in unset.stderr
    monkeypatch.setenv("DLLM_MODELS_DIR", str(tmp_path))  # set, but no folder there: exit 3
    missing = invoke("generate", "-p", "llada-8b-instruct", "hello")
    assert missing.exit_code == 3
    assert missing.stderr.strip().endswith("run `dllm pull llada-8b-instruct`")


def test_a_load_that_cannot_fit_is_refused_before_reading_weights(tmp_path):
    folder = tmp_path / "flash"
    folder.mkdir()
    write_json(folder / "config.json", json.loads((FIT / "llada2.0-flash.json").read_text()))
    result = invoke(
        "generate", "--model", str(folder), "--device", "cpu", "--dtype", "float32", "hi"
    )
    assert result.exit_code == 3, result.output
    (line,) = result.stderr.strip().splitlines()
    assert (
        line.startswith("dllm: error: flash needs ")
        and "weights 411.6 GB in float32" in line
        and "--force" in line
    )
    forced = invoke("generate", "--model", str(folder), "--device", "cpu", "--force", "hi")
    assert forced.exit_code == 3 and "needs" not in forced.stderr  # on to the loader's own error
