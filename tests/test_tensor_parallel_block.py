"""--tensor-parallel for the block-diffusion families: SDAR's model splits (each rank's logits
are its vocabulary range of one process's, its KV cache holds its KV heads), while decoding
SDAR under the flag is refused in one line until the block stepper drafts from vocabulary
shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from block_checkpoints import write_sdar
from cli_fixtures import error_lines, invoke, isolated_fixture  # noqa: F401
from test_tensor_parallel import launch

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module", name="sdar")
def sdar_fixture(tmp_path_factory) -> Path:
    return write_sdar(tmp_path_factory.mktemp("tpb") / "sdar").folder


@pytest.mark.slow
def test_two_ranks_of_sdar_compute_their_range_of_the_one_process_logits(sdar, tmp_path):
    out = tmp_path / "seen"
    result = launch([str(HERE / "tensor_parallel_forward.py"), str(out), str(sdar)])
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    for seen in ranks:
        assert seen["difference"] < 1e-5, seen
        assert seen["keys"][1] == 1  # 2 KV heads over 2 ranks
        mine, whole = seen["bytes"]
        assert mine <= whole * (1 / 2 + 0.05)
    (lo0, hi0, size), (lo1, hi1, _) = (s["columns"] for s in ranks)
    assert (lo0, hi0, hi1) == (0, lo1, size)  # the two ranges tile the vocabulary


def test_decoding_sdar_under_tensor_parallel_is_refused_in_one_line(sdar, monkeypatch):
    launch_env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**launch_env, "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    model = ["--model", str(sdar), "--device", "cpu"]
    result = invoke("generate", "-", *model, "--tensor-parallel", "2", input="hi\n")
    assert result.exit_code == 2
    assert error_lines(result) == [
        "dllm: error: --tensor-parallel does not support sdar models yet (the block-diffusion "
        "stepper drafts from whole logits)"
    ]
