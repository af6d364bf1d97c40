"""A lean cached forward for Hugging Face Llama-family causal LMs: Llama, Mistral, Qwen2, Qwen3, Gemma-2, Gemma-3, Phi-3
(not public API beyond :func:`frozen_weights`).

For small models at batch 1 most of the time of a Hugging Face forward is Python wrapper work (mask creation,
rotary module, output dataclasses, config look-ups), not matmuls. :class:`FastKVState` runs the same computation
directly on the model's own parameters (on CPU through packed, transposed copies that every new state checks bit
for bit against the live parameters: see :mod:`decode.fast_weights`), with the same ops in the same order as
``transformers.models.llama.modeling_llama``:

    embed -> per layer [RMSNorm (fp32, ``variance_epsilon``) -> q/k/v ``F.linear`` -> rotary (cos/sin from the
    model's own ``inv_freq``, precomputed per position) -> append K/V to preallocated per-layer buffers -> SDPA over
    the valid prefix (boolean key mask for left padding / holes) -> o_proj -> residual -> RMSNorm -> SiLU-gated MLP
    -> residual] -> final RMSNorm -> lm_head on the kept positions only.

Cropping the cache only moves the valid length (no copy). Mistral is Llama plus a sliding window W: the cache keeps
every slot (so rollback is exact) and attention is limited to keys whose *position* is within W of the query's
(transformers' ``sliding_window_overlay``); at batch 1 without holes that is a slice of the key buffer. Each layer
takes its window from the decoder's cache policy, so full and windowed layers may alternate (Qwen2's
``max_window_layers``, Gemma-2/3). The other families differ from Llama as listed at
:data:`decode.fast_support.FAMILY_CLASSES`. Models the lean forward does not cover (another architecture, rope
scaling, partial rotary, attention / MLP bias, a Llama config with a sliding window, another activation, ...) fall
back to the Hugging Face forward (:func:`fast_path_supported` says which and why).

The lean forward by job: this module holds the state (buffers, masks, cache edits, token-tree blocks) and is the
entry point that re-exports the rest; :mod:`decode.fast_support` the support check; :mod:`decode.fast_weights` what
a state reads from the model (packed weights, :func:`frozen_weights`); :mod:`decode.fast_settings` the compile and
row-layout settings (one :data:`~decode.fast_settings.SETTINGS` object); :mod:`decode.fast_layers` the layers.
"""
from __future__ import annotations

import functools
import time

import torch

from .fast_layers import core
from .fast_settings import SETTINGS, graph_count
from .fast_settings import (  # noqa: F401  (re-exported: decode.compile and the row layout, as before the split)
    COMPILE_MODES, ROW_LAYOUTS, compile_enabled, compile_seconds, row_layout_record, set_compile, set_row_layout)
from .fast_support import fast_path_supported, unsupported_reason  # noqa: F401  (unsupported_reason re-exported)
from .fast_weights import frozen_cached, frozen_weights, read_model, use_packed
from .kv_policy import tree_visibility
from .threads import BlockThreads

__all__ = ["fast_path_supported", "FastKVState", "frozen_weights"]


