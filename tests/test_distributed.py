"""`dllm generate -` on torch.distributed: CPU ranks over gloo on 127.0.0.1 write what one
process writes, in input order; a failed or silent rank costs only the lines it held."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_fixtures import (  # noqa: F401
    PROMPTS,
    cli_ckpt_fixture,
    invoke,
    isolated_fixture,
    profile_file_fixture,
)

from dllm_cli.distributed import Failure, Interrupts, Job, Merge, rank_device
from dllm_cli.errors import DeviceError, SettingsError

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "dllm_cli" / "tinygsm" / "weights"
SHIPPED_ARGS = ["-p", "tiny-gsm", "--device", "cpu", "--gen-length", "32"]
LINES = [*PROMPTS, "", "ann has 5 cats", "sam buys 4 books"]  # line 4 is an error record
LAUNCH_TIMEOUT = 120  # seconds before a hung launch fails the test instead of hanging it


@pytest.fixture(name="model_args")
def model_args_fixture(profile_file) -> list[str]:
    """The model these tests decode with; for the shipped one, `return SHIPPED_ARGS`."""
    return ["-p", str(profile_file)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_env(**extra: str) -> dict[str, str]:
    """One thread per rank; every rank and the rendezvous on 127.0.0.1 only."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "GLOO_SOCKET_IFNAME": "lo0" if sys.platform == "darwin" else "lo",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **extra,
    }


def single(args: list[str], lines: list[str]):
    """The same job in one process (in-process CLI run): the output to match."""
    return invoke("generate", "-", *args, input="".join(f"{line}\n" for line in lines))


