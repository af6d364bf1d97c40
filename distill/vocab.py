"""Vocabulary alignment between the target (teacher) and the draft (student) output layers.

Models often pad their embedding / LM-head rows beyond the tokenizer's vocabulary (to a multiple of 64 or 128
for speed), so a target and a draft that share one tokenizer can still have different ``config.vocab_size``.
Rows beyond ``len(tokenizer)`` are never produced by the tokenizer, so the two models' logits are comparable over
the ids ``[0, n)`` with ``n = min(teacher_vocab_size, student_vocab_size) >= len(tokenizer)``: slice both logits
to ``n`` with :func:`slice_to_shared` before computing a divergence (``distill.losses``). Any other difference
means the two models do not share a vocabulary, which no slicing can fix: :class:`VocabMismatchError`.
"""
from __future__ import annotations

import warnings

from torch import Tensor

__all__ = ["VocabMismatchError", "VocabPaddingWarning", "shared_vocab_size", "slice_to_shared"]


class VocabMismatchError(ValueError):
    """The target's and draft's output vocabularies cannot be aligned over the tokenizer's ids."""


class VocabPaddingWarning(UserWarning):
    """The target and draft differ only by padded embedding rows; logits are compared over the shared ids."""


def _check_size(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def shared_vocab_size(teacher_vocab_size: int, student_vocab_size: int, tokenizer_vocab_size: int) -> int:
    """Number of leading logit columns over which target and draft are compared.

    Args:
        teacher_vocab_size: output rows of the target (teacher), e.g. ``target.config.vocab_size`` or
            ``target.get_output_embeddings().weight.shape[0]``.
        student_vocab_size: output rows of the draft (student).
        tokenizer_vocab_size: ``len(tokenizer)`` of the shared tokenizer (base vocabulary plus added tokens).

    Returns:
        ``teacher_vocab_size`` when the two are equal (no warning). When they differ only by padded rows beyond
        the tokenizer (both ``>= tokenizer_vocab_size``), ``min(teacher_vocab_size, student_vocab_size)`` and
        exactly one :class:`VocabPaddingWarning` saying the logits are compared over the shared ids.

    Raises:
        VocabMismatchError: a model has fewer output rows than the tokenizer has tokens (some token ids would
            have no logit), naming both sizes, the tokenizer size and the fix.
        ValueError: a size that is not a positive int.
    """
    teacher = _check_size("teacher_vocab_size", teacher_vocab_size)
    student = _check_size("student_vocab_size", student_vocab_size)
    tok = _check_size("tokenizer_vocab_size", tokenizer_vocab_size)
    sizes = f"target (teacher) vocab size {teacher}, draft (student) vocab size {student}, tokenizer size {tok}"
    short = [name for name, size in (("target (teacher)", teacher), ("draft (student)", student)) if size < tok]
    if short:
        raise VocabMismatchError(
            f"vocabulary mismatch: {sizes}. The {' and the '.join(short)} has fewer output rows than the tokenizer "
            "has tokens, so the two models do not share one vocabulary. Fix: build or load the draft with the "
            "target's tokenizer and resize its embeddings to cover it, e.g. "
            "draft.resize_token_embeddings(len(tokenizer)) (optionally pad_to_multiple_of=64), then re-train; "
            "padded rows beyond the tokenizer are fine and are sliced away."
        )
    if teacher == student:
        return teacher
    shared = min(teacher, student)
    warnings.warn(
        f"{sizes}: the models differ only by padded embedding rows beyond the tokenizer's vocabulary; "
        f"logits are compared over the shared ids [0, {shared}).",
        VocabPaddingWarning,
        stacklevel=2,
    )
    return shared


def slice_to_shared(logits: Tensor, n: int) -> Tensor:
    """The first ``n`` vocabulary columns of ``logits`` (..., V) -> (..., n); a view, ``logits`` itself if V == n.

    Raises ``ValueError`` if ``n`` is not in ``[1, V]``.
    """
    vocab = logits.shape[-1]
    if not 1 <= n <= vocab:
        raise ValueError(f"cannot slice logits with vocab size {vocab} to {n} shared ids (need 1 <= n <= {vocab})")
    return logits if n == vocab else logits[..., :n]  # (..., n)
