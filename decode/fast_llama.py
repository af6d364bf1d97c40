"""A lean cached forward for Hugging Face Llama and Mistral causal LMs (not public API).

For small models at batch 1 most of the time of a Hugging Face forward is Python wrapper work (mask creation,
rotary module, output dataclasses, config look-ups), not matmuls. :class:`FastKVState` runs the same computation
directly on the model's own parameters (on CPU through packed, transposed copies that every new state checks bit
for bit against the live parameters: see ``_packed_weights``), with the same ops in the same order as
``transformers.models.llama.modeling_llama``:

    embed -> per layer [RMSNorm (fp32, ``variance_epsilon``) -> q/k/v ``F.linear`` -> rotary (cos/sin from the
    model's own ``inv_freq``, precomputed per position) -> append K/V to preallocated per-layer buffers -> SDPA over
    the valid prefix (boolean key mask for left padding / holes) -> o_proj -> residual -> RMSNorm -> SiLU-gated MLP
    -> residual] -> final RMSNorm -> lm_head on the kept positions only.

Cropping the cache only moves the valid length (no copy). Mistral is Llama plus a sliding window W: the cache keeps
every slot (so rollback is exact) and attention is limited to keys whose *position* is within W of the query's
(transformers' ``sliding_window_overlay``); at batch 1 without holes that is a slice of the key buffer. Models the
lean forward does not cover (another architecture, rope scaling, attention / MLP bias, a Llama config with a
sliding window, a non-SiLU activation, ...) fall back to the Hugging Face forward (:func:`fast_path_supported`
says which and why).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

__all__ = ["fast_path_supported", "FastKVState"]


def _unsupported_reason(model: torch.nn.Module) -> str | None:
    """``None`` when :class:`FastKVState` reproduces ``model``'s forward, else why not."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in _CLASSES:
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {sorted(_CLASSES)}"
    if type(model).__name__ != _CLASSES[cfg.model_type]:
        return f"{type(model).__name__} is not {_CLASSES[cfg.model_type]}"
    if model.training:
        return "model is in training mode (dropout)"
    base = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, n) for n in needed) or getattr(model, "lm_head", None) is None:
        return "unexpected module layout"
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else None
    if rope_type != "default" or getattr(base.rotary_emb, "rope_type", "default") != "default":
        return f"rope type {rope_type!r} is not 'default'"
    if float(getattr(base.rotary_emb, "attention_scaling", 1.0)) != 1.0:
        return "rotary attention_scaling != 1"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "attention / MLP bias"
    if cfg.model_type == "llama" and (getattr(cfg, "sliding_window", None) or getattr(cfg, "use_sliding_window", False)):
        return "sliding window attention"
    if getattr(cfg, "layer_types", None) and len(set(cfg.layer_types)) > 1:
        return "mixed full / sliding layers"
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"attn_implementation {cfg._attn_implementation!r}"
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        return f"hidden_act {cfg.hidden_act!r} is not SiLU"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if len(base.layers) != cfg.num_hidden_layers:
        return "layer count differs from the config"
    if type(model.lm_head) is not torch.nn.Linear:  # e.g. int8 dynamic Linear (decode/quantize.py): HF forward
        return f"lm_head is a {type(model.lm_head).__name__}, not a plain nn.Linear (quantized / adapted?)"
    if model.lm_head.bias is not None:
        return "lm_head has a bias"
    qkv_bias = cfg.model_type == "qwen2"  # Qwen2: q/k/v projections always have a bias, o_proj none
    for layer in base.layers:
        attn = layer.self_attn
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                    layer.mlp.down_proj):
            biased = qkv_bias and lin in (attn.q_proj, attn.k_proj, attn.v_proj)
            if type(lin) is not torch.nn.Linear or (lin.bias is not None) != biased:
                return "a projection is not a plain nn.Linear with the family's biases (quantized / adapted?)"
        if cfg.model_type == "qwen3" and not all(
                type(getattr(attn, n, None)).__name__ == "Qwen3RMSNorm" for n in ("q_norm", "k_norm")):
            return "Qwen3 attention without its q_norm / k_norm"
        if getattr(attn, "scaling", None) != attn.head_dim ** -0.5:
            return "attention scaling differs from head_dim ** -0.5"
    if any(p.device.type == "meta" for p in model.parameters()):
        return "meta parameters"
    return None


