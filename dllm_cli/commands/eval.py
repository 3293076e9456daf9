"""`dllm eval`: exact-match accuracy on a problem set under any decoding settings.

The built-in held-out TinyGSM sets (`--split`), or any GSM8K-style JSONL file (`--data`);
docs/usage.md says how answers are read and what the records hold.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from dllm_cli import options as opt
from dllm_cli.commands.common import check_output, cli_errors, progress_bar, stderr
from dllm_cli.commands.split import ExpertParallel, TensorParallel, leads, split_runtime
from dllm_cli.errors import InputError, UsageError
from dllm_cli.families import FAMILIES
from dllm_cli.family_settings import summary_line

if TYPE_CHECKING:  # torch and the models: imported by the command (cli.py)
    from dllm_cli.evaluate import Score
    from dllm_cli.problems import BadLine
    from dllm_cli.runtime import Runtime


def eval_report(
    rt: Runtime, score: Score, shots: int, batch_size: int, start: int, split: str | None
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
        "family": rt.loaded.family,
        "settings": rt.settings.to_dict(),
    }


def print_summary(report: dict) -> None:
    s, n = report["settings"], report["n"]
    guide = f"guide {report['guide']['accept']}" if report["guide"] else "no guide"
    what = f"held-out TinyGSM {report['split']}" if report["split"] else report["data"]
    guided = f" + {report['guide_forwards']} guide" if report["guide"] else ""
    lines = [f"accuracy  {report['accuracy']:.3f}  ({report['correct']}/{n} {what}, "
             f"{report['shots']}-shot)"]  # fmt: skip
    if report["restated"] is not None:
        lines.append(f"restated  {report['restated']}/{n} answers repeat every number and name "
                     "of their question")  # fmt: skip
    lines += [  # answer tokens, as bench counts them (the padding past an answer is no output)
        f"speed     {report['tokens_per_second']:.1f} tok/s (answer tokens up to their end)",
        f"forwards  {report['forwards']}{guided}  ({report['tokens_per_forward']:.2f} tokens "
        f"per forward), {report['seconds']:.2f} s, batch {report['batch_size']}",
        f"settings  {summary_line(FAMILIES[report['family']], s)} {guide}",
    ]
    out = Console(highlight=False, soft_wrap=True)
    for line in lines:
        out.print(line)
    if report["mask_violations"]:
        out.print(f"{report['mask_violations']} answers still held a mask token", style="bold red")


def write_records(path: Path, score: Score, bad: list[BadLine], from_data: bool) -> None:
    """One JSON line per problem, then one per malformed line."""
    from dllm_cli.evaluate import records

    rows = [*records(score, line_numbers=from_data), *(b.record() for b in bad)]
    try:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot write --records {path}: {e.strerror or e}") from None


def report_bad_lines(bad: list[BadLine]) -> None:
    """Each malformed line on stderr, then exit 4 (the problems were still scored)."""
    for b in bad:
        stderr.print(f"{b.file}:{b.line}: {b.error}", markup=False, highlight=False)
    raise InputError(f"{len(bad)} malformed line(s) not scored (records above)")


@opt.shared("model", "guide", "decode")
def eval_command(
    n: Annotated[
        int | None,
        opt.evaluation(
            "Problems to solve (default: 100 of a built-in set, every problem of --data).",
            "--n",
            "-n",
        ),
    ] = None,
    shots: opt.Shots = 5,
    batch_size: opt.BatchSize = 1,
    start: opt.Start = 0,
    split: Annotated[
        str | None,
        opt.evaluation(
            "Built-in held-out set: narrow (default) | wide | rich | hand | hand2"
            " (docs/models.md).",
            show_default=False,
        ),
    ] = None,
    data: Annotated[
        Path | None,
        opt.evaluation(
            'Score a JSONL file of {"question", "answer"} lines instead (GSM8K format).'
        ),
    ] = None,
    shots_from: Annotated[
        Path | None,
        opt.evaluation(
            "With --data: take the examples from this file (default: the data file's first"
            " --shots problems, which are then not scored)."
        ),
    ] = None,
    records_to: Annotated[
        Path | None,
        opt.output(
            "Write one JSON line per problem (question, gold, extracted, right, text).", "--records"
        ),
    ] = None,
    warmup: Annotated[bool, opt.evaluation("Untimed one-block decode before timing.")] = True,
    as_json: Annotated[
        bool, opt.output("Print one JSON object instead of the summary.", "--json")
    ] = False,
    per_problem: Annotated[
        bool, opt.output("With --json: add every problem's answer.", "--details")
    ] = False,
    tensor_parallel: TensorParallel = 1,
    expert_parallel: ExpertParallel = False,
    *,
    choices: opt.Choices,
) -> None:
    """Exact-match accuracy on held-out problems or a JSONL file (tokens/s, forwards)."""
    with cli_errors():
        if shots_from is not None and data is None:
            raise UsageError("--shots-from needs --data (built-in sets carry their own examples)")
        if split is not None and data is not None:
            raise UsageError("--split and --data: choose one problem set")
        check_output(records_to, "--records")
        from dllm_cli.evaluate import details

        with split_runtime(choices, tensor_parallel, expert_parallel) as rt:
            report, score, bad = solve(rt, n, shots, start, split, data, shots_from, batch_size,
                                       warmup)  # fmt: skip
        if not leads():  # another rank of --tensor-parallel: rank 0 reports
            if bad:
                raise typer.Exit(InputError.exit_code)
            return
        if records_to is not None:
            write_records(records_to, score, bad, from_data=data is not None)
        if as_json:
            if per_problem:
                report["problems"] = details(score)
            typer.echo(json.dumps(report))
        else:
            print_summary(report)
        if bad:
            report_bad_lines(bad)


def solve(
    rt: Runtime,
    n: int | None,
    shots: int,
    start: int,
    split: str | None,
    data: Path | None,
    shots_from: Path | None,
    batch_size: int,
    warmup: bool,
) -> tuple[dict, Score, list[BadLine]]:
    """The problems read, decoded and scored: (the report, the score, the malformed lines)."""
    from dllm_cli.evaluate import evaluate, from_file, held_out

    bad: list[BadLine] = []
    if data is None:
        split = split or "narrow"
        tasks = held_out(rt.encode, 100 if n is None else n, shots, start, split)
    else:
        tasks, bad = from_file(rt.encode, data, n, shots, start, shots_from)
    with progress_bar("[bold]solving[/]", leads()) as bar:
        advance = partial(bar.advance, bar.add_task("eval", total=len(tasks)))
        warm = warmup and bool(tasks)
        score = evaluate(rt, tasks, batch_size=batch_size, warmup=warm, on_batch=advance)
    report = eval_report(rt, score, shots, batch_size, start, None if data else split)
    if data is not None:
        report |= {"data": str(data), "shots_from": str(shots_from or data)}
        report["errors"] = [b.record() for b in bad]
    return report, score, bad
