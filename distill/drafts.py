"""Draft builders: Llama drafts from a small architecture spec, and layer-pruned self-drafts (a subset of the
target's own decoder layers as a standalone smaller model).

A self-draft keeps the target's token embeddings, a chosen subset of its decoder layers (in their original order),
its final norm and its LM head, with weights copied from the target, in a fresh model of the target's own class
whose config says ``num_hidden_layers = len(layers)`` (per-layer config lists such as ``layer_types`` are cut to
the kept layers). It is saved with ``save_pretrained`` like any draft, so ``AutoModelForCausalLM.from_pretrained``
and transformers' ``generate(assistant_model=...)`` load it with no specdraft code.

Layer choice (``draft.layers``, :class:`LayerChoice`): ``first_k`` (layers ``0..k-1``), ``every_nth`` (layers
``0, n, 2n, ...``), ``list`` (explicit indices) or ``search``: a greedy (beam width 1) or beam search over layer
subsets that maximises the *measured* mean accepted length of greedy speculative decoding on validation prompts
(the idea of Draft & Verify, Zhang et al., ACL 2024, "Draft & Verify: Lossless Large Language Model Acceleration
via Self-Speculative Decoding", Sec. 3.2, which searches the layers to skip by Bayesian optimisation; here the
search adds one layer at a time to a kept set, within ``search.max_evaluations`` measured candidates).
"""
from __future__ import annotations

import copy
import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch


log = logging.getLogger(__name__)


@dataclass
class LlamaArch:
    """Architecture of a Llama-style causal LM built from config (vocab size comes from the tokenizer)."""

    hidden_size: int = 128
    num_layers: int = 1  # conf/draft/small.yaml (why: its comment)
    num_heads: int = 4
    num_kv_heads: int | None = None
    intermediate_size: int = 344
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
        if min(self.hidden_size, self.num_layers, self.num_heads, self.intermediate_size) < 1:
            raise ValueError(f"every architecture size must be >= 1, got {asdict(self)}")


def build_llama(arch: LlamaArch, tokenizer, seed: int = 0, vocab_size: int | None = None):
    """A freshly initialised ``LlamaForCausalLM`` for ``tokenizer`` (vocab = ``len(tokenizer)`` unless given)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads or arch.num_heads,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        rope_theta=arch.rope_theta,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def count_parameters(model) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def describe_shape_warnings(draft, target) -> list[str]:
    """What a user should know about a config-built draft's shape against ``target``: most of its parameters in
    the vocabulary (embedding and output head), or a context shorter than the target's. Empty when neither."""
    out = []
    emb = draft.get_input_embeddings().weight
    vocab_params = emb.numel() * (1 if draft.config.tie_word_embeddings else 2)
    total = count_parameters(draft)
    if vocab_params > 0.5 * total:
        out.append(f"the draft is {100 * vocab_params / total:.0f}% vocabulary: its {emb.size(0):,} x {emb.size(1)} "
                   f"embedding{'' if draft.config.tie_word_embeddings else ' and output head'} hold "
                   f"{vocab_params / 1e6:.2f}M of its {total / 1e6:.2f}M parameters, so its layers learn little and "
                   f"its head sets its cost; at a real vocabulary start from the target instead (draft=layer_pruned: "
                   f"some of its layers with its embeddings and head)")
    mine = getattr(draft.config, "max_position_embeddings", None)
    theirs = getattr(target.config, "max_position_embeddings", None)
    if mine and theirs and mine < theirs:
        out.append(f"the draft's context is {mine:,} positions against the target's {theirs:,}: prompts plus "
                   f"generation beyond {mine:,} tokens cannot be drafted (raise draft.arch.max_position_embeddings)")
    return out


# Decoder-only architectures whose checkpoints lay the decoder layers out as ``model.layers.<i>.*`` with one
# ``num_hidden_layers`` in the config and no other per-layer state (what pruning needs to stay exact).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
LAYER_METHODS = ("first_k", "every_nth", "list", "search")
SEARCH_STRATEGIES = ("greedy", "beam")
SEARCH_METRICS = ("mean_accepted_length", "expected_acceptance")


