"""--tensor-parallel when a rank dies: killed or hung mid-decode, the survivor ends the job
within the collective timeout with one line naming the rank (2 gloo ranks on 127.0.0.1)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from checkpoints import write_llada
from test_distributed import LAUNCH_TIMEOUT, loopback_env

from dllm_cli.distributed import Job
from dllm_cli.errors import SettingsError
from dllm_cli.models import collectives
from dllm_cli.models.collectives import Shards

HERE = Path(__file__).resolve().parent
ARGS = [
    "--device", "cpu", "--dtype", "float32", "--gen-length", "16", "--block-length", "8",
    "--tensor-parallel", "2",
]  # fmt: skip
TIMEOUT = 4  # seconds: DLLM_COLLECTIVE_TIMEOUT in the launches


def launch_dying(folder: Path, how: str) -> tuple[subprocess.CompletedProcess, float]:
    """`dllm generate -` under torchrun, rank 1 dying (`how`) at its third forward; the result
    and its seconds. torchrun polls its ranks every second here, so that rank 0 (not torchrun's
    SIGTERM) is first to see a killed rank, as it is on a machine that is not loaded."""
    env = loopback_env(
        DYING_RANK="1", DYING_AFTER="3", DYING_HOW=how, DLLM_COLLECTIVE_TIMEOUT=str(TIMEOUT)
    )
    run = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--monitor-interval", "1", "--master-addr", env["MASTER_ADDR"],
        "--master-port", env["MASTER_PORT"], str(HERE / "tensor_parallel_dying.py"),
        "generate", "-", "--model", str(folder), *ARGS,
    ]  # fmt: skip
    start = time.monotonic()
    result = subprocess.run(
        run, input="how many apples\ntom has 3 pens\n", capture_output=True, text=True,
        env=env, timeout=LAUNCH_TIMEOUT,
    )  # fmt: skip
    return result, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("kill", "left the job (its connection closed: it exited or was killed)"),
        (
            "hang",
            f"did not answer for {TIMEOUT} s (hung, or one step took longer than DLLM_COLLECTIVE_TIMEOUT)",
        ),
    ],
)
def test_a_rank_lost_mid_decode_ends_the_job_in_one_line(tmp_path, how, said):
    folder = write_llada(tmp_path / "llada", seed=1, max_sequence_length=64).folder
    result, seconds = launch_dying(folder, how)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("dllm: error: rank 0")]
    assert lines == [f"dllm: error: rank 0: tensor parallel rank 1 of 2 {said}; ending the job"]
    assert "dllm_cli" not in result.stderr.split("ChildFailedError")[0]  # no traceback of ours
    assert seconds < 45  # load, a few forwards, the timeout: not the default 300 s
    assert result.stdout == ""  # no line finished: no record (as after Ctrl-C)


def test_the_collective_timeout_is_read_from_the_environment():
    launch = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "h"}
    launch["MASTER_PORT"] = "1"
    assert Job.from_env(launch).collective_timeout == 300
    assert Job.from_env({**launch, "DLLM_COLLECTIVE_TIMEOUT": "2.5"}).collective_timeout == 2.5
    with pytest.raises(SettingsError, match="DLLM_COLLECTIVE_TIMEOUT must be a number of sec"):
        Job.from_env({**launch, "DLLM_COLLECTIVE_TIMEOUT": "0"})


def test_of_more_than_two_ranks_the_silent_ones_are_named(monkeypatch):
    store = dist.HashStore()
    store.set("dllm/survivors/0/2", "1")  # rank 2 survived too; rank 1 never signs
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(collectives, "ROLL_WAIT", 0.2)
    shards = Shards(0, 4)
    store.set("dllm/survivors/0/3", "1")
    assert shards.silent_ranks() == [1]
    line = shards.lost_line("Connection closed by peer [127.0.0.1]:5000")
    assert line == (
        "rank 0: tensor parallel rank 1 of 4 left the job (its connection closed: it exited "
        "or was killed); ending the job"
    )
    timed = Shards(1, 2, replica=1, replicas=2, timeout=7).lost_line("Timed out waiting 7000ms")
    assert timed.startswith(
        "rank 3: tensor parallel rank 0 of 2 (replica 1) did not answer for 7 s"
    )
