"""Timing one decode step by step: wall time per step, model time per forward, peak memory.

A step's wall time runs from the end of the previous step to the end of this one, with the
device synchronised at both ends, so it includes everything the engine does around the model
(planning, sampling, commits, retiring rows). The model's own time is measured by forward hooks
on the model: CUDA events on a GPU (the device time from the forward's first kernel to its
last), the wall clock on a CPU. One minus their ratio is the share of a step spent outside the
model's forward.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ForwardTimer:
    """Forward hooks that time every call of `model` (CUDA events on a GPU, else the clock)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model, self.cuda = model, device.type == "cuda"
        self.pending: list = []  # (start, end) events or seconds, since the last take()
        self.handles: list = []
        self._start = None

    def __enter__(self) -> ForwardTimer:
        self.handles = [
            self.model.register_forward_pre_hook(self._before),
            self.model.register_forward_hook(self._after),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _before(self, module, args) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def _after(self, module, args, output) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((self._start, end))
        else:
            self.pending.append(time.perf_counter() - self._start)

    def take(self) -> list[float]:
        """Seconds of each forward since the last call (the caller has synchronised)."""
        done = [s.elapsed_time(e) / 1000 for s, e in self.pending] if self.cuda else self.pending
        self.pending = []
        return done


@dataclass
class StepTimes:
    """Per-step wall seconds and model seconds, by kind (full refresh or cached step)."""

    wall: dict[str, list[float]] = field(default_factory=lambda: {"full": [], "cached": []})
    model: dict[str, list[float]] = field(default_factory=lambda: {"full": [], "cached": []})
    forwards: int = 0
    steps: int = 0
    tokens: int = 0  # answer tokens committed
    cut_short: bool = False

    def add(self, refresh: bool, wall: float, model: list[float]) -> None:
        kind = "full" if refresh else "cached"
        self.wall[kind].append(wall)
        self.model[kind] += model
        self.steps += 1

    def summary(self) -> dict:
        wall = sum(map(sum, self.wall.values()))
        model = sum(map(sum, self.model.values()))
        out = {
            "steps": self.steps,
            "forwards": self.forwards,
            "tokens": self.tokens,
            "seconds": wall,
            "model_seconds": model,
            "outside_model": 1 - model / wall if wall > 0 else None,
            "cut_short": self.cut_short,
        }
        for kind in ("full", "cached"):
            walls, models = self.wall[kind], self.model[kind]
            out[f"{kind}_steps"] = len(walls)
            out[f"{kind}_step_ms"] = 1000 * sum(walls) / len(walls) if walls else None
            out[f"{kind}_forward_ms"] = 1000 * sum(models) / len(models) if models else None
        return out


def engine_events(decoder, prompts: list[list[int]], slots: int, out: list) -> Iterator:
    """Every prompt into a continuous engine of `slots` slots; its step events, each answer
    into `out` at the prompt's index as it finishes."""
    engine = decoder.engine(slots, "continuous")
    for i, prompt in enumerate(prompts):
        engine.add(prompt, key=i)
    while engine.has_work:
        step = engine.step()
        for f in step.finished:
            out[f.key] = f.tokens
        if step.event is not None:
            yield step.event


def timed(run, model: torch.nn.Module, device: torch.device, deadline=None) -> StepTimes:
    """Iterate a decode run (a DecodeRun or engine_events) step by step, timing each step.

    Stops early (`cut_short`) when `deadline` has passed; the steps measured so far stand.
    """
    times = StepTimes()
    with ForwardTimer(model, device) as timer:
        sync(device)
        last = time.perf_counter()
        for event in run:
            sync(device)
            now = time.perf_counter()
            times.add(event.refresh, now - last, timer.take())
            times.forwards = event.forwards
            times.tokens += sum(len(c.positions) for c in event.commits)
            if deadline is not None and deadline.passed:
                times.cut_short = True
                break
            last = time.perf_counter()
    return times


class PeakMemory:
    """Peak CUDA memory allocated inside the block (None on other devices)."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            sync(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)


def kernel_share(step, device: torch.device, steps: int) -> dict:
    """torch.profiler over `steps` calls of `step()`: the share of their wall time the GPU
    spent running kernels (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        wall = time.perf_counter() - began
    cuda = torch.autograd.DeviceType.CUDA
    busy_us = sum(  # kernels, copies and memsets: one stream, so they do not overlap
        e.time_range.elapsed_us() for e in prof.events() or () if e.device_type == cuda
    )
    return {"profiled_steps": steps, "wall_s": wall, "kernel_s": busy_us / 1e6,
            "kernel_share": busy_us / 1e6 / wall if wall > 0 else None}  # fmt: skip
