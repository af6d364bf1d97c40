"""Sliding-window models (Mistral, Qwen2 / Qwen3 with ``use_sliding_window``, Gemma-2 / Gemma-3, Phi-3) as target
and draft, with windows shorter than prompt + generation: rolling the cache back must be exact.

The decoder keeps a full cache for windowed layers and applies the window in the attention mask (positions, not
slots), so a rejection after the window filled neither raises (``DynamicCache.crop`` on a sliding layer) nor, in a
batch with holes, silently changes tokens. Each model is tiny and random; every test first shows that the window
changes transformers' own output on its inputs (otherwise the test could not see a wrong window).
"""
from __future__ import annotations

import pytest
import torch
from decode_testutils import hf_greedy, left_pad, random_prompts
from test_decode_sampling_exact import chi_square_pvalue

from decode import cache_policy, process_logits, speculative_generate
from decode.fast_llama import fast_path_supported
from tinymodels import SLIDING_FAMILIES, tiny_family

WINDOW = 3
NEW = 10
LENGTHS = [6, 2, 7, 3]  # batch 4, left padded; every row's prompt + generation exceeds the window


def target_and_draft(family: str, seed: int = 0, window: int | None = WINDOW, vocab: int = 64, hidden: int = 32):
    """A 2-layer target and its 1-layer draft (the target's first layer, embeddings, final norm and head)."""
    target = tiny_family(family, vocab_size=vocab, hidden_size=hidden, num_layers=2, seed=seed, sliding_window=window)
    draft = tiny_family(family, vocab_size=vocab, hidden_size=hidden, num_layers=1, seed=seed + 1,
                        sliding_window=window)
    draft.load_state_dict(target.state_dict(), strict=False)  # layer 1 of the target has no slot: ignored
    return target, draft.eval()


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_greedy_equals_generate_past_the_window(family):
    target, draft = target_and_draft(family)
    ids, mask = left_pad(random_prompts(LENGTHS, 64, seed=3))
    ref = hf_greedy(target, ids, mask, NEW)
    # the window matters here: the same weights with full attention decode differently
    full, _ = target_and_draft(family, window=None)
    assert not torch.equal(hf_greedy(full, ids, mask, NEW), ref)
    ref1 = hf_greedy(target, ids[:1], mask[:1], NEW)
    assert cache_policy(target).window == WINDOW
    assert fast_path_supported(target) and fast_path_supported(draft)  # every family here is on the lean forward
    for gamma in (1, 4, 8):
        one = speculative_generate(target, draft, ids[:1], mask[:1], max_new_tokens=NEW, num_draft_tokens=gamma)
        assert torch.equal(one.sequences, ref1), gamma
        batch = speculative_generate(target, draft, ids, mask, max_new_tokens=NEW, num_draft_tokens=gamma)
        assert torch.equal(batch.sequences, ref), gamma
        assert 0 < batch.stats.acceptance_rate < 1  # rejections happened (the rollback was exercised)


def test_mistral_smallest_case_from_the_issue():
    """Window 2, prompt [[5]], 2 new tokens, gamma 1: the first rejection after the window filled used to raise."""
    target = tiny_family("mistral", seed=1, sliding_window=2)
    draft = tiny_family("mistral", seed=2, sliding_window=2)
    ids = torch.tensor([[5]])
    for new in (1, 2, 5, 11):
        out = speculative_generate(target, draft, ids, max_new_tokens=new, num_draft_tokens=1)
        assert torch.equal(out.sequences, hf_greedy(target, ids, torch.ones_like(ids), new))


# ---------------------------------------------------------------- sampling: the exact joint of two tokens
V = 12
N = 4000  # rows of one batched call, alternating two prompts of different lengths (left padded)
ALPHA = 1e-4  # per chi-square check: a correct decoder fails one with probability 1e-4 (2 checks per family)
PROMPTS = [torch.tensor([3, 7, 1, 9, 4, 2]), torch.tensor([5, 11, 6])]  # both longer than the window (2)


