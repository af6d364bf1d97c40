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
:data:`decode.fast_weights.FAMILY_CLASSES`. Models the lean forward does not cover (another architecture, rope
scaling, partial rotary, attention / MLP bias, a Llama config with a sliding window, another activation, ...) fall
back to the Hugging Face forward (:func:`fast_path_supported` says which and why).

The lean forward by job: this module holds the state (buffers, masks, cache edits, token-tree blocks) and is the
entry point that re-exports the rest; :mod:`decode.fast_weights` the support check; :mod:`decode.fast_weights` what
a state reads from the model (packed weights, :func:`frozen_weights`); :mod:`decode.fast_settings` the compile and
row-layout settings (one :data:`~decode.fast_settings.SETTINGS` object); :mod:`decode.fast_llama` the layers.

The layers and the head of the lean forward (:class:`decode.fast_llama.FastKVState`), op for op as
``transformers.models.llama.modeling_llama`` and the family variants listed in :mod:`decode.fast_weights`, over
the state's weights (:mod:`decode.fast_weights`) and preallocated K/V buffers (not public API).

Every function takes the state ``st`` first: :func:`core` is ``FastKVState._core_impl`` (what ``decode.compile``
compiles). Per layer: RMSNorm -> q/k/v -> (q/k head norms) -> rotary -> K/V appended -> SDPA -> o_proj (-> Gemma
post-norm) -> residual -> RMSNorm -> gated MLP (-> Gemma post-norm) -> residual; then the final RMSNorm and the head.
"""
from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from decode.fast_settings import (  # noqa: F401  (re-exported: decode.compile and the row layout, as before the split)
    COMPILE_MODES,
    ROW_LAYOUTS,
    SETTINGS,
    BlockThreads,
    compile_enabled,
    compile_seconds,
    graph_count,
    row_layout_record,
    rows_addmm,
    rows_times,
    set_compile,
    set_row_layout,
)
from decode.fast_weights import (  # noqa: F401  (unsupported_reason re-exported)
    fast_path_supported,
    frozen_cached,
    frozen_weights,
    read_model,
    tree_visibility,
    unsupported_reason,
    use_packed,
)
from models.vocab import scatter_to_vocab

__all__ = [
    'core', 'norm', 'head_norm', 'softcapped_attention', 'linear', 'fast_path_supported', 'FastKVState',
    'frozen_weights',
]


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w^T (+ bias)`` for an unpacked weight ``w (out, in)``, or ``w(x)`` for a dynamic int8 Linear module
    (:mod:`decode.fast_settings`: fbgemm's int8 product on its packed weights, activations quantized per call)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    out = w(x)
    return out if bias is None else out + bias


def core(st, tokens: torch.Tensor, rope: list, masks: dict, start: int, end: int, logits_to_keep: int
         ) -> torch.Tensor:
    """The layers and the head over the prepared rotary tables and masks (what ``decode.compile`` compiles).

    ``tokens (B, T)`` fill K/V slots ``[start, end)``; ``rope``: per rotary table ``(cos, signed sin)``
    broadcastable to ``(B, T, H, D)``; ``masks``: window -> ``(first key slot, additive mask or None)``. Returns
    logits ``(B, T', V)`` for the last ``T' = logits_to_keep`` positions (all when 0).
    """
    bsz, t = tokens.shape
    # several rows (verify blocks, trees, prefills, batches): the (out, in) copies (see fast_settings.rows_times)
    rows = (st.rows_w if bsz * t > 1 else st.rows_one) if st.packed else None
    x = F.embedding(tokens, st.embed_w)  # (B, T, E)
    if st.embed_scale is not None:
        x = x * st.embed_scale
    capture, feats = st.capture, []
    for i, (ln1, eps1, w_qkv, w_o, ln2, eps2, w_gu, w_d) in enumerate(st.layers):
        if capture is not None and i in capture:  # the input of layer i: Hugging Face's hidden_states[i]
            feats.append(x)
        w_rows = None if rows is None else rows[i]  # (W_qkv, W_o, W_gu, W_down), (out, in)
        post = st.extras[i][2]
        # --- attention block
        q = _qkv(st, i, norm(st, x, ln1, eps1), w_qkv, rope[st.layer_rope[i]], start, end, w_rows)  # (B, T, H, D)
        kv_start, attn_mask = masks[st.layer_window[i]]
        o = _attend(st, q, st.k[i][:, kv_start:end], st.v[i][:, kv_start:end], attn_mask)  # (B T, H D)
        x = _attention_residual(st, x, o, w_o, w_rows, post)
        # --- MLP block (gated: SiLU, Gemma GELU-tanh)
        x = _mlp_residual(st, x, norm(st, x, ln2, eps2), w_gu, w_d, w_rows, post)
    if capture is not None:
        st.features = torch.cat(feats, -1)  # (B, T, len(capture) * E)
    return _logits(st, x, logits_to_keep)


def _qkv(st, i: int, hs: torch.Tensor, w_qkv, rope: tuple, start: int, end: int, w_rows: tuple | None
         ) -> torch.Tensor:
    """Layer ``i``'s queries ``(B, T, H, D)`` from the normed input ``hs (B, T, E)``; its keys (rotated) and values
    are written to the layer's K/V buffers at slots ``[start, end)``. Qwen2: q/k/v biases; Qwen3 / Gemma-3: RMSNorm
    of each q and k head before rotary; rotary as ``apply_rotary_pos_emb`` (``rope = (cos, signed sin)``)."""
    bsz, t = hs.shape[:2]
    h_kv, h_q, d = st.n_kv, st.n_heads, st.head_dim
    qd, kd, half = h_q * d, h_kv * d, d // 2
    cos, sin = rope
    kbuf, vbuf = st.k[i], st.v[i]
    b_qkv, qk_norm, _ = st.extras[i]
    if st.packed:  # (E, (H + 2 H_kv) D) = [q_proj; k_proj; v_proj]^T
        qkv = torch.matmul(hs, w_qkv) if w_rows is None else \
            rows_times(hs.view(bsz * t, -1), w_rows[0]).view(bsz, t, -1)  # (B, T, (H + 2 H_kv) D)
        if b_qkv is not None:
            qkv = qkv + b_qkv
        qk = qkv[..., :qd + kd].view(bsz, t, h_q + h_kv, d)  # (B, T, H + H_kv, D)
        if qk_norm is not None:  # Qwen3 / Gemma-3: RMSNorm over head_dim, q and k heads with their weights
            qk = torch.cat([head_norm(st, qk[:, :, :h_q], qk_norm[0], qk_norm[2]),
                            head_norm(st, qk[:, :, h_q:], qk_norm[1], qk_norm[2])], 2)
        qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)  # apply_rotary_pos_emb on q and k at once
        kbuf[:, start:end] = qk[:, :, h_q:]
        vbuf[:, start:end] = qkv[..., qd + kd:].view(bsz, t, h_kv, d)
        return qk[:, :, :h_q]  # (B, T, H, D)
    if len(w_qkv) == 1:  # q/k/v rows stacked in one int8 module (decode.fast_settings.fuse_int8_rows)
        q, k, v = linear(hs, w_qkv[0], b_qkv).split([qd, kd, kd], -1)
    else:
        bq, bk, bv = (None, None, None) if b_qkv is None else b_qkv.split([qd, kd, kd])
        q, k, v = linear(hs, w_qkv[0], bq), linear(hs, w_qkv[1], bk), linear(hs, w_qkv[2], bv)
    q, k = q.view(bsz, t, h_q, d), k.view(bsz, t, h_kv, d)  # (B, T, H, D), (B, T, H_kv, D)
    if qk_norm is not None:
        q = head_norm(st, q, qk_norm[0], qk_norm[2])
        k = head_norm(st, k, qk_norm[1], qk_norm[2])
    q = q * cos + q.roll(half, -1) * sin  # apply_rotary_pos_emb
    torch.add(k * cos, k.roll(half, -1) * sin, out=kbuf[:, start:end])
    vbuf[:, start:end] = v.view(bsz, t, h_kv, d)
    return q


def _attend(st, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, attn_mask: torch.Tensor | None
            ) -> torch.Tensor:
    """Attention of ``q (B, T, H, D)`` over ``keys`` / ``vals (B, L, H_kv, D)`` (grouped heads repeated as
    ``repeat_kv``; SDPA, or Gemma-2's soft-capped eager attention) -> ``(B T, H D)``."""
    bsz, t = q.shape[:2]
    h_kv, h_q, d = st.n_kv, st.n_heads, st.head_dim
    key = keys.transpose(1, 2)  # (B, H_kv, L, D)
    val = vals.transpose(1, 2)
    if st.n_rep > 1:  # repeat_kv
        n_kv = key.shape[2]
        key = key[:, :, None].expand(bsz, h_kv, st.n_rep, n_kv, d).reshape(bsz, h_q, n_kv, d)
        val = val[:, :, None].expand(bsz, h_kv, st.n_rep, n_kv, d).reshape(bsz, h_q, n_kv, d)
    if st.attn_softcap is None:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), key, val, attn_mask=attn_mask, scale=st.scaling)
    else:
        o = softcapped_attention(st, q.transpose(1, 2), key, val, attn_mask)
    return o.transpose(1, 2).reshape(bsz * t, h_q * d)  # (B T, H D)


