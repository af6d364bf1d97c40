"""Greedy losslessness: speculative == autoregressive == transformers' generate, token for token."""
from __future__ import annotations

import pytest
import torch
from decode_testutils import hf_greedy, left_pad, make_pair, random_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decode import autoregressive_generate, speculative_generate

SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=12, **SETTINGS)
@given(
    seed=st.integers(0, 10_000),
    noise=st.sampled_from([0.0, 0.2, 0.5, 2.0]),
    independent=st.booleans(),
    num_draft_tokens=st.integers(1, 8),
    max_new_tokens=st.integers(1, 23),
    prompt_len=st.integers(1, 8),
)
def test_greedy_b1_matches_target(seed, noise, independent, num_draft_tokens, max_new_tokens, prompt_len):
    target, draft = make_pair(seed, noise, independent=independent)
    (ids,) = random_prompts([prompt_len], 64, seed)
    ids = ids[None]
    mask = torch.ones_like(ids)
    ref = hf_greedy(target, ids, mask, max_new_tokens)
    ar = autoregressive_generate(target, ids, max_new_tokens=max_new_tokens)
    sp = speculative_generate(target, draft, ids, max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens)
    assert torch.equal(ar.sequences, ref)
    assert torch.equal(sp.sequences, ref)
    assert sp.sequences.shape == (1, prompt_len + max_new_tokens)
    assert sp.num_new_tokens.tolist() == [max_new_tokens]  # reached exactly, never overshot
    s = sp.stats
    assert s.emitted_tokens == max_new_tokens
    assert s.drafted_tokens == sum(s.draft_lengths) and len(s.draft_lengths) == s.verify_steps
    assert 1.0 <= s.mean_accepted_length <= num_draft_tokens + 1
    assert sum(s.accepted_length_histogram) == s.verify_steps
    assert all(k <= num_draft_tokens for k in s.draft_lengths)


@settings(max_examples=3, **SETTINGS)
@given(
    seed=st.integers(0, 10_000),
    noise=st.sampled_from([0.0, 0.3, 1.0]),
    num_draft_tokens=st.integers(1, 6),
    max_new_tokens=st.integers(5, 11),
    lengths=st.lists(st.integers(1, 9), min_size=4, max_size=4),
)
def test_greedy_batch_left_padded_matches_rows_alone(seed, noise, num_draft_tokens, max_new_tokens, lengths):
    target, draft = make_pair(seed, noise)
    prompts = random_prompts(lengths, 64, seed)
    ids, mask = left_pad(prompts)
    ref = hf_greedy(target, ids, mask, max_new_tokens)
    sp = speculative_generate(
        target, draft, ids, mask, max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens
    )
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=max_new_tokens)
    assert torch.equal(sp.sequences[:, : ids.shape[1]], ids)  # prompts kept as given
    assert torch.equal(ar.sequences, ref)
    assert torch.equal(sp.sequences, ref)
    alone_stats = []
    for i, p in enumerate(prompts):
        alone = speculative_generate(target, draft, p[None], max_new_tokens=max_new_tokens,
                                     num_draft_tokens=num_draft_tokens)
        assert torch.equal(alone.sequences[0, -max_new_tokens:], sp.sequences[i, -max_new_tokens:])
        alone_stats.append(alone.stats)
    # per-row bookkeeping: the batch counts exactly what the rows alone count
    from decode import AcceptanceStats

    pooled = AcceptanceStats.pool(alone_stats)
    for f in ("verify_steps", "drafted_tokens", "accepted_tokens", "emitted_tokens"):
        assert getattr(sp.stats, f) == getattr(pooled, f), f
    assert sp.stats.accepted_length_histogram == pooled.accepted_length_histogram


def _first_mid_block_token(seq, start, block):
    """A token whose first occurrence in ``seq[start:]`` lies strictly inside a block of ``block`` tokens."""
    new = seq[start:].tolist()
    for i, tok in enumerate(new):
        if new.index(tok) == i and i % block not in (0, block - 1) and i >= block:
            return tok, i
    return None, None


