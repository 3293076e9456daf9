"""DiffusionGemma's answer logprobs: each token's log-probability (and the top K) under the
denoising step that committed its canvas row, as transformers' own steps computed them, with
the tokens unchanged; a row the stopping rule froze keeps the step it stopped at."""

from __future__ import annotations

import pytest
import torch
from gemma_fixtures import (  # noqa: F401
    SETTLING,
    TEXTS,
    encode,
    gemma_ckpt_fixture,
    gemma_fixture,
    gemma_settings,
)

from dllm_cli.decoding import open_engine


class Watched:
    """transformers' pieces of one decode, each call written down in order: the processed
    logits of every denoising step, the stopping rule's verdicts and its resets (one a canvas)."""

    def __init__(self, model, monkeypatch):
        self.events: list[tuple[str, torch.Tensor | None]] = []
        processors = model._prepare_logits_processor
        rules = model._prepare_diffusion_stopping_criteria
        monkeypatch.setattr(
            model, "_prepare_logits_processor", lambda *a: self.wrap(processors(*a))
        )
        monkeypatch.setattr(
            model, "_prepare_diffusion_stopping_criteria", lambda c: self.rule(rules(c))
        )

    def wrap(self, processor):
        def call(ids, logits, **kw):
            out = processor(ids, logits, **kw)
            self.events.append(("logits", out.detach().double().clone()))
            return out

        return call

    def rule(self, rule):
        if rule is None:
            return None
        watched = self

        class Rule:
            def __call__(self, argmax, logits, **kw):
                stop = rule(argmax, logits, **kw)
                watched.events.append(("stop", stop.clone()))
                return stop

            def reset(self):
                watched.events.append(("reset", None))
                rule.reset()

        return Rule()

    def committing(self, rows: int) -> tuple[list[torch.Tensor], int]:
        """Per canvas, (B, L, V): each row's processed logits at the step it stopped (its
        canvas's last step if it never did), found from the calls alone; and how many rows
        stopped before their canvas's last step."""
        canvases, steps, stopped, early = [], [], None, 0
        for kind, value in [*self.events, ("reset", None)]:
            if kind == "reset" and steps:
                last = torch.full((rows,), len(steps) - 1)
                last = last if stopped is None else stopped.clamp(max=len(steps) - 1)
                early += int((last < len(steps) - 1).sum())
                canvases.append(torch.stack([steps[int(s)][b] for b, s in enumerate(last)]))
                steps, stopped = [], None
            elif kind == "logits":
                steps.append(value)
            elif kind == "stop":
                at = torch.full((rows,), len(steps) - 1)
                stopped = at if stopped is None else stopped
                stopped = torch.where((stopped == at) & ~value, at + 1, stopped)
        return canvases, early


def run(gemma, s, texts, asked):
    """Every request through the engine, each asking for `asked` alternatives (None: none)."""
    engine = open_engine(gemma.model, gemma.special, s, slots=len(texts), admission="static")
    ids = [engine.add(encode(gemma, t), logprobs=asked) for t in texts]
    done = {}
    while engine.has_work:
        for f in engine.step().finished:
            done[f.id] = f
    return [done[i] for i in ids]


@pytest.mark.parametrize("knobs", [{}, SETTLING], ids=["card-settings", "settling"])
def test_each_token_has_the_log_softmax_of_the_step_that_committed_it(gemma, knobs, monkeypatch):
    """Settling: rows stop at different steps, some before their canvas's last."""
    s = gemma_settings(gen_length=24, steps=8, **knobs)
    plain = [f.tokens for f in run(gemma, s, TEXTS, None)]
    watched = Watched(gemma.model, monkeypatch)
    asked = run(gemma, s, TEXTS, 3)
    assert [f.tokens for f in asked] == plain  # asking changes no token
    canvases, early = watched.committing(len(TEXTS))
    assert early > 0 if knobs else early == 0
    logits = torch.cat(canvases, dim=1)  # (B, canvases * L, V)
    for b, f in enumerate(asked):
        chosen, top_ids, top_values = f.token_logprobs(3)
        n = len(f.tokens)
        want = torch.log_softmax(logits[b, :n], dim=-1)  # (n, V), float64
        picked = want.gather(-1, torch.tensor(f.tokens)[:, None]).squeeze(-1)
        assert chosen[:n] == pytest.approx(picked.tolist(), abs=1e-5)
        assert [row[0] for row in top_ids[:n]] == f.tokens  # the canvas is the argmax canvas
        values = torch.tensor(top_values[:n], dtype=torch.float64)  # (n, 3)
        torch.testing.assert_close(values, want.topk(3, dim=-1).values, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            want.gather(-1, torch.tensor(top_ids[:n])), values, atol=1e-5, rtol=0
        )
