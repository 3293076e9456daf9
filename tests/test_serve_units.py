"""The server's pure parts: multi-turn prompts through real chat templates, stop strings held
back while they may still form, request validation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.responses import Response
from hypothesis import given, settings
from hypothesis import strategies as st
from test_chat import TRIMMING_TEMPLATE

from dllm_cli import chat
from dllm_cli.errors import InputError
from dllm_cli.models.collectives import RankLost
from dllm_cli.models.loading import load_tokenizer
from dllm_cli.serve import protocol
from dllm_cli.serve.answers import Deltas, cut_at_stops
from dllm_cli.serve.conversation import Message, encode_messages
from dllm_cli.serve.metrics import Metrics
from dllm_cli.serve.tickets import Ticket
from dllm_cli.serve.worker import Worker
from dllm_cli.settings import DecodeSettings

WEIGHTS = Path(chat.__file__).parent / "tinygsm" / "weights"
PIECES = ["a", "b", "c", " ", "1", "2", "+", "=", "?", ".", "\n", "<|im_end|>", "<|im_start|>"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=20).map("".join)


@pytest.fixture(scope="module", params=["tiny-gsm-dream", "tiny-gsm"])
def tok(request):
    return load_tokenizer(WEIGHTS / request.param)


def test_one_message_is_the_cli_prompt(tok):
    for text in ("What is 2 + 2?", "  padded  ", "a <|im_end|> b", "<|eot_id|>\n"):
        ids = encode_messages(tok, [Message("user", text)])
        assert ids == chat.encode_chat(tok, text, chat.frame(tok))


@settings(max_examples=30, deadline=None)
@given(turns=st.lists(TEXT, min_size=1, max_size=5))
def test_conversation_ids_are_the_whole_string_unless_text_holds_specials(tok, turns):
    roles = ["user" if i % 2 == 0 else "assistant" for i in range(len(turns))]
    turns[-1] = turns[-1] + " q"  # a last user message with text
    if len(turns) % 2 == 0:
        turns.append("next q")
        roles.append("user")
    messages = [Message(r, t) for r, t in zip(roles, turns, strict=True)]
    ids = encode_messages(tok, messages)
    rendered = tok.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        add_generation_prompt=True,
        tokenize=False,
    )
    whole = tok(rendered, add_special_tokens=False).input_ids
    if not any("<|" in t for t in turns):
        assert ids == whole
    specials = chat.special_ids(tok) - {tok.unk_token_id}  # unknown text is <|unk|>, not markup
    template_only = tok(
        tok.apply_chat_template(
            [{"role": m.role, "content": "x"} for m in messages],
            add_generation_prompt=True,
            tokenize=False,
        ),
        add_special_tokens=False,
    ).input_ids
    # Only the template writes special tokens, whatever the messages say.
    assert sum(i in specials for i in ids) == sum(i in specials for i in template_only)


def test_trimming_templates_are_followed(tmp_path):
    from test_chat import byte_level_llada

    tok = byte_level_llada(tmp_path / "llada")
    assert tok.chat_template == TRIMMING_TEMPLATE
    messages = [Message("user", "  hi  "), Message("assistant", " yes "), Message("user", "the a ")]
    rendered = tok.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert encode_messages(tok, messages) == tok(rendered, add_special_tokens=False).input_ids


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        ([], "messages is empty"),
        ([Message("robot", "hi")], "role must be one of"),
        ([Message("user", "a\x00b")], "control character U+0000"),
        ([Message("user", "hi"), Message("assistant", "yo")], "last message must be the user's"),
        ([Message("user", "   ")], "empty prompt"),
    ],
)
def test_bad_conversations_are_refused(tok, messages, words):
    with pytest.raises(InputError, match=re.escape(words)):
        encode_messages(tok, messages)


def test_stop_strings_cut_and_hold_back():
    assert cut_at_stops("abc STOP def", ("STOP",), final=False).text == "abc "
    assert cut_at_stops("abc ST", ("STOP",), final=False).text == "abc "  # may become STOP
    assert cut_at_stops("abc ST", ("STOP",), final=True).text == "abc ST"
    deltas = Deltas(lambda ids: "".join(map(chr, ids)), ("ab",))
    sent = [deltas.feed([ord(c) for c in "xyz a"[:n]]) for n in range(1, 6)]
    assert sent == ["x", "y", "z", " ", ""]  # the trailing "a" is held back
    assert deltas.feed([ord(c) for c in "xyz ab q"]) == "" and deltas.stopped
    assert deltas.finish("xyz ab q") == ""
    assert deltas.sent == "xyz "


def test_request_settings_are_validated_as_the_cli_validates():
    base = DecodeSettings(gen_length=32)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "threshold": 0.5}
    job = protocol.parse(body, "chat", base, "m", guided=False)
    assert job.settings.gen_length == 8 and job.settings.threshold == 0.5
    for extra, message in (
        ({"steps": 0}, "steps must be >= 1 (got 0)"),
        ({"block_length": "8"}, "block_length must be an integer (got '8')"),
        ({"guide": True}, "no guide model"),
        ({"batching": "static"}, "unknown field 'batching'"),
        ({"stream": "yes"}, "stream must be true or false"),
    ):
        with pytest.raises(
            protocol.ApiError, match=message.replace("(", r"\(").replace(")", r"\)")
        ):
            protocol.parse({**body, **extra}, "chat", base, "m", guided=False)


def test_chat_session_drops_the_oldest_exchanges_to_fit():
    from dllm_cli.runtime import open_runtime
    from dllm_cli.serve.session import Session

    runtime = open_runtime(None, {"decode.gen_length": 1990}, use_guide=False)  # 58 tokens left
    session = Session(runtime, system=[Message("system", "Be brief.")])
    turn = "Tom has 3 apples and buys 2 more."
    for i in range(3):
        session.messages += [Message("user", f"{turn} {i}"), Message("assistant", "5")]
    prompt = session.prompt("How many apples?")
    assert prompt.dropped >= 1
    assert len(prompt.ids) + 1990 <= runtime.loaded.model.context_length
    with pytest.raises(InputError, match="prompt too long"):
        session.prompt("apples " * 80)  # too long even alone
    session.reset()
    assert session.prompt("How many apples?").dropped == 0


def test_serve_and_chat_help_start_without_torch():
    from test_cli_startup import probe

    for command in ("serve", "chat"):
        seen = probe(command, "--help")
        assert seen["code"] == 0 and seen["heavy"] == [], seen
        assert "--api-key" in seen["stdout"] if command == "serve" else "--visual" in seen["stdout"]


@pytest.mark.parametrize("path", ["/v1/completions", "/api/chat"])
def test_an_answer_nobody_reads_is_logged_as_499(path):
    """Both APIs' routes: a client that left while its answer was made gets 499, counted."""
    import asyncio

    from starlette.requests import Request

    from dllm_cli.serve.metrics import Metrics
    from dllm_cli.serve.plumbing import Gone, Served, unless_gone

    async def left():
        raise Gone()

    async def kept():
        return Response("fine")

    served = Served.__new__(Served)  # only its metrics are read
    served.metrics = Metrics("tiny")
    request = Request({"type": "http", "method": "POST", "path": path, "headers": []})
    assert asyncio.run(unless_gone(served, request, left())).status_code == 499
    assert asyncio.run(unless_gone(served, request, kept())).body == b"fine"
    assert served.metrics.requests == {(path, 499): 1}


@pytest.mark.parametrize(
    "error, status, message, ends",
    [
        (RankLost("rank 1 left"), 503, "rank 1 left", True),
        (ValueError("a bug"), 500, "internal error: ValueError: a bug", False),
    ],
)
def test_a_stepping_thread_failure_answers_every_request(error, status, message, ends):
    """A lost rank answers 503 and ends the server; a bug answers 500 and leaves it up."""
    worker = Worker(None, slots=1, max_engines=1, metrics=Metrics("m"))
    posted, ended = [], []
    worker.parked = [Ticket(protocol.Job("chat"), lambda kind, payload: posted.append(payload))]
    worker.count = 1
    worker.ended = lambda: ended.append(True)

    def fail(block: bool) -> bool:
        raise error

    worker.drain = fail
    worker.loop()
    assert worker.failure is error and worker.count == 0 and bool(ended) == ends
    assert [(e.status, e.message) for e in posted] == [(status, message)]