def _attention_residual(st, x: torch.Tensor, o: torch.Tensor, w_o, w_rows: tuple | None, post) -> torch.Tensor:
    """``x (B, T, E)`` plus the attention output ``o (B T, H D)`` through o_proj (Gemma: RMSNorm after it)."""
    bsz, t = x.shape[:2]
    if st.packed and post is None:  # residual + o_proj in one op (beta * x + o @ W_o, beta = 1)
        return (torch.addmm(x.view(bsz * t, -1), o, w_o) if w_rows is None else
                rows_addmm(x.view(bsz * t, -1), o, w_rows[1])).view(bsz, t, -1)
    o = (linear(o, w_o) if not st.packed else torch.matmul(o, w_o) if w_rows is None else
         rows_times(o, w_rows[1])).view(bsz, t, -1)
    if post is not None:  # Gemma: RMSNorm on the attention output before the residual
        o = norm(st, o, post[0][0], post[0][1])
    return x + o


def _mlp_residual(st, x: torch.Tensor, hs: torch.Tensor, w_gu, w_d, w_rows: tuple | None, post) -> torch.Tensor:
    """``x (B, T, E)`` plus the gated MLP of the normed ``hs (B, T, E)``: ``down(act(gate hs) * up hs)`` (Gemma:
    RMSNorm after it)."""
    bsz, t = x.shape[:2]
    inter = st.inter
    if st.packed:  # (E, 2 I) = [gate_proj; up_proj]^T
        gu = torch.matmul(hs, w_gu) if w_rows is None else \
            rows_times(hs.view(bsz * t, -1), w_rows[2]).view(bsz, t, -1)  # (B, T, 2 I)
        m = st.act(gu[..., :inter]) * gu[..., inter:]
        if post is None:  # residual + down_proj in one op
            return (torch.addmm(x.view(bsz * t, -1), m.view(bsz * t, inter), w_d) if w_rows is None else
                    rows_addmm(x.view(bsz * t, -1), m.view(bsz * t, inter), w_rows[3])).view(bsz, t, -1)
        m = torch.matmul(m, w_d) if w_rows is None else \
            rows_times(m.view(bsz * t, inter), w_rows[3]).view(bsz, t, -1)
    else:
        if len(w_gu) == 1:  # gate/up rows stacked in one int8 module
            gu = linear(hs, w_gu[0])  # (B, T, 2 I)
            m = linear(st.act(gu[..., :inter]) * gu[..., inter:], w_d)
        else:
            m = linear(st.act(linear(hs, w_gu[0])) * linear(hs, w_gu[1]), w_d)
    if post is not None:  # Gemma: RMSNorm on the MLP output before the residual
        m = norm(st, m, post[1][0], post[1][1])
    return x + m