def torchrun(args: list[str], lines: list[str], ranks: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node RANKS -m dllm_cli generate - ARGS < lines`."""
    env = loopback_env()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
        "--master-addr", env["MASTER_ADDR"], "--master-port", env["MASTER_PORT"],
        "-m", "dllm_cli", "generate", "-", *args,
    ]  # fmt: skip
    text = "".join(f"{line}\n" for line in lines)
    return subprocess.run(
        command, input=text, capture_output=True, text=True, env=env, timeout=LAUNCH_TIMEOUT
    )


def check_matches_single_process(args: list[str], lines: list[str]) -> None:
    """Two ranks under torchrun: rank 0's stdout is byte for byte the one-process stdout."""
    expected = single([*args, "--batch-size", "2"], lines)
    result = torchrun([*args, "--batch-size", "2"], lines)
    assert result.stdout == expected.stdout, result.stderr
    assert len(result.stdout.splitlines()) == len(lines)
    assert "dllm: error: line 4: empty prompt" in result.stderr
    assert "1 of 6 prompts failed" in result.stderr
    assert result.returncode != 0  # rank 0 exits 4 (a bad line), so torchrun reports a failure


@pytest.mark.slow
@pytest.mark.skipif(
    not (SHIPPED / "tiny-gsm").is_dir() or not (SHIPPED / "tiny-gsm-ar").is_dir(),
    reason="the shipped tiny-gsm weights are not trained yet",
)
def test_two_ranks_match_one_process_on_the_shipped_model():
    check_matches_single_process(SHIPPED_ARGS, LINES)


# `dllm ARGS` whose second decode fails (rank 1 of the failure test).
FAILING_RANK = """
import sys
from dllm_cli import batch
from dllm_cli.cli import app
real = batch.open_engine

class Failing:
    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        out = self.engine.step()
        if any(r.id >= 1 for r in self.engine.live):  # its second valid line
            raise RuntimeError("boom")
        return out

batch.open_engine = lambda *a, **k: Failing(real(*a, **k))
app(sys.argv[1:], prog_name="dllm")
"""
# A rank that joins the job, takes the lines and then never reports (rank 2): torch only.
SILENT_RANK = """
import time
import torch.distributed as dist
dist.init_process_group("gloo")
dist.broadcast_object_list([None], src=0)
time.sleep(600)
"""


def launch(commands: list[list[str]], args: list[str], **env: str) -> list[subprocess.Popen]:
    """Rank r runs `python COMMANDS[r] ARGS`, as torchrun would start it; only rank 0 has stdin."""
    shared = loopback_env(WORLD_SIZE=str(len(commands)), **env)
    return [
        subprocess.Popen(
            [sys.executable, *command, *args],
            env={**shared, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdin=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, command in enumerate(commands)
    ]


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def test_a_failed_and_a_silent_rank_cost_only_their_lines(model_args):
    lines = [*PROMPTS, "ann has 5 cats", "", "sam buys 4 books", "tom has 2 dogs", "hi", "yes"]
    # static batches of one: FAILING_RANK fails the step that decodes its second valid line
    args = ["generate", "-", *model_args, "--json", "--batch-size", "1", "--batching", "static"]
    commands = [["-m", "dllm_cli"], ["-c", FAILING_RANK], ["-c", SILENT_RANK]]
    procs = launch(commands, args, DLLM_DIST_TIMEOUT="3")
    try:
        out0, err0 = procs[0].communicate("".join(f"{x}\n" for x in lines), LAUNCH_TIMEOUT)
        out1, err1 = procs[1].communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        stop(procs)
    expected = [json.loads(x) for x in single([*model_args, "--json"], lines).stdout.splitlines()]
    records = [json.loads(x) for x in out0.splitlines()]
    assert [r["line"] for r in records] == list(range(1, 10)), err0
    for n in (1, 2, 4, 7):  # rank 0's lines, and rank 1's first
        assert records[n - 1]["text"] == expected[n - 1]["text"]
    assert records[4] == expected[4]  # line 5 (rank 1) is empty: its own error record
    assert records[7]["error"] == "rank 1 failed: internal error: RuntimeError: boom"
    for n in (3, 6, 9):
        assert records[n - 1]["error"] == "rank 2 failed: sent nothing for 3 s"
        assert records[n - 1]["prompt"] == lines[n - 1]
    assert procs[0].returncode == 70  # rank 1's code: the lowest failed rank's
    assert "rank 1 failed: internal error: RuntimeError: boom; line 8 not decoded" in err0
    assert "rank 2 failed: sent nothing for 3 s; lines 3, 6, 9 not decoded" in err0
    assert out1 == "" and "dllm: error: rank 1: internal error: RuntimeError: boom" in err1
    assert procs[1].returncode == 70


def test_sigterm_on_rank_0_still_writes_the_answers_it_holds(model_args):
    """torchrun stops every rank with SIGTERM after Ctrl-C or a dead rank: rank 0 first writes
    the answers it holds behind an unfinished line, the gaps as error records."""
    lines = [*PROMPTS, "ann has 5 cats", "sam buys 4 books"]  # rank 0: lines 1, 3, 5
    args = ["generate", "-", *model_args, "--json", "--batch-size", "8", "--batching", "static"]
    procs = launch([["-m", "dllm_cli"], ["-c", SILENT_RANK]], args)
    try:
        procs[0].stdin.write("".join(f"{x}\n" for x in lines))
        procs[0].stdin.close()
        assert select.select([procs[0].stdout], [], [], LAUNCH_TIMEOUT)[0], "no first answer"
        first = procs[0].stdout.readline()  # line 1 comes with 3 and 5: one batch
        procs[0].send_signal(signal.SIGTERM)
        procs[0].wait(LAUNCH_TIMEOUT)
        rest, err0 = procs[0].stdout.read(), procs[0].stderr.read()
    finally:
        stop(procs)
    records = [json.loads(x) for x in (first + rest).splitlines()]
    gap = "not decoded: interrupted"
    assert [r.get("error") for r in records] == [None, gap, None, gap, None], err0
    assert [r["line"] for r in records] == [1, 2, 3, 4, 5]
    assert procs[0].returncode == 130 and "dllm: interrupted" in err0


# --- pieces, in-process ----------------------------------------------------------------------


def test_lines_are_dealt_round_robin_and_each_once():
    jobs = [Job(rank, 3, rank, 60.0) for rank in range(3)]
    assert [list(job.lines_of(job.rank, 7)) for job in jobs] == [[1, 4, 7], [2, 5], [3, 6]]
    assert list(jobs[1].shard(list("abcdefg"))) == [(2, "b"), (5, "e")]


def test_the_launch_is_read_from_torchruns_environment():
    launch = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "MASTER_ADDR": "h"}
    assert Job.from_env({}) is None and Job.from_env({"WORLD_SIZE": "1"}) is None
    assert Job.from_env({**launch, "MASTER_PORT": "1"}) == Job(3, 4, 1, 1800.0)
    with pytest.raises(SettingsError, match="MASTER_PORT not set: launch with torchrun"):
        Job.from_env(launch)
    with pytest.raises(SettingsError, match="DLLM_DIST_TIMEOUT"):
        Job.from_env({**launch, "MASTER_PORT": "1", "DLLM_DIST_TIMEOUT": "0"})


def test_each_rank_takes_its_own_gpu_unless_cpu_is_asked_for(monkeypatch):
    job = Job(3, 4, 1, 60.0)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    assert rank_device(job, None, "auto") == rank_device(job, "cuda", "cuda") == "cuda:1"
    assert rank_device(job, None, "cuda:0") == "cuda:1"  # a profile's index yields to the rank
    assert rank_device(job, "cpu", "cpu") == "cpu"
    with pytest.raises(SettingsError, match="every rank on one GPU"):
        rank_device(job, "cuda:0", "cuda:0")
    with pytest.raises(DeviceError, match="--nproc-per-node"):
        rank_device(Job(2, 4, 2, 60.0), None, "auto")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert rank_device(job, None, "auto") == "cpu"


class Rec:
    def __init__(self, line: int, error: str | None = None):
        self.line, self.error = line, error


def merge_of(world: int, count: int) -> tuple[Merge, list]:
    written: list = []
    merge = Merge(Job(0, world, 0, 60.0), count, written.append, Rec)
    return merge, written


def test_rank_zero_writes_in_input_order_and_fills_a_failed_ranks_lines():
    merge, written = merge_of(world=2, count=6)
    merge.add([Rec(2), Rec(4)])
    merge.write()
    assert written == []  # line 1 not finished yet
    merge.add([Rec(1)])
    merge.write()
    assert [r.line for r in written] == [1, 2]
    merge.give_up(0, Failure("oom", 70))
    merge.write()
    assert [(r.line, r.error) for r in written[2:]] == [
        (3, "rank 0 failed: oom"),
        (4, None),
        (5, "rank 0 failed: oom"),
    ]
    assert merge.failed == 2 and merge.failures[0][1] == [3, 5]


def test_an_interrupt_writes_up_to_the_last_finished_line_only():
    merge, written = merge_of(world=3, count=9)
    merge.add([Rec(1), Rec(3), Rec(5)])
    merge.stop("not decoded: interrupted")
    assert [(r.line, r.error) for r in written] == [
        (1, None),
        (2, "not decoded: interrupted"),
        (3, None),
        (4, "not decoded: interrupted"),
        (5, None),
    ]


def test_a_signal_while_a_record_is_written_stops_only_after_it():
    interrupts, written = Interrupts(), []

    def emit(record: Rec) -> None:
        written.append(record.line)
        if record.line == 1:
            interrupts(signal.SIGTERM, None)  # lands halfway through writing line 1

    merge = Merge(Job(0, 1, 0, 60.0), 3, emit, Rec, interrupts.held)
    merge.add([Rec(1), Rec(2)])
    with pytest.raises(KeyboardInterrupt):
        merge.write()
    assert written == [1] and merge.next == 2  # line 1 out once, whole; line 2 not begun
    merge.stop("not decoded: interrupted")
    assert written == [1, 2]
