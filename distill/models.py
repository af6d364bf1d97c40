"""Model builders: Llama configs from a small architecture spec, loading HF checkpoints with clear errors."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

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

