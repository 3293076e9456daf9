"""DiffusionGemma without a worker thread: dllm's stepping loop (gemma_loop.denoise) is
transformers' `generate` call for call, and the engine drives it one step per `step()`
(answers on the step they are final, progress, abort) in the caller's thread only."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from gemma_checkpoint import CANVAS
from gemma_fixtures import (  # noqa: F401
    SETTLING,
    TEXTS,
    encode,
    gemma_ckpt_fixture,
    gemma_fixture,
    gemma_settings,
)

from dllm_cli.decoding import decode, open_engine
from dllm_cli.decoding.gemma import generation_kwargs, resolve_config
from dllm_cli.decoding.gemma_loop import denoise


class Recorder:
    """A streamer that writes down every call generate makes, with its tensor."""

    def __init__(self):
        self.calls: list[tuple[str, torch.Tensor]] = []

    def put(self, value):
        self.calls.append(("put", value.clone()))

    def put_draft(self, value):
        self.calls.append(("draft", value.clone()))

    def end(self):
        self.calls.append(("end", torch.empty(0)))


def batch(gemma, texts):
    """Left-padded (B, W) prompt ids and their attention mask, as dllm builds them."""
    prompts = [encode(gemma, t) for t in texts]
    width = max(map(len, prompts))
    ids = torch.tensor([[gemma.special.pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]).bool()
    return ids, mask


def generate_both(gemma, s, stop):
    """transformers' generate and dllm's loop from the same seed: sequences and streamer calls."""
    ids, mask = batch(gemma, TEXTS)
    model, kwargs = gemma.model, generation_kwargs(stop, gemma.special.pad, s)
    torch.manual_seed(s.seed)
    theirs = Recorder()
    want = model.generate(ids, attention_mask=mask, streamer=theirs, **kwargs).sequences
    torch.manual_seed(s.seed)
    config = resolve_config(model, kwargs)
    sampler = model._prepare_sampler(config)  # transformers' own sampler, global generator
    rule = model._prepare_diffusion_stopping_criteria(config)
    ours = Recorder()
    steps = denoise(model, ids, mask, config, sampler, rule, ours)
    yields = 0
    while True:
        try:
            next(steps)
            yields += 1
        except StopIteration as end:
            return want, theirs, end.value, ours, yields


@pytest.mark.parametrize(
    "knobs",
    [{}, SETTLING, {"stability_threshold": 0, "confidence_threshold": 100.0}],
    ids=["card-settings", "settling", "first-step-stops"],
)
@pytest.mark.parametrize("stops", ["none", "row-1", "every-row"])
def test_the_loop_is_transformers_generate_call_for_call(gemma, knobs, stops):
    """Four left-padded rows, transformers' own sampler and stopping rule: the same sequences
    (padding after a stop included) and the same streamer calls with the same tensors; one
    yield per denoising step but the last. Stop tokens taken from a free run: row 1's third
    token (one row ends early, the rest go on), or every row's first (the decode ends there)."""
    s = gemma_settings(gen_length=40, steps=6, seed=11, early_stop=stops != "none", **knobs)
    stop, width = gemma.special.stop, batch(gemma, TEXTS)[0].shape[1]
    if stops != "none":
        free = generate_both(gemma, dataclasses.replace(s, early_stop=False), stop)[0]
        picks = [(1, 2)] if stops == "row-1" else [(r, 0) for r in range(len(TEXTS))]
        stop = tuple(int(free[r, width + j]) for r, j in picks)
    want, theirs, got, ours, yields = generate_both(gemma, s, stop)
    assert torch.equal(got, want)
    assert [k for k, _ in ours.calls] == [k for k, _ in theirs.calls]
    for (kind, a), (_, b) in zip(ours.calls, theirs.calls, strict=True):
        assert torch.equal(a, b), kind
    drafts = sum(k == "draft" for k, _ in ours.calls)
    assert yields == drafts - 1
    if stops == "row-1":  # generate padded row 1 after its stop, as we do
        answer = want[1, width:].tolist()
        after = answer[answer.index(stop[0]) + 1 :]
        assert after and set(after) == {gemma.special.pad}
    if stops == "every-row":  # every row finished with the first canvas: no second one
        assert want.shape[1] == width + CANVAS


def engine_decode(gemma, s, texts, on_step=None):
    """Every request through GemmaEngine.step(): Finished per id, and the step each came on."""
    engine = open_engine(gemma.model, gemma.special, s, slots=len(texts), admission="static")
    ids = [engine.add(encode(gemma, t)) for t in texts]
    done, at = {}, {}
    while engine.has_work:
        out = engine.step()
        for f in out.finished:
            done[f.id], at[f.id] = f, out.step
        if on_step is not None:
            on_step(engine, ids, out)
    return engine, ids, done, at


