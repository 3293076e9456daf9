"""Every feature on every family (issue 36, item 4), past the CLI: `dllm serve` through the
official `openai` client on a loopback port, the Python API, and torchrun data parallelism,
one row per families.py family (and LLaDA2.1's editing) on its tiny random folder."""

from __future__ import annotations

import json
import math
import re
import threading

import httpx
import openai
import pytest
from cli_fixtures import invoke, isolated_fixture  # noqa: F401
from family_matrix import (  # noqa: F401
    GEN,
    PROMPTS,
    WORD_LEVEL,
    expected_refusal,
    folder_fixture,
    matrix_folders_fixture,
    model_args,
    row_fixture,
)
from test_distributed import LINES, check_matches_single_process

from dllm_cli.api import LLM
from dllm_cli.errors import InputError
from dllm_cli.families import FAMILIES
from dllm_cli.runtime import open_runtime
from dllm_cli.serve import server

QUESTION = [{"role": "user", "content": PROMPTS[0]}]
# a valid value other than the default, for settings some family's table refuses
REFUSABLE = {
    "cache": "dual",
    "unmask": "wino",
    "cfg_scale": 1.0,
    "suffix_window": 4,
    "t_min": 0.5,
    "edit_threshold": 0.5,
}


@pytest.fixture(scope="module", name="client")
def client_fixture(row, folder):
    """A server on 127.0.0.1 for the row's folder, and an `openai` client of it."""
    overrides = {"model.path": str(folder), "decode.gen_length": GEN}
    overrides |= {f"decode.{k}": v for k, v in row.settings.items()}
    runtime = open_runtime(None, overrides, use_guide=False)
    handle = server.start_in_thread(runtime, server.Options(port=0, slots=2, max_queue=8))
    yield openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0)
    handle.stop()


def served(client: openai.OpenAI) -> str:
    """The one model id the server lists (an id without spaces)."""
    (model,) = [m.id for m in client.models.list().data]
    assert " " not in model
    return model


def test_serve_chat_answers_and_streams_the_same_text(client):
    model = served(client)
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=GEN)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length") and reply.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=GEN, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == choice.message.content


def test_serve_refuses_what_the_family_table_refuses_and_goes_on(row, client):
    """Each refused setting is that request's 400 with the table's reason; the next request
    is answered (a refusal once killed a block-causal server for good)."""
    model, refused = (
        served(client),
        {k: v for k, v in REFUSABLE.items() if expected_refusal(row, k, v)},
    )
    assert refused  # every family refuses some of them
    for key, value in refused.items():
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=model, messages=QUESTION, max_tokens=GEN, extra_body={key: value}
            )
        message = e.value.body["message"]
        assert f"{key} {value!r} does not apply" in message, message
        assert expected_refusal(row, key, value) in message, message
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=GEN)
    assert reply.usage.completion_tokens > 0