@dataclass
class LayerSearchConfig:
    """``draft.layers.search``: how ``method=search`` measures candidate layer subsets."""

    strategy: str = "greedy"  # greedy (beam width 1) | beam
    beam_width: int = 2  # subsets kept per size (beam only)
    max_evaluations: int = 24  # step budget: candidate subsets measured at most (checked before any model loads)
    prompts: int = 4  # validation prompts of data.domain decoded per candidate
    max_new_tokens: int = 24  # tokens generated per prompt per candidate (greedy, decode.num_draft_tokens)
    # what a candidate is scored by: mean_accepted_length (speculative greedy decoding of the prompts with the
    # candidate) | expected_acceptance (one teacher-forced forward over the target's own greedy continuations of the
    # prompts, generated once: the mean over their positions of sum_v min(p, q) = 1 - TVD(p, q), the per-token
    # acceptance rate of speculative sampling, Leviathan et al. 2023, Sec. 3.1). On a 30-layer target every
    # untrained 2-layer candidate decodes at tau 1.00-1.14, which cannot rank them; expected_acceptance is
    # continuous and costs one short forward per candidate
    metric: str = "expected_acceptance"

    def __post_init__(self):
        if self.metric not in SEARCH_METRICS:
            raise ValueError(f"draft.layers.search.metric must be one of {', '.join(SEARCH_METRICS)}, "
                             f"got {self.metric!r}")
        if self.strategy not in SEARCH_STRATEGIES:
            raise ValueError(f"draft.layers.search.strategy must be one of {', '.join(SEARCH_STRATEGIES)}, "
                             f"got {self.strategy!r}")
        if self.beam_width < 1 or self.max_evaluations < 1 or self.prompts < 1 or self.max_new_tokens < 1:
            raise ValueError("draft.layers.search.beam_width, max_evaluations, prompts and max_new_tokens must be >= 1")

    @property
    def width(self) -> int:
        return 1 if self.strategy == "greedy" else self.beam_width


_WARNED: set = set()


@dataclass
class LayerChoice:
    """``draft.layers``: which target layers a ``draft.init=layer_pruned`` self-draft keeps."""

    method: str = "first_k"  # first_k | every_nth | list | search
    k: int = 2  # first_k, search: layers kept
    n: int = 3  # every_nth: keep layers 0, n, 2n, ...
    indices: list[int] = field(default_factory=list)  # list: target layer indices kept (sorted, no duplicates)
    search: LayerSearchConfig = field(default_factory=LayerSearchConfig)

    def __post_init__(self):
        if self.method not in LAYER_METHODS:
            raise ValueError(f"draft.layers.method must be one of {', '.join(LAYER_METHODS)}, got {self.method!r}")
        if self.k < 1 or self.n < 1:
            raise ValueError(f"draft.layers.k and draft.layers.n must be >= 1, got k={self.k}, n={self.n}")
        if self.method == "list":
            if not self.indices:
                raise ValueError("draft.layers.method=list needs draft.layers.indices, e.g. '[0,2,5]'")
            if any(i < 0 for i in self.indices) or len(set(self.indices)) != len(self.indices):
                raise ValueError(f"draft.layers.indices must be distinct indices >= 0, got {self.indices}")
        if self.method != "list" and self.indices and (self.method, tuple(self.indices)) not in _WARNED:
            _WARNED.add((self.method, tuple(self.indices)))  # once per process: the config is validated more than once
            log.warning("draft.layers.indices %s is not read: draft.layers.method=%s chooses the layers; add "
                        "draft.layers.method=list to keep exactly those layers", list(self.indices), self.method)
        if self.method == "search":
            need = search_evaluations_needed(None, self.k, self.search.width)
            if need is not None and need > self.search.max_evaluations:
                raise ValueError(f"draft.layers.search needs at least {need} evaluations to choose {self.k} layers "
                                 f"but max_evaluations={self.search.max_evaluations}; raise it or lower k")


