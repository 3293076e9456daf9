"""A resolved run: profile + CLI overrides -> loaded model (and guide), settings, prompt codec.

Commands build one Runtime and hand it prompts; everything model-specific (chat template,
special tokens, what counts as the end of an answer) lives here, not in the commands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dllm_cli.chat import Frame, encode_chat, encode_plain, frame, pieces
from dllm_cli.decoding import Committer, answer_tokens, gemma
from dllm_cli.decoding.guided import GuidedCommitter, GuideRules
from dllm_cli.decoding.slots import static_reason
from dllm_cli.errors import DllmError, InputError, ModelLoadError, SettingsError
from dllm_cli.families import FAMILIES, family_for_config
from dllm_cli.family_settings import check_refused
from dllm_cli.folders import read_config_json, resolve_path
from dllm_cli.models.compiled import enable_compile
from dllm_cli.models.loading import (
    LoadedModel,
    add_stop_tokens,
    load_model,
    resolve_device,
    resolve_dtype,
)
from dllm_cli.profile_paths import require_model_folder
from dllm_cli.profiles import Profile, resolve
from dllm_cli.prompt_text import check_text
from dllm_cli.settings import DecodeSettings

if TYPE_CHECKING:  # the guide is a transformers model: imported when a profile uses one
    from dllm_cli.decoding.grammar import Grammar
    from dllm_cli.models.guide import GuideModel
    from dllm_cli.models.sharding import Shards


@dataclass
class Runtime:
    """Everything a command needs to turn prompts into answers."""

    profile: Profile
    provenance: dict[str, str]
    settings: DecodeSettings
    loaded: LoadedModel
    guide: GuideModel | None = None
    chat: bool = True
    notes: list[str] = field(default_factory=list)  # adjustments worth telling the user
    grammar: Grammar | None = None  # every answer follows it (grammar_committer.py)
    _frame: Frame | None = field(default=None, init=False, repr=False)

    def encode(self, prompt: str) -> list[int]:
        """Prompt text -> token ids (inside the chat template unless chat is off); a special
        token's string in the prompt is tokenized as text (chat.py), so only the template (or
        the tokenizer's own BOS) writes special tokens."""
        check_text(prompt)
        if not prompt.strip():
            raise InputError("empty prompt")
        tok = self.loaded.tokenizer
        if not self.chat:
            return encode_plain(tok, prompt)
        if self._frame is None:
            if not tok.chat_template:
                raise InputError("this model's tokenizer has no chat template; use --no-chat")
            self._frame = frame(tok)
        return encode_chat(tok, prompt, self._frame)

    def pieces(self, ids: list[int]) -> list[str]:
        """Each prompt token's text, special tokens by name (what --verbose-prompt shows)."""
        return pieces(self.loaded.tokenizer, ids)

    def prepare(self, prompt: str, own_length: bool = False) -> list[int]:
        """Encoded prompt, refused here (not mid-batch) when it is empty or too long (with
        `own_length`, a request's own gen_length: the engine checks its room as it queues)."""
        ids = self.encode(prompt)
        gen = 0 if own_length else self.settings.gen_length
        self.check_room(ids, gen, "gen_length", "--gen-length")
        return ids

    def check_room(self, ids: list[int], gen: int, name: str, flag: str) -> None:
        """An empty prompt, or one that leaves no room for `gen` tokens in the model's
        context, is an InputError naming the setting (`name`, as the caller spells it)."""
        if not ids:
            raise InputError("empty prompt (it encodes to no tokens)")
        context = self.loaded.model.context_length
        if FAMILIES[self.loaded.family].traits.whole_canvases:  # DiffusionGemma's canvases
            gen = gemma.denoised_length(gen, self.loaded.model.canvas_length)
        if len(ids) + gen > context:
            fix = (
                f"a prompt of at most {context - gen} tokens, or a smaller {flag}"
                if context > gen
                else f"{flag} below {context}"
            )
            raise InputError(
                f"prompt too long: {len(ids)} tokens + {name} {gen} exceeds the model's "
                f"context of {context} tokens (use {fix})"
            )

    def committer(self) -> Committer | None:
        """The guided-diffusion committer when a guide is loaded, else None (the settings' rule);
        with a grammar, the grammar's. Pass it as `committer=`; it serves decodes one at a time."""
        if self.grammar is not None:
            from dllm_cli.decoding.grammar_committer import runtime_committer

            return runtime_committer(self, self.grammar)
        return self.guide_committer()

    def guide_committer(self) -> GuidedCommitter | None:
        """The AR guide's committer (None: no guide is loaded)."""
        if self.guide is None:
            return None
        g = self.profile.guide
        rule, arg = g.acceptance()
        rules = GuideRules(rule, arg, g.on_reject, g.verify_chunk, g.draft_window or None)
        special = self.loaded.special
        vocab = special.real_vocab(self.loaded.model.vocab_size)
        return GuidedCommitter(self.guide.model, vocab, special, rules)

    def admission(self) -> str:
        """continuous, unless the settings ask for static or the decode cannot be served so."""
        static = self.settings.batching == "static" or self.static_reason() is not None
        return "static" if static else "continuous"

    def static_reason(self) -> str | None:
        """Why continuous batching falls back to static batches here (None: it does not)."""
        return static_reason(self.loaded.model)

    def text(self, tokens: list[int]) -> str:
        """Answer text: cut at the first stop token, special tokens removed."""
        special = self.loaded.special
        kept = [t for t in answer_tokens(tokens, special.stop) if t != special.mask]
        return self.loaded.tokenizer.decode(kept, skip_special_tokens=True).strip()


