"""Train the shipped TinyGSM models: an AR guide first, then the diffusion LM initialised from it.

    python -m dllm_cli.tinygsm.train --out runs/tinygsm --seed 0

Phase 1 trains a tiny Llama-family causal LM on k-shot TinyGSM text (it is the guide model for
guided diffusion). Phase 2 copies its weights into a LLaDA-format model with the same shapes
(AR initialisation, as Dream-7B was initialised from Qwen2.5) and trains it with the masked
diffusion objective (see batches.py). Deterministic for a seed: every batch is drawn from an
RNG seeded by (seed, phase, step), so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import json
import math
import platform
import random
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Annotated

import torch
import torch.nn.functional as F
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from dllm_cli.models import LLaDAConfig, LLaDAModelLM
from dllm_cli.models.loading import quiet_transformers
from dllm_cli.tinygsm.batches import (
    Encoder,
    ExampleSource,
    MaskedBatch,
    ar_batch,
    ar_rows,
    drill_batch,
    masked_batch,
)
from dllm_cli.tinygsm.quickeval import eval_ar, eval_mdm
from dllm_cli.tinygsm.tokenizer import save_tokenizer

console = Console(stderr=True)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the trained weights (recorded next to them)."""

    seed: int = 0
    d_model: int = 128
    n_layers: int = 6
    n_heads: int = 4
    mlp_hidden: int = 512
    max_len: int = 2048
    rope_theta: float = 10000.0
    threads: int = 2  # pinned: same seed + same thread count -> same weights
    ar_steps: int = 1800
    ar_tokens: int = 4096  # tokens per AR batch
    ar_lr: float = 3e-3
    mdm_steps: int = 3000
    mdm_tokens: int = 4096  # tokens per diffusion batch
    mdm_lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.1
    max_shots: int = 8
    aligned_frac: float = 0.5
    shot_mask_prob: float = 0.75  # diffusion rows also mask this share of in-context solutions
    ar_drill_frac: float = 0.2  # share of AR batches that are pure arithmetic drills
    mdm_drill_frac: float = 0.1  # same for the diffusion phase
    drill_length: int = 96
    # answer-region sizes of diffusion canvases and how often each is drawn
    regions: tuple[int, ...] = (80, 96, 128, 256, 512, 1024)
    region_probs: tuple[float, ...] = (0.25, 0.15, 0.2, 0.2, 0.12, 0.08)
    eval_every: int = 400
    eval_n: int = 64
    checkpoint_every: int = 100