# Mistral = Llama + a sliding window; Qwen2 = Llama + q/k/v biases (+ a window); Qwen3 = Llama + per-head RMSNorm
# of q and k before rotary (+ a window). Windows only where every layer has the same type (mixed: HF forward).
_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}


def fast_path_supported(model: torch.nn.Module) -> bool:
    return _unsupported_reason(model) is None


# Packed weights (CPU): [q; k; v] and [gate; up] concatenated and every projection stored transposed, (in, out)
# contiguous. In isolation MKL runs these small projections up to ~2x faster on that layout, and 7 projections per
# layer become 4 matmuls: a one-token step of the reference target is ~1.3-1.4x faster than F.linear on the
# parameters. The transposed copies are expensive to build (a strided copy of every weight: re-packing on every
# decode call made 32- and 64-token calls 1.2-1.7x slower), so they are kept per model between decode calls, next
# to a plain copy of the weights they were built from; every FastKVState compares the live parameters with that
# copy bit for bit (a sequential read of both: 32- and 64-token calls took 1.05-1.14x the time of the old cache
# keyed on storage pointer and version; no copies at all: 1.2-1.5x) and rebuilds whatever differs. No key can miss
# a change: in-place edits, writes through ``.data`` (peft merge, DeepSpeed's optimizer), ``.data = other_tensor``
# and reloading are all seen by the next state. A state reads the weights once, when it is built: like its K/V
# cache, it belongs to the weights of that moment (the decoders build new states on every call). On CUDA, and for
# models over _PACK_MAX_BYTES, the model's own parameters are used through F.linear instead (no copies). Memory: the
# packed and the plain copy of the projections, about twice the model's size, while the model lives.
_PACK_MAX_BYTES = 1 << 30
_packed_cache: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _use_packed(model: torch.nn.Module, device: torch.device) -> bool:
    if torch.device(device).type != "cpu":
        return False
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return size <= _PACK_MAX_BYTES


def _same_bits(live: torch.Tensor, snap: torch.Tensor) -> bool:
    """Whether ``live`` holds exactly ``snap``'s bits (same dtype, shape, device; NaN payloads and -0.0 included)."""
    if live.dtype != snap.dtype or live.shape != snap.shape or live.device != snap.device:
        return False
    live = live.detach()
    size = snap.element_size()
    if live.dtype.is_complex or size not in _BITS:
        return torch.equal(live, snap)
    if (live.is_contiguous() and (live.numel() * size) % 8 == 0 and (live.storage_offset() * size) % 8 == 0
            and snap.is_contiguous()):  # as int64 words: fewer, wider comparisons (~20% faster)
        return torch.equal(live.reshape(-1).view(torch.int64), snap.reshape(-1).view(torch.int64))
    return torch.equal(live.view(_BITS[size]), snap.view(_BITS[size]))


def _packed(entry: dict, key, parts: list[torch.Tensor]) -> torch.Tensor:
    """``cat(parts, 0)^T`` contiguous ``(in, sum of outs)``, reused from ``entry[key]`` only when every live part
    equals, bit for bit, the copy it was built from."""
    hit = entry.get(key)
    if hit is not None and len(hit[0]) == len(parts) and all(_same_bits(p, s) for p, s in zip(parts, hit[0])):
        return hit[1]
    snaps = [p.detach().clone(memory_format=torch.contiguous_format) for p in parts]
    packed = (snaps[0] if len(snaps) == 1 else torch.cat(snaps, 0)).t().contiguous()
    entry[key] = (snaps, packed)
    return packed


