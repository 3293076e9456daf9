"""Block-causal families at the CLI edge: one-line refusals, bench strategies, edits in the view."""

from __future__ import annotations

import io

import pytest
from block_checkpoints import write_llada2
from cli_fixtures import error_lines, invoke
from rich.console import Console

from dllm_cli.bench import BLOCK_STRATEGIES
from dllm_cli.commands.bench import choose_strategies
from dllm_cli.decoding import RowCommit, StepEvent
from dllm_cli.settings import DecodeSettings
from dllm_cli.view import CanvasView


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_llada2(tmp_path_factory.mktemp("cli") / "llada2").folder


def test_a_setting_that_does_not_apply_is_one_line(folder):
    """A refused setting is one line (cache and unmask: cells of tests/test_family_matrix.py)."""
    flags, words = (
        ["--suffix-window", "8"],
        "suffix_window 8 (from the command line) does not apply",
    )
    result = invoke("generate", "--model", str(folder), "--gen-length", "8", *flags, "hi")
    assert result.exit_code == 2, result.output
    assert len(error_lines(result)) == 1 and words in error_lines(result)[0]
    assert "Traceback" not in result.output


def test_edit_threshold_is_refused_on_masked_families():
    result = invoke("generate", "-p", "tiny-gsm", "--edit-threshold", "0.5", "hi")
    assert result.exit_code == 2, result.output
    assert (
        "edit_threshold 0.5 (from the command line) does not apply to LLaDA: it is LLaDA2.1's"
        in result.stderr
    )


def test_bench_offers_the_block_strategies():
    assert choose_strategies(None, False, "sdar") == list(BLOCK_STRATEGIES)
    assert choose_strategies(None, False, "llada2") == list(BLOCK_STRATEGIES)


def test_view_shows_edits_as_replaced_tokens():
    s = DecodeSettings(gen_length=4, block_length=4, cache="prefix", edit_threshold=0.5)
    words = {1: "one", 2: "two", 3: "three"}
    view = CanvasView(s, lambda ids: " ".join(words[i] for i in ids))  # a tokenizer's decode
    fill = RowCommit(0, (0, 1), (1, 2), (0.9, 0.8))
    view.update(StepEvent(0, 0, 0, (0, 4), False, None, 1, (fill,)), seconds=0.1)
    edit = RowCommit(0, (1,), (3,), (0.7,))
    view.update(StepEvent(1, 0, 1, (0, 4), False, None, 2, (), drafts=(edit,)), seconds=0.2)
    console = Console(record=True, width=100, file=io.StringIO(), force_terminal=True)
    console.print(view.render())
    text = console.export_text()
    assert "three" in text and "two" not in text  # the edit replaced the committed token
    assert "1 tokens replaced" in text and "replaced by a token edit" in text
    assert "~1 replaced" in view.summary()


EDITING = dict(gen_length=16, block_length=4, edit_threshold=0.0, threshold=0.5, max_post_steps=2)


@pytest.mark.slow
def test_streamed_text_under_token_editing_is_the_final_answer(folder):
    """LLaDA2.1's edits may replace committed tokens of the active block, so streamed text
    (LLM.stream, the terminal's generate, chat) holds that block back: the pieces join to the
    answer, never to a provisional text plus a corrected copy."""
    from dllm_cli.api import LLM
    from dllm_cli.serve.session import Session

    llm = LLM(model=str(folder), **EDITING)
    prompts = ["how many apples", "Tom has 3 pens", "a cat sleeps"]
    edited = 0
    for prompt in prompts:
        final = llm.generate([prompt])[0].text
        assert "".join(llm.stream(prompt)) == final
        session = Session(llm.runtime)
        answer = session.answer(prompt, session.prompt(prompt))
        pieces = []
        for event, new in answer:
            pieces.append(new)
            edited += sum(len(d.positions) for d in event.drafts)
        assert "".join(pieces) + answer.rest == answer.text
    assert edited > 0  # edits happened


def test_visualize_counts_the_blocks_a_prompt_tail_opens(folder):
    """A prompt that does not fill whole blocks shares the first answer block: 32 tokens in
    blocks of 32 take two blocks, and steps spent past the answer say so."""
    result = invoke("visualize", "--model", str(folder), "--gen-length", "32", "hi")
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("step ")]
    assert "block 1/2" in lines[0] and "block 2/2" in lines[-1]
    assert all("/1:" not in line for line in lines)
    idle = [line for line in lines if "+0 tokens" in line]
    assert idle and all("columns past the answer" in line for line in idle)