# provenance of a value the caller gave -> how messages name it
GIVEN_BY = {"cli": "the command line", "call": "the LLM call's arguments"}


def given_by(provenance: dict[str, str], source: str) -> dict[str, str]:
    """Provenance with the caller's values ("cli") named as `source` (GIVEN_BY's keys)."""
    return {k: source if v == "cli" else v for k, v in provenance.items()}


def origin(provenance: dict[str, str]) -> Callable[[str], str]:
    """decode setting -> " (from the command line)" / " (from profile FILE)" for messages."""

    def where(key: str) -> str:
        source = provenance.get(f"decode.{key}", "default")
        if source in GIVEN_BY:
            return f" (from {GIVEN_BY[source]})"
        return f" (from {source})" if source.startswith("profile ") else ""

    return where


def family_settings(
    prof: Profile, provenance: dict[str, str], loaded: LoadedModel, use_guide: bool
) -> tuple[DecodeSettings, list[str]]:
    """The profile's settings as the loaded model's family takes them, and notes to show;
    settings that mean nothing for the family are refused (SettingsError)."""
    family = FAMILIES[loaded.family]
    guided = use_guide and prof.guide is not None and prof.guide.path
    if guided and not family.traits.frontier:  # it samples on its own
        raise SettingsError(f"a guide model does not apply to {family.title} (use --no-guide)")
    settings = check_family(loaded, prof.decode, origin(provenance))
    notes = NOTES.get(family.stepper, lambda s, loaded: s.adjustments())
    return settings, notes(settings, loaded)


def check_family(
    loaded: LoadedModel, settings: DecodeSettings, where=lambda k: ""
) -> DecodeSettings:
    """The settings as the loaded model's family takes them; one it cannot use is refused
    in one line (SettingsError): the CLI's flags and every server request pass here."""
    family = FAMILIES[loaded.family]
    return CHECKS[family.stepper](loaded, family, settings, where)


def check_masked(loaded: LoadedModel, family, s: DecodeSettings, where) -> DecodeSettings:
    check_refused(family, s, where)
    return s


def check_block(loaded: LoadedModel, family, s: DecodeSettings, where) -> DecodeSettings:
    """SDAR, LLaDA2.x: the refusals and the block rule's own values."""
    from dllm_cli.decoding.block_rules import check_block_settings

    check_block_settings(s, family, where)
    return s


