"""Speculative decoder, autoregressive baseline, shared sampling pipeline, draft-length policies.

Public API::

    speculative_generate(target, draft, input_ids, attention_mask=None, *, max_new_tokens, num_draft_tokens=4, ...)
    autoregressive_generate(target, input_ids, attention_mask=None, *, max_new_tokens, ...)
    process_logits(logits, *, temperature=1.0, top_k=0, top_p=1.0) -> probs
    AcceptanceStats, expected_speedup, GenerationOutput
    cache_policy(model, batch_size, max_length) -> CachePolicy  (ValueError: cache cannot be rolled back)
    FixedDraftLength, AdaptiveDraftLength, ConfidenceDraftLength, make_policy
    frozen_weights(*models)  (context: decode calls reuse what they read from unchanged weights)
    TokenTree(branching=(b1, b2, ...), max_nodes=None), DynamicTokenTree(depth, top_k, max_nodes), parse_draft_tree
        (token-tree drafting: speculative_generate(..., draft_tree=...))
"""
from decode.autoregressive import autoregressive_generate
from decode.common import CachePolicy, GenerationOutput, cache_policy
from decode.fast_llama import frozen_weights
from decode.sampling import greedy_tokens, process_logits, sample_tokens, validate_sampling_args
from decode.speculative import (
    AdaptiveDraftLength,
    ConfidenceDraftLength,
    DraftLengthPolicy,
    FixedDraftLength,
    make_policy,
    verify_block,
)
from decode.eagle3 import speculative_generate  # token drafts and EAGLE-3 heads (decode/eagle3.py)
from decode.stats import AcceptanceStats, expected_speedup
from decode.timing import block_forward_times_s, cost_ratio, forward_times_s
from decode.tree import DynamicTokenTree, TokenTree, parse_draft_tree

__all__ = [
    "speculative_generate",
    "autoregressive_generate",
    "verify_block",
    "GenerationOutput",
    "CachePolicy",
    "cache_policy",
    "AcceptanceStats",
    "expected_speedup",
    "cost_ratio",
    "forward_times_s",
    "block_forward_times_s",
    "process_logits",
    "greedy_tokens",
    "sample_tokens",
    "validate_sampling_args",
    "DraftLengthPolicy",
    "FixedDraftLength",
    "AdaptiveDraftLength",
    "ConfidenceDraftLength",
    "make_policy",
    "TokenTree",
    "DynamicTokenTree",
    "parse_draft_tree",
    "frozen_weights",
]
