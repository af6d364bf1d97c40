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
