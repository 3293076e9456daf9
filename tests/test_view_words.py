"""The canvas view spells answers as the tokenizer does: words whole, numbers whole, on one line.

Real tokenizers: the shipped Dream model's (WordPiece pieces after a `▁` word start) and a
byte-level BPE one in Qwen2/Dream's format (a lone `Ġ` before each digit, UTF-8 characters
split over byte tokens).
"""

from __future__ import annotations

import io

import pytest
from checkpoints import write_dream_tokenizer
from rich.console import Console

from dllm_cli.decoding import RowCommit, StepEvent
from dllm_cli.models.loading import load_tokenizer, resolve_path
from dllm_cli.settings import DecodeSettings
from dllm_cli.view import CanvasView

ANSWER = "Tom has 3 rolls. He buys 45 more rolls. 3 + 45 = 48. The answer is 48."


@pytest.fixture(scope="module")
def shipped():
    return load_tokenizer(resolve_path("builtin:tiny-gsm-dream"))


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe")
    write_dream_tokenizer(folder)
    return load_tokenizer(folder)


def commit(step: int, block: int, positions, ids) -> StepEvent:
    row = RowCommit(0, tuple(positions), tuple(ids), tuple(0.9 for _ in ids))
    return StepEvent(step, block, step, (0, 64), step == 0, None, step + 1, (row,))


def view_of(tokenizer, text: str, gen: int = 64, block: int = 32, **kw) -> CanvasView:
    """A view with `text`'s tokens committed in one step, the rest of the canvas masked."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    view = CanvasView(
        DecodeSettings(gen_length=gen, block_length=block), tokenizer.decode, (), **kw
    )
    view.update(commit(0, 0, range(len(ids)), ids), seconds=0.1)
    return view


def draw(view: CanvasView, width: int = 200) -> list[str]:
    console = Console(record=True, width=width, file=io.StringIO(), force_terminal=True)
    console.print(view.render())
    return console.export_text().splitlines()


def row(lines: list[str], block: int) -> str:
    """The text of block `block`'s row (its wrapped lines joined), marker cut."""
    start = next(i for i, line in enumerate(lines) if f" B{block} " in f" {line} ")
    out = [lines[start][5:]]
    for line in lines[start + 1 :]:
        if not line.startswith("     ") or not line.strip():
            break
        out.append(line[5:])
    return " ".join(part.strip() for part in out)


def cells(text: str) -> list[str]:
    return [c for c in text.split() if c not in ("░", "∎")]


@pytest.mark.parametrize("tok", ["shipped", "byte_bpe"])
def test_sub_word_pieces_are_joined_as_the_tokenizer_decodes_them(tok, request):
    tokenizer = request.getfixturevalue(tok)
    view = view_of(tokenizer, ANSWER)
    assert cells(row(draw(view), 0) + " " + row(draw(view), 1)) == ANSWER.split()


def test_a_character_split_over_byte_tokens_is_one_character(byte_bpe):
    text = "café ☕ costs 12"
    assert len(byte_bpe.encode("☕", add_special_tokens=False)) > 1  # really split into bytes
    view = view_of(byte_bpe, text)
    assert cells(row(draw(view), 0)) == text.split()
    assert "�" not in "".join(draw(view))


def test_pieces_keep_their_own_commit_styles(shipped):
    """A word whose pieces were committed in two steps shows each piece in its step's colour."""
    ids = shipped.encode("rolls", add_special_tokens=False)
    assert len(ids) > 2
    view = CanvasView(DecodeSettings(gen_length=8, block_length=8), shipped.decode)
    view.update(commit(0, 0, range(2), ids[:2]), seconds=0.1)
    view.update(commit(1, 0, range(2, len(ids)), ids[2:]), seconds=0.2)
    start, end = view.speller.words([view.word_token(p) for p in range(8)])[0]
    cell = view.word_cell(start, end)
    assert cell.plain == "rolls" and (start, end) == (0, len(ids))
    colours = {cell[i].spans[0].style.color for i in range(len(cell))}
    assert colours == {view.token_style(0).color, view.token_style(2).color}


def test_a_number_across_a_block_boundary_stays_on_one_line(shipped):
    """`48` whose `8` falls in the next block is drawn whole where it starts."""
    prefix = "The answer is"
    n = len(shipped.encode(prefix, add_special_tokens=False))
    view = view_of(shipped, f"{prefix} 48.", gen=2 * (n + 1), block=n + 1)  # `▁4` ends block 0
    lines = draw(view)
    assert cells(row(lines, 0)) == ["The", "answer", "is", "48."]
    assert cells(row(lines, 1)) == []


def test_a_number_is_never_wrapped_inside(shipped):
    view = view_of(shipped, "12345 + 67890 = 80235. " * 4, gen=128, block=128)
    lines = draw(view, width=41)
    canvas = lines[lines.index(next(x for x in lines if " B0 " in f" {x} ")) :]
    canvas = canvas[: canvas.index(next(x for x in canvas if x.startswith("░ mask")))]
    assert len(canvas) >= 4  # it did wrap
    for line in canvas:
        for word in line.split():
            if word.rstrip(".").isdigit():
                assert len(word.rstrip(".")) == 5, line


def test_a_newline_and_masks_still_separate_cells(shipped):
    ids = shipped.encode("Tom has\n3 rolls", add_special_tokens=False)
    view = CanvasView(DecodeSettings(gen_length=16, block_length=16), shipped.decode)
    positions = [p for p in range(len(ids)) if p != 1]  # `▁has` still masked
    view.update(commit(0, 0, positions, [ids[p] for p in positions]), seconds=0.1)
    assert row(draw(view), 0).split()[:5] == ["Tom", "░", "↵", "3", "rolls"]


def test_current_block_is_where_a_guided_step_left_off(shipped):
    """A guided step that starts in block 0 and commits into block 1 leaves off in block 1:
    block 1 is current (it showed `·`, waiting, while holding committed tokens)."""
    ids = shipped.encode(ANSWER, add_special_tokens=False)
    settings = DecodeSettings(gen_length=64, block_length=16)
    view = CanvasView(settings, shipped.decode, guided=True)
    view.update(commit(0, 0, range(10), ids[:10]), seconds=0.1)
    view.update(commit(1, 0, range(10, 20), ids[10:20]), seconds=0.2)  # runs into block 1
    lines = draw(view)
    markers = {line[2:4]: line[0] for line in lines if line[2:4] in ("B0", "B1", "B2")}
    assert markers == {"B0": "✓", "B1": "▶", "B2": "·"}
    assert "block 2/4" in lines[0] and view.summary().startswith("step 2 block 2/4:")


def test_header_says_when_guided_decoding_writes_left_to_right(shipped):
    guided = draw(view_of(shipped, ANSWER, guided=True))[1]
    assert "guided: left to right (--no-guide: diffusion order)" in guided
    assert "unmask" not in guided  # the guide, not the unmask rule, chooses the commits
    plain = draw(view_of(shipped, ANSWER))[1]
    assert "left to right" not in plain and "unmask fixed" in plain
