"""Distillation losses against a *sparse* teacher: its top-k logits (values + vocabulary indices) per position.

Used when ``distill.teacher_signal=cached``: the teacher's logits were computed once and only the k largest per
position were stored (:mod:`distill.teacher`).

Renormalisation (what the loss compares)
    The teacher distribution is the softmax over its k stored logits only,
    ``p~_i = softmax(v / T)_i`` for ``i`` in the top-k ids ``I`` (0 elsewhere): the tail mass ``1 - sum_I p_i`` is
    dropped and the k kept probabilities are rescaled to sum to 1 (their ratios are exact).
    The student is *not* renormalised: ``log q_i`` is gathered at ``I`` from the full-vocabulary
    ``log_softmax(student_logits / T)``. So

        topk_forward_kl_t = T^2 * sum_{i in I} p~_i (log p~_i - log q_i).

    Why the student stays normalised over the full vocabulary: mass the draft puts on ids outside ``I`` lowers
    every ``log q_i`` and is therefore penalised; renormalising the student over ``I`` as well would make that mass
    free, and the draft would learn to propose tokens the target never ranks highly, which costs acceptance.
    With ``k = V`` the value equals :func:`distill.losses.forward_kl` exactly (same formula, same support). With
    ``k < V`` it differs from the dense loss by at most the effect of the dropped tail; the trainer tests bound the
    difference on real tiny models when the top-k covers the mass.

For the other divergences (generalized JSD with beta < 1, TVD, skew KL) :func:`densify_topk` rebuilds full
``(B, T, V)`` teacher logits with ``-inf`` outside the top-k, i.e. the same renormalised ``p~``, and the dense
functions of :mod:`distill.losses` are applied. Reverse KL (and JSD with beta = 1) is infinite whenever the student
puts mass outside the top-k, so :class:`distill.config.DistillConfig` rejects it with a cached teacher.

Shapes: ``student_logits (B, T, V)``, ``values (B, T, k)`` float, ``indices (B, T, k)`` integer ids in ``[0, V)``,
``mask (B, T)`` bool (``None``: every position counts). Reductions as in :mod:`distill.losses` (``mean`` over the
mask, ``sum``, ``none``); an all-masked batch gives 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["topk_forward_kl", "densify_topk", "teacher_topk"]


def _check(student_logits: Tensor, values: Tensor, indices: Tensor, mask: Tensor | None, temperature: float,
           reduction: str) -> None:
    if student_logits.dim() != 3:
        raise ValueError(f"student_logits must be (B, T, V), got shape {tuple(student_logits.shape)}")
    if values.shape != indices.shape or values.dim() != 3 or values.shape[:2] != student_logits.shape[:2]:
        raise ValueError(f"top-k values {tuple(values.shape)} and indices {tuple(indices.shape)} must both be "
                         f"(B, T, k) with (B, T) = {tuple(student_logits.shape[:2])}")
    if values.size(-1) > student_logits.size(-1):
        raise ValueError(f"top-k size {values.size(-1)} exceeds the student's vocabulary {student_logits.size(-1)}")
    if mask is not None and tuple(mask.shape) != tuple(student_logits.shape[:2]):
        raise ValueError(f"mask shape {tuple(mask.shape)} != logits (B, T) {tuple(student_logits.shape[:2])}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be mean, sum or none, got {reduction!r}")


def topk_forward_kl(student_logits: Tensor, values: Tensor, indices: Tensor, mask: Tensor | None = None, *,
                    temperature: float = 1.0, reduction: str = "mean") -> Tensor:
    """Forward KL ``KL(p~ || q_theta)`` against the renormalised teacher top-k (see the module docstring).

    Returns a 0-dim fp32 tensor (``(B, T)`` for ``reduction="none"``, zeros at masked positions).
    Raises ``ValueError`` on mismatched shapes, ``k > V``, a non-positive temperature or an unknown reduction.
    """
    _check(student_logits, values, indices, mask, temperature, reduction)
    B, T, _ = student_logits.shape
    keep = torch.ones(B, T, dtype=torch.bool, device=student_logits.device) if mask is None else \
        mask.to(device=student_logits.device, dtype=torch.bool)  # (B, T)
    s = torch.where(keep.unsqueeze(-1), student_logits.float(), 0.0)  # (B, T, V); masked rows never reach softmax
    v = torch.where(keep.unsqueeze(-1), values.to(s.device).float(), 0.0)  # (B, T, k)
    idx = indices.to(device=s.device, dtype=torch.long)  # (B, T, k)
    student_logp = F.log_softmax(s / temperature, dim=-1).gather(-1, idx)  # (B, T, k) full-vocab normalised
    teacher_logp = F.log_softmax(v / temperature, dim=-1)  # (B, T, k) renormalised over the top-k
    p = teacher_logp.exp()
    support = p > 0
    diff = torch.where(support, teacher_logp - student_logp, torch.zeros_like(p))  # 0 * log 0 = 0
    per_tok = (p * diff).sum(-1) * temperature**2  # (B, T)
    per_tok = torch.where(keep, per_tok, 0.0)
    if reduction == "none":
        return per_tok
    total = per_tok.sum()
    return total if reduction == "sum" else total / keep.sum().clamp(min=1)


def densify_topk(values: Tensor, indices: Tensor, vocab_size: int) -> Tensor:
    """Full teacher logits ``(B, T, V)`` (fp32) with the top-k ``values`` at ``indices`` and ``-inf`` elsewhere,
    so ``softmax`` of it is the renormalised top-k distribution ``p~``."""
    if values.shape != indices.shape:
        raise ValueError(f"values {tuple(values.shape)} and indices {tuple(indices.shape)} must have the same shape")
    out = torch.full((*values.shape[:-1], vocab_size), float("-inf"), dtype=torch.float32, device=values.device)
    return out.scatter_(-1, indices.to(device=values.device, dtype=torch.long), values.float())  # (B, T, V)


def teacher_topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest logits per position: ``logits (B, T, V)`` -> ``(values fp32 (B, T, k), indices int32
    (B, T, k))``, sorted by value (descending). Raises ``ValueError`` if ``k`` is not in ``[1, V]``."""
    if not 1 <= k <= logits.size(-1):
        raise ValueError(f"top-k size must be in [1, {logits.size(-1)}] (the vocabulary), got {k}")
    values, idx = logits.float().topk(k, dim=-1)  # (B, T, k) each
    return values, idx.to(torch.int32)
