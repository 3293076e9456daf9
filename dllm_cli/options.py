"""Command-line options, each declared once; the shared ones are plumbed one way for every command.

A shared flag is one row of `FLAGS`: the Typer option and the profile key it overrides. A command
takes the flags it wants with `@shared("model", "decode", ...)` (group or flag names) and
receives their values as one `Choices`; `commands.common.load_runtime(choices)` turns that into
a Runtime. Every shared flag defaults to None ("not given"), so a profile value wins unless the
flag is on the command line: CLI flag > profile > built-in default.

The decoding flags are not written here: `decode_flags` makes one for every `DecodeSettings`
field whose declaration (settings.py) has a help text, with its type, panel and group. To add a
decoding flag, add the field; generate, visualize and eval take it from then on, and
tests/test_cli_flags.py asks for one test value for it. An ordinary flag of a few commands is a
row of MODEL_FLAGS or GUIDE_FLAGS, or a plain Annotated option at the end of this file.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

import typer

from dllm_cli.setting_spec import DECODE, GEMMA, INPUT, declared, kinds_of  # noqa: F401 (panels)
from dllm_cli.settings import DecodeSettings

MODEL = "Model"
OUTPUT = "Output"
EVAL = "Evaluation"


@dataclass(frozen=True)
class Flag:
    """One shared option: what Typer shows, and which profile key it sets (None: not a setting)."""

    option: Any  # Annotated[type, typer.Option(...)]
    group: str
    key: str | None = None


def _option(kind: type, help: str, panel: str, *names: str) -> Any:
    return Annotated[kind | None, typer.Option(*names, help=help, rich_help_panel=panel)]


def decode_flags() -> dict[str, Flag]:
    """A flag for every DecodeSettings field that declares a help text, in field order."""
    kinds = kinds_of(DecodeSettings)
    return {
        name: Flag(
            _option(kinds[name][0], spec.flag_help(), spec.panel), spec.group, f"decode.{name}"
        )
        for name, spec in declared(DecodeSettings)
        if spec.help is not None
    }


def _guide(key: str, kind: type, help: str) -> Flag:
    """A [guide] setting (group "guide", with --guide/--no-guide)."""
    return Flag(_option(kind, help, DECODE), "guide", f"guide.{key}")


def _model(key: str | None, kind: type, help: str, *names: str) -> Flag:
    """A [model] setting (group "model"); `key` None: a flag that sets no profile key."""
    return Flag(_option(kind, help, MODEL, *names), "model", key and f"model.{key}")


MODEL_FLAGS: dict[str, Flag] = {
    "profile": _model(None, str, "Profile NAME or path to a .toml file.", "--profile", "-p"),
    "model": _model(
        "path",
        str,
        "Checkpoint folder, or ORG/NAME pulled with `dllm pull` (replaces the profile's; "
        "without --profile, its family's reference settings).",
        "--model",
    ),
    "device": _model("device", str, "auto | cpu | cuda | cuda:N."),
    "force": _model(
        None,
        bool,
        "Load even when the fit check says the model will not fit in free memory.",
        "--force",
    ),
    "dtype": _model("dtype", str, "auto | float32 | bfloat16 | float16."),
    "quantize": _model(
        "quantize",
        str,
        "none | int8: weights quantized per output channel as they load (int8 x int8 "
        "matmuls; about a quarter of float32's weight memory) | int4: 4-bit weights in "
        "groups of 32 with a bfloat16 scale and zero each (about 1/7 of float32's).",
    ),
    "chat": _model("chat_template", bool, "Wrap prompts in the chat template.", "--chat/--no-chat"),
    "compile": _model(
        "compile",
        bool,
        "Replay cached block steps as CUDA graphs (CUDA only; identical outputs).",
        "--compile/--no-compile",
    ),
    "threads": _model(
        "threads",
        int,
        "CPU threads for torch, set before the first forward (0, the default: torch's "
        "own, one per core or OMP_NUM_THREADS; a busy machine often runs faster on 1).",
    ),
}
GUIDE_FLAGS: dict[str, Flag] = {
    "guide": Flag(
        _option(
            bool,
            "Verify drafts with the profile's AR guide model (guided diffusion; on by default "
            "when the profile has one, off after --model unless given).",
            DECODE,
            "--guide/--no-guide",
        ),
        "guide",
    ),
    "accept": _guide("accept", str, "Guided: acceptance rule exact | topk:K | prob:P."),
    "on_reject": _guide(
        "on_reject",
        str,
        "Guided: on a rejection commit the guide's token (guide) or, when nothing was "
        "accepted, the diffusion model's draft (draft).",
    ),
    "verify_chunk": _guide("verify_chunk", int, "Guided: drafts the guide verifies per forward."),
    "draft_window": _guide(
        "draft_window",
        int,
        "Guided: columns drafted from the first mask (0: to the canvas end); drafts are the "
        "diffusion model's argmax whatever the temperature.",
    ),
}

FLAGS: dict[str, Flag] = {**MODEL_FLAGS, **decode_flags(), **GUIDE_FLAGS}


@dataclass(frozen=True)
class Choices:
    """The shared flags of one command line: profile, --guide/--no-guide, settings given."""

    profile: str | None = None
    guide: bool | None = None  # None: not given
    overrides: dict[str, object] = field(default_factory=dict)  # profile key -> value
    force: bool = False  # --force: skip the fit check

    @classmethod
    def of(cls, given: dict[str, object]) -> Choices:
        """From flag name -> value as parsed (None: not given)."""
        settings = {
            FLAGS[name].key: value
            for name, value in given.items()
            if value is not None and FLAGS[name].key is not None
        }
        profile, guide = given.get("profile"), given.get("guide")
        return cls(profile, guide, settings, bool(given.get("force")))  # type: ignore[arg-type]


C = TypeVar("C", bound=Callable[..., None])


def shared(*wanted: str) -> Callable[[C], C]:
    """Give a command the shared flags named (or in the groups named) where it declares a
    `choices` parameter; it is called with their values as `choices=Choices(...)`."""
    names = [n for n, f in FLAGS.items() if n in wanted or f.group in wanted]
    unknown = set(wanted) - set(names) - {f.group for f in FLAGS.values()}
    if unknown:
        raise ValueError(f"no shared flag or group named {sorted(unknown)}")

    def add_flags(command: C) -> C:
        own = inspect.signature(command, eval_str=True).parameters
        clash = set(own) & set(names)
        if clash or "choices" not in own:
            raise TypeError(
                f"{command.__name__}: needs a `choices` parameter, and none named {clash}"
            )
        flags = [
            inspect.Parameter(
                n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=FLAGS[n].option
            )
            for n in names
        ]
        params: list[inspect.Parameter] = []
        for p in own.values():
            params += flags if p.name == "choices" else [p.replace(kind=p.KEYWORD_ONLY)]

        @functools.wraps(command)
        def with_choices(**values: Any) -> None:
            given = {n: values.pop(n) for n in names}
            command(**values, choices=Choices.of(given))

        with_choices.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        with_choices.__annotations__ = {p.name: p.annotation for p in params}
        return with_choices  # type: ignore[return-value]

    return add_flags


# --- options of one or two commands ---------------------------------------------------------


def in_panel(panel: str | None) -> Callable[..., Any]:
    """`option(help, *names, **kw)`: a typer.Option shown under one command's `panel`."""

    def option(help: str, *names: str, **kw: Any) -> Any:
        return typer.Option(*names, help=help, rich_help_panel=panel, **kw)

    return option


BatchSize = Annotated[
    int,
    typer.Option(
        help="Prompts decoded together (continuous batching: slots refilled as prompts finish).",
        min=1,
    ),
]
output, evaluation = in_panel(OUTPUT), in_panel(EVAL)
Json = Annotated[
    bool,
    output(
        "One JSON object per prompt on stdout: prompt, text, token_ids (the answer's), "
        "forwards, guide_forwards, steps, seconds (static batches: the prompt's own steps and "
        "its share of the batch's seconds); a failed prompt: prompt, error.",
        "--json",
    ),
]
Stats = Annotated[
    bool,
    output(
        "Answer tokens, forwards (diffusion, guide), steps, seconds and tok/s on stderr.", "--stats"
    ),
]
VerbosePrompt = Annotated[
    bool,
    output(
        "Show on stderr the exact prompt the model sees: each token's id and text "
        "(to check a chat template or a profile).",
        "--verbose-prompt",
    ),
]
N = Annotated[int, evaluation("Held-out problems to solve.", "--n", "-n")]
Shots = Annotated[int, evaluation("Solved examples in each prompt.")]
Start = Annotated[int, evaluation("First held-out problem (0..999; hand sets 0..99).")]