@pytest.mark.parametrize("num_draft_tokens", [3, 5])
def test_eos_inside_accepted_block(num_draft_tokens):
    # identical draft: every block is fully accepted, so the EOS lands inside an accepted block
    target, draft = make_pair(seed=0, noise=0.0)
    (p,) = random_prompts([5], 64, 0)
    ids = p[None]
    n = 30
    free = autoregressive_generate(target, ids, max_new_tokens=n).sequences[0]
    eos, pos = _first_mid_block_token(free, 5, num_draft_tokens + 1)
    assert eos is not None, "the greedy continuation should contain a fresh token in the middle of a block"
    pad = 63 if eos != 63 else 62
    sp = speculative_generate(target, draft, ids, max_new_tokens=n, num_draft_tokens=num_draft_tokens,
                              eos_token_id=[999, eos], pad_token_id=pad)
    ref = hf_greedy(target, ids, torch.ones_like(ids), n, eos_token_id=eos, pad_token_id=pad)
    assert torch.equal(sp.sequences, ref)
    assert sp.num_new_tokens.tolist() == [pos + 1]
    assert sp.sequences[0, 5 + pos].item() == eos
    assert (sp.sequences[0, 5 + pos + 1:] == pad).all()
    assert sp.stats.acceptance_rate == 1.0
    assert sp.stats.emitted_tokens == pos + 1
    ar = autoregressive_generate(target, ids, max_new_tokens=n, eos_token_id=eos, pad_token_id=pad)
    assert torch.equal(ar.sequences, ref)


def test_eos_batch_rows_stop_independently():
    target, draft = make_pair(seed=11, noise=0.3)
    prompts = random_prompts([2, 6, 4, 3], 64, 5)
    ids, mask = left_pad(prompts)
    n = 24
    free = autoregressive_generate(target, ids, mask, max_new_tokens=n).sequences[:, ids.shape[1]:]
    eos = int(free[0, 4])  # row 0 stops at its 5th token (or earlier); other rows wherever it occurs
    ref = hf_greedy(target, ids, mask, n, eos_token_id=eos, pad_token_id=0)
    for gamma in (2, 4):
        sp = speculative_generate(target, draft, ids, mask, max_new_tokens=n, num_draft_tokens=gamma,
                                  eos_token_id=eos, pad_token_id=0)
        assert torch.equal(sp.sequences, ref)
        assert sp.num_new_tokens[0].item() <= 5
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=n, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(ar.sequences, ref)
    assert torch.equal(ar.num_new_tokens, sp.num_new_tokens)
    assert (ar.num_new_tokens < n).sum() >= 1


@pytest.mark.parametrize("vocab_target,vocab_draft", [(64, 72), (72, 64)])
def test_padded_vocab_never_emitted(vocab_target, vocab_draft):
    target, draft = make_pair(seed=3, noise=0.3, vocab_target=vocab_target, vocab_draft=vocab_draft)
    prompts = random_prompts([4, 7], 64, 1)
    ids, mask = left_pad(prompts)
    # the padded rows really would win the argmax somewhere if the decoder did not slice them away
    padded_model = target if vocab_target > 64 else draft
    with torch.inference_mode():
        assert (padded_model(ids, attention_mask=mask).logits.argmax(-1) >= 64).any()
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=17, vocab_size=64)
    for gamma in (1, 4):
        sp = speculative_generate(target, draft, ids, mask, max_new_tokens=17, num_draft_tokens=gamma)
        assert torch.equal(sp.sequences, ar.sequences)
        assert sp.sequences.max().item() < 64
        assert sp.stats.accepted_tokens > 0
    sp = speculative_generate(target, draft, ids, mask, max_new_tokens=17, do_sample=True,
                              generator=torch.Generator().manual_seed(0))
    assert sp.sequences.max().item() < 64
    if vocab_target == 64:
        assert torch.equal(ar.sequences, hf_greedy(target, ids, mask, 17))


@pytest.mark.parametrize("num_draft_tokens", [1, 4, 8])
def test_identical_draft_accepts_everything(num_draft_tokens):
    target, _ = make_pair(seed=5, noise=0.0)
    prompts = random_prompts([3, 8, 5], 64, 9)
    ids, mask = left_pad(prompts)
    n = 19
    sp = speculative_generate(target, target, ids, mask, max_new_tokens=n, num_draft_tokens=num_draft_tokens)
    s = sp.stats
    assert s.acceptance_rate == 1.0
    assert s.accepted_tokens == s.drafted_tokens
    assert torch.equal(sp.sequences, autoregressive_generate(target, ids, mask, max_new_tokens=n).sequences)
    # every step but a row's last (truncated to the budget) emits gamma + 1 tokens
    full_blocks = (n // (num_draft_tokens + 1))
    assert s.accepted_length_histogram[num_draft_tokens] == 3 * full_blocks
    assert s.per_position_acceptance == [1.0] * num_draft_tokens


def test_max_new_tokens_zero_and_one():
    target, draft = make_pair(seed=2, noise=0.3)
    ids, mask = left_pad(random_prompts([3, 1], 64, 2))
    out = speculative_generate(target, draft, ids, mask, max_new_tokens=0)
    assert torch.equal(out.sequences, ids) and out.stats.verify_steps == 0
    out = speculative_generate(target, draft, ids, mask, max_new_tokens=1, num_draft_tokens=5)
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 1))
    assert out.stats.drafted_tokens == 0  # nothing is drafted that could not be emitted
