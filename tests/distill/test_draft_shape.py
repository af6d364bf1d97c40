"""A config-built draft whose shape does not fit the target is named, not silently trained (distill.drafts)."""
from __future__ import annotations

from distill.drafts import LlamaArch, build_llama, describe_shape_warnings
from tinymodels import tiny_llama


class _Tok:
    def __init__(self, n):
        self.n = n
        self.bos_token_id = self.eos_token_id = self.pad_token_id = None

    def __len__(self):
        return self.n


def test_a_vocabulary_heavy_short_context_draft_is_named():
    target = tiny_llama(vocab_size=4096, hidden_size=32, max_position_embeddings=512)
    draft = build_llama(LlamaArch(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                                  max_position_embeddings=128), _Tok(4096))
    w = describe_shape_warnings(draft, target)
    assert len(w) == 2
    assert w[0].startswith("the draft is 9") and "4,096 x 16" in w[0] and "draft=layer_pruned" in w[0]
    assert "128 positions against the target's 512" in w[1]


def test_a_balanced_draft_gets_no_warning():
    target = tiny_llama(vocab_size=64, hidden_size=32, max_position_embeddings=256)
    draft = build_llama(LlamaArch(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                                  max_position_embeddings=256), _Tok(64))
    assert describe_shape_warnings(draft, target) == []
