"""EAGLE-3 draft heads: one decoder layer that reads the target's own hidden states (Li et al. 2025, "EAGLE-3:
Scaling up Inference Acceleration of Large Language Models via Training-Time Test", Sec. 3).

The head, per position ``t`` of a sequence ``x``:

- **Fused feature.** ``g_t = fc([a_t; b_t; c_t])``: the target's hidden states at a low, a middle and a high layer
  at position ``t`` (``target_layers``: Hugging Face ``hidden_states[i]``, the input of decoder layer ``i``; default
  ``(2, N // 2, N - 3)`` for an ``N``-layer target, the choice of vLLM and SpecForge), concatenated (``3 H_t``) and
  projected by ``fc`` (``3 H_t -> H``, no bias). Paper Sec. 3.2, "multi-layer feature fusion".
- **The layer.** ``u = [input_layernorm(embed(x_{t+1})); hidden_norm(g_t)]`` (``2 H``, embedding first) feeds a
  Llama attention whose q/k/v read ``2 H``; the residual stream starts at ``g_t``:
  ``r = g_t + o_proj(attn(u))``, ``h_t = r + mlp(post_attention_layernorm(r))``. ``h_t`` (before the final norm) is
  the head's hidden state; ``lm_head(norm(h_t))`` gives logits over the draft vocabulary (``draft_vocab_size``
  ids), the distribution of ``x_{t+2}``.
- **Drafting.** The next draft step feeds ``h_t`` where the fused feature was, with the drafted token
  (training-time test, Sec. 3.1: the head learns on its own outputs, :meth:`Eagle3Draft.unroll`).
- **Vocabulary.** ``d2t (N_d,)`` int64: draft id ``i`` is target id ``i + d2t[i]`` (vLLM / SpecForge's offset form);
  ``t2d (V,)`` bool marks the kept target ids.
- **Shared.** ``embed_tokens`` is the target's embedding, frozen.

On disk an EAGLE-3 head is the folder vLLM's ``eagle3`` method and llama.cpp's converter read: ``config.json``
(``architectures: [LlamaForCausalLMEagle3]``, ``draft_vocab_size``, ``target_hidden_size``, and at the top level
``eagle_aux_hidden_state_layer_ids``: the layer inputs, as vLLM and llama.cpp read them) and ``model.safetensors`` with the names of :class:`Eagle3Draft`'s
parameters (``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``, ``embed_tokens.weight``),
plus the tokenizer and ``specdraft.json``.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from core.errors import CheckpointError

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"


def default_target_layers(num_layers: int) -> tuple[int, int, int]:
    """The low / middle / high layers of an ``N``-layer target: ``(2, N // 2, N - 3)`` (vLLM's
    ``get_eagle3_aux_hidden_state_layers``, SpecForge's ``[1, N // 2 - 1, N - 4]`` layer outputs: the same states);
    where those coincide (``N < 7``), ``(1, N // 2, N - 1)``.

    Raises:
        ValueError: ``num_layers < 4`` (the three must differ and lie inside the target).
    """
    if num_layers < 4:
        raise ValueError(f"an EAGLE-3 head needs a target of >= 4 layers to fuse three of them (got {num_layers}): "
                         "use draft=layer_pruned or draft=small for this target")
    layers = (2, num_layers // 2, num_layers - 3)
    return layers if len(set(layers)) == 3 else (1, num_layers // 2, num_layers - 1)


_SIZES = ("vocab_size", "draft_vocab_size", "hidden_size", "target_hidden_size", "num_attention_heads",
          "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings")


@dataclass
class Eagle3Config:
    """The head's shape. Sizes follow the target (``from_target``); ``target_layers`` are ``hidden_states`` indices."""

    vocab_size: int
    draft_vocab_size: int
    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    target_layers: tuple[int, ...] = (2, 15, 27)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        """Every field has a type and range the head can be built with.

        Raises:
            ValueError: naming the ``config.json`` key and the value: a size that is not a positive integer, a norm
                eps or RoPE base that is not a positive finite number, an activation other than ``silu``, feature
                layers that are not three different integers >= 1, a draft vocabulary larger than the target's,
                attention heads not a multiple of the KV heads."""
        for key in _SIZES:
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v < 2 ** 31:
                raise ValueError(f"{key} must be a positive integer below 2**31 (got {v!r})")
        for key in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{key} must be a positive finite number (got {v!r})")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r}: the head's MLP computes SiLU (Llama's), the only "
                             f"activation it has")
        layers = self.target_layers
        if (not isinstance(layers, (list, tuple)) or len(layers) != 3
                or any(isinstance(i, bool) or not isinstance(i, int) for i in layers)
                or len(set(layers)) != 3 or min(layers) < 1):
            raise ValueError(f"draft.eagle3.target_layers (config.json: eagle_aux_hidden_state_layer_ids) must name "
                             f"three different target layers, integers >= 1 (got {layers!r})")
        self.target_layers = tuple(layers)
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} is larger than vocab_size {self.vocab_size}: "
                             f"one of the two is wrong (a head's draft vocabulary is a subset of the target's)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if not isinstance(self.extra, dict):
            raise ValueError(f"specdraft_eagle3 must be a JSON object (got {self.extra!r})")

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, target_layers=None) -> "Eagle3Config":
        """The head of a Hugging Face Llama-family target: its hidden size, heads, MLP width, norm eps and RoPE base.

        Raises:
            ValueError: a ``target_layers`` entry outside ``[1, N - 1]`` or a target of < 4 layers.
        """
        c = target_config
        n = int(c.num_hidden_layers)
        layers = tuple(int(i) for i in target_layers) if target_layers else default_target_layers(n)
        bad = [i for i in layers if not 1 <= i <= n - 1]
        if bad:
            raise ValueError(f"draft.eagle3.target_layers {list(layers)}: {bad} outside [1, {n - 1}] (hidden_states "
                             f"indices of a {n}-layer target: the input of that layer); name three in that range, or null "
                             f"for {list(default_target_layers(n))}")
        heads = int(c.num_attention_heads)
        head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
        rope = getattr(c, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)) if isinstance(rope, dict)
                      else getattr(c, "rope_theta", 10000.0))
        return cls(vocab_size=int(c.vocab_size), draft_vocab_size=int(draft_vocab_size), hidden_size=int(c.hidden_size),
                   target_hidden_size=int(c.hidden_size), num_attention_heads=heads,
                   num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads), head_dim=head_dim,
                   intermediate_size=int(c.intermediate_size), target_layers=layers,
                   rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-5)), rope_theta=theta,
                   max_position_embeddings=int(getattr(c, "max_position_embeddings", 8192)))

    def hf_config(self) -> dict:
        """``config.json`` as vLLM (``LlamaForCausalLMEagle3``) and llama.cpp's converter read it."""
        return {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": self.hidden_size,
                "target_hidden_size": self.target_hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": 1, "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                "hidden_act": self.hidden_act, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
                "max_position_embeddings": self.max_position_embeddings, "vocab_size": self.vocab_size,
                "draft_vocab_size": self.draft_vocab_size, "tie_word_embeddings": False, "torch_dtype": "float32",
                # layer inputs (Hugging Face hidden_states indices), read as they are by vLLM and llama.cpp; not
                # under eagle_config, where SGLang adds 1
                "eagle_aux_hidden_state_layer_ids": list(self.target_layers),
                "attention_bias": False, "mlp_bias": False,
                "specdraft_eagle3": {"target_layers": list(self.target_layers), **self.extra}}

    @classmethod
    def from_hf_config(cls, doc: dict) -> "Eagle3Config":
        """The head a ``config.json`` describes.

        Raises:
            ValueError: not a JSON object, an ``architectures`` without ``LlamaForCausalLMEagle3``, a missing key, the
                two feature-layer lists disagreeing, more than one layer, or a value :meth:`__post_init__` refuses."""
        if not isinstance(doc, dict):
            raise ValueError(f"config.json holds a JSON {type(doc).__name__}, not an object")
        arch = doc.get("architectures")
        if not isinstance(arch, list) or ARCHITECTURE not in arch:
            raise ValueError(f"architectures is {arch!r}, not [{ARCHITECTURE!r}]")
        own = doc.get("specdraft_eagle3", {})
        if not isinstance(own, dict):
            raise ValueError(f"specdraft_eagle3 must be a JSON object (got {own!r})")
        engine = doc.get("eagle_aux_hidden_state_layer_ids")  # vLLM's and llama.cpp's reading
        ours = own.get("target_layers")
        if ours is not None and engine is not None and ours != engine:
            raise ValueError(f"specdraft_eagle3.target_layers {list(ours)} and eagle_aux_hidden_state_layer_ids "
                             f"{list(engine)} disagree, so engines would feed the head other layers than ours")
        n = doc.get("num_hidden_layers", 1)
        if isinstance(n, bool) or n != 1:
            raise ValueError(f"num_hidden_layers is {n!r}; an EAGLE-3 head here has one layer: it must be 1")
        sglang = doc.get("eagle_config") or {}
        if not isinstance(sglang, dict):
            raise ValueError(f"eagle_config must be a JSON object (got {sglang!r})")
        for key in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
            if doc.get(key, False) is not False:
                raise ValueError(f"{key} is {doc[key]!r}: the head's layer has no biases and its own output rows "
                                 f"(false)")
        if doc.get("model_type", "llama") != "llama":
            raise ValueError(f"model_type is {doc['model_type']!r}: an EAGLE-3 head here is a Llama layer ('llama')")
        for key in ("rope_scaling", "rope_parameters"):
            rope = doc.get(key)
            kind = (rope.get("rope_type") or rope.get("type") or "default") if isinstance(rope, dict) else rope
            if rope is not None and kind != "default":
                raise ValueError(f"{key} {rope!r}: the head applies plain RoPE (rope_theta) only; scaled RoPE is not "
                                 f"supported")
        sg_layers = sglang.get("eagle_aux_hidden_state_layer_ids")
        if isinstance(sg_layers, list):  # SGLang's ids are layer outputs: hidden_states index = id + 1
            sg_layers = [i + 1 if isinstance(i, int) and not isinstance(i, bool) else i for i in sg_layers]
        layers = ours or engine or sg_layers
        if layers is None:
            raise ValueError("config.json names no feature layers (eagle_aux_hidden_state_layer_ids)")
        missing = [k for k in ("vocab_size", "draft_vocab_size", "hidden_size", "num_attention_heads",
                               "num_key_value_heads", "intermediate_size") if k not in doc]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        size, heads = doc["hidden_size"], doc["num_attention_heads"]
        head_dim = doc["head_dim"] if doc.get("head_dim") is not None else (
            size // heads if isinstance(size, int) and isinstance(heads, int) and heads > 0 else None)
        return cls(vocab_size=doc["vocab_size"], draft_vocab_size=doc["draft_vocab_size"],
                   hidden_size=doc["hidden_size"], target_hidden_size=doc.get("target_hidden_size", doc["hidden_size"]),
                   num_attention_heads=doc["num_attention_heads"], num_key_value_heads=doc["num_key_value_heads"],
                   head_dim=head_dim,
                   intermediate_size=doc["intermediate_size"], target_layers=layers,
                   rms_norm_eps=doc.get("rms_norm_eps", 1e-5), rope_theta=doc.get("rope_theta", 10000.0),
                   max_position_embeddings=doc.get("max_position_embeddings", 8192),
                   hidden_act=doc.get("hidden_act", "silu"),
                   extra={k: v for k, v in own.items() if k != "target_layers"})


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)`` in float32 (Zhang & Sennrich 2019, eq. 4; Llama's ``LlamaRMSNorm``)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape ``positions.shape + (head_dim,)`` (Su et al. 2021, RoPE; Llama's half-rotation)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float) / head_dim))
    freqs = positions.float()[..., None] * inv
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x (B, T, H, D)`` rotated by ``cos, sin (B, T, D)``: ``x cos + rotate_half(x) sin``."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos[:, :, None] + rot * sin[:, :, None]


