"""The same decoder on CUDA in bf16 (marked ``gpu``; skipped with a reason on machines without CUDA)."""
from __future__ import annotations

import pytest
import torch

from tinymodels import tiny_llama
from decode import autoregressive_generate, speculative_generate

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_equality_on_cuda(dtype, gamma):
    target = tiny_llama(vocab_size=96, hidden_size=64, num_layers=3, seed=0).to("cuda", dtype)
    draft = tiny_llama(vocab_size=96, hidden_size=32, num_layers=1, seed=1).to("cuda", dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (4, 9), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on one row
    ref = autoregressive_generate(target, ids, mask, max_new_tokens=37)
    out = speculative_generate(target, draft, ids, mask, max_new_tokens=37, num_draft_tokens=gamma)
    assert torch.equal(out.sequences, ref.sequences)


def test_identical_draft_accepts_everything_on_cuda():
    target = tiny_llama(vocab_size=96, hidden_size=64, num_layers=2, seed=0).to("cuda")
    ids = torch.randint(0, 96, (1, 8)).cuda()
    out = speculative_generate(target, target, ids, max_new_tokens=40, num_draft_tokens=4)
    assert out.stats.acceptance_rate == 1.0


def test_sampling_reproducible_on_cuda():
    target = tiny_llama(vocab_size=96, hidden_size=64, num_layers=2, seed=0).to("cuda")
    draft = tiny_llama(vocab_size=96, hidden_size=32, num_layers=1, seed=1).to("cuda")
    ids = torch.randint(0, 96, (2, 8)).cuda()
    a = speculative_generate(target, draft, ids, max_new_tokens=30, do_sample=True, temperature=0.8, top_p=0.9,
                             generator=torch.Generator("cuda").manual_seed(3))
    b = speculative_generate(target, draft, ids, max_new_tokens=30, do_sample=True, temperature=0.8, top_p=0.9,
                             generator=torch.Generator("cuda").manual_seed(3))
    assert torch.equal(a.sequences, b.sequences)
