"""Which models the lean forward (:mod:`decode.fast_llama`) reproduces exactly, and why not the others (not public
API beyond :func:`fast_path_supported`).

Covered: Hugging Face Llama, Mistral, Qwen2, Qwen3, Gemma-2, Gemma-3 and Phi-3 causal LMs in eval mode with the
default RoPE, no attention / MLP bias beyond the family's own, plain ``nn.Linear`` projections, a SiLU or GELU-tanh
gated MLP and a cache the decoder can roll back (:func:`decode.kv_policy.cache_policy`); anything else falls back to
the Hugging Face forward, :func:`unsupported_reason` naming why.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from data.draft_vocab import TrimmedLMHead

__all__ = ["fast_path_supported", "unsupported_reason", "FAMILY_CLASSES", "GEMMA_FAMILIES", "ACTIVATIONS",
           "norm_eps", "layer_inv_freqs"]

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
        from .kv_policy import cache_policy

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
    # int8 dynamic Linear modules (decode.quantize) run in the lean forward for the families without projection
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
