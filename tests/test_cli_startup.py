"""`dllm --help`, `--version`, `dllm profiles` and usage errors start without torch.

Importing torch and transformers took about 4 s of every `dllm --help` (issue 22); only the
commands that decode import them (cli.py says how). Each check runs in a fresh interpreter, so
nothing this test process already imported can hide an import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "dllm_cli.models", "dllm_cli.decoding", "dllm_cli.runtime")

# Runs the CLI in-process as the console script does, then reports what got imported.
PROBE = """
import json, sys
from dllm_cli import cli
watched = json.loads(sys.argv[2])
sys.argv = ["dllm", *json.loads(sys.argv[1])]
try:
    cli.main()
except SystemExit as stop:
    code = stop.code
else:
    code = 0
heavy = [m for m in watched if m in sys.modules]
print("\\nPROBE", json.dumps({"code": code, "heavy": heavy}), file=sys.__stderr__)
"""


def probe(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(list(args)), json.dumps(HEAVY)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )  # fmt: skip
    line = next(x for x in out.stderr.splitlines() if x.startswith("PROBE "))
    return json.loads(line.removeprefix("PROBE ")) | {"stdout": out.stdout, "stderr": out.stderr}


def test_importing_the_cli_imports_no_torch():
    code = f"import sys, dllm_cli.cli; print([m for m in {HEAVY!r} if m in sys.modules])"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--help"], 0),
        (["--version"], 0),
        (["generate", "--help"], 0),
        (["bench", "--help"], 0),
        (["profiles"], 0),
        (["generate", "--gen-length", "abc", "x"], 2),
        (["generate", "--gen-lenght", "8", "x"], 2),
        (["eval", "--n", "many"], 2),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else str(a),
)
def test_help_version_profiles_and_usage_errors_import_no_torch(args, code):
    result = probe(*args)
    assert result["code"] == code, result["stderr"]
    assert result["heavy"] == [], result


MODEL_STACK = ("transformers", "transformers.modeling_utils", "torch._dynamo")


@pytest.mark.parametrize(
    ("flags", "used"),
    [(["--no-guide"], []), ([], ["dllm_cli.models.causal"])],
    ids=["unguided", "guided"],
)
def test_generate_imports_no_transformers(flags, used):
    """The shipped model and its Llama guide decode as plain torch modules and the tokenizer is
    read by `tokenizers` (models/tokenizer.py): transformers, its model classes and torch._dynamo
    (about 3 s of imports, issue 30) are never imported. The default (guided) run does load our
    guide module."""
    args = ["generate", *flags, "--gen-length", "8", "--block-length", "8", "1 + 1"]
    watched = (*MODEL_STACK, "dllm_cli.models.guide", "dllm_cli.models.causal")
    code = f"""
import json, sys
from dllm_cli import cli
sys.argv = ["dllm", *{args!r}]
try:
    cli.main()
except SystemExit as stop:
    assert not stop.code, stop.code
print("\\nPROBE", json.dumps([m for m in {watched!r} if m in sys.modules]), file=sys.__stderr__)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stderr.splitlines() if x.startswith("PROBE "))
    loaded = json.loads(line.removeprefix("PROBE "))
    assert [m for m in loaded if m in MODEL_STACK] == []
    assert ("dllm_cli.models.causal" in loaded) == bool(used)
    assert out.stdout.strip()  # and it did decode an answer