def test_no_thread_is_started(gemma, monkeypatch):
    """A decode through the engine and through decode() starts no thread: Thread.start fails,
    and between steps the caller's own grad mode is back."""

    def refuse(self):
        raise AssertionError(f"a thread was started: {self.name}")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    threads = threading.active_count()
    s = gemma_settings(gen_length=24, steps=4)

    def check(engine, ids, out):
        assert threading.active_count() == threads
        assert torch.is_grad_enabled()  # the loop's no_grad holds only while it runs

    engine, ids, done, _ = engine_decode(gemma, s, TEXTS[:2], check)
    assert sorted(done) == ids and engine.steps > 2
    assert decode(gemma.model, gemma.special, [encode(gemma, TEXTS[0])], s).tokens
    assert threading.active_count() == threads


def test_engine_answers_equal_decode_and_come_when_final(gemma):
    """Early stop at a token row 2 emits in its first canvas: that row's answer comes on the
    step its canvas ends, the others later; every answer equals decode()'s."""
    texts = TEXTS[:3]
    s = gemma_settings(gen_length=40, steps=5)
    free = decode(gemma.model, gemma.special, [encode(gemma, t) for t in texts], s)
    stop = free.tokens[2][3]
    special = dataclasses.replace(gemma.special, eos=stop, eot=None, extra_stop=())
    s = dataclasses.replace(s, early_stop=True)
    loaded = dataclasses.replace(gemma, special=special)
    want = decode(gemma.model, special, [encode(gemma, t) for t in texts], s)
    _, ids, done, at = engine_decode(loaded, s, texts)
    for row, rid in enumerate(ids):
        assert done[rid].tokens == want.tokens[row]
        assert done[rid].commit_steps == want.commit_steps[row]
        assert done[rid].finished_at == want.finished_at[row] == at[rid]
        assert done[rid].forwards == at[rid] + 1
    assert at[ids[2]] < max(at.values())


def test_progress_shows_finished_canvases(gemma):
    """Before the first canvas ends nothing; after it, the first canvas's tokens; at the end
    the whole answer was shown in order."""
    s = gemma_settings(gen_length=40, steps=4)
    seen: dict[int, list[list[int]]] = {}

    def record(engine, ids, out):
        for rid in ids:
            seen.setdefault(rid, []).append(engine.progress(rid))

    _, ids, done, _ = engine_decode(gemma, s, TEXTS[:2], record)
    for rid in ids:
        answer, views = done[rid].tokens, seen[rid]
        assert views[0] == [] and views[-1] == []  # nothing yet; finished: no longer running
        shown = [v for v in views if v]
        assert shown and all(answer[: len(v)] == v for v in shown)
        assert {len(v) for v in shown} == {16, 32}  # canvases of 16; the last is the answer


def test_aborting_the_whole_batch_stops_the_decode(gemma):
    """Abort one running request: the other's answer is unchanged; abort all: no more forwards,
    no answers, the engine takes the next batch."""
    s = gemma_settings(gen_length=40, steps=5)
    _, _, full, _ = engine_decode(gemma, s, TEXTS[:2])
    engine = open_engine(gemma.model, gemma.special, s, slots=2, admission="static")
    a, b = (engine.add(encode(gemma, t)) for t in TEXTS[:2])
    engine.step()
    assert engine.abort(a) and not engine.abort(a)
    answers = []
    while engine.has_work:
        answers += engine.step().finished
    assert [f.id for f in answers] == [b] and answers[0].tokens == full[1].tokens
    engine = open_engine(gemma.model, gemma.special, s, slots=2, admission="static")
    ids = [engine.add(encode(gemma, t)) for t in TEXTS[:2]]
    engine.step(), engine.step()
    for rid in ids:
        engine.abort(rid)
    later = engine.add(encode(gemma, TEXTS[3]))
    out = engine.step()  # the aborted batch ends here; the next one starts
    assert out.finished == [] and engine.running == 1 and engine.forwards == 3
    while engine.has_work:
        answers = engine.step().finished or answers
    assert [f.id for f in answers] == [later]


