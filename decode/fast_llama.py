"""A lean cached forward for Hugging Face Llama-family causal LMs: Llama, Mistral, Qwen2, Qwen3, Gemma-2, Gemma-3, Phi-3
(not public API).

For small models at batch 1 most of the time of a Hugging Face forward is Python wrapper work (mask creation,
rotary module, output dataclasses, config look-ups), not matmuls. :class:`FastKVState` runs the same computation
directly on the model's own parameters (on CPU through packed, transposed copies that every new state checks bit
for bit against the live parameters: see ``_layer_weights``), with the same ops in the same order as
``transformers.models.llama.modeling_llama``:

    embed -> per layer [RMSNorm (fp32, ``variance_epsilon``) -> q/k/v ``F.linear`` -> rotary (cos/sin from the
    model's own ``inv_freq``, precomputed per position) -> append K/V to preallocated per-layer buffers -> SDPA over
    the valid prefix (boolean key mask for left padding / holes) -> o_proj -> residual -> RMSNorm -> SiLU-gated MLP
    -> residual] -> final RMSNorm -> lm_head on the kept positions only.

Cropping the cache only moves the valid length (no copy). Mistral is Llama plus a sliding window W: the cache keeps
every slot (so rollback is exact) and attention is limited to keys whose *position* is within W of the query's
(transformers' ``sliding_window_overlay``); at batch 1 without holes that is a slice of the key buffer. Each layer
takes its window from the decoder's cache policy, so full and windowed layers may alternate (Qwen2's
``max_window_layers``, Gemma-2/3). The other families differ from Llama as listed at ``_CLASSES``. Models the
lean forward does not cover (another architecture, rope scaling, partial rotary, attention / MLP bias, a Llama
config with a sliding window, another activation, ...) fall back to the Hugging Face forward
(:func:`fast_path_supported` says which and why).
"""
from __future__ import annotations

import contextlib
import functools
import time
import weakref

import torch
import torch.nn.functional as F

from data.draft_vocab import TrimmedLMHead, scatter_to_vocab

from .threads import BlockThreads

__all__ = ["fast_path_supported", "FastKVState", "frozen_weights"]


def _eps(norm: torch.nn.Module) -> float:
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


def _layer_inv_freqs(model: torch.nn.Module, layer_types) -> list[torch.Tensor]:
    """Per decoder layer, the rotary ``inv_freq`` its attention uses (Gemma-3: one per layer type)."""
    rot = model.model.rotary_emb
    if hasattr(rot, "inv_freq"):
        return [rot.inv_freq] * len(model.model.layers)
    return [getattr(rot, f"{t}_inv_freq") for t in layer_types]


def _unsupported_reason(model: torch.nn.Module) -> str | None:
    """``None`` when :class:`FastKVState` reproduces ``model``'s forward, else why not."""
    cfg = getattr(model, "config", None)
    family = getattr(cfg, "model_type", None)
    if cfg is None or family not in _CLASSES:
        return f"model_type {family!r} is not one of {sorted(_CLASSES)}"
    if type(model).__name__ != _CLASSES[family]:
        return f"{type(model).__name__} is not {_CLASSES[family]}"
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
    gemma = family in _GEMMA
    act = getattr(cfg, "hidden_activation", None) if gemma else getattr(cfg, "hidden_act", "silu")
    if act not in _ACTS:
        return f"{'hidden_activation' if gemma else 'hidden_act'} {act!r} is not one of {sorted(_ACTS)}"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if len(base.layers) != cfg.num_hidden_layers:
        return "layer count differs from the config"
    if gemma and not isinstance(getattr(base.embed_tokens, "embed_scale", None), torch.Tensor):
        return "Gemma embedding without its embed_scale"
    if type(model.lm_head) not in (torch.nn.Linear, TrimmedLMHead):  # e.g. int8 dynamic Linear: HF forward
        return f"lm_head is a {type(model.lm_head).__name__}, not a plain nn.Linear (quantized / adapted?)"
    if getattr(model.lm_head, "bias", None) is not None:
        return "lm_head has a bias"
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
            biased = qkv_bias and lin in (attn.q_proj, attn.k_proj, attn.v_proj)
            if type(lin) is not torch.nn.Linear or (lin.bias is not None) != biased:
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


