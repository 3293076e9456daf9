"""`dllm serve --tensor-parallel 2` under torchrun (CPU, gloo, 127.0.0.1): the official `openai`
client gets the text a one-process server sends (sampled, with logprobs, and greedy) and its echo
scores (a block-causal model's too); a client leaving mid-stream does not break the
next request; a rank killed mid-request answers it with a 503 error object and ends the server
with one line naming the rank."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from block_checkpoints import write_sdar
from checkpoints import write_llada
from test_distributed import LAUNCH_TIMEOUT, loopback_env

openai = pytest.importorskip("openai")

HERE = Path(__file__).resolve().parent
SERVE = [
    "serve", "--port", "0", "--device", "cpu", "--dtype", "float32", "--gen-length", "32",
    "--block-length", "8", "--no-ui",
]  # fmt: skip
CHAT = [{"role": "user", "content": "how many apples"}]


@pytest.fixture(scope="module", name="llada")
def llada_fixture(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tps") / "llada"
    return write_llada(folder, seed=1, max_sequence_length=256).folder


def torchrun(script: list[str], env: dict[str, str]) -> list[str]:
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    run += ["--monitor-interval", "1", "--master-addr", env["MASTER_ADDR"]]
    return [*run, "--master-port", env["MASTER_PORT"], *script]


def answers(url: str) -> tuple:
    """A sampled completion's text and its logprobs' tokens, and a streamed chat answer's,
    greedy."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    sampled = dict(temperature=0.8, top_p=0.9, seed=3, logprobs=2)
    text = client.completions.create(model=model, prompt="tom has 3 pens", **sampled)
    stream = client.chat.completions.create(model=model, messages=CHAT, stream=True, temperature=0)
    chat = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    return text.choices[0].text, text.choices[0].logprobs.tokens, chat


def echo_scores(url: str) -> tuple:
    """An echo scoring's tokens, per-token scores and alternatives, with the token a one-token
    decode adds (max_tokens 1)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    got = client.completions.create(
        model=model, prompt="tom has 3 pens and", echo=True, logprobs=3, max_tokens=1,
        temperature=0, extra_body={"score_samples": 8},
    )  # fmt: skip
    lp = got.choices[0].logprobs
    return lp.tokens, lp.token_logprobs, lp.top_logprobs


def assert_scores_match(got: tuple, want: tuple) -> None:
    """The same tokens and alternatives; scores equal to float rounding (the ranks sum
    partial products in another order)."""
    assert got[0] == want[0]
    assert got[1][0] is None is want[1][0]  # the first token has no score
    assert got[1][1:] == pytest.approx(want[1][1:], rel=1e-4, abs=1e-4)
    assert [t and list(t) for t in got[2]] == [t and list(t) for t in want[2]]
    for mine, theirs in zip(got[2], want[2], strict=True):
        assert (mine or {}) == pytest.approx(theirs or {}, rel=1e-4, abs=1e-4)


def leave_mid_stream(url: str) -> None:
    """A streamed chat whose client closes the connection after its first chunk."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=CHAT, stream=True, temperature=0)
    next(iter(stream))
    stream.close()


def start(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str, list[str]]:
    """A server process, its URL, and its stderr lines as they come (read on a thread)."""
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    for line in proc.stderr:
        if "serving " in line:
            threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
            return proc, line.split(" on ")[-1].strip(), lines
    raise AssertionError(f"the server did not start (exit {proc.wait()})")


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=LAUNCH_TIMEOUT)


@pytest.mark.slow
def test_two_ranks_serve_the_one_process_answers_and_survive_a_client_leaving(llada):
    env = loopback_env()
    args = [*SERVE, "--model", str(llada)]
    alone, url, _ = start([sys.executable, "-m", "dllm_cli", *args], env)
    try:
        expected, scored = answers(url), echo_scores(url)
    finally:
        stop(alone)
    split, url, said = start(
        torchrun(["-m", "dllm_cli", *args, "--tensor-parallel", "2"], env), env
    )
    try:
        assert answers(url) == expected
        assert_scores_match(echo_scores(url), scored)
        leave_mid_stream(url)
        assert answers(url) == expected  # the next requests: as before
    finally:
        stop(split)  # (torchrun itself exits 1 on a signal)
    assert "dllm: note: server stopped\n" in said  # rank 0 stopped cleanly, rank 1 with it
    assert not [line for line in said if line.startswith("dllm: error")], said