def test_a_failing_step_drops_its_batch(gemma, monkeypatch):
    """An error inside a denoising step reaches the caller once; the batch is gone, the queue
    goes on."""
    s = gemma_settings(gen_length=16, steps=3)
    engine = open_engine(gemma.model, gemma.special, s, slots=1, admission="static")
    first, second = (engine.add(encode(gemma, t)) for t in TEXTS[:2])
    forward = type(gemma.model).forward
    monkeypatch.setattr(type(gemma.model), "forward", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        engine.step()
    monkeypatch.setattr(type(gemma.model), "forward", forward)
    answers = []
    while engine.has_work:
        answers += engine.step().finished
    assert [f.id for f in answers] == [second] and engine.progress(first) == []


@pytest.mark.parametrize("knobs", [{}, SETTLING], ids=["card-settings", "settling"])
def test_rows_of_their_own_lengths_share_a_batch_each_as_alone(gemma, knobs):
    """Requests with their own gen_length (one canvas, part of one, three) decode in one batch:
    each answer and its logprobs are the request's alone, and a shorter one comes when its own
    last canvas ends, before the batch does."""
    s = gemma_settings(gen_length=40, steps=4, **knobs)
    lengths = (CANVAS, CANVAS + 5, 3 * CANVAS)
    engine = open_engine(gemma.model, gemma.special, s, slots=3, admission="static")
    ids = [
        engine.add(encode(gemma, t), sampling={"gen_length": g}, logprobs=2)
        for t, g in zip(TEXTS[:3], lengths, strict=True)
    ]
    done, at = {}, {}
    while engine.has_work:
        out = engine.step()
        for f in out.finished:
            done[f.id], at[f.id] = f, out.step
    for rid, text, g in zip(ids, TEXTS[:3], lengths, strict=True):
        alone = open_engine(gemma.model, gemma.special, dataclasses.replace(s, gen_length=g))
        alone.add(encode(gemma, text), logprobs=2)
        want = []
        while alone.has_work:
            want += alone.step().finished
        got, (want,) = done[rid], want
        assert got.tokens == want.tokens and len(want.tokens) == g
        (mine, my_top, _), (theirs, their_top, _) = got.token_logprobs(2), want.token_logprobs(2)
        assert (
            mine == pytest.approx(theirs, rel=1e-4) and my_top == their_top
        )  # padding: float bits
    assert at[ids[0]] < at[ids[1]] < at[ids[2]]


def test_rows_of_their_own_seeds_share_a_batch_each_as_alone(gemma):
    """Requests with their own seed decode in one static batch, each row drawing from its own
    generator: each answer is the request's alone at that seed, and the seeds differ."""
    s = gemma_settings(gen_length=24, steps=4)
    seeds = (1, 2, 1)
    engine = open_engine(gemma.model, gemma.special, s, slots=3, admission="static")
    ids = [engine.add(encode(gemma, TEXTS[0]), sampling={"seed": k}) for k in seeds]
    done = {}
    while engine.has_work:
        done |= {f.id: f.tokens for f in engine.step().finished}
    for rid, k in zip(ids, seeds, strict=True):
        one = dataclasses.replace(s, seed=k)
        alone = decode(gemma.model, gemma.special, [encode(gemma, TEXTS[0])], one)
        assert done[rid] == alone.tokens[0]
    assert done[ids[0]] == done[ids[2]] != done[ids[1]]


@pytest.mark.parametrize("early", [True, False], ids=["early-stop", "no-early-stop"])
def test_a_request_s_own_stop_ids_cut_its_answer_and_with_early_stop_end_it(gemma, early):
    """A request whose own stop id is its free answer's 4th token: that token and everything
    after it are EOS (early stop or not), the batch's other row keeps its answer; with early
    stop the cut row may come sooner, without it when the batch ends."""
    s = gemma_settings(gen_length=40, steps=4, early_stop=early)
    texts = TEXTS[:2]
    _, ids, free, _ = engine_decode(gemma, s, texts)
    tokens = free[ids[0]].tokens
    stop = next(t for t in tokens[3:] if t not in tokens[:3] and t not in gemma.special.stop)
    at = tokens.index(stop)
    engine = open_engine(gemma.model, gemma.special, s, slots=2, admission="static")
    mine = engine.add(encode(gemma, texts[0]), sampling={"stop": [stop]})
    other = engine.add(encode(gemma, texts[1]))
    done, when = {}, {}
    while engine.has_work:
        out = engine.step()
        for f in out.finished:
            done[f.id], when[f.id] = f.tokens, out.step
    eos = gemma.special.eos
    assert done[mine] == tokens[:at] + [eos] * (len(tokens) - at)
    assert done[other] == free[ids[1]].tokens
    assert when[mine] <= when[other] if early else when[mine] == when[other]
