"""The one logits pipeline shared by the target (p) and the draft (q).

Speculative sampling is only lossless when q is *exactly* the distribution the draft token was drawn from and p is
the target's distribution after the *same* transformations (docs/architecture.md, "Terms": p, q). Both therefore go through
:func:`process_logits`, which follows Hugging Face transformers' warper semantics and order:
temperature -> top-k -> top-p (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``).
"""
from __future__ import annotations

import math

import torch

__all__ = ['validate_sampling_args', 'process_logits', 'greedy_tokens', 'sample_tokens', 'uniform']


def validate_sampling_args(*, do_sample: bool, temperature: float, top_k: int, top_p: float) -> None:
    """Check sampling arguments; raise ``ValueError`` naming the argument and its valid range.

    - ``temperature``: finite float >= 0; 0 is only allowed for greedy decoding (``do_sample=False``).
    - ``top_k``: int >= 0 (0 disables top-k).
    - ``top_p``: float in (0, 1] (1 disables nucleus filtering).
    """
    if not isinstance(temperature, (int, float)) or not math.isfinite(float(temperature)) or temperature < 0:
        raise ValueError(f"temperature must be a finite float >= 0 (got {temperature!r}).")
    if do_sample and temperature == 0:
        raise ValueError(
            "temperature=0 with do_sample=True is undefined; use greedy decoding (do_sample=False) instead, "
            "or a temperature > 0."
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, where 0 disables top-k filtering (got {top_k!r}).")
    if not isinstance(top_p, (int, float)) or not (0.0 < float(top_p) <= 1.0):
        raise ValueError(f"top_p must be a float in (0, 1], where 1 disables nucleus filtering (got {top_p!r}).")


def process_logits(
    logits: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Turn raw logits into the sampling distribution, exactly as transformers' warpers do.

    Order (transformers semantics): divide by ``temperature``; keep the ``top_k`` largest logits (ties with the
    k-th value are kept, 0 disables); nucleus (Holtzman et al. 2020): sort ascending, remove the tokens whose
    cumulative probability is ``<= 1 - top_p`` so the smallest set with cumulative probability ``>= top_p`` remains,
    always keeping at least the most likely token (1.0 disables). Then softmax.

    Args:
        logits: ``(..., V)`` raw logits, any float dtype (computation is done in float32).
    Returns:
        ``(..., V)`` float32 probabilities; filtered tokens have probability exactly 0.
    Raises:
        ValueError: for out-of-range arguments (see :func:`validate_sampling_args`).
    """
    validate_sampling_args(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # (..., 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)  # (..., V) ascending
        cum_probs = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cum_probs <= (1.0 - top_p)
        sorted_remove[..., -1:] = False  # always keep the most likely token
        remove = sorted_remove.scatter(-1, sorted_idx, sorted_remove)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.softmax(dim=-1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Greedy choice: ``argmax`` of the raw logits over the last dim; ``(..., V) -> (...)`` int64.

    Computed as ``max(dim=-1).indices`` (same result, ties to the first maximal index; about 1.5x faster than
    ``argmax`` on CPU for a few rows of a 4k vocabulary, which matters once per drafted token).
    """
    return logits.max(dim=-1).indices


def _on_generator_device(t: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    if generator is None or generator.device == t.device:
        return t
    return t.to(generator.device)


def sample_tokens(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per distribution: ``probs (..., V) -> (...)`` int64, on ``probs.device``.

    Uses ``torch.multinomial`` with ``generator`` (a generator on another device than ``probs`` is honoured by
    sampling on the generator's device), so a seeded generator makes the draw reproducible. Rows need not be
    normalised but must have a positive sum.
    """
    flat = probs.reshape(-1, probs.shape[-1])  # (N, V)
    src = _on_generator_device(flat, generator)
    idx = torch.multinomial(src, 1, generator=generator).to(probs.device)  # (N, 1)
    return idx.view(probs.shape[:-1])


def uniform(shape: tuple[int, ...], *, device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """``U[0, 1)`` float32 samples of ``shape`` on ``device``, drawn from ``generator`` (on its own device)."""
    gen_device = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=gen_device, dtype=torch.float32).to(device)
