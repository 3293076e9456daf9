"""`dllm serve`'s OpenAI prompt forms, `n`, unknown routes, answer logprobs and echo scoring,
through the official `openai` client against a real server on a loopback port (the shipped
LLaDA-format model, unguided)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from cli_fixtures import invoke
from lm_eval.models.openai_completions import LocalCompletionsAPI

from dllm_cli import scoring
from dllm_cli.chat import encode_plain
from dllm_cli.runtime import open_runtime
from dllm_cli.serve import protocol, server
from dllm_cli.serve.conversation import Message, encode_messages
from dllm_cli.settings import DecodeSettings

MODEL = "tiny-gsm"
PROMPTS = [
    "Tom had 28 eggs, then bought 8 more. 28 + 8 =",
    "Ann has 10 pens. She gives 4 away. 10 - 4 =",
]
SAMPLES = {"score_samples": 8, "score_batch": 4}
QUESTION = "Tom had 28 eggs, then bought 8 more. How many eggs does Tom have now?"


@pytest.fixture(scope="module")
def running():
    runtime = open_runtime(MODEL, {"decode.gen_length": 16})
    handle = server.start_in_thread(runtime, server.Options(port=0, slots=4, max_queue=16))
    yield handle, runtime
    handle.stop()


@pytest.fixture(scope="module")
def client(running):
    return openai.OpenAI(base_url=running[0].url + "/v1", api_key="unused", max_retries=0)


def texts(reply) -> list[str]:
    ordered = sorted(reply.choices, key=lambda c: c.index)
    assert [c.index for c in ordered] == list(range(len(ordered)))
    return [c.text for c in ordered]


def test_every_prompt_form_answers_as_each_prompt_alone(client, running):
    alone = [texts(client.completions.create(model=MODEL, prompt=p))[0] for p in PROMPTS]
    assert all(alone)
    tok = running[1].loaded.tokenizer
    ids = [encode_plain(tok, p) for p in PROMPTS]
    assert texts(client.completions.create(model=MODEL, prompt=PROMPTS)) == alone
    assert texts(client.completions.create(model=MODEL, prompt=ids)) == alone
    assert texts(client.completions.create(model=MODEL, prompt=ids[1])) == alone[1:]
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[0], echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + alone[0]


def test_n_choices_greedy_equal_sampled_seeded_by_index(client):
    greedy = texts(client.completions.create(model=MODEL, prompt=PROMPTS[0], n=3))
    assert len(greedy) == 3 and len(set(greedy)) == 1
    hot = {"temperature": 1.0, "seed": 11}
    several = texts(client.completions.create(model=MODEL, prompt=PROMPTS, n=2, **hot))
    assert len(set(several)) > 1
    for i in range(2):  # choice i of prompt p: the prompt alone with seed 11 + i
        for p, prompt in enumerate(PROMPTS):
            one = client.completions.create(
                model=MODEL, prompt=prompt, temperature=1.0, seed=11 + i
            )
            assert several[2 * p + i] == texts(one)[0]
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS, stream=True)
    parts = {0: "", 1: ""}
    for c in streamed:
        for choice in c.choices:
            parts[choice.index] += choice.text
    assert [parts[0], parts[1]] == texts(client.completions.create(model=MODEL, prompt=PROMPTS))


def test_answer_logprobs_equal_generates_in_both_shapes(client, running):
    cli = invoke("generate", "-p", MODEL, "--gen-length", "16", "--logprobs", "2", QUESTION)
    assert cli.exit_code == 0, cli.output
    want = json.loads(cli.stdout)["logprobs"]
    assert len(want) > 3
    tok = running[1].loaded.tokenizer
    chat_ids = encode_messages(tok, [Message("user", QUESTION)])  # the template, as ids
    reply = client.completions.create(model=MODEL, prompt=chat_ids, logprobs=2)
    lp = reply.choices[0].logprobs
    assert lp.tokens == [t["token"] for t in want]
    assert lp.token_logprobs == pytest.approx([t["logprob"] for t in want])
    assert "".join(lp.tokens).strip() == reply.choices[0].text
    for top, t in zip(lp.top_logprobs, want, strict=True):
        assert top == pytest.approx({a["token"]: a["logprob"] for a in t["top_logprobs"]})
        assert max(top.values()) == pytest.approx(t["logprob"])  # greedy: its step's top-1
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content).strip() == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    assert all(c.logprob <= 0 for c in content)
    chunks = list(client.completions.create(model=MODEL, prompt=chat_ids, logprobs=2,
                                            stream=True))  # fmt: skip
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(parts) > 1  # streamed as the text is, not only at the end
    assert [t for p in parts for t in p.tokens] == lp.tokens  # each chunk: its text's tokens
    assert [v for p in parts for v in p.token_logprobs] == pytest.approx(lp.token_logprobs)
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    streamed = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], logprobs=True,
        top_logprobs=2, stream=True,
    )  # fmt: skip
    pieces = [t for c in streamed if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content]  # fmt: skip
    assert [t.token for t in pieces] == [c.token for c in content]


def test_logprobs_are_refused_on_a_guided_decode():
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    with pytest.raises(protocol.ApiError, match="unguided decode"):
        protocol.parse(body, "chat", DecodeSettings(), "m", guided=True)
    with pytest.raises(protocol.ApiError, match="top_logprobs needs logprobs"):
        protocol.parse(body | {"logprobs": False, "top_logprobs": 2}, "chat", DecodeSettings(),
                       "m", guided=False)  # fmt: skip


def test_chat_n_choices(client):
    messages = [{"role": "user", "content": QUESTION}]
    greedy = client.chat.completions.create(model=MODEL, messages=messages, n=2)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    one = client.chat.completions.create(model=MODEL, messages=messages)
    assert greedy.choices[0].message.content == one.choices[0].message.content


def test_unknown_routes_get_a_route_error(running):
    reply = httpx.get(running[0].url + "/tokenizer_info", timeout=30)
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["code"] == "unknown_route" and "GET /tokenizer_info" in error["message"]


def test_echo_scores_sum_to_the_estimate_for_every_split(client, running):
    loaded = running[1].loaded
    ids = encode_plain(loaded.tokenizer, PROMPTS[0])
    reply = client.completions.create(
        model=MODEL, prompt=[ids], echo=True, logprobs=2, max_tokens=0, seed=5, extra_body=SAMPLES
    )
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for c in (1, len(ids) // 2, len(ids) - 2):
        want = scoring.estimate(
            loaded.model, loaded.special.mask, "llada", ids[:c], ids[c:], samples=8, batch=4, seed=5
        ).total
        assert sum(lp.token_logprobs[c:]) == pytest.approx(want, abs=1e-4)
    flags, _ = scoring.greedy_flags(loaded.model, loaded.special.mask, "llada", ids)
    for j in range(1, len(ids)):
        assert (lp.token_logprobs[j] == max(lp.top_logprobs[j].values())) == flags[j - 1]


def test_lm_eval_reads_the_loglikelihood_request_it_sends(running):
    """The body lm-eval 0.4.13's local-completions sends, parsed by lm-eval's own parser."""
    loaded = running[1].loaded
    context = encode_plain(loaded.tokenizer, PROMPTS[1])
    continuation = encode_plain(loaded.tokenizer, " 6")[-1:]
    lm = LocalCompletionsAPI.__new__(LocalCompletionsAPI)
    lm.model = MODEL
    body = lm._create_payload([[*context, *continuation]], generate=False, seed=1234)
    body |= SAMPLES
    reply = httpx.post(running[0].url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    ((total, greedy),) = LocalCompletionsAPI.parse_logprobs(reply.json(), ctxlens=[len(context)])
    want = scoring.estimate(
        loaded.model, loaded.special.mask, "llada", context, continuation, samples=8, batch=4,
        seed=1234,
    )  # fmt: skip
    assert total == pytest.approx(want.total, abs=1e-4)
    flags, _ = scoring.greedy_flags(
        loaded.model, loaded.special.mask, "llada", [*context, *continuation]
    )
    assert greedy == flags[-1]
    assert len(reply.json()["choices"][0]["logprobs"]["tokens"]) == len(context) + 2


def test_score_splits_scores_only_the_last_positions(client, running):
    loaded = running[1].loaded
    ids = encode_plain(loaded.tokenizer, PROMPTS[1])
    body = SAMPLES | {"score_splits": 3}
    reply = client.completions.create(
        model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=0, seed=2, extra_body=body
    )
    values = reply.choices[0].logprobs.token_logprobs
    assert values[: len(ids) - 3] == [None] * (len(ids) - 3)
    c = len(ids) - 3
    want = scoring.estimate(
        loaded.model, loaded.special.mask, "llada", ids[:c], ids[c:], samples=8, batch=4, seed=2
    ).total
    assert sum(values[c:]) == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"max_tokens": 2}, "max_tokens", "must be 0 or 1"),
        ({"n": 2}, "n", "n must be 1 with echo"),
        ({"stream": True}, "stream", "stream is not supported"),
        ({"logprobs": 50}, "logprobs", "logprobs must be an integer"),
        ({"score_samples": 0}, "score_samples", "score_samples must be"),
        ({"prompt": [[]]}, "prompt", "prompt[0]"),
        ({"prompt": [3]}, "prompt", "at least two tokens"),
        ({"prompt": [3, 10**9]}, "prompt", "outside the vocabulary"),
    ],
)
def test_bad_scoring_requests_get_400(running, extra, param, words):
    body = {"prompt": "Tom has 3 apples", "echo": True, "logprobs": 1, "max_tokens": 0} | extra
    reply = httpx.post(running[0].url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
