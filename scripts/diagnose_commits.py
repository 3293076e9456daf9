"""Which commits of a parallel unmasking rule go wrong, against one token per step.

Decodes the same held-out TinyGSM problems twice with the library's decoder: once with the
reference (one token per step, the run's cache) and once with the rule under test, each row
at its own pace (so every number is what the row would get decoded alone, at batch 1). Each
commit of the rule is checked against the reference answer at the same position, up to and
including the step that committed the rule's first differing token (later commits see a
context the reference never saw). It prints, for those commits, how often they differ by:
whether a neighbouring mask was committed in the same step, how many tokens the step
committed, the position in the block, the confidence; and, for the problems whose
correctness changed, the same facts about the first differing token.

    python scripts/diagnose_commits.py -p tiny-gsm-dream --unmask threshold --threshold 0.9
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass, replace

import torch

from dllm_cli.decoding import Decoder
from dllm_cli.decoding.answer import answer_length
from dllm_cli.evaluate import held_out
from dllm_cli.runtime import open_runtime

REFERENCE = {"unmask": "fixed", "steps": None}


@dataclass
class Commit:
    problem: int
    position: int
    step: int
    token: int
    confidence: float
    together: int  # tokens the row committed in this step
    neighbour: bool  # position - 1 or position + 1 committed in the same step


def right(text: str, task) -> bool:
    """The answer's number (the task's own extraction) equals the gold one."""
    predicted = task.extract(text)
    return predicted is not None and predicted == task.answer


def decode_rows(rt, prompts, settings, batch):
    """Tokens, per-commit records and row-forwards of every prompt, each row at its own pace."""
    decoder = Decoder(rt.loaded.model, rt.loaded.special, settings)
    tokens, commits, served = [], [], 0
    for first in range(0, len(prompts), batch):
        run = decoder.run(prompts[first : first + batch], lockstep=False)
        for event in run:
            for c in event.commits:
                here = set(c.positions)
                for pos, tok, conf in zip(c.positions, c.tokens, c.confidences, strict=True):
                    near = (pos - 1 in here) or (pos + 1 in here)
                    commits.append(
                        Commit(first + c.row, pos, event.step, tok, conf, len(here), near)
                    )
        result = run.result()
        tokens += result.tokens
        served += result.rows_served
    return tokens, commits, served


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def rate(rows: list[bool]) -> str:
    return f"{sum(rows)}/{len(rows)} = {100 * sum(rows) / max(1, len(rows)):.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-p", "--profile", default="tiny-gsm-dream")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--shots", type=int, default=4)
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--cache", default="dual")
    ap.add_argument("--unmask", default="threshold")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--set", action="append", default=[], help="extra setting key=value (json)")
    ap.add_argument("--json", help="write the raw per-problem numbers here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rt = open_runtime(args.profile, {}, use_guide=False)
    common = {
        "gen_length": 256, "block_length": 32, "suffix_window": 0, "top_k": 0,
        "early_stop": True, "cache": args.cache,
    }  # fmt: skip
    base = replace(rt.settings, **common, **REFERENCE)
    extra = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    rule = replace(rt.settings, **common, unmask=args.unmask, threshold=args.threshold, **extra)
    tasks = held_out(rt.encode, args.n, args.shots)
    prompts = [t.prompt for t in tasks]
    ref_tokens, _, ref_served = decode_rows(rt, prompts, base, args.batch)
    tokens, commits, served = decode_rows(rt, prompts, rule, args.batch)
    block = rule.block_length
    ref_ok = [right(rt.text(t), task) for t, task in zip(ref_tokens, tasks, strict=True)]
    ok = [right(rt.text(t), task) for t, task in zip(tokens, tasks, strict=True)]
    first = [first_difference(a, b) for a, b in zip(tokens, ref_tokens, strict=True)]
    by_problem = defaultdict(list)
    for c in commits:
        by_problem[c.problem].append(c)
    # The commits made up to the step that wrote the first differing token.
    judged = []  # (commit, differs)
    firsts = []  # the commit of each problem's first differing token
    for p, cs in by_problem.items():
        cut = first[p]
        last = (
            max(c.step for c in cs)
            if cut is None
            else next(c.step for c in cs if c.position == cut)
        )
        for c in cs:
            if c.step <= last:
                judged.append((c, c.token != ref_tokens[p][c.position]))
            if cut is not None and c.position == cut:
                firsts.append(c)
    print(f"profile {args.profile}, {args.n} problems, {args.shots}-shot, cache {args.cache}")
    print(f"reference (one token per step): {sum(ref_ok)}/{args.n} right")
    stop = rt.loaded.special.stop
    answer = sum(answer_length(t, stop) for t in tokens)
    ref_answer = sum(answer_length(t, stop) for t in ref_tokens)
    print(
        f"rule {args.unmask} {extra or args.threshold}: {sum(ok)}/{args.n} right, "
        f"{answer / served:.2f} answer tokens per forward at batch 1 "
        f"(reference {ref_answer / ref_served:.2f})"
    )
    print(
        f"answers differing from the reference: {sum(f is not None for f in first)}; "
        f"right->wrong {sum(a and not b for a, b in zip(ref_ok, ok, strict=True))}, "
        f"wrong->right {sum(b and not a for a, b in zip(ref_ok, ok, strict=True))}"
    )
    print("\ncommits up to the first difference: share that differ from the reference")

    def table(name, key, rows):
        groups = defaultdict(list)
        for c, bad in rows:
            groups[key(c)].append(bad)
        print(f"  by {name}:")
        for k in sorted(groups):
            print(f"    {k!s:>14}: {rate(groups[k])}")

    table("neighbour committed in the same step", lambda c: c.neighbour, judged)
    table("tokens committed together", lambda c: min(c.together, 6), judged)
    table("position in block (quarters)", lambda c: (c.position % block) * 4 // block, judged)
    table("position in block (first/rest)", lambda c: c.position % block == 0, judged)
    bins = (0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999, 1.01)

    def conf_bin(c):
        i = next(i for i in range(len(bins) - 1) if c.confidence < bins[i + 1])
        return f"[{bins[i]}, {bins[i + 1]})"

    table("confidence", conf_bin, judged)
    multi = [(c, b) for c, b in judged if c.together > 1]
    table("confidence, multi-token steps only", conf_bin, multi)
    table("neighbour, multi-token steps only", lambda c: c.neighbour, multi)
    flipped = [c for c in firsts if ref_ok[c.problem] and not ok[c.problem]]
    print(f"\nfirst differing token of the {len(flipped)} right->wrong problems:")
    print(f"  committed with a neighbour in the same step: {rate([c.neighbour for c in flipped])}")
    print(f"  in a multi-token step: {rate([c.together > 1 for c in flipped])}")
    print(f"  at the block's first column: {rate([c.position % block == 0 for c in flipped])}")
    conf = sorted(c.confidence for c in flipped)
    if conf:
        print(f"  confidence median {conf[len(conf) // 2]:.3f}, min {conf[0]:.3f}")
    if args.json:
        raw = {"first": first, "ok": ok, "ref_ok": ref_ok, "served": served}
        with open(args.json, "w") as f:
            json.dump(raw, f)


if __name__ == "__main__":
    main()