def search_evaluations_needed(num_layers: int | None, k: int, width: int) -> int | None:
    """Upper bound on candidate subsets the search measures to pick ``k`` of ``num_layers`` layers with beam
    ``width``: level ``s`` (subsets of size ``s + 1``) extends at most ``min(width, C(L, s))`` subsets by each of the
    ``L - s`` other layers. With ``num_layers=None`` a lower bound valid for any target with more than ``k`` layers
    (``k`` levels of at least one candidate each)."""
    if num_layers is None:
        return k
    total = 0
    for s in range(k):
        total += min(width, math.comb(num_layers, s)) * (num_layers - s)
    return total


def resolve_layers(choice: LayerChoice, num_layers: int) -> list[int]:
    """Sorted target layer indices kept by a non-search ``choice`` for a target with ``num_layers`` layers.

    Raises:
        ValueError: an index out of range, or a choice that keeps every layer or none (the draft would be the
            target itself, or empty); the message names the target's layer count.
    """
    if choice.method == "first_k":
        if choice.k >= num_layers:
            raise ValueError(f"draft.layers.k={choice.k} would keep every layer: the target has {num_layers} layers, "
                             f"so a self-draft keeps 1 to {num_layers - 1} (set draft.layers.k below {num_layers})")
        layers = list(range(choice.k))
    elif choice.method == "every_nth":
        layers = list(range(0, num_layers, choice.n))
    elif choice.method == "list":
        bad = [i for i in choice.indices if i >= num_layers]
        if bad:
            raise ValueError(f"draft.layers.indices {bad} out of range: the target has {num_layers} layers "
                             f"(indices 0..{num_layers - 1})")
        layers = sorted(choice.indices)
    else:
        raise ValueError("draft.layers.method=search has no fixed layers; use search_layers()")
    if not layers or len(layers) >= num_layers:
        raise ValueError(f"draft.layers ({choice.method}) keeps {len(layers)} of the target's {num_layers} layers; "
                         f"a self-draft must keep at least 1 and fewer than {num_layers}")
    return layers


def _check_supported(target) -> None:
    cfg = getattr(target, "config", None)
    mt = getattr(cfg, "model_type", None)
    base = getattr(target, "model", None)
    if mt not in SUPPORTED_MODEL_TYPES or not isinstance(getattr(base, "layers", None), torch.nn.ModuleList):
        raise ValueError(f"layer-pruned self-drafts support decoder-only models of type "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} (a model.layers ModuleList); the target is "
                         f"{type(target).__name__} (model_type {mt!r}). Use draft.init=config or draft.init=pretrained.")
    if len(base.layers) != cfg.num_hidden_layers:
        raise ValueError(f"target has {len(base.layers)} decoder layers but config.num_hidden_layers="
                         f"{cfg.num_hidden_layers}; cannot prune an inconsistent model")


def pruned_config(config, layers: list[int]):
    """A deep copy of ``config`` for a model keeping target layers ``layers`` (sorted): ``num_hidden_layers``
    updated, per-layer lists (``layer_types``) cut to the kept layers, ``max_window_layers`` (Qwen2: layers below it
    use full attention) renumbered."""
    cfg = copy.deepcopy(config)
    old = config.num_hidden_layers
    cfg.num_hidden_layers = len(layers)
    lt = getattr(config, "layer_types", None)
    if isinstance(lt, (list, tuple)) and len(lt) == old:
        cfg.layer_types = [lt[i] for i in layers]
    mwl = getattr(config, "max_window_layers", None)
    if isinstance(mwl, int):
        cfg.max_window_layers = sum(1 for i in layers if i < mwl)
    return cfg