INTEGER = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}
FEATURES = {  # Family.cannot key -> (the request's fields, a check of an answer)
    "logprobs": (
        {"logprobs": True, "top_logprobs": 2},
        lambda reply: len(reply.choices[0].logprobs.content) == reply.usage.completion_tokens,
    ),
    "grammar": (
        {"response_format": INTEGER},
        lambda reply: isinstance(json.loads(reply.choices[0].message.content), int),
    ),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_serve_runs_a_feature_or_refuses_it_by_the_family_table(row, client, feature):
    fields, check = FEATURES[feature]
    ask = dict(model=served(client), messages=QUESTION, max_tokens=GEN, **fields)
    why = FAMILIES[row.family].cannot.get(feature)
    if feature == "grammar" and row.family in WORD_LEVEL:  # no integer can begin (a space)
        why = why or "vocabulary cannot write"
    try:
        reply = client.chat.completions.create(**ask)
    except openai.BadRequestError as e:  # the table's reason, or a vocabulary that cannot write
        assert why is not None and why in e.body["message"], e.body
        return
    assert why is None and check(reply), reply


def test_serve_echo_scores_or_refuses_scoring_by_the_family_table(row, client):
    """`echo` + `logprobs` with max_tokens 0 (lm-eval's loglikelihood): the prompt's tokens
    with a score each but the first, or a 400 with the family table's reason."""
    ask = dict(model=served(client), prompt=PROMPTS[0], echo=True, logprobs=1, max_tokens=0)
    body = {"score_samples": 4, "score_batch": 2, "score_splits": 3}
    why = FAMILIES[row.family].cannot.get("scoring")
    try:
        reply = client.completions.create(**ask, extra_body=body)
    except openai.BadRequestError as e:
        assert why is not None and why in e.body["message"], e.body
        return
    values = reply.choices[0].logprobs.token_logprobs
    assert why is None and len(values) >= 2 and values[0] is None, values
    scored = values[max(1, len(values) - 3) :]  # the last three splits (score_splits)
    assert all(v is not None and math.isfinite(v) for v in scored), values


def test_serve_decodes_requests_of_other_max_tokens_on_one_engine(client):
    """Two concurrent requests differing only in max_tokens: each answer as it is alone, and
    no engine is built for the shorter one (the slots gauge counts every engine's slots), nor
    for the choices of `n` (each its own seed)."""
    model, lengths, together = served(client), (GEN // 2, GEN), {}
    metrics = str(client.base_url).removesuffix("/v1/") + "/metrics"

    def ask(tokens: int) -> tuple[str, int]:
        reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=tokens)
        return reply.choices[0].message.content, reply.usage.completion_tokens

    def slots() -> float:
        return float(re.search(r"^dllm_slots (\S+)$", httpx.get(metrics).text, re.M)[1])

    alone = {GEN: ask(GEN)}  # the server's own length: its group's engine is there
    before = slots()
    alone[GEN // 2] = ask(GEN // 2)
    threads = [threading.Thread(target=lambda n=n: together.update({n: ask(n)})) for n in lengths]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert together == alone and alone[GEN // 2][1] <= GEN // 2
    assert slots() == before  # (one engine per max_tokens would have added its slots)
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=GEN, n=2, seed=5
    )  # choice i decodes with seed 5 + i: on the same engine (DiffusionGemma: one row each)
    assert len(reply.choices) == 2 and slots() == before


@pytest.fixture(scope="module", name="llm")
def llm_fixture(row, folder) -> LLM:
    return LLM(model=str(folder), gen_length=GEN, **row.settings)


def test_python_api_generates_the_cli_answers_and_streams_them(row, folder, llm):
    completions = llm.generate(list(PROMPTS), batch_size=2)
    result = invoke("generate", "-", *model_args(row, folder), "--json", input="\n".join(PROMPTS))
    assert result.exit_code == 0, result.output
    cli = [json.loads(line)["token_ids"] for line in result.stdout.splitlines()]
    assert [c.token_ids for c in completions] == cli
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        assert "".join(llm.stream(prompt)) == completion.text
    half = GEN // 2  # a call's own length (per request, or DiffusionGemma's runtime's)
    short = ["--model", str(folder), "--gen-length", str(half), *row.flags()]
    result = invoke("generate", PROMPTS[0], *short, "--json")
    (shorter,) = llm.generate([PROMPTS[0]], gen_length=half)
    assert shorter.token_ids == json.loads(result.stdout)["token_ids"], result.output
    assert "".join(llm.stream(PROMPTS[0], gen_length=half)) == shorter.text
    seeded = [*model_args(row, folder), "--seed", "3"]  # per call (DiffusionGemma: the call's
    result = invoke("generate", PROMPTS[0], *seeded, "--json")  # engine is seeded with it)
    (seed,) = llm.generate([PROMPTS[0]], seed=3)
    assert seed.token_ids == json.loads(result.stdout)["token_ids"], result.output


def test_python_api_scores_or_refuses_scoring_by_the_family_table(row, llm):
    why = FAMILIES[row.family].cannot.get("scoring")
    if why is None:
        assert llm.score(PROMPTS[0], " 3", samples=4) < 0  # a log-probability
        return
    with pytest.raises(InputError, match="scoring does not apply") as e:
        llm.score(PROMPTS[0], " 3", samples=4)
    assert why in str(e.value)


@pytest.mark.slow
def test_two_torchrun_ranks_write_the_single_process_output(row, folder):
    check_matches_single_process(model_args(row, folder), LINES)
