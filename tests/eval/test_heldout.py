"""Held-out acceptance (eval/heldout.py): the greedy replay from one teacher-forced draft pass equals what the
speculative decoder does (property over random target/draft pairs), the near-duplicate index, the section."""
from __future__ import annotations

import copy

import pytest
import torch

from decode import autoregressive_generate, speculative_generate
from eval.heldout import HeldoutSection, NearDuplicateIndex, draft_matches, replay, summarize_replays
from tinymodels import tiny_llama


def _pair(seed: int, noise: float):
    target = tiny_llama(vocab_size=48, hidden_size=32, num_layers=2, seed=seed).eval()
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=gen))
    return target, draft.eval()


@pytest.mark.parametrize("seed", range(6))
def test_replay_equals_the_speculative_decoder(seed):
    """For random pairs (agreement from high to low) and every gamma, the replay's target forwards and per-position
    proposals / acceptances are the decoder's own counters on the same prompt."""
    target, draft = _pair(seed, noise=[0.05, 0.3, 1.0][seed % 3])
    gen = torch.Generator().manual_seed(100 + seed)
    prompt = torch.randint(0, 48, (1, 5 + seed), generator=gen)
    n = 20 + 3 * seed
    answer = autoregressive_generate(target, prompt, max_new_tokens=n, eos_token_id=[]).sequences[0, prompt.size(1):]
    matches = draft_matches(draft, [prompt[0].tolist()], [answer.tolist()], vocab=48)[0]
    assert len(matches) == n
    for g in range(1, 6):
        r = replay(matches, g)
        out = speculative_generate(target, draft, prompt, max_new_tokens=n, num_draft_tokens=g, eos_token_id=[])
        assert torch.equal(out.sequences[0, prompt.size(1):], answer)  # lossless, so the replay's premise holds
        assert r.blocks[g] == out.stats.verify_steps
        assert r.proposed == list(out.stats.per_position_drafted[:g]) + [0] * (g - len(out.stats.per_position_drafted))
        assert r.accepted == list(out.stats.per_position_accepted[:g]) + [0] * (g - len(out.stats.per_position_accepted))
        assert r.tokens == n


def test_replay_counts_by_hand():
    m = [True, True, False, True, False, False, True, True, True]
    r = replay(m, 3)
    # gamma 3: blocks at t=0 (draft 3, accept 2, emit 3), t=3 (accept 1, emit 2), t=5 (accept 0, emit 1), t=6 (2
    # tokens left but one: draft 2, accept 2, emit 3): 4 blocks
    assert r.blocks == {1: 6, 2: 4, 3: 4}
    assert r.proposed == [4, 3, 1] and r.accepted == [3, 2, 0]
    assert replay([], 2).blocks == {1: 0, 2: 0}
    with pytest.raises(ValueError, match="max_gamma"):
        replay(m, 0)


def test_summary_pools_over_prompts_with_intervals():
    reps = [replay([True] * 8, 4), replay([False] * 8, 4)]
    s = summarize_replays(reps, 4, samples=200, confidence=0.95, seed=0, key=("d", "x"))
    assert s["prompts"] == 2 and s["answer_tokens"] == 16
    assert s["alpha"][0] == pytest.approx(2 / (2 + 7))  # 2 first proposals accepted; 7 rejected (none at the end)
    assert s["tau"][1] == pytest.approx(16 / (4 + 8))
    lo, hi = s["alpha_ci"][0]
    assert 0 <= lo <= s["alpha"][0] <= hi <= 1


def test_near_duplicates_follow_rare_words():
    refs = ["What is (are) Glaucoma ?", "What are the symptoms of Diabetes ?", "How to prevent Glaucoma ?",
            "What causes Parkinson's disease?"] + [f"What is (are) {x} ?" for x in
                                                  "asthma cancer flu measles mumps anemia gout lupus".split()]
    ix = NearDuplicateIndex(refs, 0.7)
    assert ix.duplicate_of("what is (are) glaucoma?") == 0  # the same words
    assert ix.duplicate_of("What is Glaucoma?") == 0  # one common word fewer
    assert ix.duplicate_of("What causes Parkinson disease?") == 3
    assert ix.duplicate_of("What are the symptoms of Glaucoma ?") is None  # another rare word: another question
    assert ix.duplicate_of("Tell me a story about a dragon") is None
    assert ix.duplicate_of("!!!") is None
    with pytest.raises(ValueError, match="near_duplicate_jaccard"):
        NearDuplicateIndex(refs, 0)


def test_section_renders_and_records():
    rec = {"max_gamma": 2, "max_new_tokens": 8, "max_prompts": 2, "near_duplicate_jaccard": 0.7,
           "near_duplicates_removed": {"medical": 3}, "prompts": {"medical": 2},
           "drafts": {"d": {"medical": summarize_replays([replay([True, False, True], 2)], 2, samples=0,
                                                         confidence=0.95, seed=0, key=())}}}
    doc = {}
    md = HeldoutSection(rec)(doc)
    assert doc["heldout"] is rec and "| d | medical | 1 |" in md and "medical: 3" in md
    doc = {}
    assert "Not measured: off" in HeldoutSection(None, "off")(doc) and doc["heldout"] == {"skipped": "off"}


@pytest.mark.parametrize("kw", [{"max_prompts": 0}, {"train_prompts": -1}, {"max_new_tokens": 0}, {"max_gamma": 0},
                                {"batch_size": 0}, {"near_duplicate_jaccard": 0}, {"near_duplicate_jaccard": 1.5}])
def test_config_refuses_bad_values(kw):
    from eval.config import HeldoutConfig

    with pytest.raises(ValueError, match="eval.heldout." + next(iter(kw))):
        HeldoutConfig(**kw)


def test_a_domain_without_held_out_prompts_is_named_not_fatal():
    rec = {"max_gamma": 1, "max_new_tokens": 8, "max_prompts": 2, "near_duplicate_jaccard": 0.7,
           "near_duplicates_removed": {}, "skipped_domains": {"mine": "no test prompts"}, "prompts": {},
           "drafts": {"d": {}}}
    md = HeldoutSection(rec)({})
    assert "Not measured on mine: no test prompts" in md and md.index("Not measured") < md.index("| draft |")
