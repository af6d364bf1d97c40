"""Lookup drafts (decode/ngram.py): the matching rules and their edge cases (no match, a match at the end of the
text, n larger than the text, the suffix store's share threshold, bound and domains), then the decoder: greedy
equal to the target alone for random targets and prompts (batched with left padding and EOS, every draft-length
policy, both target forwards), and sampling exactly the target's distribution (one-hot drafts)."""
from __future__ import annotations

import pytest
import torch

from tinymodels import tiny_llama
from decode_testutils import pooled_chisquare_pvalue
from decode import autoregressive_generate, make_policy, process_logits, speculative_generate
from decode.common import left_pad
from decode.ngram import NgramDraft, NgramIndex, ngram_generate, parse_lookup_spec


def propose(draft, text, k=4):
    return draft.propose(draft.history(text), k)[0]


def test_prompt_lookup_matching_rules():
    d = NgramDraft("prompt_lookup", min_ngram=1, max_ngram=3)
    assert propose(d, [1, 2, 3, 4]) == []  # no token repeats: nothing to copy, a plain target step
    assert propose(d, [5, 1, 2, 3, 9, 9, 1, 2]) == [3, 9, 9, 1]  # the longest n (2: "1 2") and what followed it
    assert propose(d, [5, 1, 2, 3, 9, 9, 1, 2], k=2) == [3, 9]  # at most the step's draft length
    assert propose(d, [1, 2, 7, 1, 2, 8, 1, 2]) == [8, 1, 2]  # the most recent earlier occurrence
    assert propose(d, [4, 4, 4]) == [4]  # the match ending one token before the end: it copies up to the end
    assert propose(d, [1, 2, 1]) == [2, 1]  # a match at the end of the text continues into the text's own end
    assert propose(d, [1, 2, 1], k=0) == []
    long = NgramDraft("prompt_lookup", min_ngram=3, max_ngram=5)
    assert propose(long, [1, 2]) == []  # n larger than the text
    assert propose(long, [1, 2, 1, 2]) == []  # only a 2-gram repeats: below min_ngram
    assert propose(long, [7, 1, 2, 3, 8, 1, 2, 3]) == [8, 1, 2, 3]
    assert propose(d, []) == []
    idx = NgramIndex(1, 2, [1, 2, 1])
    assert idx.ends((1,)) == [1, 3] and idx.ends((2, 1)) == [3] and idx.ends((3,)) == []


def test_suffix_store_share_bound_and_domains():
    d = NgramDraft("suffix", min_ngram=1, max_ngram=2, min_share=0.6, max_store_tokens=12)
    assert propose(d, [1, 2]) == []  # an empty store and no repeat
    d.observe([1, 2, 3, 4])
    assert propose(d, [9, 1, 2]) == [3, 4]  # the store's answer continues the text
    d.observe([1, 2, 3, 5])
    toks, conf = d.propose(d.history([9, 1, 2]), 4)
    assert toks == [3] and conf == [1.0]  # 4 and 5 each follow half of the occurrences: below min_share
    d.observe([1, 2, 3, 5])
    toks, conf = d.propose(d.history([9, 1, 2]), 4)
    assert toks == [3, 5] and conf[1] == pytest.approx(2 / 3)
    d.observe([7, 7, 7, 7, 7, 7, 7, 7, 7, 7])  # over max_store_tokens: the oldest answers go first
    assert sum(len(a) for a in d._stores["default"]) <= 14 and propose(d, [9, 1, 2]) == []
    d.use_domain("code")
    assert propose(d, [8, 7]) == []  # another domain's store
    d.observe([8, 7, 6])
    assert propose(d, [8, 7]) == [6]
    d.use_domain("default")
    assert propose(d, [0, 7]) == [7, 7, 7, 7]
    d.clear_store()
    assert propose(d, [0, 7]) == []
    # the text's own repeats count as occurrences beside the store's
    assert propose(NgramDraft("suffix", min_ngram=1, max_ngram=2), [1, 2, 3, 1, 2]) == [3, 1, 2]
    prompt_lookup = NgramDraft("prompt_lookup", min_ngram=1)
    prompt_lookup.observe([1, 2, 3])  # only the suffix kind keeps a store
    assert propose(prompt_lookup, [0, 1, 2]) == []


def test_settings_are_checked():
    for kw, msg in ((dict(kind="bigram"), "kind"), (dict(min_ngram=3, max_ngram=2), "min_ngram"),
                    (dict(min_ngram=0), "min_ngram"), (dict(min_share=0), "min_share"),
                    (dict(max_occurrences=0), "max_occurrences")):
        with pytest.raises(ValueError, match=msg):
            NgramDraft(**kw)
    assert parse_lookup_spec("ngram:suffix") == "suffix" and parse_lookup_spec("/runs/drafts/distilled") is None
    with pytest.raises(ValueError, match="ngram:prompt_lookup"):
        parse_lookup_spec("ngram:bigram")


