"""The canvas view (rendered into a recording console) and `dllm visualize`."""

from __future__ import annotations

import io

from cli_fixtures import (  # noqa: F401
    cli_ckpt_fixture,
    invoke,
    isolated_fixture,
    profile_file_fixture,
)
from rich.console import Console

from dllm_cli.commands import visualize
from dllm_cli.decoding import DecodeResult, RowCommit, StepEvent
from dllm_cli.settings import DecodeSettings
from dllm_cli.view import CanvasView, spell

WORDS = {1: " one", 2: " two", 3: " three", 9: "<eos>"}


def words(ids: list[int]) -> str:
    """A word-level tokenizer's decode: every token starts a word."""
    return "".join(WORDS[t] for t in ids)


def settings(**kw) -> DecodeSettings:
    return DecodeSettings(**{"gen_length": 8, "block_length": 4, "cache": "dual"} | kw)


def step(n: int, block: int, commits: dict[int, int], window=(0, 4), frozen=None, accepted=None):
    row = RowCommit(0, tuple(commits), tuple(commits.values()), tuple(0.9 for _ in commits))
    return StepEvent(n, block, n, window, n == 0, frozen, n + 1, (row,), (), accepted)


def draw(view: CanvasView, width: int = 100) -> str:
    console = Console(record=True, width=width, file=io.StringIO(), force_terminal=True)
    console.print(view.render())
    return console.export_text()


def test_view_shows_masks_block_markers_and_stats():
    view = CanvasView(settings(unmask="threshold"), words, stop_ids=(9,))
    view.update(step(0, 0, {0: 1, 2: 3}), seconds=0.5)
    text = draw(view)
    assert "step 1" in text and "block 1/2" in text and "+2 tokens" in text
    assert "forwards 1" in text and "4.0 tok/s" in text
    assert "cache dual" in text and "threshold 0.9" in text and "accepted" not in text
    b0, b1 = (line for line in text.splitlines() if " B0 " in f" {line} " or " B1 " in line)
    assert b0.startswith("▶ B0") and b0.split()[2:] == ["one", "░", "three", "░"]
    assert b1.startswith("· B1") and b1.split()[2:] == ["░"] * 4


def test_finished_blocks_are_marked_cached_or_done():
    view = CanvasView(settings(), words, stop_ids=(9,))
    view.update(step(0, 0, {0: 1, 1: 2, 2: 3, 3: 1}), seconds=0.1)
    view.update(step(1, 1, {4: 2}, window=(4, 8), accepted=3), seconds=0.2)
    text = draw(view)
    assert "❄ B0" in text and "▶ B1" in text and "accepted 3" in text
    result = DecodeResult([[1, 2, 3, 1, 2, 9, 9, 9]], [[0] * 8], [3], 2, 2, 0.2)
    view.finish(result)
    text = draw(view)
    assert "(done)" in text and "✓ B1" in text and "∎" in text and "░" not in text.split("\n", 2)[1]


def test_pruned_suffix_blocks_are_marked_and_move_on_with_the_block():
    view = CanvasView(settings(gen_length=16, suffix_window=4), words)
    view.update(step(0, 0, {0: 1}, window=(0, 8)), seconds=0.1)
    text = draw(view)
    assert "· B1" in text and "✂ B2" in text and "✂ B3" in text and "pruned" in text
    view.update(step(1, 1, {4: 1}, window=(0, 12)), seconds=0.2)
    assert "· B2" in draw(view) and "✂ B3" in draw(view)
    assert "✂" not in draw(CanvasView(settings(gen_length=16), words))


def test_freecache_marks_frozen_blocks_from_events():
    view = CanvasView(settings(cache="freecache"), words)
    view.update(step(0, 0, {0: 1, 1: 2, 2: 3, 3: 1}, window=(0, 8)), seconds=0.1)
    view.update(step(1, 1, {4: 1}, window=(0, 8)), seconds=0.2)
    assert "✓ B0" in draw(view)  # finished, but its K/V is not frozen yet
    view.update(step(2, 1, {5: 1}, window=(0, 8), frozen=(0, 4)), seconds=0.3)
    assert "❄ B0" in draw(view)