@torch.inference_mode()
def exact_joint(model, prompt: torch.Tensor, cfg) -> torch.Tensor:
    """``(V, V)`` float64 ``p(x1) p(x2 | x1)`` from transformers' own uncached forward (its own window)."""
    p1 = process_logits(model(prompt[None]).logits[0, -1], **cfg)
    seqs = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], 1)
    p2 = process_logits(model(seqs).logits[:, -1], **cfg)
    return (p1[:, None] * p2).double()


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_sampled_two_token_joint_matches_target_batched(family):
    target = tiny_family(family, vocab_size=V, hidden_size=16, num_layers=2, seed=11, sliding_window=2)
    draft = tiny_family(family, vocab_size=V, hidden_size=16, num_layers=1, seed=12, sliding_window=2)
    assert fast_path_supported(target) and fast_path_supported(draft)
    full = tiny_family(family, vocab_size=V, hidden_size=16, num_layers=2, seed=11, sliding_window=None)
    cfg = dict(temperature=1.0, top_k=8)
    ids, mask = left_pad(PROMPTS)
    out = speculative_generate(target, draft, ids.repeat(N // 2, 1), mask.repeat(N // 2, 1), max_new_tokens=2,
                               num_draft_tokens=2, do_sample=True, generator=torch.Generator().manual_seed(5), **cfg)
    width = ids.shape[1]
    pair = out.sequences[:, width] * V + out.sequences[:, width + 1]
    for i, prompt in enumerate(PROMPTS):
        counts = torch.bincount(pair[i::2], minlength=V * V).double()
        joint = exact_joint(target, prompt, cfg)
        assert counts[joint.flatten() == 0].sum() == 0  # never a pair the target gives probability 0
        assert chi_square_pvalue(counts, joint) > ALPHA
        # power: the draft's joint is rejected by the same test; the window changes the target's joint
        assert chi_square_pvalue(counts, exact_joint(draft, prompt, cfg)) < ALPHA
        assert (exact_joint(full, prompt, cfg) - joint).abs().sum() > 0.05
    assert 0.05 < out.stats.acceptance_rate < 0.98


# ---------------------------------------------------------------- refused: caches the decoder cannot roll back
def tiny_chunked_llama4(vocab: int = 64, seed: int = 0):
    """A tiny Llama-4 text model: chunked attention (keys only within the query's chunk of 4 positions)."""
    import transformers as tf

    cfg = tf.Llama4TextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              attention_chunk_size=4, num_local_experts=2, max_position_embeddings=256,
                              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return tf.Llama4ForCausalLM(cfg).eval()


def test_uncroppable_caches_are_refused_with_a_clear_error():
    target, _ = target_and_draft("mistral")
    ids = torch.tensor([[5, 6, 7]])
    chunked = tiny_chunked_llama4()
    for t, d in ((target, chunked), (chunked, target)):  # as draft and as target
        with pytest.raises(ValueError, match="cannot roll back the KV cache of 'llama4_text'.*chunked_attention"):
            speculative_generate(t, d, ids, max_new_tokens=4)
    bidirectional = tiny_family("gemma3", seed=0)
    bidirectional.config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        speculative_generate(bidirectional, target, ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="^draft 'x': .*llama4_text"):
        cache_policy(chunked, role="draft 'x'")


def test_gpt_neo_local_attention_refused_only_where_slots_and_positions_differ():
    """GPT-Neo's local window is counted in cache slots: exact at batch 1 (no holes), refused for a batch whose
    cache can outgrow the window, accepted for a batch that stays within it."""
    import transformers as tf

    cfg = tf.GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, window_size=6,
                          attention_types=[[["global", "local"], 1]], max_position_embeddings=64,
                          bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    target = tf.GPTNeoForCausalLM(cfg).eval()
    torch.manual_seed(1)
    draft = tf.GPTNeoForCausalLM(cfg).eval()
    ids, mask = left_pad(random_prompts([5, 3], 64, seed=1))
    one = speculative_generate(target, draft, ids[:1], max_new_tokens=8, num_draft_tokens=3)
    assert torch.equal(one.sequences, hf_greedy(target, ids[:1], mask[:1], 8))
    with pytest.raises(ValueError, match="window \\(6\\) in cache slots.*batch size 1"):
        speculative_generate(target, draft, ids, mask, max_new_tokens=8, num_draft_tokens=3)
    short = speculative_generate(target, draft, ids[:, -2:], mask[:, -2:], max_new_tokens=1, num_draft_tokens=1)
    assert torch.equal(short.sequences, hf_greedy(target, ids[:, -2:], mask[:, -2:], 1))
