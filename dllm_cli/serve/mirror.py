"""`dllm serve --tensor-parallel N`: rank 0 owns HTTP and the worker; the other ranks mirror its
engines, step for step.

Each turn of rank 0's worker, before it steps, `Leader.turn` broadcasts what changed its engines
since the last turn (engines made or dropped, requests added with their prompt ids and settings,
aborted, or ended by a stop string) and which engines it steps now; every other rank (`follow`)
applies the same changes to its own engines, in the same order, and steps the same engines, so
every rank runs the same collectives. An idle worker still broadcasts an empty turn every half
second: a rank that died is then noticed within the collective timeout, busy or not. The
broadcasts go over a gloo group of their own, with the collective timeout; a failed one, like a
failed collective of the model, is a `RankLost` that ends the server (worker.py answers every
request in flight with a 503 error object).

A request's logprobs and grammar (response_format) come with its `add`: every rank gathers
the candidates logprobs read, every rank's matcher follows the same committed tokens. A turn's
scoring estimate (echo + logprobs) comes with it: every rank runs its forwards after the steps,
as rank 0 does (scoring.py gathers each row's log-sum-exp and candidates). Every request one
process serves, the ranks serve.
"""

from __future__ import annotations

import signal
from datetime import timedelta

import torch.distributed as dist

from dllm_cli.models.collectives import RankLost, Shards
from dllm_cli.runtime import Runtime
from dllm_cli.serve import engines, scores


class Channel:
    """rank 0 -> every rank of the replica: one pickled message per turn (gloo)."""

    def __init__(self, shards: Shards):
        self.shards = shards
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=shards.timeout))

    def broadcast(self, message: object = None) -> object:
        box = [message]
        with self.shards.guarded():
            dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


class Leader:
    """Rank 0's worker's record of its engines' changes, sent before each turn's steps."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self.changes: list[tuple] = []

    def note(self, *change) -> None:
        """An engine change (`build`, `drop`, `add`, `abort`, `stop`), sent with the next turn."""
        self.changes.append(change)

    def turn(self, stepped: list[engines.Group], split: scores.Split | None = None) -> None:
        """The changes so far, the engines stepped now and the scoring estimate made after
        them, to every other rank."""
        changes, self.changes = self.changes, []
        self.channel.broadcast((changes, stepped, split))

    def close(self) -> None:
        """The server stops: the other ranks leave their loops."""
        self.channel.broadcast(None)


def follow(runtime: Runtime, slots: int, channel: Channel) -> None:
    """A rank other than 0: rank 0's engine changes and steps, until it closes. SIGINT and
    SIGTERM (torchrun's stop, Ctrl-C) are rank 0's to act on: it finishes the requests in
    flight, then closes; this rank steps them with it."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    pools: dict[engines.Group, engines.Pool] = {}
    while (message := channel.broadcast()) is not None:
        changes, stepped, split = message
        for change in changes:
            apply(pools, runtime, slots, change)
        for group in stepped:
            step(pools, group)
        if split is not None:
            score(runtime, split)


def step(pools: dict, group: engines.Group) -> None:
    """One step of rank 0's; an engine that fails drops out, as rank 0's does (worker.py
    step_or_drop: its `drop` then comes with the next turn)."""
    try:
        pools[group].engine.step()
    except RankLost:
        raise
    except Exception:  # every rank raised it at the same point: rank 0 answers the requests
        del pools[group]


def score(runtime: Runtime, split: scores.Split) -> None:
    """Rank 0's scoring estimate, its forwards and gathers with it (rank 0 answers)."""
    try:
        split.estimate(runtime)
        if split.last:
            scores.final_forwards(runtime, split.ids, split.score)
    except RankLost:
        raise
    except Exception:  # every rank raised it at the same point: rank 0 answers it 500
        pass


def apply(pools: dict, runtime: Runtime, slots: int, change: tuple) -> None:
    """One of rank 0's engine changes (`Leader.note`), made to this rank's engines."""
    kind, group, *args = change
    if kind == "build":
        pools[group] = engines.build(runtime, group, slots)
    elif kind == "drop":
        pools.pop(group, None)  # (gone already when its step failed here too)
    elif kind == "add":
        add(pools[group].engine, *args)
    elif kind == "abort":
        pools[group].engine.abort(*args)
    else:  # "stop": a stop string ended the request on rank 0
        engines.stop_early(pools[group].engine, *args)


def add(engine, ids, settings, rid: int, logprobs, grammar) -> None:
    """Rank 0's request, with its logprobs (every rank gathers the candidates they read) and
    grammar."""
    mine = engine.add(ids, settings=settings, logprobs=logprobs)
    if mine != rid:  # the engines are deterministic: this is a bug, not bad input
        raise RuntimeError(f"request {mine} on this rank is request {rid} on rank 0")
    if grammar is not None:  # response_format: its matcher here follows rank 0's
        engine.stepper.committer.bind(rid, grammar)