def test_visualize_prints_the_answer_and_a_line_per_step(profile_file):
    answer = invoke("generate", "how many apples", "-p", str(profile_file)).stdout
    result = invoke("visualize", "how many apples", "-p", str(profile_file))
    assert result.exit_code == 0, result.output
    assert result.stdout == answer
    assert "step 1 block 1/2:" in result.stderr and "forwards" in result.stderr


def test_visualize_live_and_replay_on_a_terminal(profile_file, monkeypatch):
    answer = invoke("generate", "how many apples", "-p", str(profile_file)).stdout
    monkeypatch.setattr(visualize, "stderr_is_terminal", lambda: True)
    for extra in ([], ["--replay", "--delay", "0.001"]):
        result = invoke("visualize", "how many apples", "-p", str(profile_file), *extra)
        assert result.exit_code == 0, result.output
        assert result.stdout == answer
        assert "B0" in result.stderr and "cache dual" in result.stderr


def test_save_svg_and_html(profile_file, tmp_path):
    svg, html = tmp_path / "run.svg", tmp_path / "run.html"
    assert invoke("visualize", "hi", "-p", str(profile_file), "--save", str(svg)).exit_code == 0
    assert svg.read_text().lstrip().startswith("<svg") and "cache" in svg.read_text()
    assert invoke("visualize", "hi", "-p", str(profile_file), "--save", str(html)).exit_code == 0
    page = html.read_text()
    assert "<html" in page.lower() and "step 1" in page and "final" in page


def test_save_html_is_a_player_with_the_prompt_escaped_and_says_where(profile_file, tmp_path):
    page = tmp_path / "run.html"
    prompt = "<script>alert(1)</script> & how many apples"
    result = invoke("visualize", prompt, "-p", str(profile_file), "--save", str(page))
    assert result.exit_code == 0, result.output
    html = page.read_text()
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)&lt;/script&gt; &amp;" in html
    frames = html.count('<pre class="frame"')
    assert frames >= 2 and html.count(" hidden>") == frames - 1  # no script: the final frame
    assert 'id="play"' in html and 'id="slider"' in html and "ArrowRight" in html
    assert "test-llada" in html and "threshold" in html  # the settings
    assert f"dllm: note: wrote {page}: a player of {frames - 1} steps" in result.stderr


def test_save_refuses_other_formats_before_loading(tmp_path):
    result = invoke("visualize", "hi", "-p", "nope", "--save", str(tmp_path / "x.png"))
    assert result.exit_code == 2 and ".svg" in result.stderr and not (tmp_path / "x.png").exists()


def test_tokens_are_spelled_as_one_safe_cell():
    assert [spell(t) for t in ("\n", " ", " word ", "\x1b[2J")] == ["↵", "␣", "word", "\\x1b[2J"]


def test_view_shows_guided_counts_and_marks_the_guides_tokens():
    view = CanvasView(settings(), words, stop_ids=(9,))
    row = RowCommit(0, (0, 1, 2), (1, 2, 3), (0.9, 0.8, 0.1), corrected=(False, False, True))
    event = StepEvent(0, 0, 0, (0, 8), True, None, 1, (row,), accepted=2, guide_forwards=3,
                      corrected=1)  # fmt: skip
    view.update(event, seconds=0.5)
    text = draw(view, width=200)
    assert "accepted 2" in text and "corrected 1" in text and "forwards 1 (+3 guide)" in text
    assert "inverse: the guide's token" in text
    cells = [view.token_cell(p) for p in range(3)]
    assert [c.style.reverse for c in cells] == [None, None, True]
    assert view.summary().endswith("forwards 1 (+3 guide), accepted 2, corrected 1")


def test_blocks_past_the_answers_end_share_one_row():
    view = CanvasView(settings(gen_length=32, block_length=4), words, stop_ids=(9,))
    view.update(step(0, 0, {0: 1, 1: 2, 2: 3, 3: 1, 4: 2, 5: 9}), seconds=0.1)
    assert "· B7" in draw(view)  # not filled yet: every block its own row
    view.finish(DecodeResult([[1, 2, 3, 1, 2, 9] + [9] * 26], [[0] * 32], [3], 1, 1, 0.1))
    rows = [line for line in draw(view).splitlines() if " B" in line]
    assert [r.split()[1] for r in rows] == ["B0", "B1", "B2-B7"]
    assert rows[1].split()[2:] == ["two", "∎", "∎", "∎"] and rows[2].split()[2:] == ["∎", "×", "24"]
