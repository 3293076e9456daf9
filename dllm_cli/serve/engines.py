"""Settings groups -> engines: which requests may share a canvas, and building the engine.

A group is everything an engine is built with: the full DecodeSettings (the engine takes no
per-request settings yet, so sampling settings are part of the group too) and whether the
guide verifies drafts. Two requests share an engine, and so a batch, only when every setting
is equal, which is what keeps each answer equal to `dllm generate`'s with those settings.
Every group refills a finished request's slot on the next step (continuous admission, guided
decoding included), except where the model cannot (DiffusionGemma: whole batches).
"""

from __future__ import annotations

from dataclasses import dataclass

from dllm_cli.decoding import Engine, gemma, open_engine
from dllm_cli.decoding.answer import answer_length
from dllm_cli.decoding.slots import static_reason
from dllm_cli.errors import InputError
from dllm_cli.runtime import Runtime, origin
from dllm_cli.serve.protocol import Job
from dllm_cli.settings import DecodeSettings


@dataclass(frozen=True)
class Group:
    settings: DecodeSettings
    guided: bool


@dataclass
class Pool:
    """One group's engine."""

    group: Group
    engine: Engine


@dataclass(frozen=True)
class Counts:
    """What a request cost (Finished has the same fields)."""

    forwards: int
    guide_forwards: int
    steps: int


def group_of(job: Job) -> Group:
    return Group(job.settings, job.guide)


def check_settings(runtime: Runtime, settings: DecodeSettings) -> DecodeSettings:
    """The family's own refusals, as `open_runtime` makes them for CLI flags."""
    where = origin({})
    if runtime.loaded.architecture == gemma.FAMILY:
        return gemma.check_settings(settings, runtime.loaded.model.canvas_length, where)
    gemma.check_masked(settings, runtime.loaded.architecture, where)
    return settings


def check_length(runtime: Runtime, ids: list[int], settings: DecodeSettings) -> None:
    """A prompt that leaves no room for max_tokens in the model's context: InputError."""
    if not ids:
        raise InputError("empty prompt (it encodes to no tokens)")
    context, gen = runtime.loaded.model.context_length, settings.gen_length
    if runtime.loaded.architecture == gemma.FAMILY:  # whole canvases are denoised
        gen = gemma.denoised_length(gen, runtime.loaded.model.canvas_length)
    if len(ids) + gen > context:
        fix = (
            f"a prompt of at most {context - gen} tokens, or a smaller max_tokens"
            if context > gen
            else f"max_tokens below {context}"
        )
        raise InputError(
            f"prompt too long: {len(ids)} tokens + max_tokens {gen} exceeds the model's "
            f"context of {context} tokens (use {fix})"
        )


def build(runtime: Runtime, group: Group, slots: int) -> Pool:
    committer = runtime.committer() if group.guided else None
    model, special = runtime.loaded.model, runtime.loaded.special
    whole = group.settings.batching == "static" or static_reason(model, group.guided)
    admission = "static" if whole else "continuous"
    engine = open_engine(
        model, special, group.settings, committer, slots=slots, admission=admission
    )
    return Pool(group, engine)


def stop_early(engine: Engine, rid: int) -> tuple[list[int], Counts]:
    """A request a stop string has ended: its committed tokens and counts, then aborted."""
    tokens = engine.progress(rid)
    request = engine.requests[rid]
    counts = Counts(request.forwards, request.guide_forwards, request.steps)
    engine.abort(rid)
    return tokens, counts


def completion_tokens(tokens: list[int], stop: list[int] | tuple[int, ...]) -> int:
    """Tokens the answer took (through its first stop token), as throughput counts them."""
    return answer_length(tokens, stop)