# Mistral = Llama + a sliding window; Qwen2 = Llama + q/k/v biases; Qwen3 = Llama + per-head RMSNorm of q and k
# before rotary; Phi-3 = Llama with fused qkv_proj / gate_up_proj; Gemma-2 = Llama with (1 + w) RMSNorms, a scaled
# embedding, norms after attention and MLP as well as before, GELU-tanh, query scaling query_pre_attn_scalar ** -0.5,
# attention and final logit soft-capping (tanh(x / cap) * cap); Gemma-3 = Gemma-2 + q/k head norms and a RoPE base
# per layer type. Windows per layer from the decoder's cache policy (full and sliding layers may alternate).
_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM"}
_GEMMA = ("gemma2", "gemma3_text")
_ACTS = {"silu": F.silu, "swish": F.silu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def fast_path_supported(model: torch.nn.Module) -> bool:
    return _unsupported_reason(model) is None


# Packed weights (CPU): [q; k; v] and [gate; up] concatenated and every projection stored transposed, (in, out)
# contiguous. In isolation MKL runs these small projections up to ~2x faster on that layout, and 7 projections per
# layer become 4 matmuls: a one-token step of the reference target is ~1.3-1.4x faster than F.linear on the
# parameters. The transposed copies are expensive to build (a strided copy of every weight: re-packing on every
# decode call made 32- and 64-token calls 1.2-1.7x slower), so they are kept per model between decode calls, next
# to a plain copy of the weights they were built from, [q; k; v] / [gate; up] concatenated in the parameters'
# (out, in) layout; forwards over several rows (verify blocks, trees, prefills) multiply either with that copy as the
# left operand (``_rows_times``: on the 2-core AVX2 machine about what a one-row product costs) or like one row on
# the (in, out) copy, whichever measured faster on this machine (``set_row_layout``). Every FastKVState
# compares the live parameters with the rows of that
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
            and snap.is_contiguous() and (snap.storage_offset() * size) % 8 == 0):  # as int64 words (~20% faster)
        return torch.equal(live.reshape(-1).view(torch.int64), snap.reshape(-1).view(torch.int64))
    return torch.equal(live.view(_BITS[size]), snap.view(_BITS[size]))


def _packed(entry: dict, key, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cat(parts, 0)^T, cat(parts, 0))``, both contiguous: ``(in, sum of outs)`` for one-row products and
    ``(sum of outs, in)`` for products over several rows (see ``_rows_times``); reused from ``entry[key]`` only when
    every live part equals, bit for bit, the rows of the copy it was built from."""
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
    pre_mlp = "pre_feedforward_layernorm" if model.config.model_type in _GEMMA else "post_attention_layernorm"
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
                qkv, gu, o, down = tuple(qkv), tuple(gu), a.o_proj.weight, m.down_proj.weight
            ln2 = getattr(layer, pre_mlp)
            layers.append((layer.input_layernorm.weight, _eps(layer.input_layernorm), qkv, o,
                           ln2.weight, _eps(ln2), gu, down))
        if packed:
            for key in [k for k in entry if k != "lm" and k[0] >= len(layers)]:  # layers removed since
                del entry[key]
        if packed:
            lm, lm_r = _packed(entry, "lm", [model.lm_head.weight])
            rows_major.append(lm_r)
        else:
            lm = model.lm_head.weight
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


# ---------------------------------------------------------------------------------------------- decode.compile
# torch.compile of the lean forward's layers and head (FastKVState._core_impl) over its preallocated K/V buffers
# (dynamic shapes: one graph serves every cache length and block width; a graph per model layout and mask kind).
# Inductor on CPU, mode="reduce-overhead" (CUDA graphs where inductor can use them) on CUDA. "auto" = on for CUDA,
# off on CPU: on the 2-core AVX2 machine the first compile of the reference target's forward took 324 s (load
# average 9) and the compiled 1- and 5-position forwards were no faster than the uncompiled ones (12.2 / 20.0 ms
# against 12.6-17.9 / 22.9-31.1 ms in the same run; see docs/decoder.md), so compiling cannot pay back within an
# evaluation there.
COMPILE_MODES = ("auto", "on", "off")
_compile_mode = "auto"
_compile_seconds = 0.0
_compiled: dict[str, object] = {}


def set_compile(mode: str) -> None:
    """Set ``decode.compile`` for lean forwards built from now on: ``"auto"`` (on for CUDA, off on CPU), ``"on"``,
    ``"off"``. Raises ``ValueError`` for another value."""
    global _compile_mode
    if mode not in COMPILE_MODES:
        raise ValueError(f"decode.compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    _compile_mode = mode


def compile_enabled(device) -> bool:
    """Whether a lean forward on ``device`` is compiled under the current ``decode.compile`` setting."""
    if _compile_mode == "auto":
        return torch.device(device).type == "cuda"
    return _compile_mode == "on"


def compile_seconds() -> float:
    """Seconds spent in lean-forward calls that compiled a new graph (compile time), since the process started."""
    return _compile_seconds


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _compiled_core(device):
    """The compiled ``FastKVState._core_impl`` for ``device``'s type (one per process, shared by every state)."""
    kind = torch.device(device).type
    if kind not in _compiled:
        import torch._dynamo as dynamo

        # target and draft layouts x (one-token, block) x dense / holes: more graphs than the default limit of 8
        dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
        mode = None
        if kind == "cuda":
            import torch._inductor.config as inductor

            # CUDA graphs replay fixed shapes: a graph whose shapes follow the cache length would be re-recorded at
            # every length, so those run as plain inductor kernels (a static-shape forward is not built yet)
            inductor.triton.cudagraph_skip_dynamic_graphs = True
            mode = "reduce-overhead"
        _compiled[kind] = torch.compile(FastKVState._core_impl, dynamic=True, mode=mode)
    return _compiled[kind]


