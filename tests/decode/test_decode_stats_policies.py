"""AcceptanceStats pooling and formulas, draft-length policies, the pure verify step, sampling pipeline, errors."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from decode_testutils import left_pad, make_pair, random_prompts

from decode import (
    AcceptanceStats,
    AdaptiveDraftLength,
    ConfidenceDraftLength,
    FixedDraftLength,
    autoregressive_generate,
    expected_speedup,
    make_policy,
    process_logits,
    speculative_generate,
    verify_block,
)

# ---------------------------------------------------------------------------------------------------- stats


def test_pooling_sums_counts_not_means():
    a = AcceptanceStats(verify_steps=2, drafted_tokens=8, accepted_tokens=8, emitted_tokens=10,
                        per_position_drafted=[2, 2, 2, 2], per_position_accepted=[2, 2, 2, 2],
                        accepted_length_histogram=[0, 0, 0, 0, 2], draft_lengths=[4, 4])
    b = AcceptanceStats(verify_steps=3, drafted_tokens=6, accepted_tokens=0, emitted_tokens=3,
                        per_position_drafted=[3], per_position_accepted=[0],
                        accepted_length_histogram=[3], draft_lengths=[2, 2, 2])
    pooled = AcceptanceStats.pool([a, b])
    assert pooled.mean_accepted_length == pytest.approx(13 / 5)  # not (5 + 1) / 2
    assert pooled.acceptance_rate == pytest.approx(8 / 14)
    assert pooled.per_position_drafted == [5, 2, 2, 2]
    assert pooled.per_position_accepted == [2, 2, 2, 2]
    assert pooled.per_position_acceptance == pytest.approx([0.4, 1.0, 1.0, 1.0])
    assert pooled.accepted_length_histogram == [3, 0, 0, 0, 2]
    assert pooled.draft_lengths == [4, 4, 2, 2, 2]
    assert (a + b).to_dict() == pooled.to_dict() == sum([a, b]).to_dict()
    json.dumps(pooled.to_dict())
    empty = AcceptanceStats()
    assert math.isnan(empty.acceptance_rate) and math.isnan(empty.mean_accepted_length)
    assert json.loads(json.dumps(empty.to_dict()))["acceptance_rate"] is None


def test_record_step_per_position():
    s = AcceptanceStats()
    s.record_step(draft_length=4, num_accepted=2, num_emitted=3)  # 3rd token rejected -> positions 0,1,2 drafted
    s.record_step(draft_length=4, num_accepted=4, num_emitted=5)
    s.record_step(draft_length=0, num_accepted=0, num_emitted=1)
    assert s.per_position_drafted == [2, 2, 2, 1]
    assert s.per_position_accepted == [2, 2, 1, 1]
    assert s.accepted_length_histogram == [1, 0, 1, 0, 1]
    assert s.mean_accepted_length == 3.0 and s.acceptance_rate == 6 / 8


def test_expected_speedup_formula():
    # Leviathan et al. 2023, Thm 3.8: (1 - a^(g+1)) / ((1 - a)(g c + 1))
    assert expected_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))  # 2.4011...
    assert expected_speedup(0.8, 4, 0.1) == pytest.approx(2.401142857)
    assert expected_speedup(1.0, 4, 0.1) == pytest.approx(5 / 1.4)
    assert expected_speedup(1.0 - 1e-12, 4, 0.1) == pytest.approx(5 / 1.4, rel=1e-6)  # continuous at a = 1
    assert expected_speedup(0.0, 3, 0.5) == pytest.approx(1 / 2.5)
    for bad in [(-0.1, 4, 0.1), (1.1, 4, 0.1), (0.5, -1, 0.1), (0.5, 4, -1.0)]:
        with pytest.raises(ValueError):
            expected_speedup(*bad)


# ---------------------------------------------------------------------------------------------------- verify step


def test_verify_block_greedy_never_always_partial():
    vocab = 6
    target_tokens = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])  # target argmax per position
    logits = torch.nn.functional.one_hot(target_tokens, vocab).float() * 5  # (3, G+1, V)
    drafts = torch.tensor([[0, 2, 3], [1, 2, 3], [1, 2, 5]])  # never / always / partial
    n, nxt = verify_block(logits, drafts, None, torch.tensor([3, 3, 3]), do_sample=False)
    assert n.tolist() == [0, 3, 2]
    assert nxt.tolist() == [1, 4, 3]  # correction, bonus, correction
    n, nxt = verify_block(logits, drafts, None, torch.tensor([3, 1, 3]), do_sample=False)
    assert n.tolist() == [0, 1, 2] and nxt.tolist() == [1, 2, 3]  # row 1 proposed only one token


def test_verify_block_sampling_never_always():
    vocab, g = 4, 2
    gen = torch.Generator().manual_seed(0)
    # always: p == q -> every token accepted, bonus from p at position G
    logits = torch.randn(1, g + 1, vocab, generator=gen)
    q = process_logits(logits[:, :g])
    drafts = torch.tensor([[1, 3]])
    for _ in range(20):
        n, _ = verify_block(logits, drafts, q, torch.tensor([g]), do_sample=True, generator=gen)
        assert n.item() == g
    # never: q puts all mass on token 0 which p gives probability 0 -> rejected, residual = p
    p_logits = torch.tensor([[[-1e9, 0.0, 0.0, 0.0]] * (g + 1)])
    q = torch.zeros(1, g, vocab)
    q[..., 0] = 1.0
    drafts = torch.zeros(1, g, dtype=torch.long)
    for _ in range(20):
        n, nxt = verify_block(p_logits, drafts, q, torch.tensor([g]), do_sample=True, generator=gen)
        assert n.item() == 0 and nxt.item() in (1, 2, 3)


# ---------------------------------------------------------------------------------------------------- sampling pipeline


def test_process_logits_matches_transformers_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=gen) * 3
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8), (0.5, 5, 0.3), (2.0, 40, 0.01)]:
        scores = logits.clone()
        if temperature != 1.0:
            scores = TemperatureLogitsWarper(temperature)(None, scores)
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1.0:
            scores = TopPLogitsWarper(top_p)(None, scores)
        ref = scores.softmax(-1)
        ours = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, ref)
        assert ((ours > 0).sum(-1) >= 1).all()


# ---------------------------------------------------------------------------------------------------- policies


def test_make_policy_names_and_errors():
    assert isinstance(make_policy("fixed", num_draft_tokens=3), FixedDraftLength)
    assert isinstance(make_policy("adaptive", initial=2, min_draft_tokens=1, max_draft_tokens=5), AdaptiveDraftLength)
    assert isinstance(make_policy("confidence", max_draft_tokens=6, threshold=0.3), ConfidenceDraftLength)
    with pytest.raises(ValueError, match="unknown draft length policy"):
        make_policy("magic")
    with pytest.raises(ValueError, match="adaptive"):
        make_policy("adaptive", bogus=1)
    with pytest.raises(ValueError, match="initial"):
        AdaptiveDraftLength(initial=9, min_draft_tokens=1, max_draft_tokens=8)
    with pytest.raises(ValueError, match="threshold"):
        ConfidenceDraftLength(4, threshold=1.5)


def test_adaptive_policy_unit():
    pol = AdaptiveDraftLength(initial=3, min_draft_tokens=2, max_draft_tokens=5, window=2, step=1)
    pol.update([3], [3])
    assert pol.propose_length() == 3  # window not full yet
    pol.update([3], [3])
    assert pol.propose_length() == 4  # two full acceptances -> grow
    for _ in range(10):
        pol.update([pol.current], [pol.current])
    assert pol.propose_length() == 5  # bounded above
    pol.update([5, 5], [5, 1])
    assert pol.propose_length() == 4  # a partial block in the window -> shrink
    for _ in range(10):
        pol.update([pol.current], [0])
    assert pol.propose_length() == 2  # bounded below
    pol.reset()
    assert pol.propose_length() == 3


def test_adaptive_policy_end_to_end_grows_and_shrinks():
    target, same = make_pair(seed=4, noise=0.0)
    _, bad = make_pair(seed=4, noise=0.0, independent=True)
    ids, mask = left_pad(random_prompts([4], 64, 4))
    pol = AdaptiveDraftLength(initial=2, min_draft_tokens=1, max_draft_tokens=6, window=1, step=1)
    out = speculative_generate(target, same, ids, mask, max_new_tokens=30, draft_length_policy=pol)
    lengths = out.stats.draft_lengths
    assert lengths[:4] == [2, 3, 4, 5] and max(lengths) == 6 and all(1 <= k <= 6 for k in lengths)
    assert len(lengths) == out.stats.verify_steps
    pol = AdaptiveDraftLength(initial=4, min_draft_tokens=1, max_draft_tokens=6, window=1, step=1)
    out2 = speculative_generate(target, bad, ids, mask, max_new_tokens=20, draft_length_policy=pol)
    assert out2.stats.draft_lengths[0] == 4 and out2.stats.draft_lengths[-2] == 1
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=30).sequences
    assert torch.equal(out.sequences, ar) and torch.equal(out2.sequences, ar[:, : ids.shape[1] + 20])


def test_confidence_policy_stops_early_and_stays_lossless():
    target, draft = make_pair(seed=6, noise=0.3)
    ids, mask = left_pad(random_prompts([5, 2, 7], 64, 6))
    ar = autoregressive_generate(target, ids, mask, max_new_tokens=16).sequences
    runs = {}
    for thr in (0.0, 0.05, 1.0):
        out = speculative_generate(target, draft, ids, mask, max_new_tokens=16,
                                   draft_length_policy=ConfidenceDraftLength(max_draft_tokens=5, threshold=thr))
        assert torch.equal(out.sequences, ar)
        runs[thr] = out.stats.draft_lengths
    # top probability < 1 always: only the first token of each block (0 at a row's very last token)
    assert set(runs[1.0]) == {0, 1} and runs[1.0].count(0) <= 3
    assert runs[0.0].count(5) > len(runs[0.0]) // 2  # never stops early (only the token budget caps it)
    assert any(1 < k < 5 for k in runs[0.05])  # confidence decides the length per row and step
    assert sum(runs[0.05]) < sum(runs[0.0]) and max(runs[0.05]) <= 5
    # sampling with a confidence policy stays reproducible
    pol = ConfidenceDraftLength(max_draft_tokens=4, threshold=0.5)
    a = speculative_generate(target, draft, ids, mask, max_new_tokens=10, do_sample=True, draft_length_policy=pol,
                             generator=torch.Generator().manual_seed(0))
    b = speculative_generate(target, draft, ids, mask, max_new_tokens=10, do_sample=True, draft_length_policy=pol,
                             generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.sequences, b.sequences)


# ---------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_draft_tokens=0), "num_draft_tokens"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=0.0, do_sample=True), "greedy"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    target, draft = make_pair(seed=0, noise=0.1)
    ids = torch.tensor([[1, 2, 3]])
    kw = dict(max_new_tokens=4)
    kw.update(kwargs)
    with pytest.raises(ValueError, match=match):
        speculative_generate(target, draft, ids, **kw)
    kw.pop("num_draft_tokens", None)
    if "num_draft_tokens" not in kwargs:
        with pytest.raises(ValueError, match=match):
            autoregressive_generate(target, ids, **kw)


def test_right_padding_and_shapes_rejected():
    target, draft = make_pair(seed=0, noise=0.1)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="left padding"):
        speculative_generate(target, draft, ids, torch.tensor([[1, 1, 1], [1, 1, 0]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="shape"):
        speculative_generate(target, draft, ids, torch.ones(2, 2, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt_len"):
        speculative_generate(target, draft, torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)


@settings(max_examples=100, deadline=None)
@given(a=st.floats(0.0, 0.99), g=st.integers(1, 8), c=st.floats(0.0, 1.0),
       v=st.lists(st.floats(0.5, 4.0), min_size=9, max_size=9), steps=st.lists(st.integers(0, 20), min_size=9,
                                                                             max_size=9))
def test_expected_speedup_from_costs_prices_every_step_with_its_own_verify_cost(a, g, c, v, steps):
    """tau / mean(k c + v_k): with every step at gamma and v_k = 1 it is Leviathan's Thm 3.8 at the i.i.d. tau;
    with a mixed histogram each step costs its own k c + v_k; a missing v_k gives NaN, never a guess."""
    from decode.stats import expected_speedup, expected_speedup_from_costs

    tau = (1 - a ** (g + 1)) / (1 - a)
    hist = [0] * g + [5]
    assert expected_speedup_from_costs(tau, hist, c, {g: 1.0}) == pytest.approx(expected_speedup(a, g, c))
    assert expected_speedup_from_costs(tau, hist, c, {str(g): v[g]}) == pytest.approx(tau / (g * c + v[g]))
    vk = {k: v[k] for k in range(1, 9)}
    if sum(steps):
        want = tau * sum(steps) / sum(h * (k * c + (vk[k] if k else 1.0)) for k, h in enumerate(steps))
        assert expected_speedup_from_costs(tau, steps, c, vk) == pytest.approx(want)
        used = [k for k, h in enumerate(steps) if h and k]
        if used:  # a step length without its measured v
            assert math.isnan(expected_speedup_from_costs(tau, steps, c, {k: x for k, x in vk.items() if k != used[0]}))
    # a token tree: depth levels of one-position draft forwards, the verify forward of its nodes
    assert expected_speedup_from_costs(tau, hist, c, {7: 2.0}, nodes_per_step=6.6) == pytest.approx(tau / (g * c + 2.0))
    assert math.isnan(expected_speedup_from_costs(tau, [], c, vk))


def test_expected_speedup_from_costs_rejects_bad_input():
    from decode.stats import expected_speedup_from_costs

    with pytest.raises(ValueError, match="cost_ratio"):
        expected_speedup_from_costs(2.0, [0, 1], -0.1, {1: 1.2})
    with pytest.raises(ValueError, match="verify cost ratios"):
        expected_speedup_from_costs(2.0, [0, 1], 0.1, {1: 0.0})
    with pytest.raises(ValueError, match="counts"):
        expected_speedup_from_costs(2.0, [0, -1], 0.1, {1: 1.2})
