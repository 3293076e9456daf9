"""The Python API: load a model once, then decode prompts with it.

    from dllm_cli import LLM

    llm = LLM("tiny-gsm-dream")                 # a profile (name or .toml), or LLM(model=folder)
    for c in llm.generate(["1 + 1 = ?"], gen_length=64):
        print(c.text, c.forwards, c.steps)      # every count is that prompt's own
    for piece in llm.stream("2 + 2 = ?"):       # text as it is committed
        print(piece, end="")
    llm.score("2 + 3 = ", "5", samples=64)      # log p("5" | "2 + 3 = "), estimated

Settings are the CLI's (`dllm generate --help`), by their bare names (`gen_length`, `cache`,
`threshold`, ...), and are validated exactly as the CLI validates them: a bad value raises the
same `dllm_cli.errors` exception the CLI turns into its one-line message and exit code.
Settings given to `LLM(...)` hold for every call; those given to a call, for that call only
(the model and guide stay loaded, so they cannot change per call). Per-request settings
(lifetimes.py: gen_length, temperature, top_p, top_k, seed, stop token ids) go to each request
itself, so a call that changes only those decodes on the loaded engine settings and each
answer is what the same request gets alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from dllm_cli import scoring
from dllm_cli.chat import encode_plain
from dllm_cli.decoding.request import check_slots
from dllm_cli.decoding.run import open_engine
from dllm_cli.errors import SettingsError
from dllm_cli.families import FAMILIES
from dllm_cli.family_settings import refuse_feature
from dllm_cli.lifetimes import split
from dllm_cli.profiles import resolve
from dllm_cli.runtime import Runtime, family_settings, given_by, open_runtime
from dllm_cli.serve.conversation import Message, encode_messages
from dllm_cli.text_stream import TextStream


@dataclass(frozen=True)
class Completion:
    """One prompt's answer and what it cost (its own steps, forwards and seconds)."""

    prompt: str
    text: str
    token_ids: list[int]
    forwards: int
    steps: int
    seconds: float
    guide_forwards: int = 0


class LLM:
    """A loaded model (and guide, when its profile has one) with its default settings."""

    def __init__(
        self,
        profile: str | None = None,
        *,
        model: str | None = None,
        guide: bool = True,
        **settings: object,
    ):
        self.profile, self.use_guide = profile, guide
        self.fixed = {"model.path": model} if model is not None else {}
        self.defaults = dict(settings)
        overrides = {**self.fixed, **self.defaults}
        self.runtime = open_runtime(profile, overrides, use_guide=guide, source="call")

    def generate(
        self,
        prompts: str | Sequence[str],
        *,
        batch_size: int = 8,
        json_schema: dict | str | None = None,
        **settings: object,
    ) -> list[Completion]:
        """Answers in prompt order; prompts decode `batch_size` at a time (continuous
        batching unless the settings or the model ask for static batches). `json_schema`:
        every answer is JSON valid under it (docs/structured-output.md; without the guide)."""
        own, rest = self._split(settings)
        rt = self._runtime(rest)
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        ids = [rt.prepare(p, own_length="gen_length" in own) for p in texts]
        engine = self._engine(rt, batch_size, rt.admission(), json_schema)
        for i, x in enumerate(ids):
            engine.add(x, key=i, sampling=own or None)
        done = {}
        while engine.has_work:
            for f in engine.step().finished:
                done[f.key] = f
        return [
            Completion(
                texts[i], rt.text(f.tokens), f.tokens, f.forwards, f.steps, f.seconds,
                f.guide_forwards,
            )
            for i, f in sorted(done.items())
        ]  # fmt: skip

    def stream(self, prompt: str, **settings: object) -> Iterator[str]:
        """The answer's text in pieces, each as soon as every position up to it is committed."""
        own, rest = self._split(settings)
        rt = self._runtime(rest)
        engine = self._engine(rt, 1, "static")
        rid = engine.add(rt.prepare(prompt, "gen_length" in own), sampling=own or None)
        view = TextStream(engine.requests[rid].sampling.gen_length, rt.text, row=rid)
        while engine.has_work:
            out = engine.step()
            if out.event is not None:
                piece = view.feed(out.event)
                if piece:
                    yield piece
            for f in out.finished:
                rest = view.finish(rt.text(f.tokens))[:-1]  # without the CLI's newline
                if rest:
                    yield rest

    def score(
        self, context: str, continuation: str, *, samples: int | None = None,
        batch: int | None = None, seed: int = 0, chat: bool = False,
    ) -> float:  # fmt: skip
        """log p(continuation | context): the family's reference Monte-Carlo estimate
        (scoring.py; the same number for the same seed). The context is raw text unless
        `chat` wraps it in the chat template as a user turn; the continuation's ids are the
        whole text's past the context's."""
        loaded = self.runtime.loaded
        tok = loaded.tokenizer
        if chat:
            head = encode_messages(tok, [Message("user", context)])
            whole = head + tok(continuation, add_special_tokens=False).input_ids
        else:
            head = encode_plain(tok, context)
            whole = encode_plain(tok, context + continuation)
            if whole[: len(head)] != head:  # the context's last token merged with the text
                whole = head + tok(continuation, add_special_tokens=False).input_ids
        model = loaded.model
        return scoring.estimate(
            model, loaded.special.mask, model.family, head, whole[len(head) :],
            samples=samples, batch=batch, seed=seed, cfg=self.runtime.settings.cfg_scale,
            eos=loaded.special.eos,
        ).total  # fmt: skip

    def _engine(self, rt: Runtime, slots: int, admission: str, schema=None):
        check_slots(slots, "batch_size")
        model, special = rt.loaded.model, rt.loaded.special
        committer = rt.committer()
        if schema is not None:
            from dllm_cli.decoding import grammar
            from dllm_cli.decoding.grammar_committer import runtime_committer

            refuse_feature(FAMILIES[rt.loaded.family], "grammar", "json_schema")
            compiled = grammar.compile_grammar("json_schema", schema, grammar.vocab_of(rt))
            committer = runtime_committer(rt, compiled, guided=False)
        return open_engine(model, special, rt.settings, committer, slots=slots, admission=admission)

    def _split(self, settings: dict[str, object]) -> tuple[dict, dict]:
        """(the call's per-request values, the rest); those a family's batch shares
        (DiffusionGemma's generation config: `traits.batch_wide`) build the call's engine."""
        own, rest = split(settings)
        shared = FAMILIES[self.runtime.loaded.family].traits.batch_wide
        rest |= {k: own.pop(k) for k in [*own] if k in shared}
        return own, rest

    def _runtime(self, settings: dict[str, object]) -> Runtime:
        """The loaded runtime with this call's settings, validated as the CLI validates."""
        if not settings:
            return self.runtime
        rt = self.runtime
        overrides = {**self.fixed, **self.defaults, **settings}
        prof, provenance = resolve(self.profile, overrides)
        provenance = given_by(provenance, "call")
        if prof.model != rt.profile.model or (prof.guide is None) != (rt.profile.guide is None):
            raise SettingsError("model and guide settings are fixed when the LLM is built")
        if prof.guide is not None and prof.guide.path != rt.profile.guide.path:
            raise SettingsError("model and guide settings are fixed when the LLM is built")
        decode, notes = family_settings(prof, provenance, rt.loaded, self.use_guide)
        return replace(rt, profile=prof, provenance=provenance, settings=decode, notes=notes)
