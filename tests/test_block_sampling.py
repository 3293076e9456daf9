"""Per-request sampling in the block-causal engine (SDAR, LLaDA2): a sampled request's answer is
the same alone, in a static batch, and admitted continuously beside other traffic."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from block_checkpoints import write_llada2, write_sdar

from dllm_cli.decoding import decode
from dllm_cli.decoding.run import open_engine
from dllm_cli.errors import SettingsError
from dllm_cli.models.loading import load_model
from dllm_cli.settings import DecodeSettings

PROMPTS = ([5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 7, 8, 9, 11], [12], [20, 21, 22, 23, 24])
OWN = (
    {"temperature": 1.0, "seed": 1},
    {},
    {"temperature": 0.8, "top_k": 4, "seed": 2},
    {"temperature": 1.0, "top_p": 0.9, "seed": 1},
)
WRITERS = {"sdar": write_sdar, "llada2": write_llada2}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def loaded(request, tmp_path_factory):
    torch.set_num_threads(1)
    written = WRITERS[request.param](tmp_path_factory.mktemp(request.param) / request.param)
    return load_model(written.folder, device="cpu")


def run(loaded, s, admission: str, slots: int, late: bool) -> list[list[int]]:
    engine = open_engine(loaded.model, loaded.special, s, slots=slots, admission=admission)
    first = 2 if late else len(PROMPTS)
    for i in range(first):
        engine.add(PROMPTS[i], key=i, sampling=OWN[i])
    done, steps = {}, 0
    while engine.has_work:
        out = engine.step()
        steps += 1
        if late and steps == 3:  # arrivals while rows are mid-decode
            for i in range(first, len(PROMPTS)):
                engine.add(PROMPTS[i], key=i, sampling=OWN[i])
        for f in out.finished:
            done[f.key] = f.tokens
    return [done[i] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("cache", ["prefix", "none"])
def test_a_sampled_request_decodes_as_it_does_alone(loaded, cache):
    s = DecodeSettings(
        gen_length=12, block_length=4, cache=cache, unmask="threshold", threshold=0.05
    )
    alone = [
        decode(loaded.model, loaded.special, [p], replace(s, **own)).tokens[0]
        for p, own in zip(PROMPTS, OWN, strict=True)
    ]
    assert run(loaded, s, "static", 4, late=False) == alone
    assert run(loaded, s, "continuous", 2, late=True) == alone
    greedy = decode(loaded.model, loaded.special, [PROMPTS[0]], s).tokens[0]
    assert alone[0] != greedy  # sampling changed the answer


def test_stop_ids_and_schedule_settings_per_request_are_refused(loaded):
    s = DecodeSettings(gen_length=12, block_length=4, cache="prefix", unmask="threshold")
    engine = open_engine(loaded.model, loaded.special, s, slots=2)
    with pytest.raises(SettingsError, match="stop ids per request: not supported"):
        engine.add([5, 6], sampling={"stop": [3]})
    with pytest.raises(SettingsError, match="confidence per request: not supported"):
        engine.add([5, 6], sampling={"confidence": "margin"})
    with pytest.raises(SettingsError, match="threshold cannot change per request"):
        engine.add([5, 6], sampling={"threshold": 0.5})
