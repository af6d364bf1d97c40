"""The layers and the head of the lean forward (:class:`decode.fast_llama.FastKVState`), op for op as
``transformers.models.llama.modeling_llama`` and the family variants listed in :mod:`decode.fast_support`, over
the state's weights (:mod:`decode.fast_weights`) and preallocated K/V buffers (not public API).

Every function takes the state ``st`` first: :func:`core` is ``FastKVState._core_impl`` (what ``decode.compile``
compiles). Per layer: RMSNorm -> q/k/v -> (q/k head norms) -> rotary -> K/V appended -> SDPA -> o_proj (-> Gemma
post-norm) -> residual -> RMSNorm -> gated MLP (-> Gemma post-norm) -> residual; then the final RMSNorm and the head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from data.draft_vocab import scatter_to_vocab

from .fast_settings import rows_addmm, rows_times

__all__ = ["core", "norm", "head_norm", "softcapped_attention", "linear"]


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w^T (+ bias)`` for an unpacked weight ``w (out, in)``, or ``w(x)`` for a dynamic int8 Linear module
    (:mod:`decode.quantize`: fbgemm's int8 product on its packed weights, activations quantized per call)."""
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
    for i, (ln1, eps1, w_qkv, w_o, ln2, eps2, w_gu, w_d) in enumerate(st.layers):
        w_rows = None if rows is None else rows[i]  # (W_qkv, W_o, W_gu, W_down), (out, in)
        post = st.extras[i][2]
        # --- attention block
        q = _qkv(st, i, norm(st, x, ln1, eps1), w_qkv, rope[st.layer_rope[i]], start, end, w_rows)  # (B, T, H, D)
        kv_start, attn_mask = masks[st.layer_window[i]]
        o = _attend(st, q, st.k[i][:, kv_start:end], st.v[i][:, kv_start:end], attn_mask)  # (B T, H D)
        x = _attention_residual(st, x, o, w_o, w_rows, post)
        # --- MLP block (gated: SiLU, Gemma GELU-tanh)
        x = _mlp_residual(st, x, norm(st, x, ln2, eps2), w_gu, w_d, w_rows, post)
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
    if len(w_qkv) == 1:  # q/k/v rows stacked in one int8 module (decode.quantize.fuse_int8_rows)
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
