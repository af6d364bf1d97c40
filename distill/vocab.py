"""Vocabulary alignment between the target (teacher) and the draft (student) output layers.

Models often pad their embedding / LM-head rows beyond the tokenizer's vocabulary (to a multiple of 64 or 128
for speed), so a target and a draft that share one tokenizer can still have different ``config.vocab_size``.
Rows beyond ``len(tokenizer)`` are never produced by the tokenizer, so the two models' logits are comparable over
the ids ``[0, n)`` with ``n = min(teacher_vocab_size, student_vocab_size) >= len(tokenizer)``: slice both logits
to ``n`` with :func:`slice_to_shared` before computing a divergence (``distill.losses``). Any other difference
means the two models do not share a vocabulary, which no slicing can fix: :class:`VocabMismatchError`.

A draft may also keep fewer output rows than the target on purpose: :func:`trim_draft_vocab` gives a draft being
trained a trimmed head over the ids it learns from most (``draft.draft_vocab_size``, :mod:`data.draft_vocab`).
"""
from __future__ import annotations

import warnings

from torch import Tensor

__all__ = ["VocabMismatchError", "VocabPaddingWarning", "shared_vocab_size", "shared_vocab", "slice_to_shared",
           "forced_ids", "trim_draft_vocab"]


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


def shared_vocab(target, draft, tokenizer, quiet: bool = False) -> tuple[int, int | None]:
    """``(shared, cut)`` of two loaded models sharing ``tokenizer``: :func:`shared_vocab_size` of their
    ``config.vocab_size``, and where their logits are cut (``shared``, or None when neither has padded rows beyond
    it). ``quiet``: no :class:`VocabPaddingWarning` (the caller's pair warns once). Raises as
    :func:`shared_vocab_size`."""
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore", VocabPaddingWarning)
        shared = shared_vocab_size(target.config.vocab_size, draft.config.vocab_size, len(tokenizer))
    return shared, shared if shared < max(target.config.vocab_size, draft.config.vocab_size) else None


def slice_to_shared(logits: Tensor, n: int) -> Tensor:
    """The first ``n`` vocabulary columns of ``logits`` (..., V) -> (..., n); a view, ``logits`` itself if V == n.

    Raises ``ValueError`` if ``n`` is not in ``[1, V]``.
    """
    vocab = logits.shape[-1]
    if not 1 <= n <= vocab:
        raise ValueError(f"cannot slice logits with vocab size {vocab} to {n} shared ids (need 1 <= n <= {vocab})")
    return logits if n == vocab else logits[..., :n]  # (..., n)


def forced_ids(tokenizer, target) -> list[int]:
    """Ids a trimmed draft vocabulary always keeps: the tokenizer's special tokens (chat-template markers, BOS,
    padding) and every EOS id of the target's generation config, so the draft can propose the end of an answer."""
    from decode.common import default_eos

    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    eos = default_eos(target)
    ids.update([eos] if isinstance(eos, int) else list(eos or []))
    return sorted(i for i in ids if i is not None and i >= 0)


def trim_draft_vocab(rc, pair, sig) -> dict:
    """``draft.draft_vocab_size = N``: give ``pair.draft`` a :class:`data.draft_vocab.TrimmedLMHead` over the ``N``
    ids most frequent in what this draft learns from (the target's generated answers with teacher data, else the
    training blocks), special tokens always kept, and map the learning signal to those ids: labels outside the
    kept set are ignored, the teacher (cached top-k or online logits) is conditioned on the kept set (its mass
    outside is dropped and the rest renormalised; docs/drafts.md). Returns the ``draft_vocab`` record for
    ``specdraft.json``.

    Raises:
        ValueError: ``N`` larger than the vocabulary or smaller than the special tokens; a draft whose vocabulary
            differs from the target's (padded rows) or an on-policy signal, which a trimmed head does not support.
    """
    import torch

    from data.draft_vocab import draft_vocab_record, install_trimmed_head, kept_mass, kept_token_ids

    from .models import count_parameters
    from .teacher import over_kept_ids

    if pair.cut is not None:
        raise ValueError("draft.draft_vocab_size needs a draft with the target's vocabulary size (this draft's "
                         "embedding is padded differently); drop draft.draft_vocab_size or rebuild the draft")
    if sig.answer_counts is not None:
        counts, on = sig.answer_counts, "target_answers"
    else:
        # every training block, not only those a short run reads: the distilled and baseline drafts count alike
        counts, on = torch.bincount(pair.blocks.flatten(), minlength=pair.shared).double(), "training_blocks"
    kept = kept_token_ids(counts[: pair.shared], rc.draft.draft_vocab_size, forced_ids(pair.tokenizer, pair.target))
    head = install_trimmed_head(pair.draft, kept)
    # draft.train_head (null: draft.train_embeddings) decides whether the kept rows train or stay the target's
    train_head = rc.draft.train_embeddings if rc.draft.train_head is None else rc.draft.train_head
    head.weight.requires_grad_(train_head)
    pair.draft_parameters = count_parameters(pair.draft)
    sig.teacher = over_kept_ids(sig.teacher, pair.draft)
    return draft_vocab_record(head, counted_on=on, counted_tokens=int(counts.sum()),
                              counted_share_kept=kept_mass(counts, kept), distinct_counted=int((counts > 0).sum()))
