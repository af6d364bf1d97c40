"""Draft-length policies: how many tokens the draft proposes per verify step.

The decoder asks :meth:`DraftLengthPolicy.propose_length` for the step's draft length gamma, asks
:meth:`DraftLengthPolicy.keep_drafting` after every drafted token (per row, from the draft's top probability), and
reports the outcome with :meth:`DraftLengthPolicy.update`. Policies only look at the draft's own distribution and at
past outcomes, never at the current step's target output, so rejection sampling stays exact.

Policies are stateful (the adaptive one learns across calls); create a fresh one (``make_policy``) per run when
independent runs are wanted.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

import torch

__all__ = [
    "DraftLengthPolicy",
    "FixedDraftLength",
    "AdaptiveDraftLength",
    "ConfidenceDraftLength",
    "make_policy",
]


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low} (got {value!r}).")
    return value


class DraftLengthPolicy:
    """Base class. Subclasses set ``max_draft_tokens`` and override what they need."""

    #: whether :meth:`keep_drafting` can stop a row early (the decoder then checks it after every draft token)
    uses_confidence: bool = False
    max_draft_tokens: int = 1

    def propose_length(self) -> int:
        """Draft length gamma (>= 1) for the next verify step."""
        raise NotImplementedError

    def keep_drafting(self, top_prob: torch.Tensor) -> torch.Tensor:
        """``top_prob (B,)``: the draft's highest probability for the next token -> ``(B,)`` bool, True = draft it."""
        return torch.ones_like(top_prob, dtype=torch.bool)

    def update(self, draft_lengths: Sequence[int], accepted_lengths: Sequence[int]) -> None:
        """Outcome of one verify step, one entry per active row: tokens proposed and tokens accepted."""

    def reset(self) -> None:
        """Forget learned state."""


class FixedDraftLength(DraftLengthPolicy):
    """Always propose ``num_draft_tokens`` tokens (the classic constant gamma)."""

    def __init__(self, num_draft_tokens: int = 4):
        self.max_draft_tokens = self.num_draft_tokens = _check_int("num_draft_tokens", num_draft_tokens, 1)

    def propose_length(self) -> int:
        return self.num_draft_tokens

    def __repr__(self) -> str:
        return f"FixedDraftLength({self.num_draft_tokens})"


class AdaptiveDraftLength(DraftLengthPolicy):
    """Grow or shrink gamma from a sliding window of recent block outcomes.

    After every ``window`` row-steps: if every block in the window was fully accepted, gamma grows by ``step``;
    otherwise it shrinks by ``step``; always clamped to ``[min_draft_tokens, max_draft_tokens]``. The window is then
    cleared so each decision uses fresh evidence (``window=1`` reproduces the Hugging Face "heuristic" schedule
    with symmetric steps).
    """

    def __init__(
        self,
        initial: int = 4,
        min_draft_tokens: int = 1,
        max_draft_tokens: int = 8,
        window: int = 4,
        step: int = 1,
    ):
        self.min_draft_tokens = _check_int("min_draft_tokens", min_draft_tokens, 1)
        self.max_draft_tokens = _check_int("max_draft_tokens", max_draft_tokens, 1)
        if self.max_draft_tokens < self.min_draft_tokens:
            raise ValueError(
                f"max_draft_tokens ({max_draft_tokens}) must be >= min_draft_tokens ({min_draft_tokens})."
            )
        self.initial = _check_int("initial", initial, 1)
        if not (min_draft_tokens <= initial <= max_draft_tokens):
            raise ValueError(
                f"initial must be in [min_draft_tokens, max_draft_tokens] = [{min_draft_tokens}, {max_draft_tokens}]"
                f" (got {initial})."
            )
        self.window = _check_int("window", window, 1)
        self.step = _check_int("step", step, 1)
        self.reset()

    def reset(self) -> None:
        self.current = self.initial
        self._recent: deque[bool] = deque(maxlen=self.window)

    def propose_length(self) -> int:
        return self.current

    def update(self, draft_lengths: Sequence[int], accepted_lengths: Sequence[int]) -> None:
        for k, n in zip(draft_lengths, accepted_lengths):
            if k <= 0:  # nothing was drafted (final token of a row): no evidence
                continue
            self._recent.append(n >= k)
            if len(self._recent) == self.window:
                delta = self.step if all(self._recent) else -self.step
                self.current = min(self.max_draft_tokens, max(self.min_draft_tokens, self.current + delta))
                self._recent.clear()

    def __repr__(self) -> str:
        return (
            f"AdaptiveDraftLength(current={self.current}, min={self.min_draft_tokens}, max={self.max_draft_tokens},"
            f" window={self.window}, step={self.step})"
        )


class ConfidenceDraftLength(DraftLengthPolicy):
    """Draft up to ``max_draft_tokens``, stopping a row when the draft's top probability falls below ``threshold``.

    The first token of a block is always drafted; a later token is drafted only if the draft's highest next-token
    probability (after the shared sampling pipeline; softmax of the raw logits for greedy) is ``>= threshold``.
    """

    uses_confidence = True

    def __init__(self, max_draft_tokens: int = 8, threshold: float = 0.5):
        self.max_draft_tokens = _check_int("max_draft_tokens", max_draft_tokens, 1)
        if not isinstance(threshold, (int, float)) or not (0.0 <= threshold <= 1.0):
            raise ValueError(f"threshold must be a float in [0, 1] (got {threshold!r}).")
        self.threshold = float(threshold)

    def propose_length(self) -> int:
        return self.max_draft_tokens

    def keep_drafting(self, top_prob: torch.Tensor) -> torch.Tensor:
        return top_prob >= self.threshold

    def __repr__(self) -> str:
        return f"ConfidenceDraftLength(max_draft_tokens={self.max_draft_tokens}, threshold={self.threshold})"


_POLICIES = {
    "fixed": FixedDraftLength,
    "adaptive": AdaptiveDraftLength,
    "confidence": ConfidenceDraftLength,
}


def make_policy(name: str, **cfg) -> DraftLengthPolicy:
    """Build a policy by name: ``"fixed"`` | ``"adaptive"`` | ``"confidence"``; ``cfg`` goes to its constructor.

    Raises:
        ValueError: unknown name, or invalid/unknown configuration keys.
    """
    if name not in _POLICIES:
        raise ValueError(f"unknown draft length policy {name!r}; expected one of {sorted(_POLICIES)}.")
    try:
        return _POLICIES[name](**cfg)
    except TypeError as e:
        raise ValueError(f"invalid configuration for draft length policy {name!r}: {e}") from e
