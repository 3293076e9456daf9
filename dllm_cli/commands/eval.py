"""`dllm eval`: exact-match accuracy on held-out TinyGSM problems under any decoding settings."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dllm_cli import options as opt
from dllm_cli.commands.common import cli_errors, load_runtime, stderr
from dllm_cli.evaluate import Score, details, evaluate
from dllm_cli.runtime import Runtime

EVAL = "Evaluation"
OUTPUT = "Output"

N = Annotated[
    int, typer.Option("--n", "-n", help="Held-out problems to solve.", rich_help_panel=EVAL)
]
Shots = Annotated[int, typer.Option(help="Solved examples in each prompt.", rich_help_panel=EVAL)]
BatchSize = Annotated[
    int,
    typer.Option(help="Problems decoded together (1: the papers' setting).", rich_help_panel=EVAL),
]
Start = Annotated[int, typer.Option(help="First held-out problem (0..999).", rich_help_panel=EVAL)]
Accept = Annotated[
    str | None,
    typer.Option(
        help="Guide acceptance rule: exact | topk:K | prob:P (default: the profile's).",
        rich_help_panel=opt.DECODE,
    ),
]


def open_for_eval(
    profile: str | None, flags: dict, guide: bool | None, accept: str | None
) -> Runtime:
    """The runtime as generate opens it (guide rules included), plus --accept."""
    overrides = opt.overrides(**flags)
    if accept is not None:
        overrides["accept"] = accept
    return load_runtime(profile, overrides, guide)


def progress() -> Progress:
    """A transient bar on stderr (nothing when stderr is not a terminal)."""
    return Progress(
        TextColumn("[bold]solving[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr,
        transient=True,
        disable=not stderr.is_terminal,
    )


def eval_report(rt: Runtime, score: Score, shots: int, batch_size: int, start: int) -> dict:
    """The `--json` object: the shared numbers, then what produced them."""
    guide = None
    if rt.guide is not None:
        guide = {"path": str(rt.guide.path), "accept": rt.profile.guide.accept}
    return {
        **score.summary(),
        "shots": shots,
        "start": start,
        "batch_size": batch_size,
        "gen_length": rt.settings.gen_length,
        "profile": rt.profile.name,
        "model": str(rt.loaded.path),
        "guide": guide,
        "settings": rt.settings.to_dict(),
    }


def print_summary(report: dict) -> None:
    out = Console(highlight=False, soft_wrap=True)
    s = report["settings"]
    guide = f"guide {report['guide']['accept']}" if report["guide"] else "no guide"
    out.print(
        f"accuracy  {report['accuracy']:.3f}  ({report['correct']}/{report['n']} held-out "
        f"TinyGSM, {report['shots']}-shot)"
    )
    out.print(
        f"speed     {report['tokens_per_second']:.1f} tok/s (answer tokens up to their end), "
        f"{report['gen_tokens_per_second']:.1f} tok/s over all {report['gen_length']} positions"
    )
    guided = f" + {report['guide_forwards']} guide" if report["guide"] else ""
    out.print(
        f"forwards  {report['forwards']}{guided}  ({report['tokens_per_forward']:.2f} tokens "
        f"per forward), {report['seconds']:.2f} s, batch {report['batch_size']}"
    )
    out.print(
        f"settings  cache={s['cache']} unmask={s['unmask']} block={s['block_length']} "
        f"steps={s['steps'] or s['gen_length']} early_stop={s['early_stop']} {guide}"
    )
    if report["mask_violations"]:
        out.print(f"{report['mask_violations']} answers still held a mask token", style="bold red")


def eval_command(
    n: N = 100,
    shots: Shots = 5,
    batch_size: BatchSize = 1,
    start: Start = 0,
    warmup: Annotated[
        bool,
        typer.Option(help="Untimed one-block decode before timing.", rich_help_panel=EVAL),
    ] = True,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json", help="Print one JSON object instead of the summary.", rich_help_panel=OUTPUT
        ),
    ] = False,
    per_problem: Annotated[
        bool,
        typer.Option(
            "--details", help="With --json: add every problem's answer.", rich_help_panel=OUTPUT
        ),
    ] = False,
    profile: opt.Profile = None,
    model: opt.ModelPath = None,
    device: opt.Device = None,
    dtype: opt.Dtype = None,
    chat: opt.Chat = None,
    compile: opt.Compile = None,
    guide: opt.Guide = None,
    accept: Accept = None,
    gen_length: opt.GenLength = None,
    block_length: opt.BlockLength = None,
    steps: opt.Steps = None,
    cache: opt.Cache = None,
    unmask: opt.Unmask = None,
    confidence: opt.Confidence = None,
    threshold: opt.Threshold = None,
    factor: opt.Factor = None,
    temperature: opt.Temperature = None,
    top_p: opt.TopP = None,
    top_k: opt.TopK = None,
    cfg_scale: opt.CfgScale = None,
    seed: opt.Seed = None,
    early_stop: opt.EarlyStop = None,
) -> None:
    """Exact-match accuracy on held-out TinyGSM problems (tokens/s, forwards) with any settings."""
    flags = {k: v for k, v in locals().items() if k in opt.FLAG_KEYS}
    with cli_errors():
        rt = open_for_eval(profile, flags, guide, accept)
        with progress() as bar:
            task = bar.add_task("eval", total=n)
            score = evaluate(
                rt,
                n,
                shots,
                batch_size=batch_size,
                start=start,
                warmup=warmup,
                on_batch=lambda done: bar.advance(task, done),
            )
        report = eval_report(rt, score, shots, batch_size, start)
        if as_json:
            if per_problem:
                report["problems"] = details(score)
            typer.echo(json.dumps(report))
        else:
            print_summary(report)
