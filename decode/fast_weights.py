"""What a lean state (:class:`decode.fast_llama.FastKVState`) reads from a model, and the caches that spare
re-reading it (not public API beyond :func:`frozen_weights`).

- Packed weights (CPU): transposed, concatenated copies of the projections kept per model between decode calls and
  checked bit for bit against the live parameters by every new state (:func:`_layer_weights`).
- :func:`read_model`: everything else a state derives from the model (sizes, norms, windows, rotary frequencies).
- :func:`frozen_weights` / :func:`frozen_cached`: inside the context, what a state read is reused while every
  parameter is the same tensor at the same version (fingerprints of storage, version, dtype and shape).

The decoder's KV-cache policy: which attention patterns it can roll back exactly, the window each layer type
uses, and what a token-tree block sees of the cache (shared by the Hugging Face state in :mod:`decode.common` and
the lean forward of :mod:`decode.fast_llama`).

Which models the lean forward (:mod:`decode.fast_llama`) reproduces exactly, and why not the others (not public
API beyond :func:`fast_path_supported`).

Covered: Hugging Face Llama, Mistral, Qwen2, Qwen3, Gemma-2, Gemma-3 and Phi-3 causal LMs in eval mode with the
default RoPE, no attention / MLP bias beyond the family's own, plain ``nn.Linear`` projections, a SiLU or GELU-tanh
gated MLP and a cache the decoder can roll back (:func:`decode.fast_weights.cache_policy`); anything else falls back to
the Hugging Face forward, :func:`unsupported_reason` naming why.
"""
from __future__ import annotations

import contextlib
import types
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.vocab import TrimmedLMHead

__all__ = [
    'fast_path_supported', 'unsupported_reason', 'FAMILY_CLASSES', 'GEMMA_FAMILIES', 'ACTIVATIONS', 'norm_eps',
    'layer_inv_freqs', 'frozen_weights', 'frozen_cached', 'read_model', 'use_packed',
]


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


