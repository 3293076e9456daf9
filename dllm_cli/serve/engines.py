"""Settings groups -> engines: which requests may share a canvas, and building the engine.

A group is everything an engine is built with: the DecodeSettings less the per-request ones
(lifetimes.py: max_tokens as gen_length, temperature, top_p, top_k, seed go with each request
to `Engine.add`, each row decoding its own length and sampling with its own values and
generator) and whether the guide verifies drafts. Two requests share an engine, and so a
batch, when every engine and schedule setting is equal; each answer is still what `dllm
generate` gives that request alone. DiffusionGemma decodes a static batch with one generation
config, so the settings in it stay part of the group (its length and seed go with each request).
Every group refills a finished request's slot on the next step (continuous admission, guided
decoding included), except where the model cannot (DiffusionGemma: whole batches).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from dllm_cli.decoding import Engine, open_engine
from dllm_cli.decoding.slots import static_reason
from dllm_cli.errors import DllmError
from dllm_cli.families import FAMILIES
from dllm_cli.family_settings import refuse_feature
from dllm_cli.lifetimes import SAMPLING_FIELDS
from dllm_cli.runtime import Runtime, check_family
from dllm_cli.serve.protocol import ApiError, Job
from dllm_cli.settings import DecodeSettings


@dataclass(frozen=True)
class Group:
    settings: DecodeSettings
    guided: bool
    constrained: bool = False  # response_format: each request's grammar verifies its drafts


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


# The engine's own sampling values in a group (every request brings its own to `add`).
ENGINE_SAMPLING = {f.name: f.default for f in fields(DecodeSettings) if f.name in SAMPLING_FIELDS}


def group_of(job: Job, shared: tuple[str, ...] = (), gen_length: int | None = None) -> Group:
    """The engine a job decodes on: its request settings go with it to `Engine.add` but those
    the family's batch shares (`shared`: DiffusionGemma's generation config), which stay part
    of the group. `gen_length`: the engine's own (the server's --gen-length: its canvas is
    sized for it, longer requests widen it)."""
    own = {k: v for k, v in ENGINE_SAMPLING.items() if k not in shared}
    if gen_length is not None:
        own["gen_length"] = gen_length
    return Group(replace(job.settings, **own), job.guide, job.grammar is not None)


def add(pool: Pool, ids: list[int], job: Job, key) -> int:
    """The job into its group's engine, with its own sampling values (and grammar)."""
    rid = pool.engine.add(ids, key=key, settings=job.settings, logprobs=job.logprobs)
    if job.grammar is not None:
        pool.engine.stepper.committer.bind(rid, job.grammar)
    return rid


def checked(runtime: Runtime, job: Job) -> Job:
    """The job past its family's refusals, its response_format compiled (else an ApiError 400
    saying what is wrong)."""
    try:
        check_family(runtime.loaded, job.settings)  # as open_runtime checks the CLI's flags
    except DllmError as e:
        raise ApiError(400, str(e)) from None
    if job.structure is None:
        return job
    from dllm_cli.decoding.grammar import GrammarError, compile_grammar, vocab_of

    family = FAMILIES[runtime.loaded.family]
    # the family table's reason, before any vocabulary is read
    refuse_feature(
        family, "grammar", "response_format", lambda m: ApiError(400, m, "response_format")
    )
    try:
        grammar = compile_grammar(*job.structure, vocab_of(runtime))
    except GrammarError as e:
        raise ApiError(400, f"response_format: {e}", "response_format") from None
    return replace(job, grammar=grammar)


def check_length(runtime: Runtime, ids: list[int], settings: DecodeSettings) -> None:
    """A prompt that leaves no room for max_tokens in the model's context: InputError."""
    runtime.check_room(ids, settings.gen_length, "max_tokens", "max_tokens")


def build(runtime: Runtime, group: Group, slots: int) -> Pool:
    committer = runtime.committer() if group.guided else None
    if group.constrained:  # requests bind their grammars (the guide verifies what they allow)
        from dllm_cli.decoding.grammar_committer import runtime_committer

        committer = runtime_committer(runtime, guided=group.guided)
    model, special = runtime.loaded.model, runtime.loaded.special
    whole = group.settings.batching == "static" or static_reason(model)
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
