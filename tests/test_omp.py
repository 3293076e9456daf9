"""dllm's OpenMP default (dllm_cli/omp.py): set at the CLI's start, never over a user's choice."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dllm_cli import omp


def test_spin_briefly_sets_the_short_spin_when_nothing_is_chosen(monkeypatch):
    monkeypatch.setattr(omp, "added", {})
    env: dict[str, str] = {"PATH": "/bin"}
    assert omp.spin_briefly(env, modules={}) is True
    assert env == {"PATH": "/bin", "GOMP_SPINCOUNT": "1000"}
    assert omp.added == {"GOMP_SPINCOUNT": "1000"}


@pytest.mark.parametrize(
    ("env", "modules"),
    [
        ({"OMP_WAIT_POLICY": "ACTIVE"}, {}),
        ({"GOMP_SPINCOUNT": "300000"}, {}),
        ({}, {"torch": object()}),  # libgomp has read its environment already
    ],
    ids=["wait-policy", "spin-count", "torch-loaded"],
)
def test_spin_briefly_leaves_a_chosen_policy_and_a_loaded_torch_alone(env, modules, monkeypatch):
    monkeypatch.setattr(omp, "added", {})
    before = dict(env)
    assert omp.spin_briefly(env, modules=modules) is False
    assert env == before and omp.added == {}


def test_another_tool_gets_the_user_s_environment(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    monkeypatch.setattr(omp, "added", {"GOMP_SPINCOUNT": "1000"})
    assert "GOMP_SPINCOUNT" not in omp.user_environment()
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")  # changed since: the user's value, kept
    assert omp.user_environment()["GOMP_SPINCOUNT"] == "5"


CLI = """
import os, sys
from dllm_cli import cli
sys.argv = ["dllm", "--version"]
try:
    cli.main()
except SystemExit:
    pass
print(os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    ("extra", "expected"), [({}, "1000"), ({"OMP_WAIT_POLICY": "PASSIVE"}, "None")]
)
def test_the_cli_sets_it_before_torch_loads(extra, expected):
    env = {k: v for k, v in os.environ.items() if k not in omp.CHOSEN} | extra
    done = subprocess.run([sys.executable, "-c", CLI], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == [expected, "False"]
