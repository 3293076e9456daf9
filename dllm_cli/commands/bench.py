"""`dllm bench`: decoding strategies side by side on held-out TinyGSM problems, in one process."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from dllm_cli import options as opt
from dllm_cli.bench import (
    BASELINE,
    BLOCK_STRATEGIES,
    MARKDOWN_COLUMNS,
    STRATEGIES,
    SUFFIX_WINDOW,
    BenchPlan,
    cells,
    figure,
    markdown_table,
    plot,
    progress_line,
    run_bench,
)
from dllm_cli.commands.bench_modes import bench_serve, run_batching_mode, run_frontier_mode
from dllm_cli.commands.bench_peer import (
    Peer,
    PeerBinary,
    PeerModel,
    PeerPrompt,
    PeerQuant,
    run_peer,
)
from dllm_cli.commands.common import check_output, cli_errors, fail, note, stderr
from dllm_cli.commands.split import ExpertParallel, leads, option, split_runtime
from dllm_cli.errors import UsageError, write_json, write_text
from dllm_cli.families import FAMILIES
from dllm_cli.frontier import SWEEPS
from dllm_cli.peer import PEER_PROMPT

BENCH = "Benchmark"
bench = opt.in_panel(BENCH)
SplitStrategies = Annotated[int, option("every rank runs every strategy, rank 0 prints")]


def split_list(text: str, what: str) -> list[str]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise UsageError(f"--{what} needs at least one value")
    return items


def parse_lengths(text: str) -> list[int]:
    try:
        return [int(x) for x in split_list(text, "gen-length")]
    except ValueError:
        raise UsageError(f"--gen-length takes integers like 256,512 (got {text!r})") from None


# Family.stepper -> the strategies its bench runs unasked, and why (others: every strategy)
OWN_STRATEGIES = {
    "gemma": ((BASELINE,), "decodes with transformers' own sampler: only the baseline applies"),
    "block": (
        BLOCK_STRATEGIES,
        "is block-causal: its exact block cache (prefix) against recompute",
    ),
}


def choose_strategies(text: str | None, has_guide: bool, family: str = "") -> list[str]:
    """The requested names, or every strategy (the guided ones only when a guide is loaded);
    its notes from rank 0 alone (--tensor-parallel)."""
    if text is not None:
        return split_list(text, "strategies")
    stepper = FAMILIES[family].stepper if family in FAMILIES else "masked"
    if stepper in OWN_STRATEGIES:
        names, why = OWN_STRATEGIES[stepper]
        if leads():
            note(f"{family} {why}")
        return list(names)
    names = [n for n, s in STRATEGIES.items() if has_guide or not s.guided]
    if not has_guide and leads():
        note("no guide model loaded: skipping the guided strategies")
    return names


def rich_table(records: list[dict], title: str) -> Table:
    table = Table(title=title)
    for heading, key, _ in MARKDOWN_COLUMNS:
        table.add_column(heading, justify="left" if key == "strategy" else "right")
    for r in records:
        table.add_row(*cells(r), style="red" if r["mask_violations"] else None)
    return table


def preflight(json_path, markdown_path, plot_path) -> None:
    """Refuse unwritable outputs (or a plot without matplotlib) before a long run, not after:
    usage errors, exit 2."""
    beside = json_path.with_suffix(".md") if json_path is not None and not markdown_path else None
    for path, flag in (
        (json_path, "--json"), (markdown_path or beside, "--markdown"), (plot_path, "--plot")
    ):  # fmt: skip
        check_output(path, flag)
    if plot_path is not None:
        figure(1, 1)  # the one matplotlib check (bench.py): a usage error without it


def write_outputs(records: list[dict], json_path, markdown_path, plot_path) -> None:
    """JSON (a list of records), markdown beside it unless given elsewhere, optional plot."""
    write_json(json_path, records)
    markdown_path = markdown_path or (json_path and json_path.with_suffix(".md"))
    if markdown_path is not None:
        write_text(markdown_path, markdown_table(records))
    if plot_path is not None:
        plot(records, plot_path)


@opt.shared(
    "profile", "model", "device", "dtype", "quantize", "chat", "compile", "threads", "accept",
    "on_reject", "verify_chunk", "draft_window", "temperature", "seed", "cache", "early_stop",
    "top_k", "threshold", "kl_history", "wino_verify", "jump_threshold", "credit_alpha",
    "credit_boost", "credit_decay", "edit_threshold", "max_post_steps",
)  # fmt: skip
def bench_command(
    shots: opt.Shots = 5,
    gen_length: Annotated[str, bench("Comma-separated answer lengths.")] = "256",
    strategies: Annotated[
        str | None, bench(f"Comma-separated: {', '.join(STRATEGIES)} (default: all).")
    ] = None,
    reference: Annotated[
        str, bench("Strategy the speedups are measured against (run first).")
    ] = "baseline",
    n: opt.N = 20,
    batch_size: opt.BatchSize = 1,
    start: opt.Start = 0,
    block_length: Annotated[int, bench("Block size for every strategy.")] = 32,
    suffix_window: Annotated[
        int,
        bench(
            "W of the +prune strategies: columns kept past the current block (--frontier: "
            "for every pass, 0: off).",
            min=0,
        ),
    ] = SUFFIX_WINDOW,
    frontier: Annotated[
        str | None,
        bench(
            "Instead: accuracy against answer tokens per forward (batch 1) of each rule "
            f"over a sweep of its parameter, after one token per step: {', '.join(SWEEPS)}, "
            "each optionally with values, e.g. threshold,eb=0.1/0.3 (cache, early stop, top-k, "
            "klass's --threshold and --kl-history: the profile's or the flags')."
        ),
    ] = None,
    prompt_length: Annotated[
        int | None,
        bench(
            "Throughput mode: --n synthetic prompts of this many tokens instead of "
            "TinyGSM problems (any checkpoint; no accuracy)."
        ),
    ] = None,
    warmup: Annotated[bool, bench("Untimed warm-up decode per strategy.")] = True,
    json_path: Annotated[
        Path | None, bench("Write the records here (a JSON list).", "--json")
    ] = None,
    markdown_path: Annotated[
        Path | None, bench("Markdown table (default: beside --json).", "--markdown")
    ] = None,
    plot_path: Annotated[
        Path | None, bench("Throughput vs accuracy figure (.png/.svg).", "--plot")
    ] = None,
    batching_compare: Annotated[
        str | None,
        bench(
            "Instead: static vs continuous batching of --n prompts (problem i with i mod "
            "(--shots + 1) shots) with this strategy, --batch-size slots, the first --gen-length."
        ),
    ] = None,
    rounds: Annotated[
        int, typer.Option(help="--batching-compare, --peer: alternating passes of each.", min=1)
    ] = 1,
    serve: Annotated[
        bool,
        bench(
            "Instead: start a server and send --n chat requests (hand-written questions; "
            "every other streamed) at --concurrency, after the same at concurrency 1.",
            "--serve",
        ),
    ] = False,
    concurrency: Annotated[int, bench("--serve: requests in flight at once.", min=1)] = 8,
    peer: Peer = None,
    peer_binary: PeerBinary = None,
    peer_model: PeerModel = None,
    peer_prompt: PeerPrompt = PEER_PROMPT,
    peer_quant: PeerQuant = None,
    cancel: Annotated[
        float,
        bench(
            "--serve: fraction of the concurrent requests their client cancels mid-stream.",
            min=0.0,
            max=1.0,
        ),
    ] = 0.0,
    tensor_parallel: SplitStrategies = 1,
    expert_parallel: ExpertParallel = False,
    *,
    choices: opt.Choices,
) -> None:
    """Run every decoding strategy on the same held-out problems: accuracy, tok/s, speedup."""
    with cli_errors(), ExitStack() as stack:
        lengths = parse_lengths(gen_length)
        preflight(json_path, markdown_path, plot_path)
        if plot_path is not None and prompt_length is not None:
            raise UsageError("--plot draws accuracy, which --prompt-length runs do not measure")
        from dllm_cli.throughput import bench_inputs

        apart = [flag for flag, on in (("--peer", peer), ("--serve", serve)) if on]
        if tensor_parallel > 1 and apart:  # they measure a peer's binary, an HTTP server
            raise UsageError(
                "--tensor-parallel runs the strategy table, --frontier and --batching-compare, "
                f"not {apart[0]}"
            )
        if peer is not None:
            run_peer(choices, peer, peer_binary, peer_model, peer_prompt, lengths, rounds,
                     json_path, peer_quant)  # fmt: skip
            return
        rt = stack.enter_context(split_runtime(choices, tensor_parallel, expert_parallel))
        if serve:
            bench_serve(rt, n, concurrency, cancel, batch_size, lengths[0], json_path)
            return
        if frontier is not None:
            run_frontier_mode(rt, frontier, lengths, shots, n, start, batch_size, block_length,
                              suffix_window, json_path, markdown_path, plot_path)  # fmt: skip
            return
        if batching_compare is not None:
            run_batching_mode(rt, batching_compare, lengths, shots, n, start, batch_size,
                              block_length, suffix_window, rounds, json_path)  # fmt: skip
            return
        names = choose_strategies(strategies, rt.guide is not None, rt.loaded.family)
        plan = BenchPlan.make(
            names, lengths, shots=shots, block_length=block_length, batch_size=batch_size,
            warmup=warmup, reference=reference, suffix_window=suffix_window,
        )  # fmt: skip
        tasks, measure, what = bench_inputs(rt, n, shots, start, prompt_length)

        def report(r: dict) -> None:
            if leads():
                stderr.print(progress_line(r), highlight=False)

        records = run_bench(rt, tasks, plan, on_record=report, measure=measure)
        if not leads():  # another rank of --tensor-parallel: rank 0 prints
            return
        title = f"{what}, batch {batch_size}"
        out = Console() if Console().is_terminal else Console(width=200)  # no squeezed pipes
        out.print(rich_table(records, title))
        write_outputs(records, json_path, markdown_path, plot_path)
        bad = sum(r["mask_violations"] for r in records)
    if bad:
        raise fail(f"{bad} answers contained a mask token (a decoder bug; see the table)", 1)