# Mistral = Llama + a sliding window; Qwen2 = Llama + q/k/v biases; Qwen3 = Llama + per-head RMSNorm of q and k
# before rotary; Phi-3 = Llama with fused qkv_proj / gate_up_proj; Gemma-2 = Llama with (1 + w) RMSNorms, a scaled
# embedding, norms after attention and MLP as well as before, GELU-tanh, query scaling query_pre_attn_scalar ** -0.5,
# attention and final logit soft-capping (tanh(x / cap) * cap); Gemma-3 = Gemma-2 + q/k head norms and a RoPE base
# per layer type. Windows per layer from the decoder's cache policy (full and sliding layers may alternate).
FAMILY_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                  "gemma3_text": "Gemma3ForCausalLM"}
GEMMA_FAMILIES = ("gemma2", "gemma3_text")
ACTIVATIONS = {"silu": F.silu, "swish": F.silu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def norm_eps(norm: torch.nn.Module) -> float:
    """An RMSNorm module's epsilon (Llama / Qwen / Phi-3: ``variance_epsilon``; Gemma: ``eps``)."""
    return float(norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps)


def _rope_dicts(cfg) -> list:
    """The config's RoPE parameter dicts: one, or one per layer type (Gemma-3)."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    if not isinstance(rope, dict):
        return [None]
    if rope and all(isinstance(v, dict) or v is None for v in rope.values()):
        return [v for v in rope.values() if v is not None]
    return [rope]


def layer_inv_freqs(model: torch.nn.Module, layer_types) -> list[torch.Tensor]:
    """Per decoder layer, the rotary ``inv_freq`` its attention uses (Gemma-3: one per layer type)."""
    rot = model.model.rotary_emb
    if hasattr(rot, "inv_freq"):
        return [rot.inv_freq] * len(model.model.layers)
    return [getattr(rot, f"{t}_inv_freq") for t in layer_types]


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """``None`` when :class:`decode.fast_llama.FastKVState` reproduces ``model``'s forward, else why not."""
    cfg = getattr(model, "config", None)
    family = getattr(cfg, "model_type", None)
    if cfg is None or family not in FAMILY_CLASSES:
        return f"model_type {family!r} is not one of {sorted(FAMILY_CLASSES)}"
    if type(model).__name__ != FAMILY_CLASSES[family]:
        return f"{type(model).__name__} is not {FAMILY_CLASSES[family]}"
    if model.training:
        return "model is in training mode (dropout)"
    base = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, n) for n in needed) or getattr(model, "lm_head", None) is None:
        return "unexpected module layout"
    for rope in _rope_dicts(cfg):
        rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else None
        if rope_type != "default":
            return f"rope type {rope_type!r} is not 'default'"
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            return "partial rotary embedding (partial_rotary_factor != 1)"
    rot_types = getattr(base.rotary_emb, "rope_type", "default")
    if any(t != "default" for t in (rot_types.values() if isinstance(rot_types, dict) else [rot_types])):
        return f"rotary embedding type {rot_types!r} is not 'default'"
    scalings = [v for k, v in vars(base.rotary_emb).items() if k.endswith("attention_scaling")]
    if any(float(v) != 1.0 for v in scalings):
        return "rotary attention_scaling != 1"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "attention / MLP bias"
    if family == "llama" and (getattr(cfg, "sliding_window", None) or getattr(cfg, "use_sliding_window", False)):
        return "sliding window attention"
    try:

        cache_policy(model)
    except ValueError as e:
        return str(e)
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"attn_implementation {cfg._attn_implementation!r}"
    gemma = family in GEMMA_FAMILIES
    act = getattr(cfg, "hidden_activation", None) if gemma else getattr(cfg, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        return f"{'hidden_activation' if gemma else 'hidden_act'} {act!r} is not one of {sorted(ACTIVATIONS)}"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if len(base.layers) != cfg.num_hidden_layers:
        return "layer count differs from the config"
    if gemma and not isinstance(getattr(base.embed_tokens, "embed_scale", None), torch.Tensor):
        return "Gemma embedding without its embed_scale"
    # int8 dynamic Linear modules (decode.fast_settings) run in the lean forward for the families without projection
    # biases (the module is called with its packed weights); anything else quantized takes the HF forward
    int8_ok = family not in ("qwen2", "phi3")
    if type(model.lm_head) is not TrimmedLMHead and not _plain_linear(model.lm_head, int8_ok, False):
        return f"lm_head is a {type(model.lm_head).__name__}: biased, or not a plain nn.Linear (quantized / adapted?)"
    qkv_bias = family == "qwen2"  # Qwen2: q/k/v projections always have a bias, o_proj none
    norm_names = ("input_layernorm", "post_attention_layernorm") + (
        ("pre_feedforward_layernorm", "post_feedforward_layernorm") if gemma else ())
    for layer in base.layers:
        attn = layer.self_attn
        if family == "phi3":
            lins = [attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        else:
            lins = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                    layer.mlp.down_proj]
        for lin in lins:
            if not _plain_linear(lin, int8_ok, qkv_bias and lin in (attn.q_proj, attn.k_proj, attn.v_proj)):
                return "a projection is not a plain nn.Linear with the family's biases (quantized / adapted?)"
        if not all(hasattr(getattr(layer, n, None), "weight") for n in norm_names):
            return "a decoder layer without the family's RMSNorms"
        if family in ("qwen3", "gemma3_text") and not all(
                type(getattr(attn, n, None)).__name__.endswith("RMSNorm") for n in ("q_norm", "k_norm")):
            return "attention without its q_norm / k_norm"
        want = (cfg.query_pre_attn_scalar ** -0.5) if gemma else attn.head_dim ** -0.5
        if getattr(attn, "scaling", None) != want:
            return "attention scaling differs from the family's (head_dim or query_pre_attn_scalar) ** -0.5"
        if family != "phi3" and attn.head_dim != base.layers[0].self_attn.head_dim:
            return "head_dim differs between layers"
    if any(p.device.type == "meta" for p in model.parameters()):
        return "meta parameters"
    return None


def _plain_linear(lin: torch.nn.Module, int8_ok: bool, biased: bool) -> bool:
    """Whether the lean forward runs projection ``lin``: an ``nn.Linear`` with a bias exactly when ``biased``, or,
    where ``int8_ok``, a dynamic int8 Linear without one."""
    from torch.ao.nn.quantized.dynamic import Linear as QLinear

    if type(lin) is QLinear:
        return int8_ok and lin.bias() is None
    return type(lin) is torch.nn.Linear and (lin.bias is not None) == biased


def fast_path_supported(model: torch.nn.Module) -> bool:
    """Whether the lean forward runs ``model`` (:func:`unsupported_reason` says why not)."""
    return unsupported_reason(model) is None


# Packed weights (CPU): [q; k; v] and [gate; up] concatenated and every projection stored transposed, (in, out)
# contiguous. In isolation MKL runs these small projections up to ~2x faster on that layout, and 7 projections per
# layer become 4 matmuls: a one-token step of the reference target is ~1.3-1.4x faster than F.linear on the
# parameters. The transposed copies are expensive to build (a strided copy of every weight: re-packing on every
# decode call made 32- and 64-token calls 1.2-1.7x slower), so they are kept per model between decode calls, next
# to a plain copy of the weights they were built from, [q; k; v] / [gate; up] concatenated in the parameters'
# (out, in) layout; forwards over several rows (verify blocks, trees, prefills) multiply either with that copy as the
# left operand (``rows_times`` in decode/fast_settings.py: on the 2-core AVX2 machine about what a one-row product
# costs) or like one row on the (in, out) copy, whichever measured faster on this machine (``set_row_layout``). Every
# FastKVState compares the live parameters with the rows of that
# copy bit for bit (a sequential read of both: 32- and 64-token calls took 1.05-1.14x the time of the old cache
# keyed on storage pointer and version; no copies at all: 1.2-1.5x) and rebuilds whatever differs. No key can miss
# a change: in-place edits, writes through ``.data`` (peft merge, DeepSpeed's optimizer), ``.data = other_tensor``
# and reloading are all seen by the next state. A state reads the weights once, when it is built: like its K/V
# cache, it belongs to the weights of that moment (the decoders build new states on every call; inside
# ``frozen_weights`` they reuse the first one's reading while the parameters are unchanged). On CUDA, and for
# models over _PACK_MAX_BYTES, the model's own parameters are used through F.linear instead (no copies). Memory: the
# packed and the plain copy of the projections, about twice the model's size, while the model lives.
_PACK_MAX_BYTES = 1 << 30
_packed_cache: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def use_packed(model: torch.nn.Module, device: torch.device) -> bool:
    from decode.fast_settings import is_quantized

    if torch.device(device).type != "cpu" or is_quantized(model):  # int8 Linear modules are called as they are
        return False
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return size <= _PACK_MAX_BYTES


def _weight(lin: torch.nn.Module):
    """What the unpacked forward multiplies with: the live weight of an ``nn.Linear``; a dynamic int8 Linear (or a
    trimmed head's int8 rows) as the module itself (see :func:`decode.fast_llama.linear`)."""
    from torch.ao.nn.quantized.dynamic import Linear as QLinear

    if isinstance(lin, QLinear):
        return lin
    quantized = getattr(lin, "quantized", None)
    return quantized if quantized is not None else lin.weight


_stacked_cache: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _stacked_int8(owner: torch.nn.Module, name: str, parts: list) -> list:
    """``parts`` (the weights of projections that read one input) as ``[one int8 module]`` when they are per-row
    int8 modules that :func:`decode.fast_settings.fuse_int8_rows` stacks exactly, else unchanged. Built once per
    ``owner`` and reused while its modules and their packed weights are the same objects (``set_weight_bias`` and
    ``load_state_dict`` repack a module's weights in place: a new packed object, so the stack is rebuilt)."""
    from torch.ao.nn.quantized.dynamic import Linear as QLinear

    if not all(isinstance(p, QLinear) for p in parts):
        return parts
    key = tuple(x for p in parts for x in (p, p._packed_params._packed_params))
    entry = _stacked_cache.setdefault(owner, {})
    hit = entry.get(name)
    if hit is None or len(hit[0]) != len(key) or any(a is not b for a, b in zip(hit[0], key)):
        from decode.fast_settings import fuse_int8_rows

        fused = fuse_int8_rows(parts)
        hit = entry[name] = (key, parts if fused is None else [fused])
    return hit[1]


def _same_bits(live: torch.Tensor, snap: torch.Tensor) -> bool:
    """Whether ``live`` holds exactly ``snap``'s bits (same dtype, shape, device; NaN payloads and -0.0 included)."""
    if live.dtype != snap.dtype or live.shape != snap.shape or live.device != snap.device:
        return False
    live = live.detach()
    size = snap.element_size()
    if live.dtype.is_complex or size not in _BITS:
        return torch.equal(live, snap)
    if (live.is_contiguous() and (live.numel() * size) % 8 == 0 and (live.storage_offset() * size) % 8 == 0
            and snap.is_contiguous() and (snap.storage_offset() * size) % 8 == 0):  # as int64 words (~20% faster)
        return torch.equal(live.reshape(-1).view(torch.int64), snap.reshape(-1).view(torch.int64))
    return torch.equal(live.view(_BITS[size]), snap.view(_BITS[size]))


def _packed(entry: dict, key, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cat(parts, 0)^T, cat(parts, 0))``, both contiguous: ``(in, sum of outs)`` for one-row products and
    ``(sum of outs, in)`` for products over several rows (see :func:`decode.fast_settings.rows_times`); reused from
    ``entry[key]`` only when every live part equals, bit for bit, the rows of the copy it was built from."""
    hit = entry.get(key)
    if hit is not None and len(hit[0]) == len(parts) and all(_same_bits(p, s) for p, s in zip(parts, hit[0])):
        return hit[1], hit[2]
    plain = parts[0].detach().clone(memory_format=torch.contiguous_format) if len(parts) == 1 else \
        torch.cat([p.detach() for p in parts], 0)  # (sum of outs, in)
    snaps = list(plain.split([p.shape[0] for p in parts], 0))  # each part's rows: contiguous views
    packed = plain.t().contiguous()
    entry[key] = (snaps, packed, plain)
    return packed, plain


def _layer_weights(model: torch.nn.Module, packed: bool) -> tuple[list[tuple], torch.Tensor, list | None]:
    """Per layer ``(ln1, eps1, W_qkv, W_o, ln2, eps2, W_gu, W_down)``, the head ``W_lm`` and (packed only) the same
    projections in the ``(out, in)`` layout, per layer ``(W_qkv, W_o, W_gu, W_down)`` then the head.

    Packed (CPU): ``W_qkv (E, (H + 2 H_kv) D)``, ``W_o (H D, E)``, ``W_gu (E, 2 I)``, ``W_down (I, E)``,
    ``W_lm (E, V)``: transposed copies checked against the live parameters on this call (see above), and their
    ``(out, in)`` twins (the copies they were built from). Unpacked: the live parameters (or row views of Phi-3's
    fused ``qkv_proj`` / ``gate_up_proj``), ``W_qkv`` and ``W_gu`` as tuples ``(q, k, v)`` / ``(gate, up)`` for
    ``F.linear``. ``ln2`` is the norm before the MLP (Gemma: ``pre_feedforward_layernorm``); norms are the live
    parameters."""
    phi3 = model.config.model_type == "phi3"
    pre_mlp = "pre_feedforward_layernorm" if model.config.model_type in GEMMA_FAMILIES else "post_attention_layernorm"
    entry = _packed_cache.setdefault(model, {}) if packed else None
    layers, rows_major = [], [] if packed else None
    # ordinary tensors even when first built under inference_mode (the copies outlive the call)
    with torch.inference_mode(False), torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            a, m = layer.self_attn, layer.mlp
            qkv = [a.qkv_proj.weight] if phi3 else [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]
            gu = [m.gate_up_proj.weight] if phi3 else [m.gate_proj.weight, m.up_proj.weight]
            if packed:
                (qkv, qkv_r), (o, o_r) = _packed(entry, (i, "qkv"), qkv), _packed(entry, (i, "o"), [a.o_proj.weight])
                (gu, gu_r), (down, down_r) = _packed(entry, (i, "gu"), gu), _packed(entry, (i, "down"),
                                                                                    [m.down_proj.weight])
                rows_major.append((qkv_r, o_r, gu_r, down_r))
            else:
                if phi3:
                    qd, kd = a.config.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
                    qkv = list(qkv[0].split([qd, kd, kd]))
                    gu = list(gu[0].chunk(2))
                if not phi3:  # the modules' weights, or int8 modules themselves (stacked where exact)
                    qkv = _stacked_int8(a, "qkv", [_weight(a.q_proj), _weight(a.k_proj), _weight(a.v_proj)])
                    gu = _stacked_int8(m, "gu", [_weight(m.gate_proj), _weight(m.up_proj)])
                qkv, gu, o, down = tuple(qkv), tuple(gu), _weight(a.o_proj), _weight(m.down_proj)
            ln2 = getattr(layer, pre_mlp)
            layers.append((layer.input_layernorm.weight, norm_eps(layer.input_layernorm), qkv, o,
                           ln2.weight, norm_eps(ln2), gu, down))
        if packed:
            for key in [k for k in entry if k != "lm" and k[0] >= len(layers)]:  # layers removed since
                del entry[key]
        if packed:
            lm, lm_r = _packed(entry, "lm", [model.lm_head.weight])
            rows_major.append(lm_r)
        else:
            lm = _weight(model.lm_head)
    return layers, lm, rows_major


# ---------------------------------------------------------------------------------------------- frozen weights
# Building a state reads the model: on CPU the packed copies are compared bit for bit with the live parameters
# (about 6 ms for the reference target's 22 MB, 1 ms for distill_med's draft), and the support check, cache policy
# and per-layer look-ups add 1-3 ms more, on every decode call. An evaluation or a server decodes many prompts with
# weights nobody changes; inside ``frozen_weights(*models)`` what a state reads from a model is built once and reused
# while every parameter is still the same tensor at the same version (pointer, ``_version``, shape, dtype,
# ``model.training``): an in-place edit through the parameter, ``param.data = other`` or a reload is still seen; a
# write through ``param.data`` in place (``p.data.add_(...)``, which bumps no version counter) and a replaced module
# are not. On leaving the outermost context everything cached for the models is dropped, and states check bit for
# bit again.
_frozen: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()  # [depth, parameters]
_frozen_plans: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _fingerprint(model: torch.nn.Module) -> tuple:
    """The model's mode and, per parameter listed on entering the context, its storage, version, dtype and shape
    (walking ``model.parameters()`` costs ~0.7 ms per call for the reference target: the list is taken once)."""
    return (model.training, *((p.data_ptr(), p._version, p.dtype, p.shape) for p in _frozen[model][1]))


def frozen_cached(model: torch.nn.Module, key, build):
    """``build()``, or inside :func:`frozen_weights` for ``model`` the value built under ``key`` while the model's
    parameters are unchanged (see above)."""
    if model not in _frozen:
        return build()
    fp = _fingerprint(model)
    slot = _frozen_plans.setdefault(model, {})
    hit = slot.get(key)
    if hit is not None and hit[0] == fp:
        return hit[2]
    value = build()
    # the entry holds every parameter's storage of this moment (detach() shares it): while it is cached, no new
    # tensor can be given a freed storage's address, so ``param.data = t`` always changes the pointer it records
    slot[key] = (fp, [p.detach() for p in _frozen[model][1]], value)
    return value


@contextlib.contextmanager
def frozen_weights(*models: torch.nn.Module):
    """Declare that ``models``' weights do not change inside the ``with`` block, so each decode call reuses what
    the previous one read from them instead of re-checking every weight (about 10 ms per call for the reference
    target and its draft on the 2-core CPU: 5-10 % of a 48-token decode). Outputs are unchanged.

    Still seen inside the block (the cache is rebuilt): parameters edited in place through the parameter itself
    (``copy_``, ``load_state_dict``, an optimizer step), given new storage (``param.data = t``), a change of dtype
    or shape, ``train()`` / ``eval()``. Not seen: in-place writes through ``param.data`` (``p.data.add_(...)``,
    peft's merge, DeepSpeed's optimizer) and modules or parameter objects added or replaced (including
    ``load_state_dict(..., assign=True)``): change the model that way only outside the block. Nests and is
    reentrant; leaving the outermost block for a model drops what was cached for it.

    Raises:
        TypeError: an argument that is not a ``torch.nn.Module`` (nothing is registered then).
    """
    for m in models:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"frozen_weights takes models (torch.nn.Module), got {type(m).__name__}")
    entered = []
    try:
        for m in models:
            entry = _frozen.get(m)
            if entry is None:
                _frozen[m] = [1, list(m.parameters())]
            else:
                entry[0] += 1
            entered.append(m)
        yield
    finally:
        models = entered
        for m in models:
            entry = _frozen.get(m)
            if entry is not None and entry[0] > 1:
                entry[0] -= 1
            else:
                _frozen.pop(m, None)
                _frozen_plans.pop(m, None)


# ---------------------------------------------------------------------------------------------- a model's plan
def read_model(model: torch.nn.Module, device: torch.device, packed: bool, fused_norm: bool | None) -> dict:
    """Every attribute a :class:`decode.fast_llama.FastKVState` derives from ``model``, as a dict: dtype and sizes,
    the (packed) weights (:func:`_layer_weights`), norms, per-layer windows and rotary frequencies, per-layer
    extras. The decoders build it through :func:`frozen_cached`, so inside :func:`frozen_weights` it is read once."""

    s = types.SimpleNamespace()
    s.model = model
    base = model.model
    cfg = model.config
    family = cfg.model_type
    s.gemma = family in GEMMA_FAMILIES
    s.device = device
    s.dtype = base.embed_tokens.weight.dtype  # the head's too (an int8 head computes in float32)
    s.embed_w = base.embed_tokens.weight
    # Gemma: embeddings times sqrt(hidden) cast to the weights' dtype (Gemma2TextScaledWordEmbedding)
    s.embed_scale = base.embed_tokens.embed_scale.to(s.dtype) if s.gemma else None
    attn0 = base.layers[0].self_attn
    s.head_dim = attn0.head_dim
    s.n_heads = cfg.num_attention_heads
    s.n_kv = cfg.num_key_value_heads
    s.n_rep = s.n_heads // s.n_kv
    s.scaling = attn0.scaling
    s.hidden = cfg.hidden_size
    s.act = ACTIVATIONS[cfg.hidden_activation if s.gemma else getattr(cfg, "hidden_act", "silu")]
    s.attn_softcap = getattr(cfg, "attn_logit_softcapping", None) if s.gemma else None
    s.final_softcap = getattr(cfg, "final_logit_softcapping", None) if s.gemma else None
    # fp32: torch's fused rms_norm computes exactly LlamaRMSNorm's formula (fp32 variance, rsqrt, scale);
    # other dtypes keep the explicit formula (HF casts back to the input dtype before scaling)
    s.fused_norm = s.dtype == torch.float32 if fused_norm is None else fused_norm
    s.packed = packed
    s.layers, s.lm_w, s.rows_all = _layer_weights(model, s.packed)
    # a trimmed draft head (models/vocab.py): N rows, scattered to the full vocabulary with -inf elsewhere
    kept = getattr(model.lm_head, "draft_to_target", None)
    s.vocab_map = (kept.to(device), int(model.lm_head.out_features)) if kept is not None else None
    s.rows_w = None  # the (out, in) copies when several-row products use them (set per state)
    s.rows_one = None  # the same for one-row products (one-token forwards), when measured faster
    down = s.layers[0][7]
    s.inter = down.shape[0] if s.packed else down.in_features if isinstance(down, torch.nn.Module) else down.shape[1]
    s.norm_w, s.norm_eps = _norm_factor(base.norm.weight, s.gemma), norm_eps(base.norm)
    if s.gemma:  # (1 + w) in fp32, as Gemma2RMSNorm computes it on every call
        s.layers = [(_norm_factor(l1, True), e1, qkv, o, _norm_factor(l2, True), e2, gu, d)
                    for l1, e1, qkv, o, l2, e2, gu, d in s.layers]
    # per layer: the window (a query at position p sees keys at positions p - W < q <= p, transformers'
    # sliding_window_overlay; None = full attention) and the index of its rotary table
    policy = cache_policy(model)
    layer_types = policy.layer_types or ("full_attention",) * len(base.layers)
    s.layer_window = [policy.window if t == "sliding_attention" else None for t in layer_types]
    s.windows = sorted(set(s.layer_window), key=lambda w: -1 if w is None else w)
    s.inv_freqs, s.layer_rope = _rotary_tables(layer_inv_freqs(model, layer_types))
    s.extras = _layer_extras(base.layers, s.gemma)
    return vars(s)


def _rotary_tables(inv_freqs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """The distinct ``inv_freq`` tensors of the layers (by identity) and, per layer, the index of its own."""
    distinct: list[torch.Tensor] = []
    layer_rope = []
    for f in inv_freqs:
        idx = next((j for j, g in enumerate(distinct) if g is f), None)
        if idx is None:
            distinct.append(f)
            idx = len(distinct) - 1
        layer_rope.append(idx)
    return distinct, layer_rope


def _layer_extras(layers, gemma: bool) -> list[tuple]:
    """Per layer: concatenated q/k/v bias (Qwen2), (q_norm weight, k_norm weight, eps) (Qwen3, Gemma-3) and the
    Gemma norms after attention and after the MLP ((weight, eps) or None); built from the live parameters."""
    extras = []
    for layer in layers:
        a = layer.self_attn
        bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if isinstance(
            getattr(a, "q_proj", None), torch.nn.Linear) and a.q_proj.bias is not None else None
        qk_norm = (_norm_factor(a.q_norm.weight, gemma), _norm_factor(a.k_norm.weight, gemma),
                   norm_eps(a.q_norm)) if hasattr(a, "q_norm") else None
        post = None
        if gemma:
            pa, pf = layer.post_attention_layernorm, layer.post_feedforward_layernorm
            post = ((_norm_factor(pa.weight, True), norm_eps(pa)), (_norm_factor(pf.weight, True), norm_eps(pf)))
        extras.append((bias, qk_norm, post))
    return extras


def _norm_factor(w: torch.Tensor, gemma: bool) -> torch.Tensor:
    """The factor an RMSNorm scales by: Gemma ``1 + w`` in fp32 (Gemma2RMSNorm), else ``w`` itself."""
    if not gemma:
        return w
    with torch.no_grad():
        return 1.0 + w.float()
