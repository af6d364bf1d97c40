"""The decoder's KV-cache policy: which attention patterns it can roll back exactly, the window each layer type
uses, and what a token-tree block sees of the cache (shared by the Hugging Face state in :mod:`decode.common` and
the lean forward of :mod:`decode.fast_llama`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

_ROLLBACK_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class CachePolicy:
    """How the decoder keeps and rolls back one model's KV cache (see :func:`cache_policy`).

    Attributes:
        layer_types: per decoder layer ``"full_attention"`` or ``"sliding_attention"``.
        window: the sliding window ``W`` of the windowed layers (a query at position ``p`` sees keys at positions
            ``p - W < q <= p``, transformers' ``sliding_window_overlay``); ``None`` when no layer is windowed.
    """

    layer_types: tuple[str, ...]
    window: int | None

    @property
    def windowed(self) -> bool:
        return self.window is not None


def cache_policy(model: torch.nn.Module, batch_size: int = 1, max_length: int = 0, role: str | None = None
                 ) -> CachePolicy:
    """The cache policy the decoder uses for ``model``, or a ``ValueError`` naming why its cache cannot be rolled
    back exactly.

    Speculative decoding discards the KV entries of rejected tokens. A sliding-window cache layer has already
    evicted the entries that fell out of its window, so it cannot be cropped; the decoder therefore keeps a *full*
    cache for every attention layer and applies the window itself through the attention mask, measured in token
    positions (not cache slots, which include the holes rejected tokens leave in a batch). This is exact for full
    and sliding-window attention. Anything else is refused: recurrent / linear-attention / chunked layers, sliding
    layers with different windows, bidirectional windows, an attention implementation other than ``sdpa`` /
    ``eager`` on a windowed model (a custom 4-D mask is needed), and GPT-Neo's slot-based local attention in a batch
    (``batch_size > 1``) longer than its window (``max_length``: the longest cache the call can build).

    ``role`` (e.g. ``"target"``, ``"draft 'x'"``) prefixes the error message.

    Raises:
        ValueError: one line naming the model type, the reason and the fix.
    """
    try:
        return _cache_policy(model, batch_size, max_length)
    except ValueError as e:
        if role:
            raise ValueError(f"{role}: {e}") from None
        raise


def _cache_policy(model: torch.nn.Module, batch_size: int, max_length: int) -> CachePolicy:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return CachePolicy((), None)
    try:
        cfg = cfg.get_text_config(decoder=True)
    except Exception:  # noqa: BLE001  (older / custom configs)
        pass
    name = getattr(cfg, "model_type", type(model).__name__)
    fix = "decode with a model whose layers use full or sliding-window attention"
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        types, kwargs = get_layer_types_and_kwargs(cfg)
    except Exception:  # noqa: BLE001  (a config transformers cannot describe per layer: plain full attention)
        types, kwargs = [], []
    bad = sorted({t for t in types if t not in _ROLLBACK_TYPES})
    if bad:
        raise ValueError(f"speculative decoding cannot roll back the KV cache of {name!r} exactly: it has layer "
                         f"type(s) {', '.join(bad)} (only full_attention and sliding_attention): {fix}.")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError(f"speculative decoding needs causal attention, but {name!r} has "
                         f"use_bidirectional_attention=True: {fix}.")
    windows = sorted({int(kw["sliding_window"]) for t, kw in zip(types, kwargs) if t == "sliding_attention"})
    if len(windows) > 1:
        raise ValueError(f"{name!r} has sliding-window layers with different windows {windows}: the decoder "
                         f"applies one window per model; {fix}.")
    window = windows[0] if windows else None
    if window is not None:
        impl = getattr(cfg, "_attn_implementation", None) or "eager"
        if impl not in ("sdpa", "eager"):
            raise ValueError(f"{name!r} has sliding-window attention with attn_implementation={impl!r}: the "
                             "decoder applies the window through a 4-D attention mask, which needs 'sdpa' or "
                             "'eager' (load the model with attn_implementation='sdpa').")
    if getattr(cfg, "model_type", None) == "gpt_neo" and "local" in (getattr(cfg, "attention_layers", None) or ()):
        ws = int(getattr(cfg, "window_size", 0) or 0)
        if batch_size > 1 and max_length > ws:
            raise ValueError(f"GPT-Neo's local attention counts its window ({ws}) in cache slots, and a batch "
                             f"leaves holes in the cache, so a batch of {batch_size} up to {max_length} tokens "
                             "would be decoded wrongly: decode one prompt at a time (batch size 1) or keep "
                             f"prompt + max_new_tokens + gamma below {ws}.")
    return CachePolicy(tuple(types), window)


def tree_visibility(prefix_valid: torch.Tensor, allowed_region: torch.Tensor, region_positions: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """What each token of a token-tree block sees (:mod:`decode.tree`, batch 1), over the whole cache.

    Args:
        prefix_valid: ``(R0,)`` bool, the valid slots before the tree region (visible to every new token).
        allowed_region: ``(T, L + T - R0)`` bool, which region slots each new token sees (ancestors and itself).
        region_positions: ``(L + T - R0,)`` int64, the position of every region slot, old and new.
    Returns:
        ``(allowed (T, L + T) bool, key_positions (L + T,) int64)``: a prefix slot's position is the number of
        valid slots before it (the windows compare positions, not slots).
    """
    t = allowed_region.shape[0]
    allowed = torch.cat([prefix_valid[None, :].expand(t, -1), allowed_region], 1)  # (T, L+T)
    key_positions = torch.cat([prefix_valid.long().cumsum(0) - 1, region_positions])
    return allowed, key_positions