class Eagle3Layer(nn.Module):
    """The head's decoder layer (names as vLLM's / SpecForge's ``midlayer``): attention over ``2 H`` inputs."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        attn = nn.Module()
        attn.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * d, bias=False)
        attn.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        attn.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        attn.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.self_attn = attn
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        mlp.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        mlp.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.mlp = mlp

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """``embeds, hidden (B, T, H)``, ``positions (B, T)`` -> rotated ``q (B, T, Hq, D)``, ``k, v (B, T, Hkv, D)``."""
        c, a = self.cfg, self.self_attn
        u = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)  # (B, T, 2H)
        b, t = u.shape[:2]
        q = a.q_proj(u).view(b, t, c.num_attention_heads, c.head_dim)
        k = a.k_proj(u).view(b, t, c.num_key_value_heads, c.head_dim)
        v = a.v_proj(u).view(b, t, c.num_key_value_heads, c.head_dim)
        cos, sin = rope_tables(positions, c.head_dim, c.rope_theta, u.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual, MLP, residual: ``hidden (B, T, H)`` (the step's input feature), ``attn_out (B, T, Hq * D)``."""
        m = self.mlp
        r = hidden + self.self_attn.o_proj(attn_out)
        x = self.post_attention_layernorm(r)
        return r + m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))