def _rows_times(x: torch.Tensor, w_rows: torch.Tensor) -> torch.Tensor:
    """``x (M, K) @ w_rows^T`` -> ``(M, N)`` contiguous, for ``M >= 1`` rows and ``w_rows (N, K)`` contiguous.

    Computed as ``(w_rows @ x^T)^T``: with the weight as the left operand MKL streams it once and packs only the
    few rows of ``x``; ``x @ W`` on the ``(K, N)`` copy (the one-row layout) makes it pack the whole weight for
    every call. On the 2-core AVX2 machine, the reference target's 25 projections over 5 rows took 2.5 ms this way
    against 3.8 ms (4 rows: 1.9 against 6.3 ms, median of 4 alternated runs; one row stays faster on the ``(K, N)``
    copy: 2.4 ms), which is what made a verify forward cost about twice a one-token forward.
    """
    return torch.mm(w_rows, x.t()).t().contiguous()


def _rows_addmm(res: torch.Tensor, x: torch.Tensor, w_rows: torch.Tensor) -> torch.Tensor:
    """``res + x @ w_rows^T`` (``res (M, N)``, ``x (M, K)``) in one ``addmm``, the layout of :func:`_rows_times`."""
    return torch.addmm(res.t(), w_rows, x.t()).t().contiguous()


# Which layout multiplies several rows is measured, not assumed: the best one is a property of the machine's BLAS
# kernels. On the 2-core AVX2 machine the weight-left form (:func:`_rows_times`) made a 5-row forward of the reference
# target cost 1.2-1.4x a one-row forward instead of about 2x; on a 2-core AVX-512 (AMX) Xeon the same form is 2-5x
# slower than ``x @ W`` on the ``(in, out)`` copy for 2 to 33 rows (qkv projection, 2 rows: 86 against 15 us; head,
# 5 rows: 386 against 215 us), and the one-row layout there costs about what one row costs up to 5-9 rows.
# "auto" times both forms once per process on the model's own projection shapes (one layer's four and the head, 4
# and 16 rows, alternated, medians) at the thread count multi-row forwards run with, and keeps the faster; the two
# forms compute the same products (only the summation order inside the BLAS kernel may differ, as between a one-row
# and a several-row forward).
ROW_LAYOUTS = ("auto", "weight_left", "activation_left")
_row_layout = "auto"
_row_layout_measured: dict[tuple, tuple[str, dict]] = {}


def set_row_layout(mode: str) -> None:
    """How lean forwards built from now on multiply several rows on CPU (packed weights): ``"auto"`` (measured,
    see above), ``"weight_left"`` (``(W x^T)^T`` on the ``(out, in)`` copy) or ``"activation_left"`` (``x W`` on the
    ``(in, out)`` copy, the one-row layout). Raises ``ValueError`` for another value."""
    global _row_layout
    if mode not in ROW_LAYOUTS:
        raise ValueError(f"row layout must be one of {', '.join(ROW_LAYOUTS)}, got {mode!r}")
    _row_layout = mode


