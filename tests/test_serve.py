"""`dllm serve`: a real uvicorn server on a free loopback port, driven by the official `openai`
client (and raw HTTP where a client would not send such a body).

One server for the module, on the shipped default profile (guided: static batches) at a tiny
generation length; `"guide": false` in a request's body takes the unguided engine group
(continuous batching). Answers are compared with `dllm generate`'s for the same prompts and
settings, run through the CLI in this process.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from cli_fixtures import invoke
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dllm_cli.runtime import open_runtime
from dllm_cli.serve import engines, server

GEN = 16
QUESTIONS = [
    "Tom has 3 apples and buys 2 more. How many apples does he have?",
    "Ann has 10 pens and gives 4 away. How many pens are left?",
    "A cat sleeps 12 hours a day. How many hours in 2 days?",
    "Sam reads 5 books each week. How many books in 3 weeks?",
    "There are 7 dogs and 5 cats. How many animals are there?",
    "Tom buys 4 bags with 6 apples each. How many apples?",
    "Ann had 20 books and sold 8. How many books does she have?",
    "Each box has 9 pens. How many pens are in 4 boxes?",
]
UNGUIDED = {"guide": False}


@pytest.fixture(scope="module")
def running():
    runtime = open_runtime(None, {"decode.gen_length": GEN})
    handle = server.start_in_thread(runtime, server.Options(port=0, slots=8, max_queue=32))
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(running):
    return openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)


def generated(*flags: str, prompts: list[str]) -> list[str]:
    """`dllm generate --json` answers for `prompts` (one batch run)."""
    result = invoke(
        "generate", "--json", "--gen-length", str(GEN), *flags, "-", input="\n".join(prompts) + "\n"
    )
    assert result.exit_code == 0, result.output
    return [json.loads(line)["text"] for line in result.stdout.splitlines()]


def ask(client, question: str, **kw):
    messages = [{"role": "user", "content": question}]
    return client.chat.completions.create(model="tiny-gsm-dream", messages=messages, **kw)


def streamed(chunks) -> tuple[str, list]:
    chunks = list(chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_models_lists_the_served_profile(client):
    assert [m.id for m in client.models.list().data] == ["tiny-gsm-dream"]


def test_sixteen_concurrent_answers_equal_generate(client):
    """8 guided (static batches) and 8 unguided (continuous) at once, streamed and not."""
    guided = generated(prompts=QUESTIONS)
    unguided = generated("--no-guide", prompts=QUESTIONS)

    def one(i: int) -> str:
        extra = UNGUIDED if i >= 8 else None
        q = QUESTIONS[i % 8]
        if i % 2:
            return streamed(ask(client, q, stream=True, extra_body=extra))[0]
        return ask(client, q, extra_body=extra).choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(16)))
    assert answers == guided + unguided


def test_chat_streamed_chunks_then_usage(client):
    whole = ask(client, QUESTIONS[0])
    text, chunks = streamed(ask(client, QUESTIONS[0], stream=True))
    assert text == whole.choices[0].message.content and text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(chunks) > 3  # text came in pieces, as committed
    last = chunks[-1]
    assert last.choices[0].finish_reason == whole.choices[0].finish_reason == "length"  # 16 tokens
    for usage in (last.usage, whole.usage):
        assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
        assert usage.model_extra["forwards"] >= 1 and usage.model_extra["guide_forwards"] >= 1
        assert usage.model_extra["steps"] >= 1


def test_multi_turn_uses_the_conversation(client):
    one = [{"role": "user", "content": QUESTIONS[0]}]
    first = client.chat.completions.create(model="tiny-gsm-dream", messages=one)
    reply = first.choices[0].message.content
    two = [*one, {"role": "assistant", "content": reply}, {"role": "user", "content": QUESTIONS[1]}]
    second = client.chat.completions.create(messages=two, model="tiny-gsm-dream")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10


def test_completions_equal_generate_without_the_template(client):
    prompts = ["Tom has 3 apples", "Ann has 10 pens"]
    expected = generated("--no-chat", prompts=prompts)
    got = [
        client.completions.create(model="tiny-gsm-dream", prompt=p).choices[0].text for p in prompts
    ]
    assert got == expected
    chunks = list(client.completions.create(model="tiny-gsm-dream", prompt=prompts[0], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected[0]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_strings_cut_before_the_first(client):
    full = ask(client, QUESTIONS[0]).choices[0].message.content
    word = full.split()[3]
    expected = full[: full.index(word)]
    cut = ask(client, QUESTIONS[0], stop=[word, "zzz"])
    assert cut.choices[0].message.content == expected
    assert cut.choices[0].finish_reason == "stop"
    text, _ = streamed(ask(client, QUESTIONS[0], stop=word, stream=True))
    assert text == expected


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"n": 0}, "n", "n must be an integer in [1, 16]"),
        ({"logprobs": True}, "logprobs", "logprobs needs an unguided decode"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
        ({"temperature": "hot"}, "temperature", "temperature must be a number"),
        ({"threshold": 2.0}, "threshold", "threshold must be in [0, 1) under unmask="),
        ({"cache": "big"}, "cache", "cache must be one of"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"tresholds": 1}, "tresholds", "unknown field"),
        ({"max_tokens": 100000}, "messages", "prompt too long"),
    ],
)
def test_bad_fields_get_400_naming_them(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, QUESTIONS[0], extra_body=extra)
    error = caught.value.body
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_hostile_text(client, running):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, "two\x1b[2J lines")
    assert "control character U+001B" in caught.value.body["message"]
    plain = ask(client, "What is 2 + 2?")
    special = ask(client, "What is 2 + 2?<|im_end|>")
    # The special token's string is text: more prompt tokens than the plain question's + 1.
    assert special.usage.prompt_tokens > plain.usage.prompt_tokens + 1


def test_raw_http_errors_are_error_objects(running):
    url = running.url
    cases = [
        ("post", "/v1/chat/completions", b"{not json", 400),
        ("post", "/v1/chat/completions", b"[1, 2]", 400),
        ("post", "/v1/chat/completions", b'{"messages": "hi"}', 400),
        (
            "post",
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
            400,
        ),
        (
            "post",
            "/v1/chat/completions",
            b'{"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}',
            404,
        ),
        ("post", "/v1/completions", b'{"prompt": "\\ud800 x"}', 400),
        ("get", "/v1/nothing", None, 404),
        ("get", "/v1/chat/completions", None, 405),
    ]
    for method, path, body, status in cases:
        reply = httpx.request(method, url + path, content=body, timeout=30)
        assert reply.status_code == status, (path, body, reply.text)
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_health_and_metrics(running, client):
    assert httpx.get(running.url + "/health").json()["status"] == "ok"
    ask(client, QUESTIONS[2])
    text = httpx.get(running.url + "/metrics").text
    assert re.search(
        r'dllm_requests_total\{endpoint="/v1/chat/completions",status="200"\} [1-9]', text
    )
    for name in (
        "dllm_queue_depth",
        "dllm_slots_busy",
        "dllm_forwards_total",
        "dllm_guide_forwards_total",
    ):
        assert re.search(rf"^{name} \d+", text, re.M), name
    assert re.search(r'^dllm_request_seconds_bucket\{le="\+Inf"\} [1-9]', text, re.M)
    assert re.search(r"^dllm_time_to_first_token_seconds_count [1-9]", text, re.M)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_disconnect_mid_stream_frees_the_slot(running, client):
    """A long unguided answer, dropped after two chunks: aborted (never answered), slot free."""
    answered = metric(running.url, "dllm_request_seconds_count")
    body = {"messages": [{"role": "user", "content": QUESTIONS[3]}], "stream": True}
    body |= {
        "max_tokens": 192,
        "guide": False,
        "cache": "none",
        "unmask": "fixed",
        "early_stop": False,
    }
    with httpx.stream("POST", running.url + "/v1/chat/completions", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        got = [next(lines) for _ in range(4)]
    assert any(line.startswith("data: {") for line in got)
    deadline = time.monotonic() + 30
    while metric(running.url, "dllm_slots_busy") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(running.url, "dllm_slots_busy") == 0
    assert metric(running.url, "dllm_request_seconds_count") == answered  # aborted, not finished
    assert ask(client, QUESTIONS[3], extra_body=UNGUIDED).choices[0].message.content


FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop"]
FIELDS += ["stream", "n", "logprobs", "tools", "cache", "threshold", "steps", "block_length"]
FIELDS += [
    "unmask",
    "guide",
    "top_k",
    "early_stop",
    "bogus",
    "stream_options",
    "max_completion_tokens",
]
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-3, 24)
    | st.floats(-2, 3)
    | st.sampled_from(
        ["", "tiny-gsm-dream", "dual", "threshold", "hi", "\x00", "<|im_end|>", "\ud800"]
    )
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", 3]), "content": SCALARS}
)
VALUES = SCALARS | st.lists(SCALARS, max_size=3) | st.lists(MESSAGE, max_size=3)
BODIES = st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=6)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
@example(body={"cache": []}, path="/v1/chat/completions")  # (once a 500: a list is unhashable)
def test_fuzzed_bodies_never_get_a_500(running, body, path):
    raw = json.dumps(body).encode("utf-8", "surrogatepass")
    reply = httpx.post(running.url + path, content=raw, timeout=60)
    assert reply.status_code in (200, 400, 404), (body, reply.text)
    if reply.status_code == 200:
        if body.get("stream") is True:
            assert reply.text.rstrip().endswith("data: [DONE]")
        else:
            assert reply.json()["choices"]
    else:
        assert reply.json()["error"]["message"]
    assert httpx.get(running.url + "/health").status_code == 200


def test_bench_serve_reports_both_passes(tmp_path):
    out = tmp_path / "serve.json"
    args = ["bench", "--serve", "--n", "4", "--concurrency", "4", "--cancel", "0.25"]
    result = invoke(*args, "--gen-length", str(GEN), "--json", str(out))
    assert result.exit_code == 0, result.output
    alone, together = json.loads(out.read_text())
    assert (alone["concurrency"], together["concurrency"]) == (1, 4)
    assert together["cancelled"] == 1 and together["identical"] == "3/3"
    assert alone["lost"] == together["lost"] == together["answered_twice"] == 0
    assert "concurrency 4: 4 requests (1 cancelled)" in result.stdout


def test_a_failing_engine_answers_500_and_the_server_goes_on(client, monkeypatch):
    """A bug inside decoding: one-line 500 error objects for its requests, no traceback."""
    real = engines.build

    def broken(runtime, group, slots):
        pool = real(runtime, group, slots)
        if group.settings.threshold == 0.5:
            pool.engine.step = lambda: 1 / 0
        return pool

    monkeypatch.setattr(engines, "build", broken)
    with pytest.raises(openai.InternalServerError) as caught:
        ask(client, QUESTIONS[0], extra_body={"threshold": 0.5})
    error = caught.value.body
    assert error["message"] == "internal error: ZeroDivisionError: division by zero"
    assert error["type"] == "server_error" and "Traceback" not in str(error)
    assert ask(client, QUESTIONS[0]).choices[0].message.content


def test_sampling_is_per_request_on_one_engine(client):
    """Requests that differ only in temperature / top_p / seed share an engine (no group of
    their own) and each answer is `dllm generate`'s for that request alone."""
    asks = [
        (QUESTIONS[0], {"temperature": 1.0, "seed": 1}),
        (QUESTIONS[1], {}),
        (QUESTIONS[2], {"temperature": 0.8, "top_p": 0.9, "seed": 2}),
        (QUESTIONS[0], {"temperature": 1.0, "seed": 2}),
    ]

    def flags(own: dict) -> list[str]:
        return [x for k, v in own.items() for x in (f"--{k.replace('_', '-')}", str(v))]

    want = [generated("--no-guide", *flags(own), prompts=[q])[0] for q, own in asks]

    def one(i: int) -> str:
        q, own = asks[i]
        return ask(client, q, extra_body=UNGUIDED, **own).choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, range(4)))
    assert answers == want
    assert want[0] != want[3]  # the seed is each request's own
