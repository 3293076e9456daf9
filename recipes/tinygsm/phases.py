"""One training phase of the TinyGSM recipe: its loss, its optimiser loop, its checkpoints.

Three phases, each a (loss, steps, peak learning rate) entry of PHASES:
- `ar`: the causal-LM loss of the guide on k-shot text and arithmetic drills;
- `dream`: the masked-diffusion loss with Dream's shift (the output at column i-1 predicts the
  masked token at column i, the AR model's own mapping: arXiv 2508.15487);
- `llada`: the same masked-diffusion loss without a shift (LLaDA, arXiv 2502.09992).
Every batch comes from an RNG seeded by (seed, phase, step), so a resumed phase continues
exactly where it stopped.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from recipes.tinygsm.batches import (
    Encoder,
    ExampleSource,
    MaskedBatch,
    ar_batch,
    ar_rows,
    drill_batch,
    masked_batch,
)

console = Console(stderr=True)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def step_rng(cfg, phase: str, step: int) -> random.Random:
    return random.Random(f"{cfg.seed}/{phase}/{step}")


def source(enc: Encoder, cfg, rng: random.Random) -> ExampleSource:
    return ExampleSource(enc, rng.randrange(2**31), cfg.wide_frac, cfg.rich_frac)


def wide_drills(cfg) -> float:
    """Drills take the wide operand ranges as often as problems come from beyond the narrow set."""
    return cfg.wide_frac + cfg.rich_frac


def ar_loss(model, cfg, enc: Encoder, step: int) -> torch.Tensor:
    """Causal LM loss on k-shot examples (one k per batch: little padding) or on drills."""
    rng = step_rng(cfg, "ar", step)
    if rng.random() < cfg.ar_drill_frac:
        n = max(1, cfg.ar_tokens // cfg.drill_length)
        rows = [enc.drill(rng, cfg.drill_length, wide_drills(cfg)) for _ in range(n)]
    else:
        src = source(enc, cfg, rng)
        k = rng.randint(0, cfg.max_shots)
        first = src.take(k)
        per_row = len(first.prompt) + len(first.answer) + 1
        items = [first] + [src.take(k) for _ in range(max(0, cfg.ar_tokens // per_row - 1))]
        rows = ar_rows(items, enc)
    ids, att, labels = ar_batch(rows, enc.ids.eos)
    return model(input_ids=ids, attention_mask=att, labels=labels).loss


def masked_loss(model, cfg, enc: Encoder, step: int, phase: str, shift: int) -> torch.Tensor:
    """Masked-diffusion loss on one batch of canvases of one length (or of drills)."""
    rng = step_rng(cfg, phase, step)
    if rng.random() < cfg.mdm_drill_frac:
        n = max(1, cfg.mdm_tokens // cfg.drill_length)
        rows = [enc.drill(rng, cfg.drill_length, wide_drills(cfg)) for _ in range(n)]
        return weighted_ce(model, drill_batch(rows, enc.ids.mask, rng), shift)
    src = source(enc, cfg, rng)
    region = rng.choices(cfg.regions, weights=cfg.region_probs)[0]
    k = rng.randint(0, cfg.max_shots)
    first = src.take(k)
    rows = max(1, cfg.mdm_tokens // (len(first.prompt) + region))
    items = [first] + [src.take(k) for _ in range(rows - 1)]
    # every row gets at least `region` answer columns, and always room for its whole answer
    length = min(cfg.max_len, max(len(e.prompt) + max(region, len(e.answer)) for e in items))
    batch = masked_batch(items, length, enc.ids, rng, cfg.aligned_frac, cfg.shot_mask_prob)
    return weighted_ce(model, batch, shift)


def weighted_ce(model, batch: MaskedBatch, shift: int = 0) -> torch.Tensor:
    """Sum of per-token CE times its weight (1/t, row-normalised), averaged over rows.

    shift 1 (Dream): the output at column i predicts the token at column i + 1.
    """
    logits = model(batch.noisy)  # (B, T, V)
    t = logits.shape[1]
    logits = logits[:, : t - shift]
    target, weight = batch.target[:, shift:], batch.weight[:, shift:]
    ce = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction="none")
    return (ce * weight.flatten()).sum() / batch.noisy.shape[0]


@dataclass(frozen=True)
class Phase:
    """What a phase trains: its loss and where its step count and peak rate live in the config."""

    loss: Callable[..., torch.Tensor]
    steps: str  # TrainConfig field
    lr: str


PHASES: dict[str, Phase] = {
    "ar": Phase(ar_loss, "ar_steps", "ar_lr"),
    "dream": Phase(
        lambda m, c, e, s: masked_loss(m, c, e, s, "dream", shift=1), "dream_steps", "dream_lr"
    ),
    "llada": Phase(
        lambda m, c, e, s: masked_loss(m, c, e, s, "llada", shift=0), "llada_steps", "llada_lr"
    ),
}


def save_checkpoint(path: Path, phase: str, step: int, model, opt, curve: list) -> None:
    tmp = path.with_suffix(".tmp")
    state = {"phase": phase, "step": step, "model": model.state_dict(), "opt": opt.state_dict()}
    torch.save({**state, "curve": curve}, tmp)
    tmp.replace(path)


def run_phase(
    phase: str,
    model,
    cfg,
    enc: Encoder,
    work: Path,
    resume: bool,
    log: list,
    evaluate: Callable[[], dict] | None = None,
) -> None:
    """Train one phase with AdamW, checkpointing every few steps so it can resume.

    `evaluate` (held-out accuracies, a dict) runs every `eval_every` steps for the curve.
    """
    spec = PHASES[phase]
    steps, peak = getattr(cfg, spec.steps), getattr(cfg, spec.lr)
    opt = torch.optim.AdamW(
        model.parameters(), lr=peak, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    ckpt = work / f"{phase}.ckpt"
    start = 0
    if resume and ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        log[:] = state["curve"]
        console.print(f"[dim]{phase}: resumed at step {start}[/]")
    model.train()
    columns = (
        TextColumn(f"[bold]{phase}[/]"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    ema = None
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(phase, total=steps, completed=start, loss=float("nan"))
        for step in range(start, steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, peak, cfg.warmup)
            loss = spec.loss(model, cfg, enc, step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            value = loss.item()
            ema = value if ema is None else 0.95 * ema + 0.05 * value
            bar.update(task, advance=1, loss=ema)
            if not console.is_terminal and (step + 1) % 10 == 0:
                console.print(f"{phase} step {step + 1}/{steps} loss {ema:.4f}", highlight=False)
            entry = {"step": step + 1, "loss": round(value, 4), "time": time.time()}
            due = cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < steps
            if due and evaluate is not None:
                model.eval()
                entry.update(evaluate())
                console.print(f"[dim]{phase} step {step + 1}: {entry}[/]", highlight=False)
                model.train()
            log.append(entry)
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == steps:
                save_checkpoint(ckpt, phase, step + 1, model, opt, log)
    model.eval()
