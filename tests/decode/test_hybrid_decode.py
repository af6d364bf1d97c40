"""A lookup in front of a trained draft (decode/hybrid.py): greedy equal to the target alone for random targets,
drafts and prompts (batched with left padding and EOS, rows mixing lookup and model steps, every draft-length policy,
both forwards), sampling exactly the target's distribution when the proposer changes from step to step, the spec's
parsing and the wrapper's checks."""
from __future__ import annotations

import pytest
import torch

from decode_testutils import make_pair, pooled_chisquare_pvalue
from decode import autoregressive_generate, make_policy, process_logits, speculative_generate
from decode.common import left_pad
from decode.hybrid import HybridDraft, hybrid_generate, hybrid_name, hybrid_spec, parse_hybrid_spec
from decode.ngram import NgramDraft, parse_lookup_spec
from tinymodels import tiny_llama


def _prompts(g, n, vocab):
    """Prompts of which some repeat their own pieces (lookups match) and some are random (the model drafts)."""
    out = []
    for i in range(n):
        piece = torch.randint(6, vocab, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
        noise = torch.randint(6, vocab, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        out.append((piece * 3 + noise) if i % 2 == 0 else noise + piece)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_greedy_equals_the_target_for_random_pairs(seed):
    g = torch.Generator().manual_seed(seed)
    vocab = (16, 24, 48, 32)[seed]  # small vocabularies: the target's answers repeat, so lookups match
    target, model = make_pair(seed, noise=(0.3, 1.0, 0.05, 0.5)[seed], vocab_target=vocab)
    target.config.eos_token_id = 5
    ids, mask = left_pad(_prompts(g, 4, vocab), 0)
    eos = [5] if seed % 2 else []
    ref = autoregressive_generate(target, ids, mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    lookup_tokens = model_tokens = 0
    for kind in ("prompt_lookup", "suffix"):
        lookup = NgramDraft(kind, min_ngram=1 + seed % 2, max_ngram=3, min_share=0.4)
        if kind == "suffix":
            lookup.observe(ref.sequences[0, ids.shape[1]:].tolist())  # an earlier answer in the store
        draft = HybridDraft(lookup, model)
        for gamma, policy in ((1, None), (3, None), (5, None), (3, "adaptive"), (4, "confidence")):
            pol = (make_policy("adaptive", initial=gamma, max_draft_tokens=5) if policy == "adaptive" else
                   make_policy("confidence", max_draft_tokens=gamma, threshold=0.6) if policy else None)
            for fast in (None, False):
                out = speculative_generate(target, draft, ids, mask, max_new_tokens=20, num_draft_tokens=gamma,
                                           eos_token_id=eos, pad_token_id=0, draft_length_policy=pol, fast_path=fast)
                assert torch.equal(out.sequences, ref.sequences), (kind, gamma, policy, fast)
                assert torch.equal(out.num_new_tokens, ref.num_new_tokens)
                s = out.stats
                assert s.emitted_tokens == int(ref.num_new_tokens.sum()) and s.accepted_tokens <= s.drafted_tokens
                assert 0 <= s.lookup_drafted_tokens <= s.drafted_tokens
                lookup_tokens += s.lookup_drafted_tokens
                model_tokens += s.drafted_tokens - s.lookup_drafted_tokens
        # one prompt at a time gives the same tokens as the batch
        n = int(mask[1].sum())
        one = hybrid_generate(target, draft, ids[1:2, -n:], max_new_tokens=20, num_draft_tokens=3, eos_token_id=eos,
                              pad_token_id=0)
        k = int(ref.num_new_tokens[1])
        assert one.sequences[0, -20:][:k].tolist() == ref.sequences[1, -20:][:k].tolist()
    assert lookup_tokens > 0 and model_tokens > 0  # both proposers took steps
    with pytest.raises(ValueError, match="draft_tree"):
        speculative_generate(target, HybridDraft(NgramDraft(), model), ids, mask, max_new_tokens=2,
                             draft_tree="2,1")


class _Oracle(NgramDraft):
    """A lookup that knows the target's answers (``answers``: a prompt's first token -> (prompt length, answer)): it
    proposes the answer's next tokens in alternate stretches of ``stretch`` tokens and nothing in between (the model
    drafts there); rows of odd and even prompt lengths take opposite stretches, so a batch mixes the two."""

    def __init__(self, answers: dict, stretch: int):
        super().__init__("prompt_lookup")
        self.answers, self.stretch = answers, stretch

    def propose(self, hist, max_tokens):
        prompt_len, answer = self.answers[hist.tokens[0]]
        t = len(hist.tokens) - prompt_len
        if max_tokens <= 0 or (t // self.stretch + prompt_len) % 2 == 0:  # rows of odd and even prompts: opposite
            return [], []
        out = answer[t:t + max_tokens]
        return out, [1.0] * len(out)


@pytest.mark.parametrize("stretch", [2, 3, 7])
def test_the_model_catches_up_on_what_the_lookup_emitted(stretch):
    """The model is the target itself and the lookup is always right, so every drafted token is accepted exactly
    when the model's cache holds every token emitted while the lookup drafted (a stale cache drafts from a wrong
    context and is rejected); in a batch, rows of different prompt lengths switch proposers at different steps and
    catch up through holes."""
    target, model = make_pair(7, noise=0.0, vocab_target=40)
    prompts = [[9, 10, 11, 12, 13, 14], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37]]
    ids, mask = left_pad(prompts, 0)
    ref = autoregressive_generate(target, ids, mask, max_new_tokens=30, eos_token_id=[], pad_token_id=0)
    answers = {p[0]: (len(p), ref.sequences[i, ids.shape[1]:].tolist()) for i, p in enumerate(prompts)}
    for gamma in (1, 2, 4):
        for rows in ([0], [1], [2], [0, 1, 2]):
            batch = left_pad([prompts[r] for r in rows], 0)
            want = autoregressive_generate(target, *batch, max_new_tokens=30, eos_token_id=[], pad_token_id=0)
            out = hybrid_generate(target, HybridDraft(_Oracle(answers, stretch), model), *batch, max_new_tokens=30,
                                  num_draft_tokens=gamma, eos_token_id=[], pad_token_id=0)
            assert torch.equal(out.sequences, want.sequences)
            s = out.stats
            assert 0 < s.lookup_drafted_tokens < s.drafted_tokens, (stretch, gamma, rows)
            assert s.accepted_tokens == s.drafted_tokens, (stretch, gamma, rows, s.accepted_tokens, s.drafted_tokens)


V = 8
N = 4000


@torch.inference_mode()
def _joint(model, prompt, cfg) -> torch.Tensor:
    p1 = process_logits(model(prompt).logits[0, -1], **cfg)
    seqs = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], 1)
    p2 = process_logits(model(seqs).logits[:, -1], **cfg)
    return (p1[:, None] * p2).double()


@pytest.mark.parametrize("cfg", [dict(temperature=1.0), dict(temperature=0.7, top_k=5)], ids=["t1", "t0.7-top5"])
def test_sampling_keeps_the_target_distribution(cfg):
    pytest.importorskip("scipy.stats")
    target = tiny_llama(vocab_size=V, hidden_size=16, num_layers=1, seed=1)
    model = tiny_llama(vocab_size=V, hidden_size=16, num_layers=1, seed=2)  # a draft far from the target
    prompt = torch.tensor([[3, 7, 1, 3, 7, 1, 3]])  # "3" is followed by "7 1"; tokens never seen go to the model
    draft = HybridDraft(NgramDraft("prompt_lookup", min_ngram=1, max_ngram=2), model)
    joint = _joint(target, prompt, cfg)
    out = speculative_generate(target, draft, prompt.repeat(N, 1), max_new_tokens=3, num_draft_tokens=2,
                               do_sample=True, eos_token_id=[], generator=torch.Generator().manual_seed(5), **cfg)
    s = out.stats
    assert 0 < s.lookup_drafted_tokens < s.drafted_tokens  # both proposers drafted
    assert 0 < s.accepted_tokens < s.drafted_tokens
    x = out.sequences[:, 7] * V + out.sequences[:, 8]
    counts = torch.bincount(x, minlength=V * V).double()
    assert counts[joint.flatten() == 0].sum() == 0
    assert pooled_chisquare_pvalue(counts, joint, N) > 1e-4
    # the second token after a first token the lookup never saw is the model's proposal, verified: still p's
    for first in range(V):
        rows = out.sequences[:, 7] == first
        if int(rows.sum()) > 400:
            emp = torch.bincount(out.sequences[rows, 8], minlength=V).double() / rows.sum()
            exp = joint[first] / joint[first].sum()
            assert float((emp - exp).abs().max()) < 0.08, first


def test_specs_and_checks():
    spec = hybrid_spec("suffix", "/runs/a/drafts/distilled_int8")
    assert spec == "ngram:suffix+/runs/a/drafts/distilled_int8" and hybrid_name("suffix", "distilled") == \
        "suffix+distilled"
    assert parse_hybrid_spec(spec) == ("suffix", "/runs/a/drafts/distilled_int8")
    assert parse_lookup_spec(spec) is None  # not a lookup alone
    assert parse_hybrid_spec("ngram:suffix") is None and parse_hybrid_spec("/runs/x+y") is None
    with pytest.raises(ValueError, match="unknown lookup draft"):
        parse_hybrid_spec("ngram:bigram+/x")
    with pytest.raises(ValueError, match="names no trained draft"):
        parse_hybrid_spec("ngram:suffix+")
    target, model = make_pair(0, noise=0.1, vocab_target=16)
    with pytest.raises(ValueError, match="NgramDraft"):
        HybridDraft(model, model)
    with pytest.raises(ValueError, match="trained token draft"):
        HybridDraft(NgramDraft(), NgramDraft())
    with pytest.raises(ValueError, match="HybridDraft"):
        hybrid_generate(target, model, torch.tensor([[1, 2]]), max_new_tokens=2)
