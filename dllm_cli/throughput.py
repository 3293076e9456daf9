"""Decode speed on any checkpoint without an eval set: `dllm bench --prompt-length N`.

Every chosen strategy decodes the same `n` synthetic prompts of N tokens: deterministic (seeded)
draws from the tokenizer's ordinary vocabulary (no special, added, mask or padding ids), so a
real LLaDA-8B on a GPU and a random folder on a laptop are measured the same way. The records
and the table are bench's (bench.py); accuracy is undefined here (None, shown as "-"), and
tokens, tok/s, forwards and seconds mean what they mean in evaluate.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dllm_cli.decoding import decode
from dllm_cli.errors import InputError, UsageError
from dllm_cli.evaluate import Cost, held_out
from dllm_cli.models.loading import LoadedModel


@dataclass(frozen=True)
class SyntheticTask:
    """One synthetic prompt (the `prompt` is all bench's warm-up and timing read)."""

    index: int
    prompt: list[int]


@dataclass
class Throughput(Cost):
    """Cost of one pass over synthetic prompts with one set of settings."""

    prompt_length: int = 0
    n: int = 0
    tokens: int = 0

    def summary(self) -> dict:
        """The keys of `evaluate.Score.summary()` (accuracy, correct, restated None: JSON null)."""
        head = {"accuracy": None, "n": self.n, "correct": None, "restated": None}
        return {**head, **self.costs(), "prompt_length": self.prompt_length}


def ordinary_ids(loaded: LoadedModel) -> list[int]:
    """Token ids a prompt may hold: the tokenizer's vocabulary minus every special/added id."""
    tok = loaded.tokenizer
    s = loaded.special
    special = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}))
    special |= {i for i in (s.mask, s.eos, s.pad, s.bos, s.eot) if i is not None}
    vocab = loaded.model.vocab_size
    ids = sorted({i for i in tok.get_vocab().values() if 0 <= i < vocab and i not in special})
    if not ids:
        raise InputError("the tokenizer has no ordinary tokens to build synthetic prompts from")
    return ids


def synthetic_tasks(
    loaded: LoadedModel, n: int, prompt_length: int, seed: int = 0
) -> list[SyntheticTask]:
    """n prompts of `prompt_length` ordinary ids, the same for the same seed and tokenizer."""
    if n < 1:
        raise UsageError(f"--n must be at least 1 (got {n})")
    if prompt_length < 1:
        raise UsageError(f"--prompt-length must be at least 1 (got {prompt_length})")
    ids = ordinary_ids(loaded)
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(ids), (n, prompt_length), generator=gen).tolist()
    return [SyntheticTask(i, [ids[j] for j in row]) for i, row in enumerate(picks)]


def measure(runtime, tasks: Sequence[SyntheticTask], settings, committer, batch_size: int):
    """One timed pass over synthetic prompts (bench's `measure` for throughput mode)."""
    if batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1 (got {batch_size})")
    length = len(tasks[0].prompt) if tasks else 0
    out = Throughput(gen_length=settings.gen_length, prompt_length=length)
    loaded = runtime.loaded
    for first in range(0, len(tasks), batch_size):
        batch = [t.prompt for t in tasks[first : first + batch_size]]
        began = time.perf_counter()
        result = decode(loaded.model, loaded.special, batch, settings, committer=committer)
        out.add_run(result, time.perf_counter() - began)
        for tokens in result.tokens:
            out.n += 1
            out.tokens += out.answer_tokens(tokens, loaded.special)
    return out


def bench_inputs(
    runtime, n: int, shots: int, start: int, prompt_length: int | None
) -> tuple[list, Callable | None, str]:
    """(tasks, measure, title) for bench: held-out TinyGSM problems, or synthetic prompts."""
    name = runtime.profile.name
    if prompt_length is None:
        tasks = held_out(runtime.encode, n, shots, start)
        return tasks, None, f"{name}: {n} held-out TinyGSM problems, {shots}-shot"
    tasks = synthetic_tasks(runtime.loaded, n, prompt_length, runtime.settings.seed)
    return tasks, measure, f"{name}: {n} synthetic prompts of {prompt_length} tokens"
