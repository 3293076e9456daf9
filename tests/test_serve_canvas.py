"""The step stream (`stream_options.include_canvas`) and the page routes, on a real server on a
loopback port (the shipped model, unguided and guided; LLaDA2.1 with edits and DiffusionGemma
on tiny checkpoints), read with raw HTTP and with the official `openai` client."""

from __future__ import annotations

import json
import re
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from block_checkpoints import write_llada2
from gemma_fixtures import gemma_ckpt_fixture, gemma_profile  # noqa: F401

from dllm_cli.decoding.engine import StepOutput
from dllm_cli.runtime import open_runtime
from dllm_cli.serve import server

QUESTION = [{"role": "user", "content": "Tom has 3 apples and buys 2 more. How many apples?"}]
CANVAS = {"stream": True, "stream_options": {"include_canvas": True}}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runtime():
    return open_runtime(None, {"decode.gen_length": 32})


@pytest.fixture(scope="module")
def url(runtime):
    handle = server.start_in_thread(runtime, server.Options(port=0, slots=4, max_queue=8))
    yield handle.url
    handle.stop()


def chunks(url: str, body: dict) -> tuple[list[dict], int]:
    """Every data chunk of a streamed chat answer, and the bytes its canvas chunks took."""
    out, canvas_bytes = [], 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
                canvas_bytes += len(line) if "canvas" in out[-1] else 0
    return out, canvas_bytes


def text_of(stream: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in stream if c["choices"])


@pytest.mark.parametrize("guide", [False, True])
def test_frames_rebuild_the_answer_and_leave_the_text_chunks_alone(url, runtime, guide):
    body = {"messages": QUESTION, "guide": guide, "early_stop": False}
    plain, _ = chunks(url, {**body, "stream": True})
    stream, _ = chunks(url, {**body, **CANVAS})
    assert text_of(stream) == text_of(plain) and text_of(plain)  # text chunks unchanged
    assert [c for c in stream if "canvas" not in c][-1]["usage"] == plain[-1]["usage"] | {
        "seconds": stream[-1]["usage"]["seconds"]
    }
    frames = [c["canvas"] for c in stream if "canvas" in c]
    assert all(c["choices"] == [] for c in stream if "canvas" in c)
    usage = stream[-1]["usage"]
    assert [f["step"] for f in frames] == list(range(usage["steps"]))
    assert frames[0]["layout"]["gen_length"] == 32 and frames[0]["layout"]["guided"] is guide
    assert [f["final"] for f in frames] == [False] * (len(frames) - 1) + [True]
    assert frames[-1]["forwards"] == usage["forwards"]
    tokens: dict[int, int] = {}
    for f in frames:
        for pos, tok, text, conf, fixed in f["commits"]:
            assert pos not in tokens and 0 <= conf <= 1 and fixed in (0, 1)
            assert text == runtime.loaded.tokenizer.decode([tok])
            tokens[pos] = tok
        if guide:  # this request's own accepted drafts and guide tokens
            assert f["accepted"] + f["corrected"] == len(f["commits"])
    n = len(tokens)  # guided: the guide ends the answer at its stop token
    assert sorted(tokens) == list(range(n)) and (guide or n == 32)  # each position once
    assert runtime.text([tokens[p] for p in range(n)]) == text_of(stream)
    assert frames[-1]["committed"] == n


def test_two_requests_in_one_batch_each_get_their_own_rows_frames(url, runtime):
    questions = [
        "Ann has 10 pens and gives 4 away. How many pens are left?",
        QUESTION[0]["content"],
    ]
    bodies = [
        {
            "messages": [{"role": "user", "content": q}],
            "guide": False,
            "early_stop": False,
            **CANVAS,
        }
        for q in questions
    ]
    with ThreadPoolExecutor(2) as pool:
        streams = [s for s, _ in pool.map(lambda b: chunks(url, b), bodies)]
    for stream in streams:
        tokens = {}
        for f in (c["canvas"] for c in stream if "canvas" in c):
            tokens |= {pos: tok for pos, tok, *_ in f["commits"]}
        assert sorted(tokens) == list(range(32))
        assert runtime.text([tokens[p] for p in range(32)]) == text_of(stream)
    assert text_of(streams[0]) != text_of(streams[1])


def test_n_choices_each_get_frames_naming_their_index(url, runtime):
    body = {"messages": QUESTION, "guide": False, "early_stop": False, "n": 2, **CANVAS}
    stream, _ = chunks(url, body | {"temperature": 0.9, "seed": 3})
    for index in (0, 1):
        tokens = {}
        for c in stream:
            if "canvas" in c and c["canvas"]["index"] == index:
                tokens |= {pos: tok for pos, tok, *_ in c["canvas"]["commits"]}
        text = "".join(
            c["choices"][0]["delta"].get("content") or ""
            for c in stream
            if c["choices"] and c["choices"][0]["index"] == index
        )
        assert sorted(tokens) == list(range(32))
        assert runtime.text([tokens[p] for p in range(32)]) == text


def test_a_256_position_decode_in_64_steps_stays_small(url):
    fixed = {"unmask": "fixed", "early_stop": False, "steps": 64}
    body = {"messages": QUESTION, "guide": False, "max_tokens": 256, **fixed, **CANVAS}
    stream, size = chunks(url, body)
    frames = [c for c in stream if "canvas" in c]
    assert len(frames) == 64
    assert sum(len(f["canvas"]["commits"]) for f in frames) == 256
    layout = frames[0]["canvas"]["layout"]  # the profile prunes past a 64-token suffix window
    pruned = [f["canvas"].get("pruned_from") for f in frames]
    assert layout["suffix_window"] == 64 and pruned[0] == layout["blocks"][0][1] + 64
    assert size < 200_000, size  # deltas only: bytes of every canvas chunk together