def _grouped(k: torch.Tensor, groups: int) -> torch.Tensor:
    return k if groups == 1 else k.repeat_interleave(groups, dim=2)


class Eagle3Draft(nn.Module):
    """An EAGLE-3 head (module docstring). Tensors: ``features (B, T, 3 H_t)`` the target's concatenated states,
    ``tokens (B, T)`` int64 target ids, hidden ``(B, T, H)``, logits ``(B, T, N_d)`` over draft ids."""

    is_eagle3 = True

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        # training only: fc reads features * feature_scale; folded into fc.weight when saved (save_eagle3)
        self.register_buffer("feature_scale", torch.ones(3 * cfg.target_hidden_size))

    @property
    def config(self):
        """What the pipeline's checks read of a draft's config (the target's vocabulary, the context)."""
        from types import SimpleNamespace

        return SimpleNamespace(vocab_size=self.cfg.vocab_size, max_position_embeddings=self.cfg.max_position_embeddings)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    # ------------------------------------------------------------------ vocabulary
    def set_draft_vocab(self, kept_ids: torch.Tensor) -> None:
        """Keep the target ids ``kept_ids (N_d,)`` (ascending, distinct): ``d2t = kept - arange``, ``t2d`` marks them.

        Raises:
            ValueError: a wrong count, repeated ids, or ids outside the vocabulary.
        """
        ids = torch.as_tensor(kept_ids, dtype=torch.long).sort().values
        if ids.numel() != self.cfg.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"the draft vocabulary needs {self.cfg.draft_vocab_size} distinct ids "
                             f"(got {ids.numel()}, {ids.unique().numel()} distinct)")
        if int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size:
            raise ValueError(f"draft vocabulary ids must be in [0, {self.cfg.vocab_size})")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_to_target(self) -> torch.Tensor:
        """``(N_d,)`` int64: the target id of each draft id."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def target_to_draft(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids (any shape) -> draft ids, ``-1`` where the id is outside the draft vocabulary."""
        table = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long, device=ids.device)
        table[self.draft_to_target.to(ids.device)] = torch.arange(self.cfg.draft_vocab_size, device=ids.device)
        return table[ids.clamp(0, self.cfg.vocab_size - 1)]

    # ------------------------------------------------------------------ forward pieces
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``features (B, T, 3 H_t)`` -> fused ``fc(features * feature_scale)`` ``(B, T, H)`` (paper Sec. 3.2;
        ``feature_scale`` is all ones except while training with ``draft.eagle3.feature_norm=channel``)."""
        x = features.to(self.fc.weight.dtype)
        return self.fc(x * self.feature_scale.to(x.dtype))

    @torch.no_grad()
    def normalize_features(self, features: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        """Reparametrise ``fc`` so that it reads each feature channel divided by its root mean square over
        ``features (..., 3 H_t)`` (a sample of the target's states), leaving the fused output unchanged:
        ``feature_scale = 1 / rms`` and ``fc.weight *= rms``. The function is the same; the optimiser's steps are
        not: Adam moves every weight by about the learning rate, so a channel of RMS 375 (the target's outlier
        channels) no longer moves the fused feature 375 times as far as a channel of RMS 1 (input standardisation,
        LeCun et al. 1998, "Efficient BackProp", Sec. 4.3). Returns ``rms (3 H_t,)``.

        Raises:
            ValueError: ``features`` of the wrong width.
        """
        f = features.reshape(-1, features.shape[-1]).float()
        if f.shape[-1] != self.feature_scale.numel():
            raise ValueError(f"features of width {f.shape[-1]}, the head reads {self.feature_scale.numel()}")
        rms = f.pow(2).mean(0).sqrt().clamp(min=eps)
        scale = self.feature_scale.float()
        self.fc.weight.mul_((rms * scale).to(self.fc.weight.dtype)[None, :])  # current fc on raw x: W * scale
        self.feature_scale.copy_(1.0 / rms)
        return rms

    def export_state(self) -> dict[str, torch.Tensor]:
        """The state dict as engines read it: ``feature_scale`` folded into ``fc.weight`` (``fc(x * s) =
        (W diag(s)) x``) and left out."""
        state = {k: v.detach().to("cpu").contiguous().clone() for k, v in self.state_dict().items()}
        scale = state.pop("feature_scale")
        state["fc.weight"] = (state["fc.weight"].float() * scale.float()[None, :]).to(state["fc.weight"].dtype)
        return state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden (B, T, H)`` -> draft-vocabulary logits ``(B, T, N_d)``."""
        return self.lm_head(self.norm(hidden))

    def unroll(self, tokens: torch.Tensor, fused: torch.Tensor, steps: int, valid: torch.Tensor | None = None
               ) -> list[torch.Tensor]:
        """Training-time test (paper Sec. 3.1; SpecForge's ``OnlineEagle3Model``): ``steps`` draft steps at every
        position at once, each fed the previous step's own hidden states.

        Args:
            tokens: ``(B, T)`` int64; ``tokens[:, t]`` is ``x_{t+1}``, the token after the feature's position
                (step ``j`` reads ``tokens[:, t + j]``; positions past the end read the last token, their
                outputs are for the caller to mask).
            fused: ``(B, T, H)`` fused target features (:meth:`fuse`) at positions ``0..T-1``.
            steps: draft depth ``k >= 1``.
            valid: ``(B, T)`` bool, False at padding (those keys are never attended to); default all True.
        Returns:
            ``k`` hidden-state tensors ``(B, T, H)``; step ``j`` at position ``t`` is the head's state after drafting
            ``j`` tokens past the block that ends with ``x_{t+1}``, i.e. the logits of ``x_{t+j+2}``. Step ``j`` at
            ``t`` attends to step 0 at ``0..t`` (the real features) and to steps ``1..j`` at ``t`` (its own earlier
            drafts): exactly the keys the decoder's cache holds at that draft step (:mod:`decode.eagle3`).
        """
        c, layer = self.cfg, self.midlayer
        b, t = tokens.shape
        dev = tokens.device
        if valid is None:
            valid = torch.ones(b, t, dtype=torch.bool, device=dev)
        base = (valid.long().cumsum(1) - 1).clamp(min=0)  # (B, T) position = valid tokens before
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=dev))[None] & valid[:, None, :]  # (B, T, T)
        neg = torch.finfo(fused.dtype).min
        groups = c.num_attention_heads // c.num_key_value_heads
        scale = 1.0 / math.sqrt(c.head_dim)
        hidden, outs, keys, vals = fused, [], [], []
        idx = torch.arange(t, device=dev)
        for j in range(steps):
            tok = tokens[:, (idx + j).clamp(max=t - 1)]
            q, k, v = layer.qkv(self.embed_tokens(tok), hidden, base + j)
            k, v = _grouped(k, groups), _grouped(v, groups)  # (B, T, Hq, D)
            s0 = torch.einsum("bqhd,bkhd->bhqk", q, keys[0] if keys else k) * scale  # (B, Hq, T, T)
            s0 = s0.masked_fill(~causal[:, None], neg)
            diag = [(q * kk).sum(-1).transpose(1, 2)[..., None] * scale for kk in keys[1:] + ([k] if keys else [])]
            p = torch.cat([s0, *diag], -1).float().softmax(-1).to(q.dtype)  # (B, Hq, T, T + j)
            o = torch.einsum("bhqk,bkhd->bqhd", p[..., :t], vals[0] if vals else v)
            for i, vv in enumerate(vals[1:] + ([v] if vals else [])):
                o = o + p[..., t + i].transpose(1, 2)[..., None] * vv
            keys.append(k)
            vals.append(v)
            hidden = layer.finish(hidden, o.reshape(b, t, -1))
            outs.append(hidden)
        return outs

    # ------------------------------------------------------------------ from the target
    @torch.no_grad()
    def init_from_target(self, target, kept_ids: torch.Tensor, how: str = "target", seed: int = 0) -> None:
        """Share the target's embedding (frozen) and set the draft vocabulary; ``how="target"`` also starts the layer
        from the target's (q/k/v: the embedding half from layer 0, the feature half, o_proj, MLP and norms from the
        last layer), ``norm`` from its final norm, ``lm_head`` from its output rows at ``kept_ids``, and ``fc`` as
        the identity on the high feature; ``how="random"``: those drawn as Hugging Face initialises Llama
        (normal, std ``initializer_range``), seeded.

        Raises:
            ValueError: ``how`` is neither, or the target is not a Llama-family ``*ForCausalLM`` of matching width.
        """
        if how not in ("target", "random"):
            raise ValueError(f"draft.eagle3.init={how!r}: use target or random")
        inner = getattr(target, "model", None)
        if inner is None or not hasattr(inner, "layers") or target.config.hidden_size != self.cfg.target_hidden_size:
            raise ValueError("an EAGLE-3 head initialises from a Llama-family *ForCausalLM target of its width")
        self.embed_tokens.weight = inner.embed_tokens.weight  # shared with the target, frozen (for both)
        self.embed_tokens.weight.requires_grad_(False)
        self.set_draft_vocab(kept_ids)
        if how == "random":
            gen = torch.Generator().manual_seed(seed)
            std = float(getattr(target.config, "initializer_range", 0.02))
            for name, p in self.named_parameters():
                if p.ndim == 2 and not name.startswith("embed_tokens"):
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
            return
        first, last = inner.layers[0], inner.layers[-1]
        h = self.cfg.hidden_size
        a = self.midlayer.self_attn
        for mine, name in ((a.q_proj, "q_proj"), (a.k_proj, "k_proj"), (a.v_proj, "v_proj")):
            mine.weight[:, :h] = getattr(first.self_attn, name).weight
            mine.weight[:, h:] = getattr(last.self_attn, name).weight
        a.o_proj.weight.copy_(last.self_attn.o_proj.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(self.midlayer.mlp, name).weight.copy_(getattr(last.mlp, name).weight)
        self.midlayer.input_layernorm.weight.copy_(first.input_layernorm.weight)
        self.midlayer.hidden_norm.weight.copy_(last.input_layernorm.weight)
        self.midlayer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
        self.norm.weight.copy_(inner.norm.weight)
        head = target.get_output_embeddings().weight
        self.lm_head.weight.copy_(head[self.draft_to_target])
        self.fc.weight.zero_()
        th = self.cfg.target_hidden_size
        self.fc.weight[:, 2 * th:].copy_(torch.eye(h, th))


def check_eagle3_fits(head, target, role: str = "draft") -> None:
    """The head was trained for this target: its vocabulary, width and feature layers. ``head``: an
    :class:`Eagle3Draft` or its :class:`Eagle3Config`; ``target``: the model or its config (anything with
    ``vocab_size``, ``hidden_size``, ``num_hidden_layers``, e.g. the target's ``config.json`` read before it loads).

    Raises:
        CheckpointError: a different vocabulary size or hidden size, or a feature layer past the target's depth.
    """
    c, t = getattr(head, "cfg", head), getattr(target, "config", target)
    if c.vocab_size != int(t.vocab_size) or c.target_hidden_size != int(t.hidden_size):
        raise CheckpointError(f"{role} is an EAGLE-3 head for a target of vocabulary {c.vocab_size} and width "
                              f"{c.target_hidden_size}, but this target has {t.vocab_size} and {t.hidden_size}: train "
                              f"a head for this target (draft=eagle3)")
    if max(c.target_layers) >= int(t.num_hidden_layers):
        n = int(t.num_hidden_layers)
        raise CheckpointError(f"{role} reads target layers {list(c.target_layers)}, but this target has {n} layers "
                              f"(feature layers are in [1, {n - 1}]): train a head for this target (draft=eagle3)")


def is_eagle3(model) -> bool:
    return bool(getattr(model, "is_eagle3", False))


def is_eagle3_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds an EAGLE-3 head: its ``config.json`` names ``LlamaForCausalLMEagle3``, or has a key
    only a head's has (``draft_vocab_size``, ``eagle_aux_hidden_state_layer_ids``, ``specdraft_eagle3``), so that a
    damaged head is refused as one (:func:`check_eagle3_dir`) rather than loaded as a plain model."""
    try:
        doc = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(doc, dict):
        return False
    arch = doc.get("architectures")
    return ((isinstance(arch, list) and ARCHITECTURE in arch) or arch == ARCHITECTURE
            or any(k in doc for k in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "specdraft_eagle3")))


def save_eagle3(head: Eagle3Draft, tokenizer, out_dir: str | os.PathLike, meta: dict | None = None) -> Path:
    """Write the head as vLLM's ``eagle3`` checkpoint (module docstring) into ``out_dir``, atomically (a temporary
    folder renamed into place), with ``tokenizer`` and ``specdraft.json`` (``meta``)."""
    from safetensors.torch import save_file

    from core.io import atomic_dir

    with atomic_dir(out_dir) as tmp:
        state = head.export_state()
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(head.cfg.hf_config(), indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if meta is not None:
            from models.checkpoints import FILENAME

            (tmp / FILENAME).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return Path(out_dir)


_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def check_eagle3_dir(path: str | os.PathLike, role: str = "draft") -> Eagle3Config:
    """Without reading the weights: ``config.json`` describes a head this code builds (:meth:`Eagle3Config.from_hf_config`)
    and the header of ``model.safetensors`` holds its tensors, each of the shape that config gives, floating-point
    weights and integer ``d2t`` (``embed_tokens.weight`` may be absent: the target's is used). Cheap (the header is a
    few KB), so the eval inputs check runs it before any tokenizer or model loads. Returns the config.

    Raises:
        CheckpointError: starting ``could not load <role> from <path>``: a ``config.json`` that is not a JSON object,
            lacks a key, or holds a value of the wrong type or range (named); missing or unreadable weights; a
            missing, unexpected, misshapen tensor or one of the wrong dtype (a ``config.json`` that disagrees with its
            weights)."""
    from safetensors import safe_open

    path = Path(path)
    where = f"could not load {role} from {path}"
    try:
        cfg = Eagle3Config.from_hf_config(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{where}: its config.json is not an EAGLE-3 head's ({type(e).__name__}: {e}); restore "
                              f"the config.json saved with the weights, or train a head with draft=eagle3") from e
    if not (path / WEIGHTS).is_file():
        raise CheckpointError(f"{where}: {WEIGHTS} is missing, so the head was not saved completely; train it again")
    try:
        with safe_open(str(path / WEIGHTS), framework="pt") as f:
            header = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as e:  # safetensors' SafetensorError (a truncated or foreign header) or an OSError
        raise CheckpointError(f"{where}: {WEIGHTS} cannot be read ({type(e).__name__}: {e}); it is damaged or "
                              f"incomplete (a killed copy?): copy it again whole, or train the head again") from e
    try:
        with torch.device("meta"):  # shapes only: nothing is allocated, whatever the sizes in config.json
            want = {k: tuple(v.shape) for k, v in Eagle3Draft(cfg).state_dict().items() if k != "feature_scale"}
    except (RuntimeError, TypeError, ValueError) as e:  # sizes whose products overflow a tensor's shape
        raise CheckpointError(f"{where}: config.json gives sizes no head can have ({e}); restore the config.json "
                              f"saved with the weights") from None
    misshapen = [f"{k} {shape} (config.json: {want[k]})" for k, (shape, _) in header.items()
                 if k in want and shape != want[k]]
    if misshapen:
        raise CheckpointError(f"{where}: config.json disagrees with the weights: {'; '.join(misshapen[:3])}. Restore "
                              f"the config.json saved with these weights, or train the head again")
    missing = sorted(set(want) - set(header) - {"embed_tokens.weight", "t2d"})
    unexpected = sorted(set(header) - set(want))
    if missing or unexpected:
        raise CheckpointError(f"{where}: tensors missing {missing} / unexpected {unexpected}; it is not a complete "
                              f"head saved by draft=eagle3: train it again")
    kinds = {"d2t": ("I64", "I32"), "t2d": ("BOOL", "U8", "I64", "I32")}
    wrong = [f"{k} {dtype}" for k, (_, dtype) in header.items() if dtype not in kinds.get(k, _FLOAT_DTYPES)]
    if wrong:
        raise CheckpointError(f"{where}: tensors of the wrong dtype: {', '.join(wrong[:3])} (weights are floating "
                              f"point, d2t integer): it was not saved by draft=eagle3; train the head again")
    with safe_open(str(path / WEIGHTS), framework="pt") as f:  # N_d integers: read now, not after the target loads
        _check_d2t(f.get_tensor("d2t").long(), cfg.vocab_size, where)
    return cfg


def _check_d2t(d2t: torch.Tensor, vocab_size: int, where: str) -> torch.Tensor:
    """``d2t (N_d,)`` maps the draft ids to distinct target ids inside the vocabulary; returns those ids.

    Raises:
        CheckpointError: a target id outside ``[0, V)`` or one reached twice (a damaged vocabulary map)."""
    ids = torch.arange(d2t.numel()) + d2t.cpu()
    bad = int(((ids < 0) | (ids >= vocab_size)).sum())
    if bad or ids.unique().numel() != ids.numel():
        problem = (f"{bad} draft ids map outside the target vocabulary [0, {vocab_size})" if bad else
                   f"{ids.numel() - ids.unique().numel()} target ids are reached by two draft ids")
        raise CheckpointError(f"{where}: its d2t is damaged: {problem}. Restore the {WEIGHTS} saved with the head, "
                              f"or train it again")
    return ids


def load_eagle3(path: str | os.PathLike, target=None, dtype: torch.dtype = torch.float32, device=None,
                role: str = "draft") -> Eagle3Draft:
    """An EAGLE-3 head saved by :func:`save_eagle3` (or any vLLM ``eagle3`` folder with these names), after
    :func:`check_eagle3_dir`. With ``target``, the embedding is the target's own tensor (a folder without
    ``embed_tokens.weight`` needs it). ``role`` names the head in errors (``draft 'distilled'``).

    Raises:
        CheckpointError: anything :func:`check_eagle3_dir` refuses, an unreadable (e.g. truncated) weights file, a
            ``d2t`` that maps outside the vocabulary or twice to one id, NaN/inf weights, a head whose vocabulary or
            width does not match ``target``, no embedding and no ``target``. The message starts
            ``could not load <role> from <path>``.
    """
    from safetensors.torch import load_file

    from models.checkpoints import check_finite_weights

    path = Path(path)
    where = f"could not load {role} from {path}"
    cfg = check_eagle3_dir(path, role)
    try:
        state = load_file(str(path / WEIGHTS))
    except Exception as e:  # safetensors' SafetensorError (a truncated or foreign file) or an OSError
        raise CheckpointError(f"{where}: {WEIGHTS} cannot be read ({type(e).__name__}: {e}); it is damaged or "
                              f"incomplete (a killed copy?): copy it again whole, or train the head again") from e
    if target is not None:
        if int(target.config.vocab_size) != cfg.vocab_size or int(target.config.hidden_size) != cfg.target_hidden_size:
            raise CheckpointError(f"{where}: it was trained for a target of vocabulary {cfg.vocab_size} and width "
                                  f"{cfg.target_hidden_size}; this target has {target.config.vocab_size} and "
                                  f"{target.config.hidden_size}")
        state.pop("embed_tokens.weight", None)
    elif "embed_tokens.weight" not in state:
        raise CheckpointError(f"{where}: it has no embed_tokens.weight (it uses the target's), and no target was "
                              f"given to take it from")
    head = Eagle3Draft(cfg)
    head.load_state_dict(state, strict=False)  # names and shapes checked above; values cast to the head's dtypes
    head.t2d.zero_()
    head.t2d[_check_d2t(head.d2t, cfg.vocab_size, where)] = True  # rebuilt from d2t, whatever the file's t2d
    check_finite_weights(head, path, role)
    if target is not None:
        head.embed_tokens.weight = target.get_input_embeddings().weight
    head.requires_grad_(False)
    return head.to(device=device or "cpu", dtype=dtype).eval()
