"""Where an answer ends: the list form (finished answers) and the tensor form (early stop) agree."""

from __future__ import annotations

import torch
from decode_fixtures import EOS, EOT, MASK, SPECIAL
from hypothesis import given
from hypothesis import strategies as st

from dllm_cli.decoding import answer_end, answer_length, answer_tokens, first_stop

STOP = SPECIAL.stop  # (EOS, EOT)


def test_an_answer_ends_at_its_first_stop_token():
    assert answer_end([5, 6, EOT, 7, EOS], STOP) == 2
    assert answer_tokens([5, 6, EOT, 7, EOS], STOP) == [5, 6]
    assert answer_length([5, 6, EOT, 7, EOS], STOP) == 3  # the stop token counts, not past it
    assert (answer_end([EOS, 7], STOP), answer_tokens([EOS, 7], STOP)) == (0, [])
    assert answer_length([EOS, 7], STOP) == 1
    assert answer_length([5, 6, 7], STOP) == 3  # never ended: every position counts
    assert answer_end([5, None, EOS], STOP) == 2  # a live view's canvas: None is not decoded


@given(
    st.lists(st.lists(st.sampled_from([4, 5, EOS, EOT, MASK]), min_size=6, max_size=6), min_size=1)
)
def test_the_tensor_form_finds_the_same_end_once_nothing_before_it_is_masked(rows):
    found = first_stop(torch.tensor(rows), torch.tensor(STOP), MASK).tolist()
    for row, at in zip(rows, found, strict=True):
        end = answer_end(row, STOP)
        final = end < len(row) and MASK not in row[:end]
        assert at == (end if final else len(row))