def _packed_weights(model: torch.nn.Module) -> tuple[list[tuple], torch.Tensor]:
    """Per layer ``(ln1, eps1, W_qkv (E, (H + 2 H_kv) D), W_o (H D, E), ln2, eps2, W_gu (E, 2 I), W_down (I, E))``
    and ``W_lm (E, V)``: norms are the live parameters, projections transposed copies checked against the live
    parameters on this call (see above)."""
    entry = _packed_cache.setdefault(model, {})
    layers = []
    # ordinary tensors even when first built under inference_mode (the copies outlive the call)
    with torch.inference_mode(False), torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            a, m = layer.self_attn, layer.mlp
            layers.append((
                layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                _packed(entry, (i, "qkv"), [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                _packed(entry, (i, "o"), [a.o_proj.weight]),
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                _packed(entry, (i, "gu"), [m.gate_proj.weight, m.up_proj.weight]),
                _packed(entry, (i, "down"), [m.down_proj.weight]),
            ))
        for key in [k for k in entry if k != "lm" and k[0] >= len(layers)]:  # layers removed since
            del entry[key]
        lm = _packed(entry, "lm", [model.lm_head.weight])
    return layers, lm


class FastKVState:
    """Lean cached forward for a Llama model: the same interface and semantics as ``decode._common.KVState``.

    Buffers: per layer ``K, V (B, cap, H_kv, D)``; ``valid (B, cap)`` bool over physical slots (0 = left padding or
    a hole left by a rejected token); ``num_valid (B,)`` = next position id per row. While no row has a hole or
    padding (``dense``, the batch-1 case), positions are the slot indices and no key mask is needed for one-token
    steps, so a step does no index arithmetic at all.

    The weights are read when the state is built (on CPU: packed copies, verified against the live parameters bit
    for bit, rebuilt where they differ); like the K/V cache, a state belongs to the weights of that moment, so build
    a new state after changing the model (the decoders build one per call).
    """

    fast = True

    def __init__(self, model: torch.nn.Module, batch_size: int, device: torch.device, capacity: int = 256,
                 packed: bool | None = None, fused_norm: bool | None = None):
        self.model = model
        base = model.model
        cfg = model.config
        self.device = device
        self.dtype = model.lm_head.weight.dtype
        self.batch_size = batch_size
        self.embed_w = base.embed_tokens.weight
        self.norm_w, self.norm_eps = base.norm.weight, base.norm.variance_epsilon
        attn0 = base.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.n_rep = self.n_heads // self.n_kv
        self.scaling = attn0.scaling
        self.hidden = cfg.hidden_size
        self.inter = base.layers[0].mlp.gate_proj.weight.shape[0]
        # fp32: torch's fused rms_norm computes exactly LlamaRMSNorm's formula (fp32 variance, rsqrt, scale);
        # other dtypes keep the explicit formula (HF casts back to the input dtype before scaling)
        self.fused_norm = self.dtype == torch.float32 if fused_norm is None else fused_norm
        self.packed = _use_packed(model, device) if packed is None else packed
        if self.packed:
            self.layers, self.lm_w = _packed_weights(model)
        else:
            self.layers = [
                (
                    layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                    (layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight),
                    layer.self_attn.o_proj.weight,
                    layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                    (layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight), layer.mlp.down_proj.weight,
                )
                for layer in base.layers
            ]
            self.lm_w = model.lm_head.weight
        self.inv_freq = base.rotary_emb.inv_freq
        # Mistral's sliding window W: a query at position p sees keys at positions p - W < q <= p
        # (transformers' sliding_window_overlay); None = full attention
        if cfg.model_type == "mistral":
            self.window = getattr(cfg, "sliding_window", None)
        elif cfg.model_type in ("qwen2", "qwen3") and set(getattr(cfg, "layer_types", None) or ()) == {
                "sliding_attention"}:
            self.window = cfg.sliding_window
        else:
            self.window = None
        # per layer: concatenated q/k/v bias (Qwen2) and (q_norm weight, k_norm weight, eps) (Qwen3), else None;
        # built per state from the live parameters (never cached across calls)
        self.extras = []
        for layer in base.layers:
            a = layer.self_attn
            bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None
            qk_norm = (a.q_norm.weight, a.k_norm.weight, a.q_norm.variance_epsilon) if hasattr(a, "q_norm") else None
            self.extras.append((bias, qk_norm))
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
        # rotary tables exactly as LlamaRotaryEmbedding.forward: fp32 freqs, cat, cos/sin, cast to the model dtype
        pos = torch.arange(cap, device=self.device)
        freqs = pos[:, None].float() * self.inv_freq.to(device=self.device, dtype=torch.float)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # (cap, D)
        half = self.head_dim // 2
        self.cos = emb.cos().to(self.dtype)  # (cap, D)
        sin = emb.sin().to(self.dtype)
        # rotate_half(x) * sin == roll(x, D/2) * [-sin_lo, sin_hi]  (negation is exact, so bitwise equal)
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.cos4, self.sin4 = self.cos[None, :, None, :], self.sin_signed[None, :, None, :]  # (1, cap, 1, D)
        self.arange = pos
        self.cap = cap

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor, token_mask: torch.Tensor | None = None, logits_to_keep: int = 1,
                tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Append ``tokens (B, T)`` (``token_mask (B, T)``: 1 real, 0 hole; ``None`` = all real) to the cache;
        return logits ``(B, T', V)`` for the last ``T' = logits_to_keep`` slots (all slots when 0).

        ``tree`` (token trees, :mod:`decode.tree`): ``(position_ids (B, T), additive mask (B, 1, T, L+T))`` used
        as given instead of the causal ones (every new token is a real token)."""
        if not torch.is_inference_mode_enabled():  # the buffers are inference tensors (the decoders run inside)
            with torch.inference_mode():
                return self._forward(tokens, token_mask, logits_to_keep, tree)
        return self._forward(tokens, token_mask, logits_to_keep, tree)

    def _forward(self, tokens: torch.Tensor, token_mask: torch.Tensor | None, logits_to_keep: int,
                 tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        bsz, t = tokens.shape
        start = self.length
        end = start + t
        if end > self.cap:
            self._grow(end + 64)
        if token_mask is not None and self.dense and not bool(token_mask.all()):
            self.dense = False
        arange = self.arange
        window = self.window
        kv_start = 0  # keys before this slot are outside every query's window (dense: slot == position)
        if tree is not None:  # decode.tree: the caller's positions and mask (window included)
            position_ids, attn_mask = tree
            self.valid[:, start:end] = True
            cos = self.cos[position_ids][:, :, None, :]  # (B, T, 1, D)
            sin = self.sin_signed[position_ids][:, :, None, :]
            self.num_valid = self.num_valid + t
        elif self.dense:
            self.valid[:, start:end] = True
            cos = self.cos4[:, start:end]  # (1, T, 1, D)
            sin = self.sin4[:, start:end]
            if window is not None:
                kv_start = max(0, start - window + 1)
            if t == 1:
                attn_mask = None
            else:  # (T, L+T) causal, additive (SDPA would convert a boolean mask again in every layer)
                kpos, qpos = arange[kv_start:end][None, :], arange[start:end][:, None]
                allowed = kpos <= qpos
                if window is not None:
                    allowed = allowed & (kpos > qpos - window)
                attn_mask = torch.where(allowed, 0.0, self._neg_inf)
            self.num_valid = self.num_valid + t
        else:
            if token_mask is None:
                tm = torch.ones_like(tokens)
                position_ids = self.num_valid[:, None] + arange[:t][None, :]
            else:
                tm = token_mask.to(torch.long)
                position_ids = self.num_valid[:, None] + tm.cumsum(1) - tm  # (B, T) valid tokens before each slot
            self.valid[:, start:end] = tm.bool()
            cos = self.cos[position_ids][:, :, None, :]  # (B, T, 1, D)
            sin = self.sin_signed[position_ids][:, :, None, :]
            keys = self.valid[:, None, :end]  # (B, 1, L+T)
            kpos, qpos = arange[:end][None, :], arange[start:end][:, None]
            # every query also sees its own slot, so a padding / hole query never has an all-masked row (NaN);
            # its output is never read and its key stays masked for every other query
            allowed = keys & (kpos <= qpos)[None]  # (B, T, L+T)
            if window is not None:  # the window counts positions (valid tokens), not slots: holes are skipped
                key_pos = self.valid[:, :end].cumsum(1) - 1  # (B, L+T) position of each valid slot
                allowed = allowed & ((position_ids[:, :, None] - key_pos[:, None, :]) < window)
            allowed = allowed | (kpos == qpos)[None]
            attn_mask = torch.where(allowed[:, None], 0.0, self._neg_inf)  # (B, 1, T, L+T) additive
            self.num_valid = self.num_valid + tm.sum(1)
        self.length = end

        half = self.head_dim // 2
        h_kv, h_q, d = self.n_kv, self.n_heads, self.head_dim
        qd, kd, inter, packed = h_q * d, h_kv * d, self.inter, self.packed
        norm = self._norm
        x = F.embedding(tokens, self.embed_w)  # (B, T, E)
        for i, (ln1, eps1, w_qkv, w_o, ln2, eps2, w_gu, w_d) in enumerate(self.layers):
            # --- attention block
            hs = norm(x, ln1, eps1)
            kbuf, vbuf = self.k[i], self.v[i]
            b_qkv, qk_norm = self.extras[i]
            if packed:  # (E, (H + 2 H_kv) D) = [q_proj; k_proj; v_proj]^T
                qkv = torch.matmul(hs, w_qkv)  # (B, T, (H + 2 H_kv) D)
                if b_qkv is not None:
                    qkv = qkv + b_qkv
                qk = qkv[..., :qd + kd].view(bsz, t, h_q + h_kv, d)  # (B, T, H + H_kv, D)
                if qk_norm is not None:  # Qwen3: RMSNorm over head_dim, q and k heads with their own weights
                    qk = torch.cat([self._head_norm(qk[:, :, :h_q], qk_norm[0], qk_norm[2]),
                                    self._head_norm(qk[:, :, h_q:], qk_norm[1], qk_norm[2])], 2)
                qk = qk * cos + qk.roll(half, -1) * sin  # apply_rotary_pos_emb on q and k at once
                q = qk[:, :, :h_q]  # (B, T, H, D)
                kbuf[:, start:end] = qk[:, :, h_q:]
                vbuf[:, start:end] = qkv[..., qd + kd:].view(bsz, t, h_kv, d)
            else:
                bq, bk, bv = (None, None, None) if b_qkv is None else b_qkv.split([qd, kd, kd])
                q = F.linear(hs, w_qkv[0], bq).view(bsz, t, h_q, d)  # (B, T, H, D)
                k = F.linear(hs, w_qkv[1], bk).view(bsz, t, h_kv, d)
                if qk_norm is not None:
                    q = self._head_norm(q, qk_norm[0], qk_norm[2])
                    k = self._head_norm(k, qk_norm[1], qk_norm[2])
                q = q * cos + q.roll(half, -1) * sin  # apply_rotary_pos_emb
                torch.add(k * cos, k.roll(half, -1) * sin, out=kbuf[:, start:end])
                vbuf[:, start:end] = F.linear(hs, w_qkv[2], bv).view(bsz, t, h_kv, d)
            key = kbuf[:, kv_start:end].transpose(1, 2)  # (B, H_kv, L+T, D)
            val = vbuf[:, kv_start:end].transpose(1, 2)
            if self.n_rep > 1:  # repeat_kv
                n_kv = end - kv_start
                key = key[:, :, None].expand(bsz, h_kv, self.n_rep, n_kv, d).reshape(bsz, h_q, n_kv, d)
                val = val[:, :, None].expand(bsz, h_kv, self.n_rep, n_kv, d).reshape(bsz, h_q, n_kv, d)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), key, val, attn_mask=attn_mask, scale=self.scaling)
            o = o.transpose(1, 2).reshape(bsz, t, qd)  # (B, T, H D)
            x = x + (torch.matmul(o, w_o) if packed else F.linear(o, w_o))
            # --- MLP block (SiLU-gated)
            hs = norm(x, ln2, eps2)
            if packed:  # (E, 2 I) = [gate_proj; up_proj]^T
                gu = torch.matmul(hs, w_gu)  # (B, T, 2 I)
                x = x + torch.matmul(F.silu(gu[..., :inter]) * gu[..., inter:], w_d)
            else:
                x = x + F.linear(F.silu(F.linear(hs, w_gu[0])) * F.linear(hs, w_gu[1]), w_d)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        hs = norm(x, self.norm_w, self.norm_eps)
        return torch.matmul(hs, self.lm_w) if packed else F.linear(hs, self.lm_w)  # (B, T', V)

    @staticmethod
    def _head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Qwen3RMSNorm over the last (head) dim: fp32 variance, rsqrt, cast back, times weight."""
        hs = x.float()
        hs = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + eps)
        return weight * hs.to(x.dtype)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """LlamaRMSNorm: fp32 variance, ``x * rsqrt(var + eps)``, cast back, times weight."""
        if self.fused_norm:
            return F.rms_norm(x, (self.hidden,), weight, eps)
        hs = x.float()
        hs = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + eps)
        return weight * hs.to(x.dtype)

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
