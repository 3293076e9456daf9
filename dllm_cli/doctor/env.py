"""The machine a doctor report was measured on (the report's first lines)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from dllm_cli.version import __version__

REPO = Path(__file__).resolve().parent.parent.parent


def environment() -> dict:
    """GPU, driver, torch, CUDA and dllm versions; every lookup that can fail says so instead."""
    info = {
        "dllm": __version__,
        "commit": git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda or "none (CPU build)",
        "transformers": package_version("transformers"),
        "cuda_available": torch.cuda.is_available(),
    }
    if not torch.cuda.is_available():
        return info | {"gpu": "none"}
    try:
        return info | gpu_facts()
    except Exception as e:  # a broken driver or context: the checks will say more
        return info | {"gpu": f"unknown ({type(e).__name__}: {e})"}


def gpu_facts() -> dict:
    """Name, memory, compute capability and driver of GPU 0 (the one the doctor uses)."""
    props = torch.cuda.get_device_properties(0)
    facts = {
        "gpu": props.name,
        "gpu_count": torch.cuda.device_count(),
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "compute_capability": f"{props.major}.{props.minor}",
        "bf16_supported": torch.cuda.is_bf16_supported(),
        "driver": nvidia_smi("driver_version"),
    }
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    facts["cudnn"] = str(cudnn) if cudnn else "none"
    return facts


def nvidia_smi(field: str) -> str:
    """One `nvidia-smi --query-gpu` field of GPU 0, or why it is unknown."""
    try:
        query = ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"]
        done = subprocess.run(query, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({type(e).__name__})"
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else "unknown (nvidia-smi failed)"


def git_commit() -> str:
    """The checkout's commit (with `+dirty` when files changed), or why it is unknown."""
    if not (REPO / ".git").exists():
        return "unknown (not a git checkout)"
    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        return f"unknown ({type(e).__name__})"
    return head + ("+dirty" if dirty else "")


def git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=20, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip())
    return done.stdout.strip()


def package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"
