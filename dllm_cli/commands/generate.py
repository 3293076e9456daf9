"""`dllm generate`: prompts in (an argument, or stdin lines), answers out on stdout, nothing else.

Batch mode (prompt "-" or omitted with stdin piped) runs the batch pipeline (dllm_cli/batch.py)
on stdin; under torchrun it runs on each rank's share of the lines (dllm_cli/distributed/); those
run paths are in generate_runs.py. This module decides what goes to stdout and stderr, and the
exit code.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Annotated

import typer

from dllm_cli import options as o
from dllm_cli.commands.common import (
    USAGE,
    cli_errors,
    fail,
    load_runtime,
    note,
    show_prompt,
    stdin_is_terminal,
    stdout_is_terminal,
    write,
)
from dllm_cli.commands.generate_runs import (
    load_on_rank,
    run_batch,
    run_sharded,
    run_split,
    run_split_prompt,
    tensor_shards,
)
from dllm_cli.commands.split import ExpertParallel, check_experts, parallelism
from dllm_cli.errors import InputError
from dllm_cli.families import FAMILIES
from dllm_cli.family_settings import refuse_feature
from dllm_cli.prompt_text import escape_bytes, from_argv

if TYPE_CHECKING:  # the decoding modules (torch) are imported by the command, not at start-up
    from dllm_cli.batch import Pipeline
    from dllm_cli.runtime import Runtime

JsonInput = Annotated[
    bool,
    o.in_panel(o.INPUT)(
        'Batch mode: each stdin line is a JSON object with a "prompt" field.', "--json-input"
    ),
]
Prompt = Annotated[
    str | None,
    typer.Argument(
        help="The prompt. '-' (or none, with stdin piped) reads one prompt per stdin line.",
        show_default=False,
    ),
]
JsonCanvas = Annotated[
    bool,
    o.output(
        "Implies --json; each object also carries canvas_ids: every generated position "
        "(padding included), before the answer is cut.",
        "--json-canvas",
    ),
]
Logprobs = Annotated[
    int | None,
    o.output(
        "Implies --json; each object also carries logprobs: per answer token its "
        "log-probability under the step that committed it and that step's K most likely "
        "tokens (unguided decodes; docs/scoring.md).",
        "--logprobs",
        metavar="K",
        show_default=False,
    ),
]
TensorParallel = Annotated[
    int,
    parallelism(
        "Under torchrun: split the model over N ranks (heads, MLP columns, vocabulary); "
        "every rank decodes every prompt, rank 0 writes them (docs/tensor-parallel.md). LLaDA, "
        "Dream, LLaDA-MoE, SDAR and LLaDA2.x; a multiple of N processes runs replicas of N "
        "ranks, each decoding its share of the stdin lines.",
        "--tensor-parallel",
    ),
]
JsonSchema = Annotated[
    str | None,
    o.output(
        "Every answer is JSON valid under this JSON schema (compact: no free whitespace), "
        "decoded through the grammar engine llguidance (docs/structured-output.md).",
        "--json-schema",
        metavar="FILE",
        show_default=False,
    ),
]
GrammarFile = Annotated[
    str | None,
    o.output(
        "Every answer matches this grammar: llguidance's Lark dialect (start: the "
        "answer), or a regular expression if FILE ends in .regex.",
        "--grammar",
        metavar="FILE",
        show_default=False,
    ),
]


@o.shared("model", "decode", "guide", "batch")
def generate_command(
    prompt: Prompt = None,
    *,
    choices: o.Choices,
    stats: o.Stats = False,
    json_out: o.Json = False,
    batch_size: o.BatchSize = 8,
    json_input: JsonInput = False,
    json_canvas: JsonCanvas = False,
    logprobs: Logprobs = None,
    verbose_prompt: o.VerbosePrompt = False,
    tensor_parallel: TensorParallel = 1,
    expert_parallel: ExpertParallel = False,
    json_schema: JsonSchema = None,
    grammar: GrammarFile = None,
) -> None:
    """Generate an answer to PROMPT (or to every line of stdin) and print it on stdout.

    The built-in model (the default profile) is a 1.6M-parameter toy trained only on synthetic grade-school math word problems (TinyGSM): right on all 100 held-out problems of its training generator (4-shot), but on only 62 and 42 of two sets of 100 questions written by hand (0-shot; docs/models.md). It is not a general assistant: a greeting or a fact question gets confident nonsense. For real use, choose a profile that points at a real checkpoint (dllm profiles) or give --model PATH.

    Batch mode ('-', or no PROMPT with stdin piped): output line N answers input line N. A bad line gets an error record (--json: {"line", "prompt", "error"}, or {"line", "raw", "error"} for a line that is not UTF-8, its bytes shown as \\xNN; text: an empty line, the reason on stderr) and the exit code is 4 at the end. Text mode writes newlines inside an answer as \\n; --json keeps the exact text.

    A prompt is UTF-8 text: control characters other than tab, newline and carriage return (NUL, ESC, ...) make it a bad line. Special token strings in it (<|eot_id|>, <|mdm_mask|>, ...) are read as plain text: only the chat template writes special tokens.
    """
    with cli_errors():
        from dllm_cli import distributed
        from dllm_cli.batch import Pipeline, check_logprobs

        job = distributed.Job.from_env()
        leader = job is None or job.rank == 0  # the process that reads stdin and writes stdout
        batch = prompt is None or prompt == "-"
        check_experts(tensor_parallel, expert_parallel)
        shards = (
            None if tensor_parallel == 1 else tensor_shards(job, tensor_parallel, expert_parallel)
        )
        split_prompt = shards is not None and shards.replicas == 1 and not batch
        if job is not None and not batch and not split_prompt:
            raise fail(
                "under torchrun, prompts come from stdin: give '-' and pipe them (one prompt "
                "as an argument runs under --tensor-parallel N over N processes)",
                USAGE,
            )
        if batch and leader and stdin_is_terminal():
            raise fail(
                "no prompt: give one as an argument, or pipe prompts on stdin (one per line)", USAGE
            )
        if json_input and not batch:
            raise fail("--json-input reads prompts from stdin: give '-' instead of a prompt", USAGE)
        if logprobs is not None and not 0 <= logprobs <= 20:
            raise fail(f"--logprobs must be in 0..20 (got {logprobs})", USAGE)
        source = grammar_source(json_schema, grammar)
        defaulted = choices.guide is None  # the profile's guide would have been loaded
        if source is not None and defaulted:  # the grammar verifies the drafts: no guide
            choices = replace(choices, guide=False)  # unless --guide (grammar_committer.py)
        if job is None:
            runtime = load_runtime(choices, slots=batch_size)
        else:
            runtime = load_on_rank(job, choices, shards)
        if source is not None:
            from dllm_cli.decoding.grammar import compile_grammar, vocab_of

            if defaulted and runtime.profile.guide is not None and job is None:
                note("the grammar verifies the drafts: decoding without the profile's guide")
            family = FAMILIES[runtime.loaded.family]
            refuse_feature(family, "grammar", "--json-schema" if json_schema else "--grammar")
            runtime.grammar = compile_grammar(*source, vocab_of(runtime))
            runtime.committer()  # refused here (one line) when the unmask rule cannot follow it
        json_out = json_out or json_canvas or logprobs is not None
        pipeline = Pipeline(runtime, batch_size, json_out, json_input, canvas=json_canvas)
        pipeline.logprobs = logprobs
        if logprobs is not None:
            check_logprobs(runtime)
        if batch and leader:
            note_static(pipeline)
        shown, failed = runtime if verbose_prompt else None, 0
        if split_prompt:
            decode = partial(run_single, runtime, prompt, pipeline, verbose_prompt)
            run_split_prompt(job, shards, stats, decode)
        elif shards is not None and shards.replicas == 1:
            failed = run_split(job, pipeline, shards, shown, stats)
        elif job is not None:
            failed = run_sharded(job, pipeline, shown, shards)
        elif batch:
            failed = run_batch(pipeline, shown)
        else:
            run_single(runtime, prompt, pipeline, verbose_prompt)
        if stats and leader:
            note(pipeline.totals.line())
        if failed:
            total = pipeline.totals.prompts + failed
            raise fail(f"{failed} of {total} prompts failed", InputError.exit_code)


def grammar_source(schema: str | None, grammar: str | None) -> tuple[str, str] | None:
    """(kind, text) of --json-schema or --grammar FILE; None without either."""
    if schema is not None and grammar is not None:
        raise fail("give --json-schema or --grammar, not both", USAGE)
    path = schema if schema is not None else grammar
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise fail(f"cannot read {path}: {e.strerror or e}", USAGE) from None
    if schema is not None:
        return "json_schema", text
    from pathlib import Path

    from dllm_cli.decoding.grammar import GRAMMAR_SUFFIXES

    return GRAMMAR_SUFFIXES.get(Path(path).suffix, "lark"), text


def note_static(pipeline: Pipeline) -> None:
    """One line on stderr when continuous batching, asked for, falls back to static batches."""
    rt = pipeline.runtime
    asked = rt.provenance.get("decode.batching", "default") != "default"
    reason = rt.static_reason()
    if asked and rt.settings.batching == "continuous" and reason is not None:
        note(f"continuous batching falls back to static batches: {reason}")


def run_single(
    runtime: Runtime, arg: str, pipeline: Pipeline, verbose: bool = False, shown: bool = True
) -> None:
    """Decode one prompt; on a terminal, print text as soon as its prefix is final. Not
    `shown` (a tensor-parallel rank but the first): the same decode, nothing written."""
    from dllm_cli.batch import record, solo
    from dllm_cli.decoding import decode_steps
    from dllm_cli.text_stream import TextStream

    json_out, totals = pipeline.json_out and shown, pipeline.totals
    put = write if shown else lambda text: None
    said = None
    try:
        prompt = from_argv(arg)
        said = {"prompt": prompt}
        ids = runtime.prepare(prompt)
    except InputError as e:
        said = said or {"raw": escape_bytes(os.fsencode(arg))}  # not UTF-8: its bytes
        if json_out:  # --json: the record says what failed; the error line follows
            put(json.dumps({**said, "error": str(e)}) + "\n")
        raise
    if verbose and shown:
        show_prompt(runtime, ids)
    model, special = runtime.loaded.model, runtime.loaded.special
    if pipeline.logprobs is not None:  # the engine's record, with each token's logprobs
        return put(json.dumps(logprob_record(runtime, prompt, ids, pipeline)) + "\n")
    run = decode_steps(model, special, [ids], runtime.settings, committer=runtime.committer())
    stream = None
    if shown and stdout_is_terminal() and not json_out:
        stream = TextStream(runtime.settings.gen_length, runtime.text)
    for event in run:
        if stream is not None:
            put(stream.feed(event))
    result = run.result()
    text = runtime.text(result.tokens[0])
    totals.add(result, special.stop)
    if json_out:
        line = record(prompt, text, solo(result), special.stop, pipeline.canvas)
        put(json.dumps(line) + "\n")
    elif stream is not None:
        put(stream.finish(text))
    else:
        put(text + "\n")


def logprob_record(runtime: Runtime, prompt: str, ids: list[int], pipeline: Pipeline) -> dict:
    """One prompt decoded alone with --logprobs: its --json record and logprobs."""
    from dllm_cli.batch import record, token_logprobs
    from dllm_cli.decoding.run import open_engine

    model, special = runtime.loaded.model, runtime.loaded.special
    engine = open_engine(model, special, runtime.settings, runtime.committer(), slots=1)
    engine.add(ids, logprobs=pipeline.logprobs)
    while engine.has_work:
        finished = engine.step().finished
    done = finished[0]
    pipeline.totals.add_answer(done.tokens, special.stop)
    pipeline.totals.add_run(engine.forwards, engine.guide_forwards, engine.steps, engine.seconds)
    shown = record(prompt, runtime.text(done.tokens), done, special.stop, pipeline.canvas)
    return shown | {"logprobs": token_logprobs(runtime, done, pipeline.logprobs)}