PRESETS = {
    "default": TrainConfig(),
    "micro": TrainConfig(
        d_model=32,
        threads=1,
        n_layers=2,
        n_heads=2,
        mlp_hidden=64,
        ar_steps=6,
        ar_tokens=512,
        mdm_steps=6,
        mdm_tokens=1024,
        max_shots=1,
        regions=(80, 96),
        region_probs=(0.5, 0.5),
        eval_every=0,
        eval_n=4,
        checkpoint_every=4,
    ),
}


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def padded_vocab(n: int) -> int:
    """Embedding rows rounded up to a multiple of 8 (like LLaDA's embedding_size > vocab_size)."""
    return -(-n // 8) * 8


def build_ar(cfg: TrainConfig, tok) -> LlamaForCausalLM:
    conf = LlamaConfig(
        vocab_size=padded_vocab(len(tok)),
        hidden_size=cfg.d_model,
        intermediate_size=cfg.mlp_hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        max_position_embeddings=cfg.max_len,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|eot_id|>")],
        pad_token_id=tok.eos_token_id,
    )
    return LlamaForCausalLM(conf)


def build_mdm(cfg: TrainConfig, tok) -> LLaDAModelLM:
    conf = LLaDAConfig(
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_heads,
        n_layers=cfg.n_layers,
        mlp_hidden_size=cfg.mlp_hidden,
        mlp_ratio=4,
        rope_theta=cfg.rope_theta,
        max_sequence_length=cfg.max_len,
        vocab_size=len(tok),
        embedding_size=padded_vocab(len(tok)),
        mask_token_id=tok.mask_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        architectures=["LLaDAModelLM"],
    )
    return LLaDAModelLM(conf)


# Llama parameter name -> LLaDA parameter name (the two blocks compute the same function).
_AR_TO_LLADA = {
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "attn_out",
    "mlp.gate_proj": "ff_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "ff_out",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ff_norm",
}


def ar_to_llada(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a Llama state dict to LLaDA's names (AR initialisation of the diffusion model)."""
    out = {}
    for name, w in state.items():
        if name == "model.embed_tokens.weight":
            out["model.transformer.wte.weight"] = w
        elif name == "model.norm.weight":
            out["model.transformer.ln_f.weight"] = w
        elif name == "lm_head.weight":
            out["model.transformer.ff_out.weight"] = w
        elif name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, _, kind = rest.rpartition(".")
            out[f"model.transformer.blocks.{i}.{_AR_TO_LLADA[module]}.{kind}"] = w
    return out


def step_rng(cfg: TrainConfig, phase: str, step: int) -> random.Random:
    return random.Random(f"{cfg.seed}/{phase}/{step}")


def ar_loss(model: LlamaForCausalLM, cfg: TrainConfig, enc: Encoder, step: int) -> torch.Tensor:
    """Causal LM loss on k-shot examples (one k per batch: little padding) or on drills."""
    rng = step_rng(cfg, "ar", step)
    if rng.random() < cfg.ar_drill_frac:
        n = max(1, cfg.ar_tokens // cfg.drill_length)
        rows = [enc.drill(rng, cfg.drill_length) for _ in range(n)]
    else:
        src = ExampleSource(enc, seed=rng.randrange(2**31))
        k = rng.randint(0, cfg.max_shots)
        first = src.take(k)
        per_row = len(first.prompt) + len(first.answer) + 1
        items = [first] + [src.take(k) for _ in range(max(0, cfg.ar_tokens // per_row - 1))]
        rows = ar_rows(items, enc)
    ids, att, labels = ar_batch(rows, enc.ids.eos)
    return model(input_ids=ids, attention_mask=att, labels=labels).loss


def mdm_loss(model: LLaDAModelLM, cfg: TrainConfig, enc: Encoder, step: int) -> torch.Tensor:
    """Masked-diffusion loss on one batch of canvases of one length."""
    rng = step_rng(cfg, "mdm", step)
    if rng.random() < cfg.mdm_drill_frac:
        n = max(1, cfg.mdm_tokens // cfg.drill_length)
        batch = drill_batch([enc.drill(rng, cfg.drill_length) for _ in range(n)], enc.ids.mask, rng)
        return weighted_ce(model, batch)
    src = ExampleSource(enc, seed=rng.randrange(2**31))
    region = rng.choices(cfg.regions, weights=cfg.region_probs)[0]
    k = rng.randint(0, cfg.max_shots)
    first = src.take(k)
    rows = max(1, cfg.mdm_tokens // (len(first.prompt) + region))
    items = [first] + [src.take(k) for _ in range(rows - 1)]
    length = min(cfg.max_len, max(len(e.prompt) for e in items) + region)
    batch = masked_batch(items, length, enc.ids, rng, cfg.aligned_frac, cfg.shot_mask_prob)
    return weighted_ce(model, batch)


def weighted_ce(model: LLaDAModelLM, batch: MaskedBatch) -> torch.Tensor:
    """Sum of per-token CE times its weight (1/t, row-normalised), averaged over rows."""
    logits = model(batch.noisy)  # (B, T, V)
    ce = F.cross_entropy(logits.flatten(0, 1).float(), batch.target.flatten(), reduction="none")
    return (ce * batch.weight.flatten()).sum() / batch.noisy.shape[0]


PHASES = {"ar": ar_loss, "mdm": mdm_loss}


def save_checkpoint(path: Path, phase: str, step: int, model, opt, curve: list) -> None:
    tmp = path.with_suffix(".tmp")
    state = {"phase": phase, "step": step, "model": model.state_dict(), "opt": opt.state_dict()}
    torch.save({**state, "curve": curve}, tmp)
    tmp.replace(path)


def run_phase(
    phase: str, model, cfg: TrainConfig, enc: Encoder, work: Path, resume: bool, log: list
) -> None:
    """Train one phase with AdamW, checkpointing every few steps so it can resume."""
    steps, peak = (cfg.ar_steps, cfg.ar_lr) if phase == "ar" else (cfg.mdm_steps, cfg.mdm_lr)
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
    loss_fn = PHASES[phase]
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
            loss = loss_fn(model, cfg, enc, step)
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
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < steps:
                entry["accuracy"] = evaluate(phase, model, enc, cfg)
                console.print(f"[dim]{phase} step {step + 1}: accuracy {entry['accuracy']:.3f}[/]")
                model.train()
            log.append(entry)
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == steps:
                save_checkpoint(ckpt, phase, step + 1, model, opt, log)
    model.eval()


def evaluate(phase: str, model, enc: Encoder, cfg: TrainConfig, n: int | None = None) -> float:
    """Held-out accuracy, 0-shot (greedy AR; diffusion: gen 96, block 32), on `n` problems
    (default `eval_n`: the learning curve; the final figures use twice as many)."""
    n = cfg.eval_n if n is None else n
    with torch.inference_mode():
        if phase == "ar":
            return eval_ar(model, enc, n=n, shots=0)
        return eval_mdm(model, enc, n=n, shots=0, gen_length=96, block_length=32)


def export(model, folder: Path, tok, record: dict, state: dict | None = None) -> None:
    """Write config.json + model.safetensors + tokenizer + training.json."""
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(str(folder))
    tensors = {k: v.detach().contiguous() for k, v in (state or model.state_dict()).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(folder)
    (folder / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def train(cfg: TrainConfig, out: Path, resume: bool = False) -> dict:
    """Both phases end to end; returns the final metrics."""
    quiet_transformers()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    tok = save_tokenizer(work)
    enc = Encoder(tok)
    started = time.time()
    hardware = f"{platform.machine()} {platform.processor() or ''}".strip()
    meta = {
        "command": "python -m dllm_cli.tinygsm.train",
        "config": asdict(cfg),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "hardware": hardware,
    }

    ar = build_ar(cfg, tok)
    ar_curve: list = []
    run_phase("ar", ar, cfg, enc, work, resume, ar_curve)
    ar_acc = evaluate("ar", ar, enc, cfg, n=cfg.eval_n * 2)
    console.print(f"AR guide: held-out accuracy {ar_acc:.3f} (0-shot, greedy)")
    ar_record = {**meta, "phase": "ar", "accuracy_0shot": ar_acc, "curve": ar_curve}
    export(ar, out / "tiny-gsm-ar", tok, ar_record)

    torch.manual_seed(cfg.seed + 1)
    mdm = build_mdm(cfg, tok)
    mdm.load_state_dict(ar_to_llada(ar.state_dict()))
    mdm_curve: list = []
    run_phase("mdm", mdm, cfg, enc, work, resume, mdm_curve)
    mdm_acc = evaluate("mdm", mdm, enc, cfg, n=cfg.eval_n * 2)
    console.print(f"Diffusion LM: held-out accuracy {mdm_acc:.3f} (0-shot, gen 96, block 32)")
    minutes = (time.time() - started) / 60
    mdm_record = {
        **meta,
        "phase": "mdm",
        "init": "AR guide weights (tiny-gsm-ar)",
        "accuracy_0shot_gen96": mdm_acc,
        "minutes": round(minutes, 1),
        "curve": mdm_curve,
    }
    export(mdm, out / "tiny-gsm", tok, mdm_record)
    shutil.rmtree(work, ignore_errors=True)
    return {"ar_accuracy": ar_acc, "mdm_accuracy": mdm_acc, "minutes": minutes}


def main(
    out: Annotated[Path, typer.Option(help="Output folder (gets tiny-gsm/ and tiny-gsm-ar/).")],
    seed: Annotated[int, typer.Option(help="Seed: same seed, same weights.")] = 0,
    preset: Annotated[str, typer.Option(help="default | micro (a seconds-long smoke run).")] = (
        "default"
    ),
    resume: Annotated[bool, typer.Option(help="Continue from the last checkpoint.")] = False,
    ar_steps: Annotated[int | None, typer.Option(help="Override the AR phase's steps.")] = None,
    mdm_steps: Annotated[int | None, typer.Option(help="Override the diffusion steps.")] = None,
    eval_every: Annotated[int | None, typer.Option(help="Held-out check every N steps.")] = None,
) -> None:
    """Train the TinyGSM guide and diffusion model from scratch on this machine."""
    if preset not in PRESETS:
        raise typer.BadParameter(f"unknown preset {preset!r} (choose {', '.join(PRESETS)})")
    cfg = replace(PRESETS[preset], seed=seed)
    if ar_steps is not None:
        cfg = replace(cfg, ar_steps=ar_steps)
    if mdm_steps is not None:
        cfg = replace(cfg, mdm_steps=mdm_steps)
    if eval_every is not None:
        cfg = replace(cfg, eval_every=eval_every)
    result = train(cfg, out, resume=resume)
    console.print(json.dumps(result))


if __name__ == "__main__":
    typer.run(main)