def check_gemma(loaded: LoadedModel, family, s: DecodeSettings, where) -> DecodeSettings:
    """DiffusionGemma: the refusals; its canvas length is the block length."""
    return gemma.check_settings(s, loaded.model.canvas_length, where)


# Family.stepper -> how its settings are checked, and (where not `adjustments`) its notes
CHECKS = {"masked": check_masked, "block": check_block, "gemma": check_gemma}
NOTES = {"gemma": lambda s, loaded: gemma.notes(s, loaded.model.canvas_length)}


def set_threads(threads: int) -> None:
    """--threads / [model] threads: size torch's CPU thread pool before the first forward (on
    a loaded machine the default pool made one decode 100x slower than one thread); 0 leaves
    torch's default."""
    if threads > 0:
        torch.set_num_threads(threads)


def check_fit(prof: Profile, device: str, slots: int) -> None:
    """FitError (one line: the numbers and what would fit) when the load cannot fit."""
    from dllm_cli import fit

    folder = resolve_path(prof.model.path)
    try:
        raw = read_config_json(folder)
        family = family_for_config(raw, folder / "config.json")
    except DllmError:
        return  # the loader says what is wrong with the folder
    dev = resolve_device(device)
    dtype = str(resolve_dtype(prof.model.dtype, dev)).removeprefix("torch.")
    where = f"cuda:{dev.index or 0}" if dev.type == "cuda" else dev.type
    decode, name = prof.decode.gen_length, prof.name if prof.source else folder.name
    quantize = prof.model.quantize
    fit.check(raw, family.name, where, dtype, quantize, slots, decode, name=name, folder=folder)


def open_runtime(
    profile: str | None,
    overrides: dict[str, object] | None = None,
    *,
    use_guide: bool = True,
    require_guide: bool = False,
    place: Callable[[str], str] | None = None,
    slots: int = 1,
    force: bool = False,
    shards: Shards | None = None,
    source: str = "cli",
) -> Runtime:
    """Resolve the profile with CLI overrides (which builds the settings), load the model and
    guide; `shards`: only this rank's slices of it (tensor parallelism).

    `require_guide` (explicit --guide): a profile without [guide] is an error before any load.
    `place`: the configured device -> the one to load on (torchrun: this rank's GPU). A load
    that cannot fit with `slots` rows is refused before any weight is read (fit.py), unless
    `force`. `source`: who gave `overrides` (GIVEN_BY's keys), as error messages name it.
    """
    prof, provenance = resolve(profile, overrides)
    provenance = given_by(provenance, source)
    if require_guide and prof.guide is None:
        raise SettingsError(
            f"--guide: profile {prof.name!r} has no [guide] section (no AR guide model to use)"
        )
    set_threads(prof.model.threads)
    device = prof.model.device if place is None else place(prof.model.device)
    require_model_folder(prof)
    if not force and shards is None:  # (it sizes the whole model: a rank holds 1/N of it)
        check_fit(prof, device, slots)
    loaded = load_model(
        prof.model.path, dtype=prof.model.dtype, device=device,
        special_overrides=prof.special_overrides(), quantize=prof.model.quantize, shards=shards,
    )  # fmt: skip
    loaded = add_stop_tokens(loaded, prof.model.stop_tokens)
    wanted, family = prof.model.architecture, FAMILIES[loaded.family]
    if wanted and wanted.lower() != family.name:
        raise ModelLoadError(
            f"profile says architecture {wanted!r} but {loaded.path} is {family.name!r}"
        )
    settings, notes = family_settings(prof, provenance, loaded, use_guide)
    guide = None
    if use_guide and prof.guide is not None and prof.guide.path:
        from dllm_cli.models.guide import load_guide

        guide = load_guide(prof.guide.path, loaded)
    if prof.model.compile:
        why = enable_compile(loaded.model)  # None, or why the model stays eager
        notes = [*notes, why] if why else notes
    return Runtime(prof, provenance, settings, loaded, guide, prof.model.chat_template, notes)
