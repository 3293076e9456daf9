"""The Python API: `from dllm_cli import LLM` decodes as the CLI does, the README example runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dllm_cli.errors import InputError, ProfileError, SettingsError

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(scope="module")
def llm():
    from dllm_cli import LLM

    return LLM("tiny-gsm", gen_length=32, cache="dual")


def test_generate_equals_decoding_alone_and_counts_are_each_prompts_own(llm):
    from dllm_cli.decoding import decode

    prompts = ["What is 2 + 3?", "Tom has 3 apples and buys 2 more. How many?"]
    out = llm.generate(prompts, batch_size=2)
    rt = llm.runtime
    for prompt, c in zip(prompts, out, strict=True):
        alone = decode(rt.loaded.model, rt.loaded.special, [rt.prepare(prompt)], rt.settings)
        assert c.prompt == prompt and c.token_ids == alone.tokens[0]
        assert c.text == rt.text(alone.tokens[0])
        assert c.steps == alone.steps and c.forwards == alone.forwards and c.seconds > 0


def test_stream_pieces_add_up_to_the_generated_text(llm):
    pieces = list(llm.stream("What is 7 - 4?", gen_length=32))
    assert len(pieces) >= 1
    assert "".join(pieces) == llm.generate("What is 7 - 4?")[0].text


def test_bad_settings_and_prompts_raise_the_cli_errors(llm):
    with pytest.raises(SettingsError, match="gen_length"):
        llm.generate(["x"], gen_length=0)
    with pytest.raises(ProfileError, match="unknown setting"):
        llm.generate(["x"], gen_lenght=8)
    with pytest.raises(InputError, match="empty prompt"):
        llm.generate([" "])
    with pytest.raises(InputError, match="batch_size"):
        llm.generate(["x"], batch_size=0)
    with pytest.raises(SettingsError, match="fixed"):
        llm.generate(["x"], model="elsewhere")


def test_the_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    example = next(b for b in blocks if "from dllm_cli import LLM" in b)
    run = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 3 and "steps" in lines[0] and "forwards" in lines[1]


def test_importing_the_package_does_not_load_the_api():
    code = "import sys, dllm_cli; print('dllm_cli.api' in sys.modules, 'torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.stdout.split() == ["False", "False"]


def test_per_call_sampling_is_each_requests_own(llm):
    """temperature / seed per call go to each request: a batch answers as each prompt alone."""
    prompts = ["What is 2 + 3?", "Tom has 3 apples and buys 2 more. How many?", "What is 9 - 4?"]
    batch = llm.generate(prompts, batch_size=2, temperature=1.0, seed=4)
    assert [c.token_ids for c in batch] == [
        llm.generate(p, temperature=1.0, seed=4)[0].token_ids for p in prompts
    ]
    assert llm.runtime.settings.temperature == 0  # the loaded settings are untouched
    assert batch[0].token_ids != llm.generate(prompts[0], temperature=1.0, seed=5)[0].token_ids
    with pytest.raises(SettingsError, match="temperature must be 0"):
        llm.generate("x", temperature=-1.0)
    with pytest.raises(SettingsError, match="stop must be a list of token ids"):
        llm.generate("x", stop="done")


def test_score_is_the_reference_estimate_of_the_continuation(llm):
    from dllm_cli import scoring
    from dllm_cli.chat import encode_plain

    loaded = llm.runtime.loaded
    got = llm.score("Tom has 3 apples and buys 2 more. 3 + 2 =", " 5", samples=8, seed=3)
    head = encode_plain(loaded.tokenizer, "Tom has 3 apples and buys 2 more. 3 + 2 =")
    whole = encode_plain(loaded.tokenizer, "Tom has 3 apples and buys 2 more. 3 + 2 = 5")
    want = scoring.estimate(
        loaded.model, loaded.special.mask, "llada", head, whole[len(head) :], samples=8, seed=3
    )
    assert got == want.total < 0
    assert llm.score("3 + 2 =", " 5", samples=8, seed=3, chat=True) < 0


def test_api_errors_name_the_call_not_the_command_line(tmp_path):
    from block_checkpoints import write_sdar

    from dllm_cli.api import LLM
    from dllm_cli.errors import SettingsError

    folder = str(write_sdar(tmp_path / "sdar").folder)
    with pytest.raises(SettingsError, match=r"cache 'dual' \(from the LLM call's arguments\)"):
        LLM(model=folder, cache="dual")
    llm = LLM(model=folder, gen_length=8)
    with pytest.raises(SettingsError, match=r"unmask 'wino' \(from the LLM call's arguments\)"):
        llm.generate("hi", unmask="wino")
