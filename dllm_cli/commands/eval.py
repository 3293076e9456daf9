"""`dllm eval`: exact-match accuracy on held-out TinyGSM problems under any decoding settings."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dllm_cli import options as opt
from dllm_cli.commands.common import cli_errors, load_runtime, stderr

if TYPE_CHECKING:  # torch and the models: imported by the command (cli.py)
    from dllm_cli.runtime import Runtime
    from dllm_cli.tinygsm.evaluate import Score


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
        redirect_stdout=False,  # stdout is for the report, never drawn on the terminal
        redirect_stderr=False,
    )


def eval_report(
    rt: Runtime, score: Score, shots: int, batch_size: int, start: int, split: str
) -> dict:
    """The `--json` object: the shared numbers, then what produced them."""
    guide = None
    if rt.guide is not None:
        g = rt.profile.guide
        guide = {
            "path": str(rt.guide.path), "accept": g.accept, "on_reject": g.on_reject,
            "verify_chunk": g.verify_chunk, "draft_window": g.draft_window,
        }  # fmt: skip
    return {
        **score.summary(),
        "split": split,
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
        f"TinyGSM {report['split']}, {report['shots']}-shot)"
    )
    if report["restated"] is not None:
        out.print(
            f"restated  {report['restated']}/{report['n']} answers repeat every number and "
            "name of their question"
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
        f"steps={s['steps'] or s['gen_length']} early_stop={s['early_stop']}"
        + (f" suffix_window={s['suffix_window']}" if s.get("suffix_window") else "")
        + f" {guide}"
    )
    if report["mask_violations"]:
        out.print(f"{report['mask_violations']} answers still held a mask token", style="bold red")


@opt.shared("model", "guide", "decode")
def eval_command(
    n: opt.N = 100,
    shots: opt.Shots = 5,
    batch_size: opt.BatchSize = 1,
    start: opt.Start = 0,
    split: Annotated[
        str,
        typer.Option(
            help="Held-out set: narrow | wide | rich | hand | hand2 (README: The shipped models).",
            rich_help_panel=opt.EVAL,
        ),
    ] = "narrow",
    warmup: Annotated[
        bool,
        typer.Option(help="Untimed one-block decode before timing.", rich_help_panel=opt.EVAL),
    ] = True,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print one JSON object instead of the summary.",
            rich_help_panel=opt.OUTPUT,
        ),
    ] = False,
    per_problem: Annotated[
        bool,
        typer.Option(
            "--details",
            help="With --json: add every problem's answer.",
            rich_help_panel=opt.OUTPUT,
        ),
    ] = False,
    *,
    choices: opt.Choices,
) -> None:
    """Exact-match accuracy on held-out TinyGSM problems (tokens/s, forwards) with any settings."""
    with cli_errors():
        from dllm_cli.tinygsm.evaluate import details, evaluate

        rt = load_runtime(choices)
        with progress() as bar:
            task = bar.add_task("eval", total=n)
            score = evaluate(
                rt,
                n,
                shots,
                batch_size=batch_size,
                start=start,
                split=split,
                warmup=warmup,
                on_batch=lambda done: bar.advance(task, done),
            )
        report = eval_report(rt, score, shots, batch_size, start, split)
        if as_json:
            if per_problem:
                report["problems"] = details(score)
            typer.echo(json.dumps(report))
        else:
            print_summary(report)