def row_layout_record() -> dict:
    """What ``auto`` chose so far in this process, for reports: ``{"setting", "measured": [{"shapes", "threads",
    "chosen", "weight_left_us", "activation_left_us"}, ...], "one_row": [... the same for one-row products, with
    "layers"]}`` (microseconds for the timed set of products)."""
    return {"setting": _row_layout,
            "measured": [{"shapes": [list(s) for s in key[2]], "threads": key[3], "chosen": chosen, **times}
                         for key, (chosen, times) in _row_layout_measured.items()],
            "one_row": [{"shapes": [list(s) for s in key[2]], "layers": key[3], "threads": key[4], "chosen": chosen,
                         **times} for key, (chosen, times) in _one_row_measured.items()]}


@torch.inference_mode()
def _measure_row_layout(pairs: list[tuple[torch.Tensor, torch.Tensor]], threads: int, rounds: int = 9) -> tuple:
    """``("weight_left" | "activation_left", {"weight_left_us", "activation_left_us"})``: the summed median time of
    ``x @ W`` for every ``(W (in, out), W_rows (out, in))`` of ``pairs`` at 4 and 16 rows, the two forms alternated
    ``rounds`` times (the first round is warm-up) with ``threads`` threads."""
    import statistics

    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        xs = [[torch.randn(m, w.shape[0], generator=gen).to(w.dtype) for m in (4, 16)] for w, _ in pairs]
        times = {"weight_left": [], "activation_left": []}
        for _ in range(rounds):
            for form in times:
                t0 = time.perf_counter()
                for (w, w_rows), x_m in zip(pairs, xs):
                    for x in x_m:
                        if form == "weight_left":
                            _rows_times(x, w_rows)
                        else:
                            torch.matmul(x, w)
                times[form].append(time.perf_counter() - t0)
        med = {f"{form}_us": round(statistics.median(ts[1:]) * 1e6, 1) for form, ts in times.items()}
    finally:
        torch.set_num_threads(prev)
    return ("weight_left" if med["weight_left_us"] < med["activation_left_us"] else "activation_left"), med


def _row_layout_for(layer: tuple, rows: tuple, lm: torch.Tensor, lm_rows: torch.Tensor, device: torch.device) -> str:
    """The layout several-row products use for a model with this first layer's packed weights ``layer`` (``(ln1,
    eps1, W_qkv, W_o, ln2, eps2, W_gu, W_down)``), their ``(out, in)`` twins ``rows`` and head ``lm`` /
    ``lm_rows``: the setting, or under ``auto`` the measured faster form (once per shapes, dtype and threads)."""
    if _row_layout != "auto":
        return _row_layout
    from .threads import resolved_block_threads

    threads = resolved_block_threads(device) or torch.get_num_threads()
    pairs = [(layer[2], rows[0]), (layer[3], rows[1]), (layer[6], rows[2]), (layer[7], rows[3]), (lm, lm_rows)]
    key = (torch.device(device).type, str(lm.dtype), tuple(tuple(w.shape) for w, _ in pairs), threads)
    if key not in _row_layout_measured:
        _row_layout_measured[key] = _measure_row_layout(pairs, threads)
    return _row_layout_measured[key][0]


# One-row products (one-token forwards: target-only decoding, the draft's steps) multiply a vector with every weight
# of the model once, from memory. On the 2-core AMD EPYC (AVX-512) development machine, SmolLM2-135M-Instruct's
# one-position forward took 50.6 ms with ``x @ W`` on the (in, out) copies against 36.0 ms for a two-position forward
# with the weight-left form: the one-row layout read the weights at 10 GB/s, the weight-left one at 15 GB/s (28-31
# GB/s measured for a plain sum). So under ``auto`` the one-row layout is measured too, over all of the model's
# products in turn (its whole weight set, so the weights come from memory as in a real forward, not from a cache).
_one_row_measured: dict[tuple, tuple[str, dict]] = {}