def _logits(st, x: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """Final RMSNorm and head over the last ``logits_to_keep`` positions of ``x (B, T, E)`` (all when 0) ->
    ``(B, T', V)`` (Gemma: ``cap * tanh(logits / cap)``; a trimmed draft head scattered to the full vocabulary)."""
    if logits_to_keep:
        x = x[:, -logits_to_keep:]
    hs = norm(st, x, st.norm_w, st.norm_eps)
    head_rows = (st.rows_w if hs.shape[0] * hs.shape[1] > 1 else st.rows_one) if st.packed else None
    if head_rows is not None:
        logits = rows_times(hs.reshape(-1, hs.shape[-1]), head_rows[-1]).view(*hs.shape[:2], -1)
    else:
        logits = torch.matmul(hs, st.lm_w) if st.packed else linear(hs, st.lm_w)  # (B, T', V)
    if st.final_softcap is not None:  # Gemma: cap * tanh(logits / cap)
        logits = torch.tanh(logits / st.final_softcap) * st.final_softcap
    if st.vocab_map is not None:  # (B, T', N) -> (B, T', V), -inf outside the kept ids
        logits = scatter_to_vocab(logits, *st.vocab_map)
    return logits


def softcapped_attention(st, q: torch.Tensor, key: torch.Tensor, val: torch.Tensor,
                         attn_mask: torch.Tensor | None) -> torch.Tensor:
    """Gemma-2's eager attention with logit soft-capping: ``softmax(cap * tanh(q k^T s / cap) + mask)`` (fp32
    softmax, cast back) times ``v``; ``q (B, H, T, D)``, ``key`` / ``val (B, H, L, D)`` -> ``(B, H, T, D)``."""
    cap = st.attn_softcap
    scores = torch.matmul(q, key.transpose(2, 3)) * st.scaling
    scores = torch.tanh(scores / cap) * cap
    if attn_mask is not None:
        scores = scores + attn_mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, val)


