"""Screen per-step unmasking variants that are not shipped rules, on held-out TinyGSM problems.

Each variant runs in the `credit` rule's slot (its per-row history: decoding/credit.py), so it
decodes through the engine exactly as a shipped rule would (dual cache, early stop, rows at
their own pace, 4-shot, gen 256, block 32, no suffix pruning) and reports what `dllm bench
--frontier` reports for a point: accuracy and batch-1 answer tokens per forward. No reference
pass: compare with a frontier run of the same problems. docs/decoding-rules.md ("What else was
screened") has the results.

    python scripts/screen_stability_rules.py -p tiny-gsm-dream --n 100 \
        rule=near,threshold=0.99,near=0.9,width=8 rule=stable,threshold=0.99,low=0.9,steps=2
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

import dllm_cli.decoding.unmask as unmask
from dllm_cli.decoding.credit import TIE, fused_drafts
from dllm_cli.evaluate import held_out, warm_up
from dllm_cli.frontier import score_alone
from dllm_cli.runtime import open_runtime


def at_least_best(ok: torch.Tensor, conf: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """The threshold rule's progress guarantee (dInfer's form): the best mask always goes."""
    return (ok | (conf >= conf.max(dim=1, keepdim=True).values - TIE)) & cand


def near_first_mask(cand: torch.Tensor, width: int) -> torch.Tensor:
    """(B, L) slots within `width` columns of the row's first mask (the left context)."""
    idx = torch.arange(cand.shape[1], device=cand.device).expand_as(cand)
    first = torch.where(cand, idx, cand.shape[1]).min(dim=1, keepdim=True).values
    return idx < first + width


def stable_for(memory, best: torch.Tensor, steps: int) -> torch.Tensor:
    """(B, L) masks whose top-1 token was the same for the block's last `steps` steps."""
    tokens, gains = memory.held.tokens[..., -steps:], memory.held.gains[..., -steps:]
    return ((tokens == best[..., None]) & (gains > 0)).all(dim=-1)


def near(v, p, ctx):
    """Threshold `near` within `width` columns of the first mask, `threshold` beyond."""
    cand, conf = ctx.candidates, ctx.confidence
    bar = torch.where(near_first_mask(cand, int(v["width"])), v["near"], p.threshold)
    return at_least_best(conf >= bar, conf, cand), ctx.drafts


def stable(v, p, ctx):
    """`threshold`, or `low` for a mask whose top-1 held for the last `steps` steps (and,
    with `width`, lies within it of the first mask)."""
    top, best = ctx.probs.max(dim=-1)
    p.credit.update(ctx, top, best)
    cand, conf = ctx.candidates, ctx.confidence
    held = stable_for(p.credit, best, int(v["steps"]))
    if "width" in v:
        held &= near_first_mask(cand, int(v["width"]))
    return at_least_best((conf >= p.threshold) | ((conf >= v["low"]) & held), conf, cand), (
        ctx.drafts
    )


def credit_earlier(v, p, ctx):
    """Credit decoding without the current step's own gain (only earlier steps' credit)."""
    m = p.credit
    top, best = ctx.probs.max(dim=-1)
    credit = m.update(ctx, top, best)
    gain = top.float().pow(m.boost) * ctx.candidates
    credit = credit.scatter_add(2, best[..., None], -gain[..., None]).clamp(min=0)
    tokens, conf = fused_drafts(ctx, credit, m.alpha)
    conf = conf.masked_fill(~ctx.candidates, float("-inf"))
    return at_least_best(conf >= p.threshold, conf, ctx.candidates), tokens


def credit_near(v, p, ctx):
    """Credit decoding with threshold `near` within `width` columns of the first mask."""
    m = p.credit
    top, best = ctx.probs.max(dim=-1)
    tokens, conf = fused_drafts(ctx, m.update(ctx, top, best), m.alpha)
    cand = ctx.candidates
    conf = conf.masked_fill(~cand, float("-inf"))
    bar = torch.where(near_first_mask(cand, int(v["width"])), v["near"], p.threshold)
    return at_least_best(conf >= bar, conf, cand), tokens


def whole_block(v, p, ctx):
    """Prophet-style early commit inside a block: the threshold rule, and every mask of the
    block once the masks' mean top-2 log-probability gap reaches `gap`."""
    cand, conf = ctx.candidates, ctx.confidence
    top2 = ctx.probs.topk(2, dim=-1).values.clamp(min=1e-300).log()
    gap = (top2[..., 0] - top2[..., 1]).masked_fill(~cand, 0.0)
    mean = gap.sum(1, keepdim=True) / cand.sum(1, keepdim=True).clamp(min=1)
    return at_least_best((conf >= p.threshold) | (mean >= v["gap"]), conf, cand), ctx.drafts


VARIANTS = {
    "near": near,
    "stable": stable,
    "credit-earlier": credit_earlier,
    "credit-near": credit_near,
    "whole-block": whole_block,
}
SETTINGS = ("threshold", "credit_alpha", "credit_boost", "credit_decay")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-p", "--profile", default="tiny-gsm-dream")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=20)
    ap.add_argument("specs", nargs="+", help="rule=NAME,threshold=T,... (variant values)")
    args = ap.parse_args()
    rt = open_runtime(args.profile, {}, use_guide=False)
    base = replace(
        rt.settings, gen_length=256, block_length=32, suffix_window=0, cache="dual",
        early_stop=True, unmask="credit",
    )  # fmt: skip
    tasks = held_out(rt.encode, args.n, 4, 0)
    for spec in args.specs:
        values = dict(item.split("=") for item in spec.split(","))
        rule = VARIANTS[values.pop("rule")]
        own = {k: float(x) for k, x in values.items() if k not in SETTINGS}
        s = replace(base, **{k: float(x) for k, x in values.items() if k in SETTINGS})
        unmask.UNMASK_RULES["credit"] = lambda p, ctx, rule=rule, own=own: rule(own, p, ctx)
        warm_up(rt.loaded.model, rt.loaded.special, tasks[0], s)
        summary = score_alone(rt, tasks, s, args.batch_size).summary()
        record = {"spec": spec, **{k: summary[k] for k in ("accuracy", "tokens_per_forward")}}
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
