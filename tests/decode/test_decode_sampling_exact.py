"""Sampling losslessness: speculative sampling reproduces the target's distribution exactly.

We draw the first two new tokens for many copies of one prompt (one batched call) and compare their empirical
joint distribution with the target's exact joint p(x1) p(x2 | x1), enumerated from the target's own probabilities
after the same temperature / top-k / top-p pipeline, with a chi-square goodness-of-fit test.

False-failure probability: the test fails when p < 1e-4, so a correct decoder fails with probability 1e-4 per
check (4 checks: < 5e-4 per run); with the fixed generator seed the outcome is deterministic anyway. Power: the
same test must reject the *draft's* own joint distribution (p < 1e-4), which shows the sample is large enough to
see a wrong distribution.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tinymodels import tiny_llama
from decode import autoregressive_generate, process_logits, speculative_generate

scipy_stats = pytest.importorskip("scipy.stats")

V = 12
N = 4000
ALPHA = 1e-4
PROMPT = torch.tensor([[3, 7, 1]])


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(vocab_size=V, hidden_size=16, num_layers=1, seed=1)
    draft = tiny_llama(vocab_size=V, hidden_size=16, num_layers=1, seed=5)
    return target, draft


@torch.inference_mode()
def exact_joint(model, cfg) -> torch.Tensor:
    """``(V, V)`` float64: p(x1) * p(x2 | x1) after the shared sampling pipeline."""
    p1 = process_logits(model(PROMPT).logits[0, -1], **cfg)  # (V,)
    seqs = torch.cat([PROMPT.repeat(V, 1), torch.arange(V)[:, None]], 1)  # (V, 4): prompt + each x1
    p2 = process_logits(model(seqs).logits[:, -1], **cfg)  # (V, V)
    return (p1[:, None] * p2).double()


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit; cells with expected count < 5 are merged into one (zero-probability cells excluded)."""
    expected = probs.flatten() * counts.sum()
    big = expected >= 5
    obs, exp = counts[big], expected[big]
    rest = expected[~big].sum()
    if rest > 0:
        obs = torch.cat([obs, counts[~big].sum()[None]])
        exp = torch.cat([exp, rest[None]])
    exp = exp * obs.sum() / exp.sum()
    return float(scipy_stats.chisquare(obs.numpy(), exp.numpy()).pvalue)


CONFIGS = [
    dict(num_draft_tokens=1),  # second token is the bonus token after a full acceptance, or fresh after a rejection
    dict(num_draft_tokens=3),  # both tokens can come from one block: multi-position acceptance
    dict(num_draft_tokens=2, temperature=0.7, top_k=6, top_p=0.9),
    dict(num_draft_tokens=3, temperature=1.6, top_p=0.8),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_joint_of_two_tokens_matches_target(pair, cfg):
    target, draft = pair
    cfg = dict(cfg)
    gamma = cfg.pop("num_draft_tokens")
    joint = exact_joint(target, cfg)
    out = speculative_generate(
        target, draft, PROMPT.repeat(N, 1), max_new_tokens=3, num_draft_tokens=gamma, do_sample=True,
        generator=torch.Generator().manual_seed(1234), **cfg,
    )
    x = out.sequences[:, 3] * V + out.sequences[:, 4]
    counts = torch.bincount(x, minlength=V * V).double()
    # a token pair of probability 0 (filtered by top-k / top-p) must never appear
    assert counts[joint.flatten() == 0].sum() == 0
    assert chi_square_pvalue(counts, joint) > ALPHA
    # power: the draft's own joint distribution is clearly rejected by the same test
    assert chi_square_pvalue(counts, exact_joint(draft, cfg)) < ALPHA
    # the draft really was used and rejected sometimes
    assert 0.05 < out.stats.acceptance_rate < 0.98


def test_autoregressive_sampling_matches_target(pair):
    target, _ = pair
    cfg = dict(temperature=0.8, top_k=8)
    out = autoregressive_generate(target, PROMPT.repeat(N, 1), max_new_tokens=2, do_sample=True,
                                  generator=torch.Generator().manual_seed(7), **cfg)
    counts = torch.bincount(out.sequences[:, 3] * V + out.sequences[:, 4], minlength=V * V).double()
    assert chi_square_pvalue(counts, exact_joint(target, cfg)) > ALPHA


def test_same_seed_same_output_and_identical_draft(pair):
    target, draft = pair
    prompts = PROMPT.repeat(3, 1)
    kw = dict(max_new_tokens=12, num_draft_tokens=3, do_sample=True, temperature=0.9, top_p=0.95)
    a = speculative_generate(target, draft, prompts, generator=torch.Generator().manual_seed(3), **kw)
    b = speculative_generate(target, draft, prompts, generator=torch.Generator().manual_seed(3), **kw)
    c = speculative_generate(target, draft, prompts, generator=torch.Generator().manual_seed(4), **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert a.stats.accepted_length_histogram == b.stats.accepted_length_histogram
    assert not torch.equal(a.sequences, c.sequences)
    same = speculative_generate(target, target, prompts, generator=torch.Generator().manual_seed(3), **kw)
    # p and q are the same model: p(x)/q(x) = 1 up to float rounding between cached and block forwards
    assert same.stats.acceptance_rate >= 0.99


def test_sampling_with_the_confidence_policy_from_the_config_has_the_target_distribution(pair):
    """The confidence policy built from ``decode.*`` overrides, sampling: the first two new tokens of 4000 copies of
    one prompt follow the target's exact joint p(x1) p(x2 | x1) (chi-square). False-failure probability: the test
    fails when p < 1e-4, i.e. with probability 1e-4 for a correct decoder (deterministic under the fixed seed).
    Power: the same sample must reject the draft's own joint (p < 1e-4). Each row stops drafting by its own draft
    probabilities, so the rows are independent samples, and the lengths really vary (asserted)."""
    from hydra import compose, initialize_config_dir

    import eval.__main__  # noqa: F401  (registers the specdraft_root resolver)
    from eval.config import validate_eval

    overrides = ["decode.draft_length_policy=confidence", "decode.max_draft_tokens=3",
                 "decode.confidence_threshold=0.15", "decode.do_sample=true", "decode.temperature=0.9"]
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        rc = validate_eval(compose("config", overrides=overrides))
    target, draft = pair
    # 4 new tokens so the token budget never caps the first block (3 drafted at most); the first two are tested
    out = speculative_generate(target, draft, PROMPT.repeat(N, 1), max_new_tokens=4,
                               draft_length_policy=rc.decode.make_policy(),
                               generator=torch.Generator().manual_seed(0), **rc.decode.sampling_kwargs())
    assert set(out.stats.draft_lengths) >= {1, 2}  # confidence stopped some rows early, not others
    x = out.sequences[:, PROMPT.shape[1]:PROMPT.shape[1] + 2]
    counts = torch.bincount(x[:, 0] * V + x[:, 1], minlength=V * V).double()
    cfg = {k: v for k, v in rc.decode.sampling_kwargs().items() if k != "do_sample"}
    assert chi_square_pvalue(counts, exact_joint(target, cfg)) > ALPHA
    assert chi_square_pvalue(counts, exact_joint(draft, cfg)) < ALPHA