def build_layer_pruned(target, layers: list[int]):
    """A new model of ``type(target)`` with the target's embeddings, decoder layers ``layers`` (in order), final
    norm and LM head; every weight copied (the draft shares no storage with the target), in eval mode, on the
    target's device and dtype.

    Args:
        target: a Hugging Face causal LM of a type in :data:`SUPPORTED_MODEL_TYPES`.
        layers: target layer indices to keep; sorted, distinct, in ``[0, num_hidden_layers)``.

    Raises:
        ValueError: unsupported architecture (names the supported ones), bad indices.
    """
    _check_supported(target)
    n = target.config.num_hidden_layers
    if not layers or list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= n:
        raise ValueError(f"layers must be sorted distinct indices in [0, {n}), got {layers}")
    cfg = pruned_config(target.config, list(layers))
    p = next(target.parameters())
    with torch.device("meta"):
        draft = type(target)(cfg)
    new_index = {old: new for new, old in enumerate(layers)}
    state = {}
    prefix = "model.layers."
    for key, value in target.state_dict().items():
        if key.startswith(prefix):
            idx, rest = key[len(prefix):].split(".", 1)
            if int(idx) not in new_index:
                continue
            key = f"{prefix}{new_index[int(idx)]}.{rest}"
        state[key] = value.detach().clone()
    missing, unexpected = draft.load_state_dict(state, strict=False, assign=True)
    tied = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"layer pruning left weights unmatched (missing {sorted(set(missing) - tied)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}); is {type(target).__name__} a standard decoder?")
    if tied:
        draft.tie_weights()
    for name, buf in draft.named_buffers():  # non-persistent buffers (rotary inv_freq) are rebuilt from the config
        if buf.device.type == "meta":
            src = dict(target.named_buffers()).get(_map_key(name, new_index))
            if src is None:
                raise ValueError(f"buffer {name} of the pruned model has no counterpart in the target")
            _set_buffer(draft, name, src.detach().clone())
    if hasattr(target, "generation_config") and target.generation_config is not None:
        draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.to(device=p.device, dtype=p.dtype).eval()


def _map_key(name: str, new_index: dict[int, int]) -> str:
    prefix = "model.layers."
    if name.startswith(prefix):
        idx, rest = name[len(prefix):].split(".", 1)
        old = {v: k for k, v in new_index.items()}[int(idx)]
        return f"{prefix}{old}.{rest}"
    return name


def _set_buffer(model, name: str, value: torch.Tensor) -> None:
    mod_name, _, buf = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    persistent = buf not in getattr(mod, "_non_persistent_buffers_set", set())
    mod.register_buffer(buf, value, persistent=persistent)


ScoreFn = Callable[[torch.nn.Module], float]


def search_layers(target, score: ScoreFn, k: int, search: LayerSearchConfig,
                  on_candidate: Callable[[list[int], float], None] | None = None) -> dict:
    """Greedy / beam search for the ``k`` target layers whose self-draft scores highest.

    Starts from the empty set; level by level every kept subset (at most ``search.width`` of them) is extended by
    each layer it lacks, each new subset is built with :func:`build_layer_pruned` and measured with ``score`` (the
    mean accepted length on validation prompts: higher is better), and the ``width`` best distinct subsets go on.
    Ties keep the subset with the lower indices (deterministic).

    Returns:
        ``{"layers": best subset of size k, "score": its score, "evaluations": candidates measured,
        "trace": [{"layers", "score"}] in measurement order}``.

    Raises:
        ValueError: ``k`` not in ``[1, num_layers)``, or the beam needs more than ``search.max_evaluations``
            measurements (raised before any is made).
    """
    _check_supported(target)
    n = target.config.num_hidden_layers
    if not 1 <= k < n:
        raise ValueError(f"draft.layers.k={k} must be in [1, {n}) for a target with {n} layers")
    need = search_evaluations_needed(n, k, search.width)
    if need > search.max_evaluations:
        raise ValueError(f"the {search.strategy} search for {k} of {n} layers (beam width {search.width}) measures up "
                         f"to {need} candidate subsets but draft.layers.search.max_evaluations="
                         f"{search.max_evaluations}; raise it to {need}, lower k, or narrow the beam")
    beam: list[tuple[int, ...]] = [()]
    trace: list[dict] = []
    scores: dict[tuple[int, ...], float] = {}
    for _ in range(k):
        cands = sorted({tuple(sorted(b + (i,))) for b in beam for i in range(n) if i not in b})
        for c in cands:
            if c not in scores:
                scores[c] = float(score(build_layer_pruned(target, list(c))))
                trace.append({"layers": list(c), "score": scores[c]})
                if on_candidate:
                    on_candidate(list(c), scores[c])
                log.info("self-draft layers %s: score %.4f", list(c), scores[c])
        beam = sorted(cands, key=lambda c: (-scores[c], c))[: search.width]
    best = beam[0]
    return {"layers": list(best), "score": scores[best], "evaluations": len(trace), "trace": trace}
