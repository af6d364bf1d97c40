"""distill.losses: identity, endpoints against F.kl_div, hand values, masking / padding / micro-batch invariance."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from distill.losses import (
    LOSSES,
    cross_entropy,
    forward_kl,
    generalized_jsd,
    get_loss,
    reverse_kl,
    skew_kl,
    token_count,
    total_variation,
)

NAMES = sorted(LOSSES)
ATOL = 1e-6


def _logits(seed: int, shape=(3, 5, 11), scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale


def _mask(seed: int, shape=(3, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(shape, generator=g) > 0.3
    m[0, 0] = True  # at least one token counts
    return m


# -------- independent reference formulas (plain torch on probabilities, per token) --------


def _ref_per_token(name: str, s: torch.Tensor, t: torch.Tensor, T: float = 1.0, **kw) -> torch.Tensor:
    q = torch.softmax(s.double() / T, -1)
    p = torch.softmax(t.double() / T, -1)

    def kl(a, b):
        return (a * (a.log() - b.log())).sum(-1)

    if name == "forward_kl":
        d = kl(p, q)
    elif name == "reverse_kl":
        d = kl(q, p)
    elif name == "generalized_jsd":
        beta = kw.get("beta", 0.5)
        m = beta * p + (1 - beta) * q
        d = beta * kl(p, m) + (1 - beta) * kl(q, m)
    elif name == "total_variation":
        d = 1.0 - torch.minimum(p, q).sum(-1)  # 1 - TVD = acceptance probability
    elif name == "skew_kl":
        lam = kw.get("skew", 0.1)
        d = kl(p, lam * p + (1 - lam) * q)
    else:
        raise AssertionError(name)
    return d * T**2


def _ref_mean(name, s, t, mask, T=1.0, **kw):
    d = _ref_per_token(name, s, t, T, **kw)
    return (d * mask).sum() / mask.sum()


# -------- identity --------


@pytest.mark.parametrize("name", NAMES)
def test_equal_logits_give_zero(name):
    t = _logits(0)
    for T in (1.0, 2.0):
        val = LOSSES[name](t.clone(), t, None, temperature=T)
        assert val.dtype == torch.float32 and val.dim() == 0
        assert abs(val.item()) < ATOL


# -------- endpoints / closed form against F.kl_div --------


def test_jsd_endpoints_equal_forward_and_reverse_kl_via_kl_div():
    s, t, m = _logits(1), _logits(2), _mask(3)
    logq, logp = F.log_softmax(s, -1), F.log_softmax(t, -1)
    # F.kl_div(input, target) = KL(target || input) with input, target given as log-probabilities.
    fwd_tok = F.kl_div(logq, logp, reduction="none", log_target=True).sum(-1)  # KL(p || q)
    rev_tok = F.kl_div(logp, logq, reduction="none", log_target=True).sum(-1)  # KL(q || p)
    fwd = fwd_tok[m].mean()
    rev = rev_tok[m].mean()
    torch.testing.assert_close(generalized_jsd(s, t, m, beta=0.0), fwd)
    torch.testing.assert_close(generalized_jsd(s, t, m, beta=1.0), rev)
    torch.testing.assert_close(forward_kl(s, t, m), fwd)
    torch.testing.assert_close(reverse_kl(s, t, m), rev)
    torch.testing.assert_close(skew_kl(s, t, m, skew=0.0), fwd)
    assert abs(skew_kl(s, t, m, skew=1.0).item()) < ATOL


def test_jsd_half_is_symmetric_and_interior_matches_formula():
    s, t, m = _logits(4), _logits(5), _mask(6)
    torch.testing.assert_close(generalized_jsd(s, t, m, beta=0.5), generalized_jsd(t, s, m, beta=0.5))
    for beta in (0.1, 0.5, 0.9):
        torch.testing.assert_close(
            generalized_jsd(s, t, m, beta=beta).double(), _ref_mean("generalized_jsd", s, t, m, beta=beta)
        )
    # JSD(beta) with swapped arguments is JSD(1 - beta).
    torch.testing.assert_close(generalized_jsd(s, t, m, beta=0.3), generalized_jsd(t, s, m, beta=0.7))


def test_total_variation_is_one_minus_acceptance_probability():
    s, t, m = _logits(7), _logits(8), _mask(9)
    q, p = torch.softmax(s, -1), torch.softmax(t, -1)
    accept = torch.minimum(p, q).sum(-1)  # (B, T) per-token acceptance probability
    torch.testing.assert_close(total_variation(s, t, m), (1 - accept)[m].mean())


@pytest.mark.parametrize("name", NAMES)
def test_temperature_squared_scaling_matches_direct_formula(name):
    s, t, m = _logits(10), _logits(11), _mask(12)
    got = LOSSES[name](s, t, m, temperature=2.0).double()
    torch.testing.assert_close(got, _ref_mean(name, s, t, m, T=2.0), atol=1e-6, rtol=1e-5)
    # The T^2 factor is really there: without it the value would be 4x smaller.
    unscaled = _ref_mean(name, s, t, m, T=2.0) / 4.0
    assert not torch.isclose(got, unscaled)
    torch.testing.assert_close(got, 4.0 * unscaled, atol=1e-6, rtol=1e-5)


# -------- hand-computed values on a 2-token vocabulary --------
# teacher logits (0, 0)      -> p = (1/2, 1/2)
# student logits (ln 3, 0)   -> q = (3/4, 1/4)
_P = (0.5, 0.5)
_Q = (0.75, 0.25)
HAND = {
    # KL(p||q) = 1/2 ln(0.5/0.75) + 1/2 ln(0.5/0.25) = 1/2 ln(4/3)
    "forward_kl": (dict(), 0.5 * math.log(4 / 3)),  # 0.143841036
    # KL(q||p) = 3/4 ln(1.5) + 1/4 ln(0.5)
    "reverse_kl": (dict(), 0.75 * math.log(1.5) + 0.25 * math.log(0.5)),  # 0.130812035
    # m = (0.625, 0.375); 1/2 [1/2 ln(0.8) + 1/2 ln(4/3)] + 1/2 [3/4 ln(1.2) + 1/4 ln(2/3)]
    "generalized_jsd": (
        dict(beta=0.5),
        0.5 * (0.5 * math.log(0.8) + 0.5 * math.log(4 / 3)) + 0.5 * (0.75 * math.log(1.2) + 0.25 * math.log(2 / 3)),
    ),  # 0.033822076
    # 1/2 (|0.5 - 0.75| + |0.5 - 0.25|) = 0.25
    "total_variation": (dict(), 0.25),
    # m = 0.1 p + 0.9 q = (0.725, 0.275); 1/2 ln(0.5/0.725) + 1/2 ln(0.5/0.275)
    "skew_kl": (dict(skew=0.1), 0.5 * math.log(0.5 / 0.725) + 0.5 * math.log(0.5 / 0.275)),  # 0.113136722
}
@pytest.mark.parametrize("name", NAMES)
def test_hand_computed_value(name):
    kw, expected = HAND[name]
    s = torch.tensor([[[math.log(3.0), 0.0]]])  # (1, 1, 2)
    t = torch.tensor([[[0.0, 0.0]]])
    # The second position is padding with garbage logits: it must not count.
    s = torch.cat([s, torch.tensor([[[50.0, -50.0]]])], dim=1)
    t = torch.cat([t, torch.tensor([[[float("-inf"), 3.0]]])], dim=1)
    mask = torch.tensor([[True, False]])
    assert LOSSES[name](s, t, mask, **kw).item() == pytest.approx(expected, abs=1e-6)


def test_hand_computed_value_three_token_vocab_with_inf_entry():
    # p = (1/2, 1/2, 0) (banned/padded id at -inf), q = (1/4, 1/2, 1/4):
    # KL(p||q) = 1/2 ln 2 + 0 + 0 (0 log 0 = 0);  TVD = 1/2 (1/4 + 0 + 1/4) = 1/4
    t = torch.tensor([[[0.0, 0.0, float("-inf")]]])
    s = torch.tensor([[[0.0, math.log(2.0), 0.0]]], requires_grad=True)
    val = forward_kl(s, t)
    assert val.item() == pytest.approx(0.5 * math.log(2.0), abs=1e-6)
    val.backward()
    assert torch.isfinite(s.grad).all()
    assert total_variation(s, t).item() == pytest.approx(0.25, abs=1e-6)
    # Reverse KL is genuinely infinite here (q puts mass where p has none): inf, not NaN.
    assert math.isinf(reverse_kl(s, t).item())


# -------- masking and padding --------


@pytest.mark.parametrize("name", NAMES)
def test_appending_masked_positions_changes_neither_value_nor_gradients(name):
    s0, t, m = _logits(20), _logits(21), _mask(22)
    s = s0.clone().requires_grad_(True)
    base = LOSSES[name](s, t, m, temperature=1.5)
    base.backward()
    grad = s.grad.clone()

    B, T, V = s0.shape
    pad_s = torch.full((B, 4, V), 1e30)
    pad_s[:, 1] = float("-inf")
    pad_t = torch.full((B, 4, V), float("-inf"))
    pad_t[:, 2] = float("nan")
    pad_t[:, 3] = -1e30
    s_long = torch.cat([s0, pad_s], dim=1).requires_grad_(True)
    t_long = torch.cat([t, pad_t], dim=1)
    m_long = torch.cat([m, torch.zeros(B, 4, dtype=torch.bool)], dim=1)
    val = LOSSES[name](s_long, t_long, m_long, temperature=1.5)
    val.backward()
    torch.testing.assert_close(val, base)
    torch.testing.assert_close(s_long.grad[:, :T], grad)
    assert torch.equal(s_long.grad[:, T:], torch.zeros_like(s_long.grad[:, T:]))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_all_masked_is_zero_with_finite_gradients(name, chunk_size):
    s = torch.full((2, 3, 5), float("-inf"))
    s[0, 0] = 1e30
    s.requires_grad_(True)
    t = torch.full((2, 3, 5), float("nan"))
    mask = torch.zeros(2, 3, dtype=torch.bool)
    val = LOSSES[name](s, t, mask, chunk_size=chunk_size)
    assert val.item() == 0.0
    val.backward()
    assert torch.equal(s.grad, torch.zeros_like(s.grad))
    assert LOSSES[name](s, t, mask, reduction="sum").item() == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_inf_vocab_entries_give_finite_values_and_gradients(name):
    s0, t = _logits(30), _logits(31)
    s0[..., -3:] = float("-inf")  # e.g. padded embedding rows masked out in both models
    t[..., -3:] = float("-inf")
    s = s0.clone().requires_grad_(True)
    val = LOSSES[name](s, t, _mask(32), chunk_size=2)
    val.backward()
    assert torch.isfinite(val)
    assert torch.isfinite(s.grad).all()


# -------- gradient accumulation --------


@pytest.mark.parametrize("name", NAMES)
def test_micro_batch_split_invariance_with_global_token_count(name):
    B, T, V = 5, 6, 9
    s0, t = _logits(40, (B, T, V)), _logits(41, (B, T, V))
    m = _mask(42, (B, T))
    m[3] = False  # one sequence entirely padding
    m[4, 1:] = False  # one very short sequence: micro-batches have very different token counts

    s_full = s0.clone().requires_grad_(True)
    LOSSES[name](s_full, t, m).backward()

    s_acc = s0.clone().requires_grad_(True)
    global_count = token_count(m)
    for lo, hi in ((0, 1), (1, 4), (4, 5)):  # uneven micro-batches
        (LOSSES[name](s_acc[lo:hi], t[lo:hi], m[lo:hi], reduction="sum") / global_count).backward()
    torch.testing.assert_close(s_acc.grad, s_full.grad)

    # The naive mean of micro-batch means weights tokens differently: the test above is not vacuous.
    s_naive = s0.clone().requires_grad_(True)
    for lo, hi in ((0, 1), (1, 4), (4, 5)):
        (LOSSES[name](s_naive[lo:hi], t[lo:hi], m[lo:hi]) / 3).backward()
    assert not torch.allclose(s_naive.grad, s_full.grad)


def test_token_count_and_reductions():
    s, t, m = _logits(50), _logits(51), _mask(52)
    assert token_count(m).item() == int(m.sum())
    assert token_count(m.long()).item() == int(m.sum())
    per_tok = forward_kl(s, t, m, reduction="none")
    assert per_tok.shape == m.shape and torch.equal(per_tok[~m], torch.zeros_like(per_tok[~m]))
    torch.testing.assert_close(per_tok.sum(), forward_kl(s, t, m, reduction="sum"))
    torch.testing.assert_close(per_tok.sum() / m.sum(), forward_kl(s, t, m))
    torch.testing.assert_close(forward_kl(s, t, None), forward_kl(s, t, torch.ones_like(m)))
    with pytest.raises(ValueError, match="reduction"):
        forward_kl(s, t, m, reduction="avg")


# -------- chunking, dtypes --------


@pytest.mark.parametrize("name", NAMES)
def test_chunked_equals_unchunked_value_and_gradient(name):
    s0, t, m = _logits(60, (2, 7, 13)), _logits(61, (2, 7, 13)), _mask(62, (2, 7))
    labels = torch.randint(0, 13, (2, 7), generator=torch.Generator().manual_seed(63))
    labels[0, :2] = -100
    kw = dict(mask=m, temperature=1.3, hard_label_weight=0.25, labels=labels)
    s = s0.clone().requires_grad_(True)
    ref = LOSSES[name](s, t, **kw)
    ref.backward()
    for chunk in (1, 3, 7, 100):
        sc = s0.clone().requires_grad_(True)
        val = LOSSES[name](sc, t, chunk_size=chunk, **kw)
        val.backward()
        torch.testing.assert_close(val, ref)
        torch.testing.assert_close(sc.grad, s.grad)
    with torch.no_grad():
        torch.testing.assert_close(LOSSES[name](s0, t, chunk_size=3, **kw), ref.detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", NAMES)
def test_half_precision_inputs_are_computed_in_fp32(name, dtype):
    s32, t32, m = _logits(70), _logits(71), _mask(72)
    s = s32.to(dtype).requires_grad_(True)
    t = t32.to(dtype)
    val = LOSSES[name](s, t, m, temperature=2.0)
    assert val.dtype == torch.float32
    # Same as the fp32 computation on the (rounded) half-precision values.
    torch.testing.assert_close(val, LOSSES[name](s.detach().float(), t.float(), m, temperature=2.0))
    val.backward()
    assert s.grad.dtype == dtype and torch.isfinite(s.grad.float()).all()


# -------- hard labels --------


@pytest.mark.parametrize("name", NAMES)
def test_hard_label_weight_mixes_divergence_and_cross_entropy(name):
    s, t = _logits(80), _logits(81)
    labels = torch.randint(0, s.shape[-1], s.shape[:2], generator=torch.Generator().manual_seed(82))
    labels[1, 3:] = -100
    m = labels != -100
    fn = LOSSES[name]
    ce = F.cross_entropy(s.reshape(-1, s.shape[-1]), labels.reshape(-1), ignore_index=-100)  # (B*T, V) flat
    div = fn(s, t, m, temperature=2.0)
    torch.testing.assert_close(fn(s, t, m, temperature=2.0, hard_label_weight=0.0, labels=labels), div)
    torch.testing.assert_close(fn(s, t, m, temperature=2.0, hard_label_weight=1.0, labels=labels), ce)
    torch.testing.assert_close(
        fn(s, t, m, temperature=2.0, hard_label_weight=0.3, labels=labels), 0.7 * div + 0.3 * ce
    )
    torch.testing.assert_close(cross_entropy(s, labels), ce)
    torch.testing.assert_close(cross_entropy(s, labels, m, chunk_size=2), ce)
    with pytest.raises(ValueError, match="labels"):
        fn(s, t, m, hard_label_weight=0.5)
    with pytest.raises(ValueError, match="hard_label_weight"):
        fn(s, t, m, hard_label_weight=1.5, labels=labels)


def test_cross_entropy_all_ignored_is_zero():
    s = _logits(90).requires_grad_(True)
    labels = torch.full(s.shape[:2], -100)
    val = cross_entropy(s, labels)
    val.backward()
    assert val.item() == 0.0 and torch.equal(s.grad, torch.zeros_like(s.grad))


# -------- errors and dispatch --------


def test_shape_mismatch_names_both_shapes():
    s, t = _logits(100, (2, 3, 11)), _logits(101, (2, 3, 12))
    with pytest.raises(ValueError, match=r"\(2, 3, 11\).*\(2, 3, 12\)"):
        forward_kl(s, t)
    with pytest.raises(ValueError, match=r"mask shape \(2, 4\)"):
        forward_kl(s, s, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(s, s, beta=1.5)
    with pytest.raises(ValueError, match="skew"):
        skew_kl(s, s, skew=-0.1)
    with pytest.raises(ValueError, match="temperature"):
        forward_kl(s, s, temperature=0.0)


def test_get_loss_dispatch_and_unknown_name():
    assert set(LOSSES) == {"forward_kl", "reverse_kl", "generalized_jsd", "total_variation", "skew_kl"}
    for name, fn in LOSSES.items():
        assert get_loss(name) is fn
    s, t = _logits(110), _logits(111)
    torch.testing.assert_close(get_loss("generalized_jsd", beta=0.0)(s, t), forward_kl(s, t))
    with pytest.raises(ValueError) as err:
        get_loss("kl")
    for name in LOSSES:
        assert name in str(err.value)


# -------- properties --------


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    scale=st.floats(0.1, 20.0),
    temperature=st.floats(0.5, 3.0),
    beta=st.floats(0.0, 1.0),
)
def test_property_nonnegative_and_bounded(seed, scale, temperature, beta):
    s, t, m = _logits(seed, (2, 3, 6), scale), _logits(seed + 1, (2, 3, 6), scale), _mask(seed + 2, (2, 3))
    T2 = temperature**2
    for name, fn in LOSSES.items():
        kw = {"beta": beta} if name == "generalized_jsd" else {}
        val = fn(s, t, m, temperature=temperature, **kw).item()
        assert math.isfinite(val) and val >= -1e-5, (name, val)
    assert total_variation(s, t, m, temperature=temperature).item() <= T2 * (1 + 1e-6)
    assert generalized_jsd(s, t, m, temperature=temperature, beta=0.5).item() <= T2 * math.log(2) + 1e-5
    assert skew_kl(s, t, m, temperature=temperature, skew=0.1).item() <= T2 * -math.log(0.1) + 1e-5


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), chunk=st.integers(1, 6), split=st.integers(1, 3))
def test_property_chunking_and_splitting_preserve_the_sum(seed, chunk, split):
    s, t, m = _logits(seed, (4, 5, 7)), _logits(seed + 1, (4, 5, 7)), _mask(seed + 2, (4, 5))
    for fn in LOSSES.values():
        full = fn(s, t, m, reduction="sum")
        parts = fn(s[:split], t[:split], m[:split], reduction="sum", chunk_size=chunk) + fn(
            s[split:], t[split:], m[split:], reduction="sum", chunk_size=chunk
        )
        torch.testing.assert_close(parts, full, atol=1e-5, rtol=1e-5)
