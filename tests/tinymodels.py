"""Tiny real Hugging Face models built from a config (never mocks), shared by every test folder.

Import as ``from tinymodels import tiny_llama`` (``tests/`` is on ``sys.path`` through the root conftest); a
uniquely named module avoids the ambiguity of ``from conftest import`` when several folders have a conftest.
"""
from __future__ import annotations

import torch


def tiny_llama(
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 2,
    seed: int = 0,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    eos_token_id: int | None = None,
):
    """A tiny randomly initialised ``LlamaForCausalLM`` in eval mode (fp32, CPU), deterministic in ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    # Sharpen the output distribution a little so random models have structure worth drafting.
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model.eval()
