"""Token-level distillation losses for training a draft (student) against a target (teacher).

Every divergence here is a pure function with one signature::

    loss = fn(student_logits, teacher_logits, mask, *, temperature=1.0, <own keyword>,
              hard_label_weight=0.0, labels=None, chunk_size=None, reduction="mean")

Notation (docs/architecture.md, "Terms"): ``p`` is the target (teacher) next-token distribution, ``q`` (``q_theta``) is the
draft (student) one, both computed at the *same* temperature ``T``:
``p = softmax(teacher_logits / T)``, ``q = softmax(student_logits / T)``.

Shapes
    student_logits, teacher_logits: ``(B, T, V)`` float (fp32, bf16 or fp16; computed in fp32).
    mask: ``(B, T)`` bool (or 0/1 integer); ``True`` marks a token that counts. ``None`` counts every token.
    labels: ``(B, T)`` long, already aligned with the logits (``labels[b, t]`` is the token that
        ``logits[b, t]`` should predict); ``-100`` is ignored. Only used when ``hard_label_weight > 0``.

Conventions shared by every divergence
    * Temperature divides both logits and the divergence is multiplied by ``T**2`` so that gradient magnitudes do
      not shrink with ``T`` (Hinton et al. 2015, "Distilling the Knowledge in a Neural Network", Sec. 2).
    * Token mean over the mask: ``sum_{masked tokens} loss_t / token_count(mask)``. An all-masked batch gives
      ``0`` (finite, with zero gradients), never NaN.
    * ``reduction="sum"`` returns the sum over masked tokens instead. For gradient accumulation with a global
      token normalisation (docs/architecture.md, "Conventions") the trainer sums these per micro-batch and divides by
      ``token_count`` of the whole optimizer step; that gives exactly the gradient of the full-batch mean.
      ``reduction="none"`` returns the per-token losses ``(B, T)`` with zeros at masked positions.
    * Masked positions are replaced by zeros before any arithmetic, so garbage or ``-inf`` logits there change
      neither the value nor the gradients. ``-inf`` entries inside the vocabulary of a counted position (e.g.
      banned or padded ids) are fine: ``0 * log 0`` is taken as ``0`` with ``torch.where`` guards on the
      *inputs* of the product, so no NaN reaches the value or the gradient. (A divergence is genuinely ``+inf``
      when one distribution puts mass where the other has none, e.g. forward KL with ``q = 0 < p``.)
    * Hard labels: with ``hard_label_weight = w`` the per-token loss is
      ``(1 - w) * T**2 * D_t + w * CE_t`` where ``CE_t = -log softmax(student_logits)[labels_t]`` is the
      cross-entropy at temperature 1 (no ``T**2`` factor) and ``CE_t = 0`` where ``labels_t == -100``.
      Both terms share the normaliser ``token_count(mask)``; pass ``mask = labels != -100`` to make the two
      coincide. ``w = 0`` (default) is the pure divergence, ``w = 1`` pure cross-entropy.
    * ``chunk_size``: the sequence dimension is processed ``chunk_size`` positions at a time and, when gradients
      are needed, each chunk is wrapped in activation checkpointing, so the fp32 ``(B, chunk, V)`` intermediates
      exist for one chunk at a time (forward and backward). The value equals the unchunked one (up to float
      summation order).

Errors: ``ValueError`` for mismatched shapes (the message names both shapes), an unknown ``reduction``, a weight
or mixing coefficient outside ``[0, 1]``, a non-positive temperature or chunk size, and ``hard_label_weight > 0``
without ``labels``. Vocabulary sizes that differ only by padded embedding rows are the caller's job: slice both
logits with :func:`distill.teacher.slice_to_shared` first.

Distillation losses against a *sparse* teacher: its top-k logits (values + vocabulary indices) per position.

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

import functools
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = [
    'forward_kl', 'reverse_kl', 'generalized_jsd', 'total_variation', 'skew_kl', 'cross_entropy', 'token_count',
    'get_loss', 'LOSSES', 'topk_forward_kl', 'densify_topk', 'teacher_topk',
]


IGNORE_INDEX = -100
_REDUCTIONS = ("mean", "sum", "none")

# A per-token divergence maps fp32 log-probabilities (N..., V) of teacher and student to (N...,) values.
_TokenDivergence = Callable[[Tensor, Tensor], Tensor]


# --------------------------------------------------------------------------------------------------------------
# Per-token divergences on log-probabilities (last dim is the vocabulary). All guard 0 * log 0 = 0.
# --------------------------------------------------------------------------------------------------------------


def _kl_from_logprobs(log_a: Tensor, log_b: Tensor) -> Tensor:
    """KL(a || b) = sum_v a_v (log a_v - log b_v), with terms where a_v = 0 set to 0 (values and gradients)."""
    a = log_a.exp()
    support = a > 0
    # Guard the *inputs* of the product: where a_v = 0 the difference may be -inf - (-inf) = NaN or inf, and
    # torch.where only zeroes the gradient of the unselected branch, not the NaN that 0 * inf would create.
    diff = torch.where(support, log_a - log_b, torch.zeros_like(log_a))
    return (a * diff).sum(dim=-1)


def _forward_kl_tok(teacher_logp: Tensor, student_logp: Tensor) -> Tensor:
    return _kl_from_logprobs(teacher_logp, student_logp)


def _reverse_kl_tok(teacher_logp: Tensor, student_logp: Tensor) -> Tensor:
    return _kl_from_logprobs(student_logp, teacher_logp)


def _log_mixture(log_a: Tensor, log_b: Tensor, weight_a: float) -> Tensor:
    """log(weight_a * a + (1 - weight_a) * b) computed stably with logsumexp; weight_a in (0, 1).

    Where both a_v = b_v = 0 the result is -inf. Those entries are replaced by 0 before logsumexp, because its
    backward computes exp(x - result) = exp(-inf + inf) = NaN there, and 0 * NaN would leak into the gradient.
    """
    both_zero = torch.isneginf(log_a) & torch.isneginf(log_b)  # (..., V)
    safe_a = torch.where(both_zero, 0.0, log_a)
    safe_b = torch.where(both_zero, 0.0, log_b)
    stacked = torch.stack([safe_a + math.log(weight_a), safe_b + math.log1p(-weight_a)])  # (2, ..., V)
    log_m = torch.logsumexp(stacked, dim=0)  # (..., V)
    return torch.where(both_zero, float("-inf"), log_m)


def _jsd_tok(teacher_logp: Tensor, student_logp: Tensor, *, beta: float) -> Tensor:
    if beta == 0.0:
        return _forward_kl_tok(teacher_logp, student_logp)
    if beta == 1.0:
        return _reverse_kl_tok(teacher_logp, student_logp)
    log_m = _log_mixture(teacher_logp, student_logp, beta)  # m = beta * p + (1 - beta) * q
    return beta * _kl_from_logprobs(teacher_logp, log_m) + (1.0 - beta) * _kl_from_logprobs(student_logp, log_m)


def _tvd_tok(teacher_logp: Tensor, student_logp: Tensor) -> Tensor:
    return 0.5 * (teacher_logp.exp() - student_logp.exp()).abs().sum(dim=-1)


def _skew_kl_tok(teacher_logp: Tensor, student_logp: Tensor, *, skew: float) -> Tensor:
    if skew == 0.0:
        return _forward_kl_tok(teacher_logp, student_logp)
    if skew == 1.0:
        return torch.zeros(teacher_logp.shape[:-1], dtype=teacher_logp.dtype, device=teacher_logp.device)
    log_m = _log_mixture(teacher_logp, student_logp, skew)  # m = skew * p + (1 - skew) * q
    return _kl_from_logprobs(teacher_logp, log_m)


# --------------------------------------------------------------------------------------------------------------
# Shared driver: validation, masking, temperature, fp32, hard labels, chunking, reduction.
# --------------------------------------------------------------------------------------------------------------


def _check_unit_interval(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value


def _validate(
    student_logits: Tensor,
    teacher_logits: Optional[Tensor],
    mask: Optional[Tensor],
    labels: Optional[Tensor],
    temperature: float,
    chunk_size: Optional[int],
    reduction: str,
) -> None:
    if student_logits.dim() != 3:
        raise ValueError(f"student_logits must be (B, T, V), got shape {tuple(student_logits.shape)}")
    if teacher_logits is not None and teacher_logits.shape != student_logits.shape:
        hint = ""
        if teacher_logits.dim() == 3 and teacher_logits.shape[:2] == student_logits.shape[:2]:
            hint = (
                " (vocabulary sizes differ: slice both logits to the shared ids with "
                "distill.teacher.shared_vocab_size / slice_to_shared)"
            )
        raise ValueError(
            f"student_logits shape {tuple(student_logits.shape)} != teacher_logits shape "
            f"{tuple(teacher_logits.shape)}{hint}"
        )
    bt = tuple(student_logits.shape[:2])
    if mask is not None and tuple(mask.shape) != bt:
        raise ValueError(f"mask shape {tuple(mask.shape)} != logits (B, T) {bt}")
    if labels is not None and tuple(labels.shape) != bt:
        raise ValueError(f"labels shape {tuple(labels.shape)} != logits (B, T) {bt}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and int(chunk_size) <= 0:
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _token_losses(
    student_logits: Tensor,
    teacher_logits: Optional[Tensor],
    mask: Tensor,
    labels: Optional[Tensor],
    *,
    token_div: Optional[_TokenDivergence],
    temperature: float,
    hard_label_weight: float,
) -> Tensor:
    """Per-token losses (B, t) for one sequence chunk, zero at masked positions; fp32."""
    keep = mask.unsqueeze(-1)  # (B, t, 1)
    # Zero masked rows before anything else: garbage / -inf there must not reach log_softmax (NaN rows).
    s = torch.where(keep, student_logits.float(), 0.0)  # (B, t, V) fp32
    per_tok = torch.zeros(mask.shape, dtype=torch.float32, device=s.device)  # (B, t)
    if token_div is not None and hard_label_weight < 1.0:
        t = torch.where(keep, teacher_logits.float(), 0.0)  # (B, t, V) fp32
        student_logp = F.log_softmax(s / temperature, dim=-1)  # (B, t, V)
        teacher_logp = F.log_softmax(t / temperature, dim=-1)  # (B, t, V)
        div = token_div(teacher_logp, student_logp) * (temperature**2)  # (B, t)
        per_tok = per_tok + (1.0 - hard_label_weight) * div
    if hard_label_weight > 0.0:
        valid = labels != IGNORE_INDEX  # (B, t)
        safe_labels = torch.where(valid, labels, 0).unsqueeze(-1)  # (B, t, 1)
        ce = -F.log_softmax(s, dim=-1).gather(-1, safe_labels).squeeze(-1)  # (B, t), temperature 1
        per_tok = per_tok + hard_label_weight * torch.where(valid, ce, 0.0)
    return torch.where(mask, per_tok, 0.0)  # (B, t)


def _reduce(
    student_logits: Tensor,
    teacher_logits: Optional[Tensor],
    mask: Optional[Tensor],
    labels: Optional[Tensor],
    *,
    token_div: Optional[_TokenDivergence],
    temperature: float,
    hard_label_weight: float,
    chunk_size: Optional[int],
    reduction: str,
) -> Tensor:
    _validate(student_logits, teacher_logits, mask, labels, temperature, chunk_size, reduction)
    hard_label_weight = _check_unit_interval("hard_label_weight", hard_label_weight)
    if hard_label_weight > 0.0 and labels is None:
        raise ValueError("hard_label_weight > 0 needs labels (B, T) long (-100 = ignored)")
    B, T, _ = student_logits.shape
    if mask is None:
        mask = torch.ones((B, T), dtype=torch.bool, device=student_logits.device)
    else:
        mask = mask.to(device=student_logits.device, dtype=torch.bool)
    fn = functools.partial(
        _token_losses, token_div=token_div, temperature=float(temperature), hard_label_weight=hard_label_weight
    )
    if chunk_size is None or chunk_size >= T:
        per_tok = fn(student_logits, teacher_logits, mask, labels)  # (B, T)
    else:
        needs_grad = torch.is_grad_enabled() and (
            student_logits.requires_grad or (teacher_logits is not None and teacher_logits.requires_grad)
        )
        pieces = []
        for start in range(0, T, int(chunk_size)):
            sl = slice(start, start + int(chunk_size))
            args = (
                student_logits[:, sl],  # (B, c, V)
                None if teacher_logits is None else teacher_logits[:, sl],  # (B, c, V)
                mask[:, sl],  # (B, c)
                None if labels is None else labels[:, sl],  # (B, c)
            )
            # Checkpointing keeps only the chunk's inputs (views) alive; the fp32 (B, c, V) intermediates are
            # recomputed chunk by chunk in backward, which is what bounds memory for large vocabularies.
            pieces.append(checkpoint(fn, *args, use_reentrant=False) if needs_grad else fn(*args))
        per_tok = torch.cat(pieces, dim=1)  # (B, T)
    if reduction == "none":
        return per_tok
    total = per_tok.sum()
    if reduction == "sum":
        return total
    return total / token_count(mask).clamp(min=1)


def token_count(mask: Tensor) -> Tensor:
    """Number of tokens that count, ``mask.sum()``, as a 0-dim long tensor on ``mask``'s device.

    ``mask``: ``(B, T)`` bool or 0/1 integer. For gradient accumulation sum this over all micro-batches of an
    optimizer step (and all-reduce it across ranks), then divide each micro-batch's ``reduction="sum"`` loss by
    it (docs/architecture.md, "Conventions"). ``.item()`` gives a Python int.
    """
    return mask.to(torch.bool).sum()


# --------------------------------------------------------------------------------------------------------------
# Public divergences.
# --------------------------------------------------------------------------------------------------------------


def forward_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Optional[Tensor] = None,
    *,
    temperature: float = 1.0,
    hard_label_weight: float = 0.0,
    labels: Optional[Tensor] = None,
    chunk_size: Optional[int] = None,
    reduction: str = "mean",
) -> Tensor:
    """Forward KL, ``KL(p || q_theta) = sum_v p_v (log p_v - log q_v)`` per token (mode covering).

    The standard knowledge-distillation objective (Hinton et al. 2015, Sec. 2; Agarwal et al. ICLR 2024, GKD,
    Sec. 2 "forward KL"). Equals ``F.kl_div(log q, log p, log_target=True).sum(-1)``.

    Args: ``student_logits`` (B, T, V), ``teacher_logits`` (B, T, V), ``mask`` (B, T) bool or None, and the
    keywords described in the module docstring. Returns a 0-dim fp32 tensor (``(B, T)`` for ``"none"``).
    Raises ``ValueError`` on shape mismatch (naming both shapes) or invalid keywords.
    """
    return _reduce(
        student_logits, teacher_logits, mask, labels,
        token_div=_forward_kl_tok, temperature=temperature, hard_label_weight=hard_label_weight,
        chunk_size=chunk_size, reduction=reduction,
    )  # fmt: skip


def reverse_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Optional[Tensor] = None,
    *,
    temperature: float = 1.0,
    hard_label_weight: float = 0.0,
    labels: Optional[Tensor] = None,
    chunk_size: Optional[int] = None,
    reduction: str = "mean",
) -> Tensor:
    """Reverse KL, ``KL(q_theta || p) = sum_v q_v (log q_v - log p_v)`` per token (mode seeking).

    Gu et al. ICLR 2024 (MiniLLM, Eq. 1); Agarwal et al. ICLR 2024 (GKD, Sec. 2). Equals
    ``F.kl_div(log p, log q, log_target=True).sum(-1)``.

    Shapes, keywords, return value and errors as in :func:`forward_kl` / the module docstring.
    """
    return _reduce(
        student_logits, teacher_logits, mask, labels,
        token_div=_reverse_kl_tok, temperature=temperature, hard_label_weight=hard_label_weight,
        chunk_size=chunk_size, reduction=reduction,
    )  # fmt: skip


def generalized_jsd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Optional[Tensor] = None,
    *,
    temperature: float = 1.0,
    beta: float = 0.5,
    hard_label_weight: float = 0.0,
    labels: Optional[Tensor] = None,
    chunk_size: Optional[int] = None,
    reduction: str = "mean",
) -> Tensor:
    """Generalized Jensen-Shannon divergence JSD(beta), GKD convention (Agarwal et al. ICLR 2024, Sec. 2, Eq. for
    JSD(beta); same as TRL's ``GKDTrainer.generalized_jsd_loss``).

    For ``beta`` in (0, 1), with the mixture ``m = beta * p + (1 - beta) * q_theta``::

        JSD_beta(p || q) = beta * KL(p || m) + (1 - beta) * KL(q || m)

    and at the endpoints, exactly: ``beta = 0`` -> forward KL ``KL(p || q)``, ``beta = 1`` -> reverse KL
    ``KL(q || p)``. Note the interior formula itself tends to 0 as beta -> 0 or 1 (its gradients behave like
    ``beta * forward KL`` resp. ``(1 - beta) * reverse KL``); the endpoints are defined as the KLs, not as limits
    of its value. ``beta = 0.5`` is the symmetric Jensen-Shannon divergence (bounded by ``log 2`` per token at
    ``T = 1``).

    Shapes, keywords, return value and errors as in :func:`forward_kl` / the module docstring; also
    ``ValueError`` if ``beta`` is outside [0, 1].
    """
    beta = _check_unit_interval("beta", beta)
    return _reduce(
        student_logits, teacher_logits, mask, labels,
        token_div=functools.partial(_jsd_tok, beta=beta), temperature=temperature,
        hard_label_weight=hard_label_weight, chunk_size=chunk_size, reduction=reduction,
    )  # fmt: skip


def total_variation(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Optional[Tensor] = None,
    *,
    temperature: float = 1.0,
    hard_label_weight: float = 0.0,
    labels: Optional[Tensor] = None,
    chunk_size: Optional[int] = None,
    reduction: str = "mean",
) -> Tensor:
    """Total variation distance ``TVD(p, q) = 0.5 * sum_v |p_v - q_v|`` per token, in [0, 1] (times ``T**2``).

    ``1 - TVD(p, q) = sum_v min(p_v, q_v)`` is the probability that speculative sampling accepts a draft token
    at that position (Leviathan et al. ICML 2023, Sec. 3.3 / Definition 3.1 and Corollary 3.6: beta = 1 - D_LK),
    so minimising the token-mean TVD directly maximises the expected acceptance rate alpha. The same ``T**2``
    factor as the other divergences is applied, for a uniform interface; at ``T = 1`` it is 1.

    Shapes, keywords, return value and errors as in :func:`forward_kl` / the module docstring.
    """
    return _reduce(
        student_logits, teacher_logits, mask, labels,
        token_div=_tvd_tok, temperature=temperature, hard_label_weight=hard_label_weight,
        chunk_size=chunk_size, reduction=reduction,
    )  # fmt: skip


def skew_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Optional[Tensor] = None,
    *,
    temperature: float = 1.0,
    skew: float = 0.1,
    hard_label_weight: float = 0.0,
    labels: Optional[Tensor] = None,
    chunk_size: Optional[int] = None,
    reduction: str = "mean",
) -> Tensor:
    """Skew KL (DistiLLM, Ko et al. ICML 2024, Eq. 3, "skew forward KL")::

        SKL_lambda(p || q_theta) = KL(p || lambda * p + (1 - lambda) * q_theta)

    with ``lambda = skew`` (DistiLLM's default 0.1). ``skew = 0`` is forward KL; ``skew = 1`` is identically 0.
    The mixture keeps the divergence finite (at most ``-log lambda`` per token at ``T = 1``) even where the draft
    puts no mass on a target token.

    Shapes, keywords, return value and errors as in :func:`forward_kl` / the module docstring; also
    ``ValueError`` if ``skew`` is outside [0, 1].
    """
    skew = _check_unit_interval("skew", skew)
    return _reduce(
        student_logits, teacher_logits, mask, labels,
        token_div=functools.partial(_skew_kl_tok, skew=skew), temperature=temperature,
        hard_label_weight=hard_label_weight, chunk_size=chunk_size, reduction=reduction,
    )  # fmt: skip


def cross_entropy(
    student_logits: Tensor,
    labels: Tensor,
    mask: Optional[Tensor] = None,
    *,
    chunk_size: Optional[int] = None,
    reduction: str = "mean",
) -> Tensor:
    """Hard-label cross-entropy ``-log softmax(student_logits)[labels]`` per token (temperature 1).

    ``student_logits`` (B, T, V); ``labels`` (B, T) long, already aligned with the logits, ``-100`` ignored;
    ``mask`` (B, T) bool or None. The tokens that count are ``mask & (labels != -100)``; the mean is over those
    (``token_count(mask & (labels != -100))``), and an all-ignored batch gives 0 with zero gradients. ``chunk_size``
    and ``reduction`` as in the module docstring. Raises ``ValueError`` on shape mismatch.
    """
    if labels is None:
        raise ValueError("cross_entropy needs labels (B, T) long")
    _validate(student_logits, None, mask, labels, 1.0, chunk_size, reduction)
    valid = labels.to(student_logits.device) != IGNORE_INDEX  # (B, T)
    if mask is not None:
        valid = valid & mask.to(device=student_logits.device, dtype=torch.bool)
    return _reduce(
        student_logits, None, valid, labels,
        token_div=None, temperature=1.0, hard_label_weight=1.0, chunk_size=chunk_size, reduction=reduction,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Dispatch by name (config: distill.loss=<name>).
# --------------------------------------------------------------------------------------------------------------

LOSSES: dict[str, Callable[..., Tensor]] = {
    "forward_kl": forward_kl,
    "reverse_kl": reverse_kl,
    "generalized_jsd": generalized_jsd,
    "total_variation": total_variation,
    "skew_kl": skew_kl,
}


def get_loss(name: str, **kwargs) -> Callable[..., Tensor]:
    """The divergence called ``name`` (a key of :data:`LOSSES`), with ``kwargs`` (e.g. ``beta=0.5``) bound.

    Raises ``ValueError`` listing the valid names for an unknown name.
    """
    try:
        fn = LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; valid names: {', '.join(sorted(LOSSES))}") from None
    return functools.partial(fn, **kwargs) if kwargs else fn


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
