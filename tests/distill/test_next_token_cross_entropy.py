"""The one next-token cross-entropy (distill.trainer.next_token_cross_entropy) that the baseline's step and
every validation loss use: it equals transformers' own causal-LM loss on a real forward, counts only the positions
asked for, and with a trimmed draft vocabulary is the cross-entropy over the kept rows with other labels left out."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tinymodels import tiny_llama

from models.vocab import install_trimmed_head, trimmed_logits
from distill.trainer import next_token_cross_entropy


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 3), length=st.integers(2, 12))
def test_equals_transformers_causal_lm_loss(seed, batch, length):
    model = tiny_llama(vocab_size=64, seed=seed % 7)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (batch, length), generator=g)
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
        loss, labels = next_token_cross_entropy(out.logits, ids, torch.ones(batch, length - 1, dtype=torch.bool))
    n = batch * (length - 1)
    assert torch.allclose(loss / n, out.loss, rtol=1e-5, atol=1e-6) and (labels == ids[:, 1:]).all()


def test_counts_only_the_positions_asked_for():
    model = tiny_llama(vocab_size=64, seed=1)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    counted = torch.rand(2, 8, generator=torch.Generator().manual_seed(1)) > 0.5
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        loss, labels = next_token_cross_entropy(logits, ids, counted)
    per = F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1), reduction="none").view(2, 8)
    assert torch.allclose(loss, per[counted].sum(), rtol=1e-5) and ((labels == -100) == ~counted).all()


def test_a_trimmed_head_scores_kept_labels_over_the_kept_rows_and_leaves_the_rest_out():
    model = tiny_llama(vocab_size=64, seed=2)
    kept = torch.arange(0, 64, 2)  # the even ids
    install_trimmed_head(model, kept)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), trimmed_logits(model):
        logits = model(input_ids=ids).logits  # (2, 10, 32): the kept rows only
        loss, labels = next_token_cross_entropy(logits, ids, torch.ones(2, 9, dtype=torch.bool), model)
    assert logits.shape[-1] == 32
    nxt = ids[:, 1:]
    inside = nxt % 2 == 0
    expect = F.cross_entropy(logits[:, :-1][inside], nxt[inside] // 2, reduction="sum")
    assert torch.allclose(loss, expect, rtol=1e-5)
    assert ((labels == -100) == ~inside).all() and (labels[inside] == nxt[inside] // 2).all()