def head_norm(st, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last (head) dim: fp32 variance, rsqrt; Qwen3: cast back, times weight; Gemma-3: times
    ``1 + w`` (``weight`` here) in fp32, cast back."""
    hs = x.float()
    hs = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + eps)
    if st.gemma:
        return (hs * weight).to(x.dtype)
    return weight * hs.to(x.dtype)


def norm(st, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: fp32 variance, ``x * rsqrt(var + eps)``, cast back, times weight; Gemma: times ``1 + w``
    (``weight`` here, fp32) before the cast back."""
    if st.fused_norm:
        return F.rms_norm(x, (st.hidden,), weight, eps)
    hs = x.float()
    hs = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + eps)
    if st.gemma:
        return (hs * weight).to(x.dtype)
    return weight * hs.to(x.dtype)


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
    _core_impl = core  # the layers and the head (decode/fast_llama.py): what decode.compile compiles

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
        self.capture, self.features = None, None  # see set_capture
        self._core = (self._core_impl if not self.compiled else
                      functools.partial(SETTINGS.compiled_core(device, FastKVState._core_impl), self))

    def set_capture(self, layers) -> None:
        """After every forward, keep ``features (B, T, len(layers) * E)``: the inputs of decoder layers ``layers``
        (Hugging Face's ``hidden_states[i]``) concatenated, for an EAGLE-3 draft (:mod:`decode.eagle3`). The
        capturing forward runs uncompiled."""
        self.capture = tuple(int(i) for i in layers)
        if self.compiled:
            self.compiled, self._core = False, self._core_impl

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
        with BlockThreads(self.device, tokens.numel()):  # decode.block_threads (decode/fast_settings.py)
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
