"""distill.losses: the sparse (top-k) forward KL equals the dense one when k = V, and stays close when the top-k
covers the teacher's mass; densify_topk gives the dense losses the same renormalised teacher."""
from __future__ import annotations

import pytest
import torch

from distill.losses import forward_kl, generalized_jsd, skew_kl, total_variation
from distill.losses import densify_topk, teacher_topk, topk_forward_kl


def _logits(seed, shape=(3, 7, 50), scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_full_k_equals_dense_forward_kl_value_and_grad(temperature, reduction):
    s, t = _logits(0), _logits(1)
    mask = torch.rand(3, 7, generator=torch.Generator().manual_seed(2)) > 0.3
    s1, s2 = s.clone().requires_grad_(), s.clone().requires_grad_()
    values, indices = teacher_topk(t, t.size(-1))
    sparse = topk_forward_kl(s1, values, indices, mask, temperature=temperature, reduction=reduction)
    dense = forward_kl(s2, t, mask, temperature=temperature, reduction=reduction)
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-5)
    sparse.sum().backward()
    dense.sum().backward()
    torch.testing.assert_close(s1.grad, s2.grad, atol=1e-6, rtol=1e-5)


def test_sparse_equals_dense_on_densified_teacher_for_any_k():
    s, t = _logits(3), _logits(4)
    values, indices = teacher_topk(t, 5)
    dense_t = densify_topk(values, indices, t.size(-1))
    assert torch.isneginf(dense_t).sum(-1).eq(t.size(-1) - 5).all()
    torch.testing.assert_close(topk_forward_kl(s, values, indices), forward_kl(s, dense_t), atol=1e-5, rtol=1e-5)


def test_renormalisation_student_stays_full_vocab():
    # The student's mass outside the top-k is penalised: moving it away from the top-k ids raises the loss.
    t = torch.tensor([[[5.0, 4.0, -9.0, -9.0]]])
    values, indices = teacher_topk(t, 2)
    on_topk = torch.tensor([[[5.0, 4.0, -9.0, -9.0]]])
    off_topk = torch.tensor([[[5.0, 4.0, 6.0, 6.0]]])  # same ratio on the top-k, large mass elsewhere
    assert topk_forward_kl(on_topk, values, indices) < 1e-3
    assert topk_forward_kl(off_topk, values, indices) > 1.0


def test_close_to_dense_when_topk_covers_the_mass():
    t = _logits(5, scale=12.0)  # sharp teacher
    s = _logits(6)
    values, indices = teacher_topk(t, 16)
    mass = t.softmax(-1).gather(-1, indices.long()).sum(-1)
    assert mass.min() > 0.995
    a, b = topk_forward_kl(s, values, indices), forward_kl(s, t)
    assert abs(a - b) <= 0.01 * b + 0.01


@pytest.mark.parametrize("fn", [lambda s, t, m: generalized_jsd(s, t, m, beta=0.5), total_variation,
                                lambda s, t, m: skew_kl(s, t, m, skew=0.1)])
def test_densified_teacher_keeps_other_losses_finite(fn):
    s, t = _logits(7).requires_grad_(), _logits(8)
    values, indices = teacher_topk(t, 4)
    loss = fn(s, densify_topk(values, indices, t.size(-1)), None)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(s.grad).all()


def test_all_masked_is_zero_and_errors_are_clear():
    s, t = _logits(9), _logits(10)
    values, indices = teacher_topk(t, 3)
    assert topk_forward_kl(s, values, indices, torch.zeros(3, 7, dtype=torch.bool)).item() == 0.0
    with pytest.raises(ValueError, match=r"\(B, T, k\)"):
        topk_forward_kl(s, values[:, :3], indices[:, :3])
    with pytest.raises(ValueError, match="top-k size"):
        teacher_topk(t, 51)
    with pytest.raises(ValueError, match="temperature"):
        topk_forward_kl(s, values, indices, temperature=0)
