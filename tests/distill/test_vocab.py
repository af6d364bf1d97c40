"""distill.teacher: padded embedding rows are tolerated (one warning), real vocabulary mismatches are errors."""
from __future__ import annotations

import warnings

import pytest
import torch

from distill.losses import forward_kl
from distill.teacher import VocabPaddingWarning, shared_vocab_size, slice_to_shared
from core.errors import VocabMismatchError


def test_equal_sizes_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert shared_vocab_size(64, 64, 60) == 64
        assert shared_vocab_size(60, 60, 60) == 60


@pytest.mark.parametrize("teacher,student", [(128, 64), (64, 128), (64, 61)])
def test_padded_rows_give_min_and_one_warning(teacher, student):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert shared_vocab_size(teacher, student, 60) == min(teacher, student)
    assert len(caught) == 1
    assert issubclass(caught[0].category, VocabPaddingWarning)
    msg = str(caught[0].message)
    assert "shared ids" in msg and str(teacher) in msg and str(student) in msg


@pytest.mark.parametrize("teacher,student", [(64, 50), (50, 64), (50, 50)])
def test_model_smaller_than_tokenizer_is_an_error(teacher, student):
    with pytest.raises(VocabMismatchError) as err:
        shared_vocab_size(teacher, student, 60)
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    assert f"vocab size {teacher}" in msg and f"vocab size {student}" in msg and "tokenizer size 60" in msg
    assert "resize_token_embeddings" in msg


def test_invalid_sizes():
    with pytest.raises(ValueError):
        shared_vocab_size(0, 64, 60)
    with pytest.raises(ValueError):
        shared_vocab_size(64, 64.0, 60)


def test_slice_to_shared_then_loss():
    teacher = torch.randn(2, 3, 128)
    student = torch.randn(2, 3, 64)
    with pytest.warns(VocabPaddingWarning):
        n = shared_vocab_size(128, 64, 60)
    assert slice_to_shared(student, n) is student
    t = slice_to_shared(teacher, n)
    assert t.shape == (2, 3, 64) and t.data_ptr() == teacher.data_ptr()
    with pytest.raises(ValueError, match=r"\(2, 3, 64\).*\(2, 3, 128\)"):
        forward_kl(student, teacher)
    assert torch.isfinite(forward_kl(student, t))
    with pytest.raises(ValueError):
        slice_to_shared(student, 65)