def _repetitive_prompts(g, n, vocab):
    """Prompts that repeat their own pieces, so lookups match (and often miss: a random target rarely copies)."""
    out = []
    for _ in range(n):
        piece = torch.randint(6, vocab, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
        noise = torch.randint(6, vocab, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
        out.append((piece * 3 + noise)[: int(torch.randint(1, 14, (1,), generator=g))])
    return out


@pytest.mark.parametrize("seed", range(4))
def test_greedy_equals_the_target_for_random_targets(seed):
    g = torch.Generator().manual_seed(seed)
    vocab = (12, 24, 48, 16)[seed]  # small vocabularies: the target's own answers repeat, lookups are accepted
    target = tiny_llama(vocab_size=vocab, hidden_size=32, num_layers=2, seed=seed, eos_token_id=5)
    prompts = _repetitive_prompts(g, 3, vocab)
    ids, mask = left_pad(prompts, 0)
    eos = [5] if seed % 2 else []
    ref = autoregressive_generate(target, ids, mask, max_new_tokens=24, eos_token_id=eos, pad_token_id=0)
    accepted = 0
    for kind in ("prompt_lookup", "suffix"):
        draft = NgramDraft(kind, min_ngram=1 + seed % 2, max_ngram=3, min_share=0.4)
        if kind == "suffix":
            draft.observe(ref.sequences[0, ids.shape[1]:].tolist())  # an earlier answer in the store
        for gamma, policy in ((1, None), (3, None), (6, None), (3, "adaptive"), (4, "confidence")):
            pol = (make_policy("adaptive", initial=gamma, max_draft_tokens=6) if policy == "adaptive" else
                   make_policy("confidence", max_draft_tokens=gamma, threshold=0.7) if policy else None)
            for fast in (None, False):
                out = speculative_generate(target, draft, ids, mask, max_new_tokens=24, num_draft_tokens=gamma,
                                           eos_token_id=eos, pad_token_id=0, draft_length_policy=pol, fast_path=fast)
                assert torch.equal(out.sequences, ref.sequences), (kind, gamma, policy, fast)
                assert torch.equal(out.num_new_tokens, ref.num_new_tokens)
                s = out.stats
                assert s.emitted_tokens == int(ref.num_new_tokens.sum()) and s.accepted_tokens <= s.drafted_tokens
                accepted += s.accepted_tokens
        # one prompt at a time gives the same tokens as the batch
        one = ngram_generate(target, draft, ids[1:2, -int(mask[1].sum()):], max_new_tokens=24, num_draft_tokens=3,
                             eos_token_id=eos, pad_token_id=0)
        n = int(ref.num_new_tokens[1])
        assert one.sequences[0, -24:][:n].tolist() == ref.sequences[1, -24:][:n].tolist()
    assert accepted > 0  # the lookups were used, not only zero-length steps
    with pytest.raises(ValueError, match="draft_tree"):
        speculative_generate(target, NgramDraft(), ids, mask, max_new_tokens=2, draft_tree="2,1")


def test_no_match_is_a_plain_target_step():
    target = tiny_llama(vocab_size=64, hidden_size=32, num_layers=2, seed=3)
    ids = torch.arange(10, 20)[None]  # no token repeats
    draft = NgramDraft("prompt_lookup", min_ngram=3, max_ngram=4)
    out = ngram_generate(target, draft, ids, max_new_tokens=1, num_draft_tokens=4, eos_token_id=[])
    assert out.stats.drafted_tokens == 0 and out.stats.verify_steps == 1
    ref = autoregressive_generate(target, ids, max_new_tokens=1, eos_token_id=[])
    assert torch.equal(out.sequences, ref.sequences)
    assert ngram_generate(target, draft, ids, max_new_tokens=0).sequences.shape == ids.shape


V = 8
N = 4000


@torch.inference_mode()
def _joint(model, prompt, cfg) -> torch.Tensor:
    p1 = process_logits(model(prompt).logits[0, -1], **cfg)
    seqs = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], 1)
    p2 = process_logits(model(seqs).logits[:, -1], **cfg)
    return (p1[:, None] * p2).double()


@pytest.mark.parametrize("kind,cfg", [("prompt_lookup", dict(temperature=1.0)),
                                      ("suffix", dict(temperature=0.7, top_k=5))], ids=["prompt_lookup", "suffix"])
def test_sampling_keeps_the_target_distribution(kind, cfg):
    pytest.importorskip("scipy.stats")
    target = tiny_llama(vocab_size=V, hidden_size=16, num_layers=1, seed=1)
    prompt = torch.tensor([[3, 7, 1, 3, 7, 1, 3]])  # "3" is followed by "7 1": the lookup proposes them
    draft = NgramDraft(kind, min_ngram=1, max_ngram=2, min_share=0.3)
    joint = _joint(target, prompt, cfg)
    out = speculative_generate(target, draft, prompt.repeat(N, 1), max_new_tokens=3, num_draft_tokens=3,
                               do_sample=True, eos_token_id=[], generator=torch.Generator().manual_seed(11), **cfg)
    s = out.stats
    assert s.accepted_tokens > 0 and s.accepted_tokens < s.drafted_tokens  # accepted and rejected both
    x = out.sequences[:, 7] * V + out.sequences[:, 8]
    counts = torch.bincount(x, minlength=V * V).double()
    assert counts[joint.flatten() == 0].sum() == 0
    assert pooled_chisquare_pvalue(counts, joint, N) > 1e-4
    # power: accepting the proposal "7" more often than the target emits it would show; the target is far from it
    p7 = float(joint.sum(1)[7])
    assert p7 < 0.9 and abs(float((out.sequences[:, 7] == 7).double().mean()) - p7) < 0.03