def featured(url: str) -> list:
    """The shipped pair's guided chat, a JSON schema's (alone, with the guide, and with its
    logprobs) and a classifier-free-guided completion, greedy."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}
    chats = [{}, {"response_format": fmt}, {"response_format": fmt, "extra_body": {"guide": True}}]
    texts = [
        client.chat.completions.create(model=model, messages=CHAT, temperature=0, **kw)
        .choices[0]
        .message.content
        for kw in chats
    ]
    guided = {"cfg_scale": 1.5, "guide": False}
    cfg = client.completions.create(model=model, prompt="tom has 3", extra_body=guided)
    scored = client.chat.completions.create(
        model=model, messages=CHAT, temperature=0, response_format=fmt, logprobs=True,
        top_logprobs=2,
    ).choices[0]  # fmt: skip
    tokens = [(t.token, [a.token for a in t.top_logprobs]) for t in scored.logprobs.content]
    values = [t.logprob for t in scored.logprobs.content]
    return [*texts, cfg.choices[0].text, scored.message.content, tokens, values]


def alone_then_split(args: list[str], probe) -> tuple:
    """`probe(url)` of a one-process server, then of a two-rank one (which logs no error)."""
    env = loopback_env()
    alone, url, _ = start([sys.executable, "-m", "dllm_cli", *args], env)
    try:
        expected = probe(url)
    finally:
        stop(alone)
    split, url, said = start(
        torchrun(["-m", "dllm_cli", *args, "--tensor-parallel", "2"], env), env
    )
    try:
        got = probe(url)
    finally:
        stop(split)
    assert not [line for line in said if line.startswith("dllm: error")], said
    return expected, got


@pytest.mark.slow
def test_two_ranks_serve_the_guide_a_json_schema_and_cfg_as_one_process():
    args = ["serve", "--port", "0", "--device", "cpu", "--gen-length", "24", "--no-ui"]
    expected, got = alone_then_split(args, featured)
    assert got[:-1] == expected[:-1]
    assert got[-1] == pytest.approx(expected[-1], abs=1e-4)  # the logprobs' values


@pytest.mark.slow
def test_two_ranks_echo_score_a_block_causal_model_as_one_process(tmp_path):
    """SDAR's block-wise estimate (scoring.py) from the ranks' gathered summaries."""
    folder = write_sdar(tmp_path / "sdar").folder
    args = ["serve", "--port", "0", "--device", "cpu", "--model", str(folder), "--no-ui"]
    scored, got = alone_then_split(args, echo_scores)
    assert_scores_match(got, scored)


@pytest.mark.slow
def test_a_rank_killed_mid_request_answers_503_and_ends_the_server(llada):
    env = loopback_env(DYING_RANK="1", DYING_AFTER="3", DYING_HOW="kill")
    script = [str(HERE / "tensor_parallel_dying.py"), *SERVE, "--model", str(llada)]
    proc, url, said = start(torchrun([*script, "--tensor-parallel", "2"], env), env)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=client.models.list().data[0].id, prompt="tom has 3")
    lost = (
        "rank 0: tensor parallel rank 1 of 2 left the job (its connection closed: it exited or "
        "was killed)"
    )
    assert caught.value.status_code == 503
    assert caught.value.body["message"] == f"{lost}; ending the job"
    assert proc.wait(timeout=LAUNCH_TIMEOUT) != 0
    time.sleep(0.5)  # the last lines through the reading thread
    errors = [line for line in said if line.startswith("dllm: error")]
    assert errors == [f"dllm: error: {lost}; ending the job\n"], said
    assert "dllm_cli" not in "".join(said).split("ChildFailedError")[0]  # no traceback of ours


def test_a_follower_drops_an_engine_that_fails_as_rank_0_does():
    from types import SimpleNamespace

    from dllm_cli.models.collectives import RankLost
    from dllm_cli.serve import mirror

    def failing(error: Exception) -> SimpleNamespace:
        def step():
            raise error

        return SimpleNamespace(engine=SimpleNamespace(step=step))

    pools = {"bad": failing(ValueError("a bug")), "lost": failing(RankLost("rank 1 left"))}
    mirror.step(pools, "bad")
    assert list(pools) == ["lost"]
    mirror.apply(pools, None, 1, ("drop", "bad"))  # rank 0's drop of it, next turn: none left
    with pytest.raises(RankLost):
        mirror.step(pools, "lost")
