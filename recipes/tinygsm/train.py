"""Train the shipped TinyGSM models: the AR guide, then the diffusion models initialised from it.

    python -m recipes.tinygsm.train --out runs/tinygsm --seed 0 [--phases ar,dream,llada]

Phase `ar` trains a tiny Llama-family causal LM on k-shot TinyGSM text (the guide model of
guided diffusion). Phase `dream` copies its weights into a Dream-format model (Qwen2 names,
zero q/k/v biases) and trains it with the shifted masked-diffusion objective, the way Dream-7B
was adapted from Qwen2.5-7B; phase `llada` does the same into LLaDA's format (no shift), or
continues a LLaDA model given with `--llada-init`. `--ar-init` continues an existing guide
(its vocabulary rows grow into the current tokenizer's). Deterministic for a seed and a thread
count: every batch is drawn from an RNG seeded by (seed, phase, step), so `--resume` after an
interruption continues exactly where it stopped.
"""

from __future__ import annotations

import json
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Annotated

import torch
import typer
from safetensors.torch import save_file

from dllm_cli.models.loading import quiet_transformers, resolve_path
from recipes.tinygsm.architectures import (
    ar_to_dream,
    ar_to_llada,
    build_ar,
    build_dream,
    build_llada,
    grow_into,
    read_weights,
)
from recipes.tinygsm.batches import Encoder
from recipes.tinygsm.phases import PHASES, console, run_phase
from recipes.tinygsm.quickeval import eval_ar, eval_mdm
from recipes.tinygsm.tokenizer import save_tokenizer


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the trained weights (recorded next to them)."""

    seed: int = 0
    phases: tuple[str, ...] = ("ar", "dream")
    d_model: int = 128
    n_layers: int = 6
    n_heads: int = 4
    mlp_hidden: int = 512
    max_len: int = 2048
    rope_theta: float = 10000.0
    threads: int = 1  # pinned: same seed + same thread count -> same weights
    ar_init: str | None = None  # an exported guide folder to continue from
    dream_init: str | None = None  # an exported Dream folder to continue from (else the guide)
    llada_init: str | None = None  # an exported LLaDA folder to continue from (else the guide)
    ar_steps: int = 1800
    ar_tokens: int = 4096  # tokens per AR batch
    ar_lr: float = 3e-3
    dream_steps: int = 3000
    dream_lr: float = 1e-3
    llada_steps: int = 3000
    llada_lr: float = 1e-3
    mdm_tokens: int = 4096  # tokens per diffusion batch
    warmup: int = 50
    weight_decay: float = 0.1
    max_shots: int = 8
    wide_frac: float = 0.3  # share of problems from the wide generator
    rich_frac: float = 0.5  # share from the rich generator (the rest: narrow)
    aligned_frac: float = 0.5
    shot_mask_prob: float = 0.75  # diffusion rows also mask this share of in-context solutions
    ar_drill_frac: float = 0.2  # share of AR batches that are pure arithmetic drills
    mdm_drill_frac: float = 0.1  # same for the diffusion phases
    drill_length: int = 96
    # answer-region sizes of diffusion canvases and how often each is drawn
    regions: tuple[int, ...] = (64, 96, 128, 256, 512)
    region_probs: tuple[float, ...] = (0.25, 0.2, 0.2, 0.25, 0.1)
    eval_every: int = 500
    eval_n: int = 64
    checkpoint_every: int = 100


PRESETS = {
    "default": TrainConfig(),
    "micro": TrainConfig(
        phases=("ar", "dream", "llada"),
        d_model=32,
        n_layers=2,
        n_heads=2,
        mlp_hidden=64,
        ar_steps=6,
        ar_tokens=512,
        dream_steps=6,
        llada_steps=6,
        mdm_tokens=1024,
        max_shots=1,
        regions=(80, 96),
        region_probs=(0.5, 0.5),
        eval_every=0,
        eval_n=4,
        checkpoint_every=4,
    ),
}
# phase -> (exported folder, model builder, how the guide's weights map onto it)
OUTPUTS: dict[str, tuple[str, Callable, Callable | None]] = {
    "ar": ("tiny-gsm-ar", build_ar, None),
    "dream": ("tiny-gsm-dream", build_dream, ar_to_dream),
    "llada": ("tiny-gsm", build_llada, ar_to_llada),
}


CURVE_SPLITS = {
    "narrow": "accuracy",
    "wide": "accuracy_wide",
    "rich": "accuracy_rich",
    "hand": "accuracy_hand",
}


def accuracies(phase: str, model, enc: Encoder, n: int) -> dict[str, float]:
    """Held-out accuracy, 0-shot, on each curve split (greedy AR; diffusion: gen 128, block 32,
    one token per step, no cache)."""
    out = {}
    with torch.inference_mode():
        for split, key in CURVE_SPLITS.items():
            if phase == "ar":
                out[key] = eval_ar(model, enc, n=n, shots=0, max_new=128, split=split)
            else:
                out[key] = eval_mdm(model, enc, n=n, gen_length=128, block_length=32, split=split)
    return out


def export(model, folder: Path, record: dict) -> None:
    """Write config.json + model.safetensors + tokenizer + training.json."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(str(folder))
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(folder)
    (folder / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def initial_model(phase: str, cfg: TrainConfig, tok, guide) -> tuple[torch.nn.Module, str]:
    """The phase's network and a note on where its weights start from."""
    torch.manual_seed(cfg.seed + list(OUTPUTS).index(phase))
    _, build, from_guide = OUTPUTS[phase]
    model = build(cfg, tok)
    start = {"ar": cfg.ar_init, "dream": cfg.dream_init, "llada": cfg.llada_init}[phase]
    if start:
        grown = grow_into(model, read_weights(resolve_path(start)))
        return model, f"continued from {start} (grown: {', '.join(grown) or 'nothing'})"
    if from_guide is None:
        return model, "random"
    model.load_state_dict(from_guide(guide.state_dict()))
    return model, "AR guide weights (tiny-gsm-ar)"


def train(cfg: TrainConfig, out: Path, resume: bool = False) -> dict:
    """The phases in order; returns the final accuracies per phase."""
    unknown = [p for p in cfg.phases if p not in PHASES]
    if unknown or not cfg.phases or cfg.phases[0] != "ar":
        raise ValueError(f"phases must start with ar and come from {list(PHASES)}: {cfg.phases}")
    quiet_transformers()
    torch.set_num_threads(cfg.threads)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    tok = save_tokenizer(work)
    enc = Encoder(tok)
    meta = {
        "command": "python -m recipes.tinygsm.train",
        "config": asdict(cfg),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "hardware": f"{platform.machine()} {platform.processor() or ''}".strip(),
    }
    results, guide = {}, None
    for phase in cfg.phases:
        began = time.time()
        model, init = initial_model(phase, cfg, tok, guide)
        folder = out / OUTPUTS[phase][0]
        if resume and (folder / "training.json").is_file():  # finished before the interruption
            model.load_state_dict(read_weights(folder))
            results[phase] = json.loads((folder / "training.json").read_text())["final_0shot"]
            console.print(f"[dim]{phase}: already exported to {folder}[/]")
            guide = model if phase == "ar" else guide
            continue
        curve: list = []

        def check(model=model, phase=phase) -> dict:
            return accuracies(phase, model, enc, cfg.eval_n)

        run_phase(phase, model, cfg, enc, work, resume, curve, check)
        final = accuracies(phase, model, enc, cfg.eval_n * 2)
        console.print(f"{phase}: held-out accuracy (0-shot) {final}")
        record = {**meta, "phase": phase, "init": init, "final_0shot": final}
        record |= {"minutes": round((time.time() - began) / 60, 1), "curve": curve}
        export(model, folder, record)
        results[phase] = final
        guide = model if phase == "ar" else guide
    shutil.rmtree(work, ignore_errors=True)
    return results


def main(
    out: Annotated[Path, typer.Option(help="Output folder (gets one folder per phase).")],
    seed: Annotated[int, typer.Option(help="Seed: same seed, same weights.")] = 0,
    preset: Annotated[str, typer.Option(help="default | micro (a seconds-long smoke run).")] = (
        "default"
    ),
    phases: Annotated[
        str | None, typer.Option(help="Comma-separated, starting with ar: ar,dream,llada.")
    ] = None,
    resume: Annotated[bool, typer.Option(help="Continue from the last checkpoint.")] = False,
    ar_init: Annotated[str | None, typer.Option(help="Continue this guide folder.")] = None,
    dream_init: Annotated[str | None, typer.Option(help="Continue this Dream folder.")] = None,
    llada_init: Annotated[str | None, typer.Option(help="Continue this LLaDA folder.")] = None,
    wide_frac: Annotated[float | None, typer.Option(help="Share of wide problems.")] = None,
    rich_frac: Annotated[float | None, typer.Option(help="Share of rich problems.")] = None,
    ar_steps: Annotated[int | None, typer.Option(help="Override the AR phase's steps.")] = None,
    dream_steps: Annotated[int | None, typer.Option(help="Override the Dream steps.")] = None,
    llada_steps: Annotated[int | None, typer.Option(help="Override the LLaDA steps.")] = None,
    eval_every: Annotated[int | None, typer.Option(help="Held-out check every N steps.")] = None,
    threads: Annotated[int | None, typer.Option(help="Torch threads (pinned).")] = None,
) -> None:
    """Train the TinyGSM guide and diffusion models on this machine."""
    if preset not in PRESETS:
        raise typer.BadParameter(f"unknown preset {preset!r} (choose {', '.join(PRESETS)})")
    changes = {
        "seed": seed,
        "ar_init": ar_init,
        "dream_init": dream_init,
        "llada_init": llada_init,
        "wide_frac": wide_frac,
        "rich_frac": rich_frac,
        "ar_steps": ar_steps,
        "dream_steps": dream_steps,
        "llada_steps": llada_steps,
        "eval_every": eval_every,
        "threads": threads,
    }
    if phases is not None:
        changes["phases"] = tuple(p.strip() for p in phases.split(",") if p.strip())
    cfg = replace(PRESETS[preset], **{k: v for k, v in changes.items() if v is not None})
    result = train(cfg, out, resume=resume)
    console.print(json.dumps(result))


if __name__ == "__main__":
    typer.run(main)
