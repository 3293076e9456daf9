"""`dllm bench`'s other modes: --frontier, --batching-compare and --serve, each run and reported.

Split from bench.py (the strategy table, the default mode) so the command stays a thin layer.
Under --tensor-parallel every rank runs --frontier's and --batching-compare's decodes (the
same collectives in the same order) and rank 0 alone reports them.
"""

from __future__ import annotations

from dataclasses import replace

import typer

from dllm_cli import frontier
from dllm_cli.bench import STRATEGIES, settings_for
from dllm_cli.commands.common import fail, stderr
from dllm_cli.commands.split import leads
from dllm_cli.errors import UsageError, write_json, write_text
from dllm_cli.frontier import parse_frontier, run_frontier


def run_frontier_mode(
    rt, text, lengths, shots, n, start, batch_size, block_length, window, json_path,
    markdown_path, plot_path,
) -> None:  # fmt: skip
    """`--frontier`: every rule's sweep on the same problems; table on stdout, files on request."""
    if len(lengths) != 1:
        raise UsageError("--frontier measures one --gen-length at a time")
    points = parse_frontier(text)
    base = replace(
        rt.settings, gen_length=lengths[0], block_length=block_length, suffix_window=window
    )
    from dllm_cli.evaluate import held_out

    tasks = held_out(rt.encode, n, shots, start)

    def report(r: dict) -> None:
        if leads():
            stderr.print(frontier.progress_line(r), highlight=False)

    records = run_frontier(rt, tasks, points, base, batch_size, on_record=report)
    if not leads():  # another rank of --tensor-parallel: rank 0 reports
        return
    s = base
    title = (
        f"{rt.profile.name}: {n} held-out TinyGSM problems, {shots}-shot, gen {s.gen_length}, "
        f"block {s.block_length}, cache {s.cache}, early stop {s.early_stop}, suffix window "
        f"{s.suffix_window};\nrows at their own pace, {batch_size} at a time"
    )
    typer.echo(title)
    typer.echo(frontier.markdown(records), nl=False)
    write_json(json_path, records)
    markdown_path = markdown_path or (json_path and json_path.with_suffix(".md"))
    if markdown_path is not None:
        write_text(markdown_path, title + "\n\n" + frontier.markdown(records))
    if plot_path is not None:
        frontier.plot(records, plot_path, title)
    bad = sum(r["mask_violations"] for r in records)
    if bad:
        raise fail(f"{bad} answers contained a mask token (a decoder bug; see the table)", 1)


def run_batching_mode(
    rt, name, lengths, shots, n, start, batch_size, block_length, window, rounds, json_path
) -> None:
    """`--batching-compare`: static vs continuous batching with one strategy; table on stdout."""
    from dllm_cli.bench_batching import compare_batching, mixed_shots, table

    usable = [k for k, v in STRATEGIES.items() if rt.guide is not None or not v.guided]
    if name not in usable:
        raise UsageError(f"--batching-compare takes one of: {', '.join(usable)}")
    settings = settings_for(rt.settings, name, lengths[0], block_length, window)
    prompts = mixed_shots(rt.encode, n, shots, start)
    records = compare_batching(
        rt, prompts, settings, batch_size, rounds, report_pass if leads() else None,
        STRATEGIES[name].guided,
    )  # fmt: skip
    if not leads():
        return
    for r in records:
        del r["tokens"]
    print(table(records), end="")
    write_json(json_path, records)


def report_pass(r: dict) -> None:
    stderr.print(
        f"{r['batching']:>10} round {r['round']}: {r['prompts_per_second']:.3f} prompts/s, "
        f"{r['steps']} steps, {r['forwards']} forwards, {r['row_columns'] / 1e3:.1f}k "
        f"row-columns, {r['identical']}/{r['prompts']} identical",
        highlight=False,
    )


def bench_serve(rt, n: int, concurrency: int, cancel: float, slots: int, gen: int, json_path):
    """`--serve`: the server under load (dllm_cli/serve/load.py); slots: --batch-size, at least
    --concurrency."""
    import dataclasses

    from dllm_cli.serve import load

    rt.settings = dataclasses.replace(rt.settings, gen_length=gen)
    records = load.run(rt, n, concurrency, cancel, max(slots, concurrency), report_serve)
    write_json(json_path, records)


def report_serve(r: dict) -> None:
    """One line per pass on stdout."""
    same = f", identical {r['identical']}" if "identical" in r else ""
    print(
        f"concurrency {r['concurrency']}: {r['requests']} requests ({r['cancelled']} cancelled) "
        f"in {r['seconds']:.2f}s, {r['requests_per_second']:.2f} req/s, "
        f"{r['tokens_per_second']:.1f} tok/s, latency p50 {r['latency_p50']:.3f}s "
        f"p99 {r['latency_p99']:.3f}s, ttft p50 {r['ttft_p50']:.3f}s p99 {r['ttft_p99']:.3f}s, "
        f"lost {r['lost']}, answered twice {r['answered_twice']}{same}, "
        f"rss {r['rss_mb_warm']:.0f} -> {r['rss_mb']:.0f} MB"
        + (f", speedup {r['speedup']:.2f}x" if "speedup" in r else ""),
        flush=True,
    )
