"""Command-line options shared by generate, visualize, eval and bench (`Annotated` aliases).

Every decoding flag defaults to None ("not given"), so a profile value wins unless the flag is
on the command line: CLI flag > profile > built-in default.
"""

from __future__ import annotations

from typing import Annotated

import typer

DECODE = "Decoding"
MODEL = "Model"

Profile = Annotated[
    str | None,
    typer.Option(
        "--profile", "-p", help="Profile NAME or path to a .toml file.", rich_help_panel=MODEL
    ),
]
ModelPath = Annotated[
    str | None,
    typer.Option(
        "--model", help="Checkpoint folder (replaces the profile's).", rich_help_panel=MODEL
    ),
]
Device = Annotated[
    str | None,
    typer.Option(help="auto | cpu | cuda | cuda:N.", rich_help_panel=MODEL),
]
Dtype = Annotated[
    str | None,
    typer.Option(help="auto | float32 | bfloat16 | float16.", rich_help_panel=MODEL),
]
Compile = Annotated[
    bool | None,
    typer.Option(
        "--compile/--no-compile",
        help="Replay cached block steps as CUDA graphs (CUDA only; identical outputs).",
        rich_help_panel=MODEL,
    ),
]
Chat = Annotated[
    bool | None,
    typer.Option(
        "--chat/--no-chat", help="Wrap prompts in the chat template.", rich_help_panel=MODEL
    ),
]
Guide = Annotated[
    bool | None,
    typer.Option(
        "--guide/--no-guide",
        help="Verify drafts with the profile's AR guide model (guided diffusion; on by "
        "default when the profile has one, off after --model unless given).",
        rich_help_panel=DECODE,
    ),
]
GenLength = Annotated[int | None, typer.Option(help="Tokens to generate.", rich_help_panel=DECODE)]
BlockLength = Annotated[
    int | None, typer.Option(help="Semi-autoregressive block size.", rich_help_panel=DECODE)
]
Steps = Annotated[
    int | None,
    typer.Option(
        help="Denoising steps in all (fixed/origin); default one per token.", rich_help_panel=DECODE
    ),
]
Cache = Annotated[
    str | None,
    typer.Option(help="KV cache: none | prefix | dual | freecache.", rich_help_panel=DECODE),
]
Unmask = Annotated[
    str | None,
    typer.Option(help="Commit rule: fixed | threshold | factor | origin.", rich_help_panel=DECODE),
]
Confidence = Annotated[
    str | None,
    typer.Option(help="low_confidence | random | margin | entropy.", rich_help_panel=DECODE),
]
Threshold = Annotated[
    float | None,
    typer.Option(
        help="threshold rule: commit tokens at least this confident, in (0, 1].",
        rich_help_panel=DECODE,
    ),
]
Factor = Annotated[
    float | None,
    typer.Option(
        help="factor rule: commit the largest n with (n+1)(1-c_n) < f.", rich_help_panel=DECODE
    ),
]
Temperature = Annotated[float | None, typer.Option(help="0 = greedy.", rich_help_panel=DECODE)]
TopP = Annotated[float | None, typer.Option(help="Nucleus sampling mass.", rich_help_panel=DECODE)]
TopK = Annotated[
    int | None,
    typer.Option(
        help="Keep the top K tokens (0: off; default: the family's, 50 for Dream as in its code).",
        rich_help_panel=DECODE,
    ),
]
CfgScale = Annotated[
    float | None,
    typer.Option(help="Classifier-free guidance scale (0 = off).", rich_help_panel=DECODE),
]
Seed = Annotated[int | None, typer.Option(help="Random seed.", rich_help_panel=DECODE)]
EarlyStop = Annotated[
    bool | None,
    typer.Option(
        "--early-stop/--no-early-stop",
        help="Stop a row once its answer has ended (same text, fewer forwards).",
        rich_help_panel=DECODE,
    ),
]

OUTPUT = "Output"

Json = Annotated[
    bool,
    typer.Option(
        "--json",
        help="One JSON object per prompt on stdout: prompt, text, token_ids, forwards, steps, "
        "seconds (a failed prompt: prompt, error).",
        rich_help_panel=OUTPUT,
    ),
]
Stats = Annotated[
    bool,
    typer.Option(
        "--stats",
        help="Answer tokens, forwards, steps, seconds and tok/s on stderr.",
        rich_help_panel=OUTPUT,
    ),
]

# flag name -> profile key understood by profiles.resolve
FLAG_KEYS = {
    "model": "model.path",
    "device": "model.device",
    "dtype": "model.dtype",
    "chat": "model.chat_template",
    "compile": "model.compile",
    "gen_length": "decode.gen_length",
    "block_length": "decode.block_length",
    "steps": "decode.steps",
    "cache": "decode.cache",
    "unmask": "decode.unmask",
    "confidence": "decode.confidence",
    "threshold": "decode.threshold",
    "factor": "decode.factor",
    "temperature": "decode.temperature",
    "top_p": "decode.top_p",
    "top_k": "decode.top_k",
    "cfg_scale": "decode.cfg_scale",
    "seed": "decode.seed",
    "early_stop": "decode.early_stop",
}


def overrides(**flags) -> dict[str, object]:
    """Flags given on the command line (not None) as profile keys."""
    return {FLAG_KEYS[k]: v for k, v in flags.items() if v is not None and k in FLAG_KEYS}
