"""Ollama's API on `dllm serve`: a real server process on a loopback port, driven by the official
`ollama` client (and raw HTTP to time the NDJSON stream), answers checked against the same
server's OpenAI routes, which tests/test_serve.py checks against `dllm generate`."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import ollama
import pytest
from test_serve_process import gauge, start

MODEL = "tiny-gsm-dream"
QUESTION = "Tom has 3 apples and buys 2 more. How many apples does he have?"
SECOND = "Ann has 10 pens and gives 4 away. How many pens are left?"
# One token per step over a long canvas: the answer takes many steps to complete.
SLOW = {"num_predict": 64, "guide": False, "cache": "none", "unmask": "fixed", "early_stop": False}


@pytest.fixture(scope="module")
def url():
    proc, where = start()
    yield where
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def client(url):
    return ollama.Client(host=url)


def openai_chat(url: str, messages: list[dict]) -> dict:
    body = {"model": MODEL, "messages": messages}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()


def test_generate_is_the_chat_answer_and_raw_is_the_completion(url, client):
    reply = client.generate(model=MODEL, prompt=QUESTION, stream=False)
    expected = openai_chat(url, [{"role": "user", "content": QUESTION}])
    assert reply.response == expected["choices"][0]["message"]["content"] and reply.response
    assert reply.done and reply.done_reason in ("stop", "length")
    assert reply.prompt_eval_count == expected["usage"]["prompt_tokens"]
    assert reply.eval_count == expected["usage"]["completion_tokens"]
    assert reply.total_duration > 0 and reply.model == MODEL + ":latest"

    raw = client.generate(model=MODEL + ":latest", prompt="Tom has 3 apples", raw=True)
    body = {"model": MODEL, "prompt": "Tom has 3 apples"}
    completion = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
    assert raw.response == completion["choices"][0]["text"]

    pieces = list(client.generate(model=MODEL, prompt=QUESTION, stream=True))
    assert "".join(p.response for p in pieces) == reply.response
    assert [p.done for p in pieces] == [False] * (len(pieces) - 1) + [True]


def test_chat_multi_turn_streamed_and_not(url, client):
    one = [{"role": "user", "content": QUESTION}]
    first = client.chat(model=MODEL, messages=one)
    assert first.message.role == "assistant" and first.message.content
    assert first.message.content == openai_chat(url, one)["choices"][0]["message"]["content"]
    two = [*one, {"role": "assistant", "content": first.message.content}]
    two.append({"role": "user", "content": SECOND})
    second = client.chat(model=MODEL, messages=two, options={"temperature": 0, "num_predict": 16})
    assert second.prompt_eval_count > first.prompt_eval_count + 10  # the whole conversation
    assert second.message.content == openai_chat(url, two)["choices"][0]["message"]["content"]
    chunks = list(client.chat(model=MODEL, messages=two, stream=True))
    assert "".join(c.message.content for c in chunks) == second.message.content
    assert chunks[-1].done and chunks[-1].eval_count == second.eval_count


def test_options_map_to_dllm_settings(url, client):
    longer = client.generate(model=MODEL, prompt=QUESTION, options={"num_predict": 48})
    default = client.generate(model=MODEL, prompt=QUESTION, options={"num_predict": -1})
    assert longer.eval_count > default.eval_count  # the server's --gen-length is 16
    own = {"guide": False, "threshold": 0.9, "seed": 3, "top_k": 5, "num_ctx": 4096}
    assert client.chat(model=MODEL, messages=[{"role": "user", "content": QUESTION}], options=own)
    cut = client.generate(model=MODEL, prompt=QUESTION, options={"stop": ["apples"]})
    assert "apples" not in cut.response and cut.done_reason in ("stop", "length")


def test_list_show_ps_version(url, client):
    (card,) = client.list().models
    assert card.model == MODEL + ":latest" and card.size > 0 and card.details.family == "dream"
    shown = client.show(MODEL)
    assert shown.details.parameter_size.endswith("M") and shown.capabilities == ["completion"]
    assert "num_predict 16" in shown.parameters and shown.template
    assert shown.modelinfo["general.architecture"] == "Dream"  # config.json's model_type
    (running,) = client.ps().models
    assert running.model == MODEL + ":latest" and running.size > 0
    assert httpx.get(url + "/api/version").json()["version"]


@pytest.mark.parametrize(
    ("call", "status", "words"),
    [
        (lambda c: c.generate(model="llama3", prompt="hi"), 404, "not found"),
        (lambda c: c.show("llama3"), 404, "not found"),
        (lambda c: c.generate(model=MODEL, prompt="hi", format={"type": 3}), 400, "format"),
        (lambda c: c.generate(model=MODEL, prompt="hi", options={"mirostat": 2}), 400, "mirostat"),
        (lambda c: c.generate(model=MODEL, prompt="hi", options={"nope": 1}), 400, "unknown"),
        (lambda c: c.generate(model=MODEL, prompt="hi", options={"num_predict": 0}), 400, "num_"),
        (lambda c: c.chat(model=MODEL, messages=[{"role": "robot", "content": "x"}]), 400, "role"),
    ],
)
def test_errors_in_ollamas_shape(client, call, status, words):
    with pytest.raises(ollama.ResponseError) as caught:
        call(client)
    assert caught.value.status_code == status and words in caught.value.error


def test_format_gives_json_under_the_schema(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["op", "ok"],
              "properties": {"op": {"enum": ["+", "-"]}, "ok": {"type": "boolean"}}}  # fmt: skip
    options = {"num_predict": 24}  # the guide stays out of a constrained request
    reply = client.chat(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                        format=schema, options=options)  # fmt: skip
    jsonschema.validate(json.loads(reply.message.content), schema)
    plain = client.generate(model=MODEL, prompt=QUESTION, format="json", options=options)
    assert isinstance(json.loads(plain.response), dict)


def test_raw_errors_and_load_requests(url):
    bad = httpx.post(url + "/api/chat", content=b"{nope", timeout=30)
    assert bad.status_code == 400 and set(bad.json()) == {"error"}
    missing = httpx.get(url + "/api/nothing")
    assert missing.status_code == 404 and set(missing.json()) == {"error"}
    assert missing.json()["error"].startswith("unknown route GET /api/nothing (dllm serves ")
    assert "/api/chat" in missing.json()["error"]
    load = httpx.post(url + "/api/generate", json={"model": MODEL}, timeout=30).json()
    assert load["done"] and load["done_reason"] == "load"


def test_ndjson_chunks_arrive_before_the_answer_is_complete(url):
    body = {"model": MODEL, "prompt": QUESTION, "options": SLOW}
    arrivals, began = [], time.perf_counter()
    with httpx.stream("POST", url + "/api/generate", json=body, timeout=120) as reply:
        assert reply.headers["content-type"].startswith("application/x-ndjson")
        for raw in reply.iter_lines():
            arrivals.append((time.perf_counter(), json.loads(raw)))
    texts = [(t, c) for t, c in arrivals if not c["done"]]
    assert len(texts) >= 3 and arrivals[-1][1]["done"]
    # The first text came while the canvas still had steps to go: sent as it was committed.
    assert texts[0][0] - began < arrivals[-1][0] - began - 0.05
    assert arrivals[-1][1]["steps"] > 16


def test_a_client_that_leaves_mid_stream_frees_its_slot(url, client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "options": SLOW}
    body["options"] = {**SLOW, "num_predict": 256}
    with httpx.stream("POST", url + "/api/chat", json=body, timeout=120) as reply:
        first = json.loads(next(reply.iter_lines()))
        assert first["done"] is False
    deadline = time.monotonic() + 30
    while gauge(url, "dllm_slots_busy") + gauge(url, "dllm_queue_depth") > 0:
        assert time.monotonic() < deadline, "the aborted request still holds its slot"
        time.sleep(0.05)
    assert client.generate(model=MODEL, prompt=QUESTION).done
