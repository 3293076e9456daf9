"""The properties every unmask rule keeps, written once and checked with each rule's settings."""

from __future__ import annotations

from decode_fixtures import MASK, SPECIAL, prompts, settings, tiny
from test_decode_continuous import stream

from dllm_cli.decoding import Decoder, decode


def assert_rows_decode_alone(kind: str, cache: str, rule: dict) -> None:
    """Deterministic, no [MASK] left, several tokens a step, batch == single == rows apart."""
    model, ps = tiny(kind, seed=2, head_scale=4.0).model, prompts([3, 8, 5], seed=3)
    s = settings(cache=cache, gen_length=12, **rule)
    batch = decode(model, SPECIAL, ps, s)
    assert batch.tokens == decode(model, SPECIAL, ps, s).tokens  # deterministic
    assert all(MASK not in row for row in batch.tokens)
    assert batch.steps < 12  # commits several tokens in some step
    apart = Decoder(model, SPECIAL, s).run(ps, lockstep=False).result()
    for row, prompt in enumerate(ps):
        alone = decode(model, SPECIAL, [prompt], s).tokens[0]
        assert batch.tokens[row] == alone == apart.tokens[row], row


def assert_stops_prunes_and_batches_continuously(
    kind: str, cache: str, window: int, rule: dict
) -> None:
    """Early stop and suffix pruning keep each row's text, static and continuous alike."""
    model = tiny(kind, seed=1, head_scale=4.0, eos_from=9).model
    ps = prompts([3, 9, 5, 1], seed=1)
    s = settings(cache=cache, gen_length=16, early_stop=True, suffix_window=window, **rule)
    want = [decode(model, SPECIAL, [p], s).tokens[0] for p in ps]
    assert decode(model, SPECIAL, ps, s).tokens == want
    out, refused, _ = stream(model, ps, s, slots=2)
    assert not refused
    assert [out[i].tokens for i in range(len(ps))] == want
    assert all(MASK not in row for row in want)