@torch.inference_mode()
def _measure_one_row(pairs: list[tuple[torch.Tensor, torch.Tensor]], threads: int, rounds: int = 5) -> tuple:
    """``("weight_left" | "activation_left", {"weight_left_us", "activation_left_us"})``: the median time of one
    sweep of one-row products over every ``(W (in, out), W_rows (out, in))`` of ``pairs`` in each form, the forms
    alternated ``rounds`` times after a warm-up round, with ``threads`` threads."""
    import statistics

    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        xs = [torch.randn(1, w.shape[0], generator=gen).to(w.dtype) for w, _ in pairs]
        times = {"weight_left": [], "activation_left": []}
        for _ in range(rounds + 1):
            for form in times:
                t0 = time.perf_counter()
                for (w, w_rows), x in zip(pairs, xs):
                    _rows_times(x, w_rows) if form == "weight_left" else torch.matmul(x, w)
                times[form].append(time.perf_counter() - t0)
        med = {f"{form}_us": round(statistics.median(ts[1:]) * 1e6, 1) for form, ts in times.items()}
    finally:
        torch.set_num_threads(prev)
    return ("weight_left" if med["weight_left_us"] < 0.95 * med["activation_left_us"] else "activation_left"), med


def _one_row_layout_for(layers: list, rows_all: list, lm: torch.Tensor, device: torch.device) -> str:
    """The layout one-row products use: ``activation_left`` unless ``auto`` measured the weight-left form at least
    5 % faster over the whole model (once per shapes, layer count, dtype and threads)."""
    if _row_layout != "auto":
        return "activation_left"
    pairs = [(layer[j], rows[k]) for layer, rows in zip(layers, rows_all[:-1]) for j, k in ((2, 0), (3, 1), (6, 2),
                                                                                                (7, 3))]
    pairs.append((lm, rows_all[-1]))
    threads = torch.get_num_threads()
    key = (torch.device(device).type, str(lm.dtype), tuple(tuple(w.shape) for w, _ in pairs[:4]) + (tuple(lm.shape),),
           len(layers), threads)
    if key not in _one_row_measured:
        _one_row_measured[key] = _measure_one_row(pairs, threads)
    return _one_row_measured[key][0]


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

    def __init__(self, model: torch.nn.Module, batch_size: int, device: torch.device, capacity: int = 256,
                 packed: bool | None = None, fused_norm: bool | None = None, compile: bool | None = None):
        if packed is None:
            packed = frozen_cached(model, ("packed", str(device)), lambda: _use_packed(model, device))
        # what the state reads from the model (weights, norms, windows, rotary frequencies): built here, or reused
        # inside decode.frozen_weights while the parameters are the same tensors (see frozen_weights)
        self.__dict__.update(frozen_cached(model, ("plan", str(device), packed, fused_norm),
                                           lambda: self._read_model(model, device, packed, fused_norm)))
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
            self.rows_w = (self.rows_all if _row_layout_for(self.layers[0], self.rows_all[0], self.lm_w,
                                                            self.rows_all[-1], device) == "weight_left" else None)
            self.rows_one = (self.rows_all if _one_row_layout_for(self.layers, self.rows_all, self.lm_w, device)
                             == "weight_left" else None)
        self.compiled = compile_enabled(device) if compile is None else bool(compile)
        self._core = self._core_impl if not self.compiled else functools.partial(_compiled_core(device), self)

    def _read_model(self, model: torch.nn.Module, device: torch.device, packed: bool, fused_norm: bool | None
                    ) -> dict:
        """Set and return (as a dict) every attribute the state derives from ``model``: dtype and sizes, the
        (packed) weights, norms, per-layer windows and rotary frequencies, per-layer extras."""
        from .kv_policy import cache_policy

        before = set(self.__dict__)
        self.model = model
        base = model.model
        cfg = model.config
        family = cfg.model_type
        self.gemma = family in _GEMMA
        self.device = device
        self.dtype = model.lm_head.weight.dtype
        self.embed_w = base.embed_tokens.weight
        # Gemma: embeddings times sqrt(hidden) cast to the weights' dtype (Gemma2TextScaledWordEmbedding)
        self.embed_scale = base.embed_tokens.embed_scale.to(self.dtype) if self.gemma else None
        attn0 = base.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.n_rep = self.n_heads // self.n_kv
        self.scaling = attn0.scaling
        self.hidden = cfg.hidden_size
        self.act = _ACTS[cfg.hidden_activation if self.gemma else getattr(cfg, "hidden_act", "silu")]
        self.attn_softcap = getattr(cfg, "attn_logit_softcapping", None) if self.gemma else None
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None) if self.gemma else None
        # fp32: torch's fused rms_norm computes exactly LlamaRMSNorm's formula (fp32 variance, rsqrt, scale);
        # other dtypes keep the explicit formula (HF casts back to the input dtype before scaling)
        self.fused_norm = self.dtype == torch.float32 if fused_norm is None else fused_norm
        self.packed = packed
        self.layers, self.lm_w, self.rows_all = _layer_weights(model, self.packed)
        # a trimmed draft head (data/draft_vocab.py): N rows, scattered to the full vocabulary with -inf elsewhere
        kept = getattr(model.lm_head, "draft_to_target", None)
        self.vocab_map = (kept.to(device), int(model.lm_head.out_features)) if kept is not None else None
        self.rows_w = None  # the (out, in) copies when several-row products use them (set per state in __init__)
        self.rows_one = None  # the same for one-row products (one-token forwards), when measured faster
        self.inter = (self.layers[0][7].shape[0] if self.packed else self.layers[0][7].shape[1])
        norm_w = self._norm_weight
        self.norm_w, self.norm_eps = norm_w(base.norm.weight), _eps(base.norm)
        if self.gemma:  # (1 + w) in fp32, as Gemma2RMSNorm computes it on every call
            self.layers = [(norm_w(l1), e1, qkv, o, norm_w(l2), e2, gu, d)
                           for l1, e1, qkv, o, l2, e2, gu, d in self.layers]
        # per layer: the window (a query at position p sees keys at positions p - W < q <= p, transformers'
        # sliding_window_overlay; None = full attention) and the index of its rotary table
        policy = cache_policy(model)
        types = policy.layer_types or ("full_attention",) * len(base.layers)
        self.layer_window = [policy.window if t == "sliding_attention" else None for t in types]
        self.windows = sorted(set(self.layer_window), key=lambda w: -1 if w is None else w)
        inv_freqs = _layer_inv_freqs(model, types)
        self.inv_freqs: list[torch.Tensor] = []
        self.layer_rope = []
        for f in inv_freqs:
            idx = next((j for j, g in enumerate(self.inv_freqs) if g is f), None)
            if idx is None:
                self.inv_freqs.append(f)
                idx = len(self.inv_freqs) - 1
            self.layer_rope.append(idx)
        # per layer: concatenated q/k/v bias (Qwen2), (q_norm weight, k_norm weight, eps) (Qwen3, Gemma-3) and the
        # Gemma norms after attention and after the MLP ((weight, eps) or None); built per state from the live
        # parameters (never cached across calls)
        self.extras = []
        for layer in base.layers:
            a = layer.self_attn
            bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if getattr(
                a, "q_proj", None) is not None and a.q_proj.bias is not None else None
            qk_norm = (norm_w(a.q_norm.weight), norm_w(a.k_norm.weight), _eps(a.q_norm)) if hasattr(
                a, "q_norm") else None
            post = None
            if self.gemma:
                pa, pf = layer.post_attention_layernorm, layer.post_feedforward_layernorm
                post = ((norm_w(pa.weight), _eps(pa)), (norm_w(pf.weight), _eps(pf)))
            self.extras.append((bias, qk_norm, post))
        return {k: v for k, v in self.__dict__.items() if k not in before}

    def _norm_weight(self, w: torch.Tensor) -> torch.Tensor:
        """The factor an RMSNorm scales by: Gemma ``1 + w`` in fp32 (Gemma2RMSNorm), else ``w`` itself."""
        if not self.gemma:
            return w
        with torch.no_grad():
            return 1.0 + w.float()

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
    def forward(self, tokens: torch.Tensor, token_mask: torch.Tensor | None = None, logits_to_keep: int = 1,
                tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Append ``tokens (B, T)`` (``token_mask (B, T)``: 1 real, 0 hole; ``None`` = all real) to the cache;
        return logits ``(B, T', V)`` for the last ``T' = logits_to_keep`` slots (all slots when 0).

        ``tree`` (token trees, :mod:`decode.tree`): ``(position_ids (1, T), allowed (T, L+T) bool, key positions
        (L+T,))``: the tree's visibility (ancestors and self) used instead of the causal mask, each layer's window
        applied on top by position (every new token is a real token)."""
        with BlockThreads(self.device, tokens.numel()):  # decode.block_threads (decode/threads.py)
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
        masks = {}  # window -> (first key slot, additive mask or None)
        if tree is not None:  # decode.tree: the caller's positions, tree structure and key positions
            position_ids, allowed, key_pos = tree  # (B, T), (T, L+T) bool, (L+T,)
            self.valid[:, start:end] = True
            rope = [(c[position_ids][:, :, None, :], s[position_ids][:, :, None, :])  # (B, T, 1, D)
                    for c, s in zip(self.cos, self.sin_signed)]
            for window in self.windows:  # the window counts positions, as in the chain
                a = allowed if window is None else allowed & ((position_ids[0][:, None] - key_pos[None, :]) < window)
                masks[window] = (0, torch.where(a, 0.0, self._neg_inf)[None, None])  # (1, 1, T, L+T)
            self.num_valid = self.num_valid + t
        elif self.dense:
            self.valid[:, start:end] = True
            rope = [(c[:, start:end], s[:, start:end]) for c, s in zip(self.cos4, self.sin4)]  # (1, T, 1, D)
            for window in self.windows:
                # keys before kv_start are outside every query's window (dense: slot == position)
                kv_start = 0 if window is None else max(0, start - window + 1)
                if t == 1:
                    masks[window] = (kv_start, None)
                    continue
                # (T, L+T) causal, additive (SDPA would convert a boolean mask again in every layer)
                kpos, qpos = arange[kv_start:end][None, :], arange[start:end][:, None]
                allowed = kpos <= qpos
                if window is not None:
                    allowed = allowed & (kpos > qpos - window)
                masks[window] = (kv_start, torch.where(allowed, 0.0, self._neg_inf))
            self.num_valid = self.num_valid + t
        else:
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
        self.length = end
        if not self.compiled:
            return self._core(tokens, rope, masks, start, end, logits_to_keep)
        global _compile_seconds
        graphs = _graph_count()
        t0 = time.perf_counter()
        out = self._core(tokens, rope, masks, start, end, logits_to_keep)
        if _graph_count() != graphs:  # this call compiled a new graph: its time is compile time
            _compile_seconds += time.perf_counter() - t0
        return out

    def _core_impl(self, tokens: torch.Tensor, rope: list, masks: dict, start: int, end: int, logits_to_keep: int
                   ) -> torch.Tensor:
        """The layers and the head over the prepared rotary tables and masks (what ``decode.compile`` compiles)."""
        bsz, t = tokens.shape
        half = self.head_dim // 2
        h_kv, h_q, d = self.n_kv, self.n_heads, self.head_dim
        qd, kd, inter, packed = h_q * d, h_kv * d, self.inter, self.packed
        norm, act = self._norm, self.act
        # several rows (verify blocks, trees, prefills, batches): the (out, in) copies (see _rows_times)
        rows = (self.rows_w if bsz * t > 1 else self.rows_one) if packed else None
        x = F.embedding(tokens, self.embed_w)  # (B, T, E)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        for i, (ln1, eps1, w_qkv, w_o, ln2, eps2, w_gu, w_d) in enumerate(self.layers):
            # --- attention block
            hs = norm(x, ln1, eps1)
            kbuf, vbuf = self.k[i], self.v[i]
            b_qkv, qk_norm, post = self.extras[i]
            cos, sin = rope[self.layer_rope[i]]
            kv_start, attn_mask = masks[self.layer_window[i]]
            if packed:  # (E, (H + 2 H_kv) D) = [q_proj; k_proj; v_proj]^T
                qkv = torch.matmul(hs, w_qkv) if rows is None else \
                    _rows_times(hs.view(bsz * t, -1), rows[i][0]).view(bsz, t, -1)  # (B, T, (H + 2 H_kv) D)
                if b_qkv is not None:
                    qkv = qkv + b_qkv
                qk = qkv[..., :qd + kd].view(bsz, t, h_q + h_kv, d)  # (B, T, H + H_kv, D)
                if qk_norm is not None:  # Qwen3 / Gemma-3: RMSNorm over head_dim, q and k heads with their weights
                    qk = torch.cat([self._head_norm(qk[:, :, :h_q], qk_norm[0], qk_norm[2]),
                                    self._head_norm(qk[:, :, h_q:], qk_norm[1], qk_norm[2])], 2)
                qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)  # apply_rotary_pos_emb on q and k at once
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
            if self.attn_softcap is None:
                o = F.scaled_dot_product_attention(q.transpose(1, 2), key, val, attn_mask=attn_mask,
                                                   scale=self.scaling)
            else:
                o = self._softcapped_attention(q.transpose(1, 2), key, val, attn_mask)
            o = o.transpose(1, 2).reshape(bsz * t, qd)  # (B T, H D)
            if packed and post is None:  # residual + o_proj in one op (beta * x + o @ W_o, beta = 1)
                x = (torch.addmm(x.view(bsz * t, -1), o, w_o) if rows is None else
                     _rows_addmm(x.view(bsz * t, -1), o, rows[i][1])).view(bsz, t, -1)
            else:
                o = (F.linear(o, w_o) if not packed else torch.matmul(o, w_o) if rows is None else
                     _rows_times(o, rows[i][1])).view(bsz, t, -1)
                if post is not None:  # Gemma: RMSNorm on the attention output before the residual
                    o = norm(o, post[0][0], post[0][1])
                x = x + o
            # --- MLP block (gated: SiLU, Gemma GELU-tanh)
            hs = norm(x, ln2, eps2)
            if packed:  # (E, 2 I) = [gate_proj; up_proj]^T
                gu = torch.matmul(hs, w_gu) if rows is None else \
                    _rows_times(hs.view(bsz * t, -1), rows[i][2]).view(bsz, t, -1)  # (B, T, 2 I)
                m = act(gu[..., :inter]) * gu[..., inter:]
                if post is None:  # residual + down_proj in one op
                    x = (torch.addmm(x.view(bsz * t, -1), m.view(bsz * t, inter), w_d) if rows is None else
                         _rows_addmm(x.view(bsz * t, -1), m.view(bsz * t, inter), rows[i][3])).view(bsz, t, -1)
                    continue
                m = torch.matmul(m, w_d) if rows is None else \
                    _rows_times(m.view(bsz * t, inter), rows[i][3]).view(bsz, t, -1)
            else:
                m = F.linear(act(F.linear(hs, w_gu[0])) * F.linear(hs, w_gu[1]), w_d)
            if post is not None:  # Gemma: RMSNorm on the MLP output before the residual
                m = norm(m, post[1][0], post[1][1])
            x = x + m
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        hs = norm(x, self.norm_w, self.norm_eps)
        head_rows = (self.rows_w if hs.shape[0] * hs.shape[1] > 1 else self.rows_one) if packed else None
        if head_rows is not None:
            logits = _rows_times(hs.reshape(-1, hs.shape[-1]), head_rows[-1]).view(*hs.shape[:2], -1)
        else:
            logits = torch.matmul(hs, self.lm_w) if packed else F.linear(hs, self.lm_w)  # (B, T', V)
        if self.final_softcap is not None:  # Gemma: cap * tanh(logits / cap)
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        if self.vocab_map is not None:  # (B, T', N) -> (B, T', V), -inf outside the kept ids
            logits = scatter_to_vocab(logits, *self.vocab_map)
        return logits

    def _softcapped_attention(self, q: torch.Tensor, key: torch.Tensor, val: torch.Tensor,
                              attn_mask: torch.Tensor | None) -> torch.Tensor:
        """Gemma-2's eager attention with logit soft-capping: ``softmax(cap * tanh(q k^T s / cap) + mask)`` (fp32
        softmax, cast back) times ``v``; ``q (B, H, T, D)``, ``key`` / ``val (B, H, L, D)`` -> ``(B, H, T, D)``."""
        cap = self.attn_softcap
        scores = torch.matmul(q, key.transpose(2, 3)) * self.scaling
        scores = torch.tanh(scores / cap) * cap
        if attn_mask is not None:
            scores = scores + attn_mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, val)

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last (head) dim: fp32 variance, rsqrt; Qwen3: cast back, times weight; Gemma-3: times
        ``1 + w`` (``weight`` here) in fp32, cast back."""
        hs = x.float()
        hs = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + eps)
        if self.gemma:
            return (hs * weight).to(x.dtype)
        return weight * hs.to(x.dtype)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """LlamaRMSNorm: fp32 variance, ``x * rsqrt(var + eps)``, cast back, times weight; Gemma: times ``1 + w``
        (``weight`` here, fp32) before the cast back."""
        if self.fused_norm:
            return F.rms_norm(x, (self.hidden,), weight, eps)
        hs = x.float()
        hs = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + eps)
        if self.gemma:
            return (hs * weight).to(x.dtype)
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