class FastKVState:
    """Lean cached forward for a Llama-family model: the same interface and semantics as ``decode.common.KVState``.

    Buffers: per layer ``K, V (B, cap, H_kv, D)``; ``valid (B, cap)`` bool over physical slots (0 = left padding or
    a hole left by a rejected token); ``num_valid (B,)`` = next position id per row. While no row has a hole or
    padding (``dense``, the batch-1 case), positions are the slot indices and no key mask is needed for one-token
    steps, so a step does no index arithmetic at all.

    Per layer, the window (``None`` or W, from :func:`decode.common.cache_policy`: full and sliding layers may
    alternate, Gemma-2/3) and the rotary table (Gemma-3: one RoPE base per layer type) are looked up; one mask per
    distinct window is built per forward.

    The weights are read when the state is built (on CPU: packed copies, verified against the live parameters bit
    for bit, rebuilt where they differ); like the K/V cache, a state belongs to the weights of that moment, so build
    a new state after changing the model (the decoders build one per call; inside :func:`frozen_weights` they reuse
    what the previous state read while the parameters are unchanged).
    """

    fast = True
    _core_impl = core  # the layers and the head (decode/fast_layers.py): what decode.compile compiles

    def __init__(self, model: torch.nn.Module, batch_size: int, device: torch.device, capacity: int = 256,
                 packed: bool | None = None, fused_norm: bool | None = None, compile: bool | None = None):
        if packed is None:
            packed = frozen_cached(model, ("packed", str(device)), lambda: use_packed(model, device))
        # what the state reads from the model (weights, norms, windows, rotary frequencies): built here, or reused
        # inside decode.frozen_weights while the parameters are the same tensors (see frozen_weights)
        self.__dict__.update(frozen_cached(model, ("plan", str(device), packed, fused_norm),
                                           lambda: read_model(model, device, packed, fused_norm)))
        self.batch_size = batch_size
        self._neg_inf = torch.tensor(float("-inf"), dtype=self.dtype, device=device)
        self.cap = 0
        self.length = 0  # physical slots in use
        self.dense = True  # every slot < length of every row is a real token
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)
        self.num_valid = torch.zeros(batch_size, dtype=torch.long, device=device)
        with torch.inference_mode():
            self._grow(max(int(capacity), 16))
        if self.rows_all is not None:  # several-row products: the measured (or set) layout, see set_row_layout
            self.rows_w = (self.rows_all if SETTINGS.row_layout_for(self.layers[0], self.rows_all[0], self.lm_w,
                                                                    self.rows_all[-1], device) == "weight_left"
                           else None)
            self.rows_one = (self.rows_all if SETTINGS.one_row_layout_for(self.layers, self.rows_all, self.lm_w,
                                                                          device) == "weight_left" else None)
        self.compiled = SETTINGS.compile_enabled(device) if compile is None else bool(compile)
        self._core = (self._core_impl if not self.compiled else
                      functools.partial(SETTINGS.compiled_core(device, FastKVState._core_impl), self))

    # ------------------------------------------------------------------ buffers
    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.cap)
        b, h, d, n = self.valid.shape[0], self.n_kv, self.head_dim, self.length
        new_k, new_v = [], []
        for i in range(len(self.layers)):
            k = torch.empty(b, cap, h, d, dtype=self.dtype, device=self.device)
            v = torch.empty(b, cap, h, d, dtype=self.dtype, device=self.device)
            if n:
                k[:, :n] = self.k[i][:, :n]
                v[:, :n] = self.v[i][:, :n]
            new_k.append(k)
            new_v.append(v)
        self.k, self.v = new_k, new_v
        valid = torch.zeros(b, cap, dtype=torch.bool, device=self.device)
        valid[:, :n] = self.valid[:, :n]
        self.valid = valid
        # rotary tables exactly as LlamaRotaryEmbedding.forward: fp32 freqs, cat, cos/sin, cast to the model dtype;
        # one (cos (cap, D), signed sin (cap, D)) per distinct inv_freq
        pos = torch.arange(cap, device=self.device)
        half = self.head_dim // 2
        self.cos, self.sin_signed, self.cos4, self.sin4 = [], [], [], []
        for inv_freq in self.inv_freqs:
            freqs = pos[:, None].float() * inv_freq.to(device=self.device, dtype=torch.float)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)  # (cap, D)
            cos = emb.cos().to(self.dtype)
            sin = emb.sin().to(self.dtype)
            # rotate_half(x) * sin == roll(x, D/2) * [-sin_lo, sin_hi]  (negation is exact, so bitwise equal)
            sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            self.cos.append(cos)
            self.sin_signed.append(sin_signed)
            self.cos4.append(cos[None, :, None, :])  # (1, cap, 1, D)
            self.sin4.append(sin_signed[None, :, None, :])
        self.arange = pos
        self.cap = cap


    # ------------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor, token_mask: torch.Tensor | None = None, logits_to_keep: int = 1
                ) -> torch.Tensor:
        """Append ``tokens (B, T)`` (``token_mask (B, T)``: 1 real, 0 hole; ``None`` = all real) to the cache;
        return logits ``(B, T', V)`` for the last ``T' = logits_to_keep`` slots (all slots when 0)."""
        return self._run(tokens, token_mask, logits_to_keep, None)

    def forward_tree(self, tokens: torch.Tensor, positions: torch.Tensor, region_start: int,
                     region_positions: torch.Tensor, allowed_region: torch.Tensor) -> torch.Tensor:
        """Append a token-tree block (batch 1, :mod:`decode.tree`): ``tokens (T,)`` int64 at position ids
        ``positions (T,)``; return logits ``(T, V)``.

        Every valid slot before ``region_start`` is visible to every new token; in the region ``[region_start,
        L + T)`` token ``i`` sees the slots where ``allowed_region[i]`` is set (``(T, L + T - region_start)`` bool:
        its ancestors and itself), whose positions are ``region_positions (L + T - region_start,)``. Each layer's
        window applies on top, by position (every new token is a real token)."""
        allowed, key_pos = tree_visibility(self.mask[0, :region_start].bool(), allowed_region, region_positions)
        return self._run(tokens[None], None, 0, (positions[None], allowed, key_pos))[0]

    def _run(self, tokens: torch.Tensor, token_mask: torch.Tensor | None, logits_to_keep: int,
             tree: tuple | None) -> torch.Tensor:
        with BlockThreads(self.device, tokens.numel()):  # decode.block_threads (decode/threads.py)
            if not torch.is_inference_mode_enabled():  # the buffers are inference tensors (the decoders run inside)
                with torch.inference_mode():
                    return self._forward(tokens, token_mask, logits_to_keep, tree)
            return self._forward(tokens, token_mask, logits_to_keep, tree)

    def _forward(self, tokens: torch.Tensor, token_mask: torch.Tensor | None, logits_to_keep: int,
                 tree: tuple | None) -> torch.Tensor:
        start = self.length
        end = start + tokens.shape[1]
        if end > self.cap:
            self._grow(end + 64)
        if token_mask is not None and self.dense and not bool(token_mask.all()):
            self.dense = False
        if tree is not None:  # decode.tree: the caller's positions, tree structure and key positions
            rope, masks = self._tree_block(start, end, *tree)
        elif self.dense:
            rope, masks = self._dense_block(start, end)
        else:
            rope, masks = self._holes_block(tokens, token_mask, start, end)
        self.length = end
        if not self.compiled:
            return self._core(tokens, rope, masks, start, end, logits_to_keep)
        graphs = graph_count()
        t0 = time.perf_counter()
        out = self._core(tokens, rope, masks, start, end, logits_to_keep)
        if graph_count() != graphs:  # this call compiled a new graph: its time is compile time
            SETTINGS.compile_time_s += time.perf_counter() - t0
        return out

    # Each *_block marks the new slots [start, end) valid, advances num_valid and returns the rotary tables (per
    # distinct inv_freq, (cos, signed sin) broadcastable to (B, T, H, D)) and the masks: window -> (first key slot,
    # additive mask or None).
    def _tree_block(self, start: int, end: int, position_ids: torch.Tensor, allowed: torch.Tensor,
                    key_pos: torch.Tensor) -> tuple[list, dict]:
        """Token trees: ``position_ids (1, T)``, ``allowed (T, L+T)`` bool, ``key_pos (L+T,)``."""
        masks = {}
        self.valid[:, start:end] = True
        rope = [(c[position_ids][:, :, None, :], s[position_ids][:, :, None, :])  # (B, T, 1, D)
                for c, s in zip(self.cos, self.sin_signed)]
        for window in self.windows:  # the window counts positions, as in the chain
            a = allowed if window is None else allowed & ((position_ids[0][:, None] - key_pos[None, :]) < window)
            masks[window] = (0, torch.where(a, 0.0, self._neg_inf)[None, None])  # (1, 1, T, L+T)
        self.num_valid = self.num_valid + (end - start)
        return rope, masks

    def _dense_block(self, start: int, end: int) -> tuple[list, dict]:
        """No hole or padding in any row: positions are the slots; one-token steps need no mask at all."""
        arange, masks = self.arange, {}
        self.valid[:, start:end] = True
        rope = [(c[:, start:end], s[:, start:end]) for c, s in zip(self.cos4, self.sin4)]  # (1, T, 1, D)
        for window in self.windows:
            # keys before kv_start are outside every query's window (dense: slot == position)
            kv_start = 0 if window is None else max(0, start - window + 1)
            if end - start == 1:
                masks[window] = (kv_start, None)
                continue
            # (T, L+T) causal, additive (SDPA would convert a boolean mask again in every layer)
            kpos, qpos = arange[kv_start:end][None, :], arange[start:end][:, None]
            allowed = kpos <= qpos
            if window is not None:
                allowed = allowed & (kpos > qpos - window)
            masks[window] = (kv_start, torch.where(allowed, 0.0, self._neg_inf))
        self.num_valid = self.num_valid + (end - start)
        return rope, masks

    def _holes_block(self, tokens: torch.Tensor, token_mask: torch.Tensor | None, start: int, end: int
                     ) -> tuple[list, dict]:
        """Left padding or holes: positions count the valid slots before each one, keys are masked per row."""
        arange, masks, t = self.arange, {}, end - start
        if token_mask is None:
            tm = torch.ones_like(tokens)
            position_ids = self.num_valid[:, None] + arange[:t][None, :]
        else:
            tm = token_mask.to(torch.long)
            position_ids = self.num_valid[:, None] + tm.cumsum(1) - tm  # (B, T) valid tokens before each slot
        self.valid[:, start:end] = tm.bool()
        rope = [(c[position_ids][:, :, None, :], s[position_ids][:, :, None, :])  # (B, T, 1, D)
                for c, s in zip(self.cos, self.sin_signed)]
        keys = self.valid[:, None, :end]  # (B, 1, L+T)
        kpos, qpos = arange[:end][None, :], arange[start:end][:, None]
        # every query also sees its own slot, so a padding / hole query never has an all-masked row (NaN);
        # its output is never read and its key stays masked for every other query
        causal = keys & (kpos <= qpos)[None]  # (B, T, L+T)
        diag = (kpos == qpos)[None]
        for window in self.windows:
            allowed = causal
            if window is not None:  # the window counts positions (valid tokens), not slots: holes are skipped
                key_pos = self.valid[:, :end].cumsum(1) - 1  # (B, L+T) position of each valid slot
                allowed = allowed & ((position_ids[:, :, None] - key_pos[:, None, :]) < window)
            masks[window] = (0, torch.where((allowed | diag)[:, None], 0.0, self._neg_inf))  # (B, 1, T, L+T)
        self.num_valid = self.num_valid + tm.sum(1)
        return rope, masks

    # ------------------------------------------------------------------ cache edits
    @property
    def mask(self) -> torch.Tensor:
        return self.valid[:, : self.length].to(torch.long)

    def truncate(self, start: int, keep: torch.Tensor | None, max_keep: int) -> None:
        """Keep, per row, only the first ``keep[b]`` slots of the region ``[start, L)``; later slots become holes
        and the physical length becomes ``start + max_keep`` (``max_keep == keep.max()``; ``keep=None``: every row
        keeps ``max_keep``). No copy."""
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.truncate(start, keep, max_keep)
        new_len = start + max_keep
        old_len = self.length
        self.length = new_len
        if keep is None or self.valid.shape[0] == 1:  # every row keeps max_keep: nothing becomes a hole
            if self.dense:
                self.num_valid = self.num_valid - (old_len - new_len)
            else:
                self.num_valid = self.valid[:, :new_len].sum(1)
            return
        self.dense = False
        region = self.valid[:, start:new_len]  # (B, max_keep) view
        region &= self.arange[:max_keep][None, :] < keep[:, None]
        self.num_valid = self.valid[:, :new_len].sum(1)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (1-D index tensor)."""
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.select_rows(rows)
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]
        self.valid = self.valid.index_select(0, rows)
        self.num_valid = self.num_valid.index_select(0, rows)

    def compact(self, start: int, keep: list[int]) -> None:
        """Keep only the slots ``start + keep[i]`` (``keep`` ascending) of the region after ``start``, moved into the
        consecutive slots ``start + i``; every later slot is cut off (token trees, batch 1: the accepted path).
        Their positions must already be consecutive (a root-to-node path). No recomputation: the K/V entries are
        copied."""
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.compact(start, keep)
        n = len(keep)
        if keep != list(range(n)):
            idx = torch.tensor(keep, dtype=torch.long, device=self.num_valid.device) + start
            for k, v in zip(self.k, self.v):  # (B, cap, H_kv, D)
                k[:, start:start + n] = k[:, idx]
                v[:, start:start + n] = v[:, idx]
        self.truncate(start, None, n)
