"""`dllm doctor --gpu`'s multi-GPU section on a machine without several GPUs: the degrees it
would run, its one skip row, and its launches and comparison (on the CPU over gloo)."""

from __future__ import annotations

import pytest
import torch

from dllm_cli.doctor import multi_gpu
from dllm_cli.doctor.run import Doctor


def test_the_degrees_are_one_gpu_and_every_split_that_fits():
    assert [multi_gpu.degrees(n) for n in (0, 1, 2, 3, 4, 8)] == [
        [], [], [1, 2], [1, 2], [1, 2, 4], [1, 2, 4],
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("available", "count", "said"),
    [
        (False, 0, "skipped: 0 GPU(s) under test (no CUDA device)"),
        (True, 1, "skipped: 1 GPU(s)"),
    ],
)
def test_fewer_than_two_gpus_is_one_skip_row(tmp_path, monkeypatch, available, count, said):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    rows = []
    doctor = Doctor(tmp_path, gpu=True, budget=60, on_check=rows.append)
    doctor.several_gpus()
    assert [(r.section, r.status, r.detail) for r in rows] == [("multi-GPU", "skip", said)]


def test_without_gpu_the_section_says_why():
    assert multi_gpu.skipped(4, "--gpu not given") == (
        "skipped: 4 GPU(s) under test (--gpu not given)"
    )
    assert multi_gpu.skipped(2, None) is None


def test_one_gpu_runs_without_torchrun_and_more_under_it():
    one = multi_gpu.command(multi_gpu.Path("f"), 1, "float32", 1234)
    assert "torch.distributed.run" not in one and "--tensor-parallel" not in one
    two = multi_gpu.command(multi_gpu.Path("f"), 2, "bfloat16", 1234)
    assert two[2:5] == ["torch.distributed.run", "--nproc-per-node", "2"]
    assert two[-2:] == ["--tensor-parallel", "2"]


@pytest.mark.slow
def test_the_tokens_check_launches_and_compares_on_the_cpu(tmp_path):
    outcome = multi_gpu.tokens_check(tmp_path, 2, device="cpu")
    assert outcome.status == "pass", outcome.detail
    assert outcome.detail == "NCCL tensor parallel on 1, 2 GPU(s): one GPU's tokens"
