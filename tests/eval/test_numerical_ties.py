"""Telling a numerical tie of the target's logits from a decoder fault (eval.evaluate.divergence)."""
from __future__ import annotations

import torch

from eval.evaluate import TIE_LOGIT_TOLERANCE, divergence
from tinymodels import tiny_llama


def _greedy(model, ids, n):
    from decode import autoregressive_generate

    return autoregressive_generate(model, ids, max_new_tokens=n, eos_token_id=[]).sequences


def test_equal_outputs_are_no_divergence():
    m = tiny_llama(seed=3)
    ids = torch.tensor([[5, 9, 2, 7]])
    ref = _greedy(m, ids, 6)
    assert divergence(m, ref, ref.clone(), ids.size(1)) is None


def test_a_lower_ranked_token_is_a_fault_unless_within_the_tolerance():
    m = tiny_llama(seed=3)
    ids = torch.tensor([[5, 9, 2, 7]])
    ref = _greedy(m, ids, 6)
    j = 2
    with torch.no_grad():
        logits = m(ref[:, : ids.size(1) + j]).logits[0, -1]
    second = int(torch.topk(logits, 2).indices[1])
    gap = float(torch.topk(logits, 2).values[0] - logits[second])
    out = ref.clone()
    out[0, ids.size(1) + j] = second  # the decoder emitted the runner-up there
    d = divergence(m, ref, out, ids.size(1))
    assert d["position"] == j and abs(d["logit_gap"] - gap) < 1e-6 and d["top2_gap"] == d["logit_gap"]
    assert d["numerical_tie"] is (gap <= TIE_LOGIT_TOLERANCE) and gap > TIE_LOGIT_TOLERANCE  # a random model
    assert divergence(m, ref, out, ids.size(1), tolerance=gap * 1.01)["numerical_tie"] is True
    worst = int(torch.argmin(logits))
    out[0, ids.size(1) + j] = worst
    assert divergence(m, ref, out, ids.size(1), tolerance=gap * 1.01)["numerical_tie"] is False


def test_a_length_difference_alone_is_never_a_tie():
    m = tiny_llama(seed=3)
    ids = torch.tensor([[5, 9, 2, 7]])
    ref = _greedy(m, ids, 6)
    d = divergence(m, ref, ref[:, :-2], ids.size(1))
    assert d == {"position": 4, "logit_gap": None, "top2_gap": None, "numerical_tie": False}