def test_no_frames_and_no_events_built_for_requests_that_did_not_ask(url, monkeypatch):
    built = []
    original = StepOutput.event

    def spy(self):
        built.append(self.step)
        return original.fget(self)

    monkeypatch.setattr(StepOutput, "event", property(spy))
    stream, _ = chunks(url, {"messages": QUESTION, "guide": False, "stream": True})
    assert text_of(stream) and not any("canvas" in c for c in stream)
    assert built == []  # no StepEvent was materialised
    chunks(url, {"messages": QUESTION, "guide": False, **CANVAS})
    assert built


def test_the_openai_client_reads_the_text_past_the_canvas_chunks(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="tiny-gsm-dream", messages=QUESTION, stream=True,
        stream_options={"include_canvas": True},  # type: ignore[typeddict-unknown-key]
    )  # fmt: skip
    got = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in got if c.choices)
    canvases = [c.model_extra["canvas"] for c in got if not c.choices and c.model_extra]
    assert text == client.chat.completions.create(messages=QUESTION, model="tiny-gsm-dream").choices[0].message.content  # fmt: skip
    assert len(canvases) >= 2 and "layout" in canvases[0]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream_options": {"include_canvas": True}}, "stream_options.include_canvas"),
        ({**CANVAS, "stream_options": {"include_canvas": "yes"}}, "stream_options.include_canvas"),
        ({**CANVAS, "stream_options": {"include_frames": True}}, "stream_options"),
    ],
)
def test_bad_canvas_options_are_400s_naming_the_field(url, extra, param):
    reply = httpx.post(url + "/v1/chat/completions", json={"messages": QUESTION, **extra})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_page_needs_no_key_the_api_does_and_no_ui_is_a_404(runtime):
    keyed = server.start_in_thread(runtime, server.Options(port=0, api_key="sk-1"))
    bare = server.start_in_thread(runtime, server.Options(port=0, ui=False))
    try:
        page = httpx.get(keyed.url + "/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        config = json.loads(page.text.split('type="application/json">')[1].split("</script>")[0])
        assert config["key"] is True and config["model"] == "tiny-gsm-dream"
        names = {row["name"]: row for row in config["settings"]}
        assert names["gen_length"]["value"] == 32 and "batching" not in names
        for name in ("app.js", "style.css"):  # nothing to fetch from elsewhere: no URL, font
            asset = httpx.get(keyed.url + "/web/" + name)
            assert asset.status_code == 200
            assert re.search(r"https?://|@import|@font-face|url\(", asset.text) is None
        assert re.search(r"https?://|@import", page.text) is None
        assert httpx.get(keyed.url + "/web/other.js").status_code == 401  # not an asset
        assert httpx.post(keyed.url + "/v1/chat/completions", json={}).status_code == 401
        for path in ("/", "/web/app.js"):
            missing = httpx.get(bare.url + path)
            assert missing.status_code == 404 and "error" in missing.json()
    finally:
        keyed.stop()
        bare.stop()


LLADA2 = """\
    name = "tiny-llada2"
    description = "tiny random LLaDA2.1 with token editing"

    [model]
    path = "{folder}"
    dtype = "float32"
    device = "cpu"

    [decode]
    gen_length = 8
    block_length = 4
    cache = "prefix"
    unmask = "threshold"
    threshold = 0.1
    edit_threshold = 0.0
    max_post_steps = 2
"""


def family_profile(tmp: Path, family: str, request) -> Path:
    """A profile for a tiny random LLaDA2.x (edits on) or DiffusionGemma (the session's) folder."""
    if family == "llada2":
        text = textwrap.dedent(LLADA2).format(folder=write_llada2(tmp / "llada2").folder)
    else:
        text = gemma_profile(request.getfixturevalue("gemma_ckpt").folder)
    path = tmp / f"{family}.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("family", ["llada2", "gemma"])
def test_block_diffusion_edits_and_gemma_drafts_rebuild_the_answer(tmp_path, family, request):
    torch.set_num_threads(1)
    runtime = open_runtime(str(family_profile(tmp_path, family, request)), {})
    handle = server.start_in_thread(runtime, server.Options(port=0, slots=2))
    try:
        body = {"prompt": "how many apples", **CANVAS}
        stream = []
        with httpx.stream("POST", handle.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    stream.append(json.loads(line[6:]))
    finally:
        handle.stop()
    text = "".join(c["choices"][0]["text"] for c in stream if c["choices"])
    frames = [c["canvas"] for c in stream if "canvas" in c]
    layout = frames[0]["layout"]
    tokens: dict[int, int] = {}
    for f in frames:
        for pos, tok, *_ in [*f["commits"], *f.get("edits", [])]:
            tokens[pos] = tok  # a commit, then edits replacing it, in step order
        a, b = layout["blocks"][f["block"]]
        if family == "llada2":  # the window is the block the step worked in
            assert [max(0, f["window"][0]), min(f["window"][1], 8)] == [a, b]
    g = layout["gen_length"]
    answer = [tokens[p] for p in range(g) if p in tokens]
    assert runtime.text(answer) == text
    kind = "edits" if family == "llada2" else "drafts"
    assert any(kind in f for f in frames) and layout["uniform"] is (family == "gemma")
    assert layout["blocks"][-1][1] == g
    # The block engine retires a finished row on a step without a forward (no event, no frame)
    assert frames[-1]["final"] is (family == "gemma")
