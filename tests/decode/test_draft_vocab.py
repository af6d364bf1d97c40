"""Trimmed draft vocabularies (models/vocab.py): a draft head over N of the target's V ids stays lossless.

Greedy: speculative output equals target-only greedy for random target/draft pairs, random kept-set sizes (kept
sets that miss the target's argmax included), gamma 1-5, batch 1 and left-padded batches, on the lean forward and on
transformers' own. Sampling: the first token's distribution equals the target's by a chi-square test, including the
tokens outside the kept set (which only the residual max(0, p - q) can emit).

False-failure probability of the chi-square checks: each fails when p < 1e-4 (3 checks: < 3e-4 per run, and the
generator seed is fixed, so the outcome is deterministic). Power: the same test must reject the draft's own
distribution and the target's distribution restricted to the kept set (p < 1e-4), so the sample is large enough to
see a decoder that never emits an outside token.
"""
from __future__ import annotations

import copy

import pytest
import torch
from decode_testutils import hf_greedy, left_pad, make_pair, random_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.vocab import (TrimmedLMHead, draft_labels, full_vocab_head, install_trimmed_head, kept_token_ids,
                              trimmed_logits)
from decode import autoregressive_generate, process_logits, speculative_generate
from tinymodels import tiny_llama

SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
V = 64


def trimmed(draft, ids):
    d = copy.deepcopy(draft)
    install_trimmed_head(d, torch.as_tensor(sorted(set(ids)), dtype=torch.long))
    return d.eval()


def kept_set(seed: int, n: int, drop: list[int] = ()) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    pool = [i for i in torch.randperm(V, generator=gen).tolist() if i not in set(drop)]
    return sorted(pool[:n])


def test_trimmed_head_shapes_and_minus_inf_outside():
    _, draft = make_pair(3, 0.3)
    ids = kept_set(1, 10)
    d = trimmed(draft, ids)
    head = d.get_output_embeddings()
    assert isinstance(head, TrimmedLMHead) and head.num_kept == 10 and head.out_features == V
    x = torch.tensor([[1, 2, 3]])
    full = d(x).logits  # eval mode: (1, 3, V)
    assert full.shape == (1, 3, V)
    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(full[..., outside]).all() and (full[..., outside] < 0).all()
    torch.testing.assert_close(full[..., ids], draft(x).logits[..., ids], rtol=0, atol=1e-6)  # same rows
    with trimmed_logits(d):
        assert d(x).logits.shape == (1, 3, 10)
    d.train()
    assert d(x).logits.shape == (1, 3, 10)
    labels = torch.tensor([ids[0], ids[3], -100, next(i for i in range(V) if i not in ids)])
    assert draft_labels(d, labels).tolist() == [0, 3, -100, -100]
    assert draft_labels(draft, labels) is labels


def test_kept_token_ids_counts_then_forced_then_id_order():
    counts = torch.zeros(20)
    counts[[7, 3, 11]] = torch.tensor([5.0, 9.0, 1.0])
    assert kept_token_ids(counts, 4, forced=[19]).tolist() == [3, 7, 11, 19]
    assert kept_token_ids(counts, 5).tolist() == [0, 1, 3, 7, 11]  # never-seen ids fill in id order
    with pytest.raises(ValueError, match="draft_vocab_size"):
        kept_token_ids(counts, 21)
    with pytest.raises(ValueError, match="special tokens"):
        kept_token_ids(counts, 1, forced=[1, 2])


@settings(max_examples=14, **SETTINGS)
@given(
    seed=st.integers(0, 10_000),
    noise=st.sampled_from([0.0, 0.3, 1.0]),
    n_kept=st.integers(1, V),
    miss_argmax=st.booleans(),
    num_draft_tokens=st.integers(1, 5),
    max_new_tokens=st.integers(1, 16),
    fast=st.booleans(),
)
def test_trimmed_greedy_b1_matches_target(seed, noise, n_kept, miss_argmax, num_draft_tokens, max_new_tokens, fast):
    target, draft = make_pair(seed, noise)
    (ids,) = random_prompts([1 + seed % 7], V, seed)
    ids = ids[None]
    ref = hf_greedy(target, ids, torch.ones_like(ids), max_new_tokens)
    # a kept set without the target's first greedy token: that token can only come from the target's residual
    drop = [int(ref[0, ids.shape[1]])] if miss_argmax and n_kept < V else []
    d = trimmed(draft, kept_set(seed, min(n_kept, V - len(drop)), drop))
    sp = speculative_generate(target, d, ids, max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens,
                              fast_path=None if fast else False)
    assert torch.equal(sp.sequences, ref)
    assert sp.num_new_tokens.tolist() == [max_new_tokens]


@settings(max_examples=4, **SETTINGS)
@given(seed=st.integers(0, 10_000), n_kept=st.integers(2, V - 1), num_draft_tokens=st.integers(1, 5),
       lengths=st.lists(st.integers(1, 9), min_size=3, max_size=3))
def test_trimmed_greedy_left_padded_batch_matches_target(seed, n_kept, num_draft_tokens, lengths):
    target, draft = make_pair(seed, 0.3)
    ids, mask = left_pad(random_prompts(lengths, V, seed))
    ref = hf_greedy(target, ids, mask, 10)
    d = trimmed(draft, kept_set(seed + 1, n_kept))
    sp = speculative_generate(target, d, ids, mask, max_new_tokens=10, num_draft_tokens=num_draft_tokens)
    assert torch.equal(sp.sequences, ref)


def test_trimmed_draft_never_proposes_an_outside_id():
    target, draft = make_pair(5, 0.0)  # identical weights: the untrimmed draft is always accepted
    ids = torch.tensor([[4, 9, 1]])
    ref = autoregressive_generate(target, ids, max_new_tokens=24).sequences[0, 3:].tolist()
    kept = sorted(set(range(V)) - {ref[0], ref[5]})
    d = trimmed(draft, kept)
    draft_greedy = autoregressive_generate(d, ids, max_new_tokens=24).sequences[0, 3:].tolist()
    assert set(draft_greedy) <= set(kept)  # -inf outside: never its argmax
    sp = speculative_generate(target, d, ids, max_new_tokens=24, num_draft_tokens=4)
    assert sp.sequences[0, 3:].tolist() == ref  # the outside tokens still come out, from the target


@pytest.fixture(scope="module")
def sampling_pair():
    target = tiny_llama(vocab_size=12, hidden_size=16, num_layers=1, seed=1)
    draft = tiny_llama(vocab_size=12, hidden_size=16, num_layers=1, seed=5)
    return target, draft


@pytest.mark.parametrize("cfg", [dict(num_draft_tokens=1), dict(num_draft_tokens=3, temperature=0.8, top_k=8),
                                 dict(num_draft_tokens=2, temperature=1.4, top_p=0.9)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_trimmed_sampling_first_token_matches_target(sampling_pair, cfg):
    scipy_stats = pytest.importorskip("scipy.stats")
    target, draft = sampling_pair
    cfg = dict(cfg)
    gamma = cfg.pop("num_draft_tokens")
    prompt = torch.tensor([[3, 7, 1]])
    with torch.inference_mode():
        p = process_logits(target(prompt).logits[0, -1], **cfg).double()  # (12,)
    # keep the half of the ids the target likes least, so most of its mass lies outside the kept set
    kept = torch.argsort(p)[:6].sort().values
    assert p[kept].sum() < 0.5
    d = trimmed(draft, kept.tolist())
    n = 6000
    out = speculative_generate(target, d, prompt.repeat(n, 1), max_new_tokens=1, num_draft_tokens=gamma,
                               do_sample=True, generator=torch.Generator().manual_seed(99), **cfg)
    counts = torch.bincount(out.sequences[:, 3], minlength=12).double()
    assert counts[p == 0].sum() == 0

    def pvalue(probs):
        if counts[probs == 0].sum() > 0:  # a sample the distribution cannot produce
            return 0.0
        big = probs * n >= 5
        obs = torch.cat([counts[big], counts[~big].sum()[None]])
        exp = torch.cat([probs[big] * n, (probs[~big].sum() * n)[None]])
        keep = exp > 0
        obs, exp = obs[keep], exp[keep]
        return float(scipy_stats.chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue)

    assert pvalue(p) > 1e-4
    restricted = torch.zeros_like(p)
    restricted[kept] = p[kept] / p[kept].sum()
    assert pvalue(restricted) < 1e-4  # power: a decoder that only emits kept ids would fail


def test_full_vocab_export_decodes_like_trimmed(tmp_path, sampling_pair):
    from transformers import AutoModelForCausalLM

    from models.checkpoints import load_causal_lm
    from models.vocab import draft_vocab_record
    from models.checkpoints import save_hf_atomic

    target, draft = make_pair(11, 0.3)
    kept = kept_set(4, 20)
    d = trimmed(draft, kept)
    meta = {"kind": "distilled", "draft_vocab": draft_vocab_record(d.get_output_embeddings(), counted_on="test")}
    save_hf_atomic(d, None, tmp_path / "draft", extra=meta)
    assert isinstance(d.get_output_embeddings(), TrimmedLMHead)  # restored after saving
    export = AutoModelForCausalLM.from_pretrained(tmp_path / "draft").eval()
    assert export.lm_head.weight.shape == (V, 32)
    outside = [i for i in range(V) if i not in kept]
    assert (export.lm_head.weight[outside] == 0).all()
    assert sorted(export.generation_config.suppress_tokens) == outside
    prompt = torch.tensor([[5, 17, 2, 40]])
    ours = autoregressive_generate(d, prompt, max_new_tokens=20).sequences
    # transformers' generate on the export alone: suppress_tokens keeps it on the kept ids, token for token
    hf = export.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=20,
                         min_new_tokens=20, pad_token_id=0, eos_token_id=None)
    assert torch.equal(hf, ours)
    # our loader turns the export back into the trimmed draft: same logits over the kept ids, -inf elsewhere
    loaded, _ = load_causal_lm(tmp_path / "draft", role="draft", need_tokenizer=False)
    assert isinstance(loaded.get_output_embeddings(), TrimmedLMHead)
    torch.testing.assert_close(loaded(prompt).logits, d(prompt).logits)
    a = speculative_generate(target, loaded, prompt, max_new_tokens=20, num_draft_tokens=3)
    b = speculative_generate(target, d, prompt, max_new_tokens=20, num_draft_tokens=3)
    assert torch.equal(a.sequences, b.sequences) and a.stats.accepted_tokens == b.stats.accepted_tokens
    # as transformers' assistant_model the export keeps the target's greedy output
    assisted = target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=export,
                               do_sample=False, max_new_tokens=20, min_new_tokens=20, pad_token_id=0,
                               eos_token_id=None)
    assert torch.equal(assisted, hf_greedy(target, prompt, torch.ones_like(prompt), 20))
    with full_vocab_head(draft) as outside_ids:  # a full-vocabulary draft is saved as it is
        assert outside_ids == []


def test_weights_read_per_token_counts_a_lookup_embedding_as_rows_not_as_a_matrix():
    """The memory-bound deployment c reads these counts: an untied input embedding is a lookup (not read whole), a
    head tied to it is read whole, a trimmed head counts its kept rows."""
    from decode.timing import weights_read_per_token
    from tinymodels import tiny_family_lm

    untied = tiny_llama(vocab_size=V, hidden_size=32, num_layers=1)
    total = sum(p.numel() for p in untied.parameters())
    assert weights_read_per_token(untied) == total - V * 32
    tied = tiny_family_lm("llama", vocab_size=V, tie_word_embeddings=True)
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    assert weights_read_per_token(tied) == sum(p.numel() for p in tied.parameters())
    d = trimmed(untied, list(range(10)))
    assert weights_read_per_token(d) == total - 2 * V * 32 + 10 * 32
    assert weights_read_per_token(d, in_bytes=True) == 4 * weights_read_per_token(d)


@pytest.mark.parametrize("edit", [
    {"draft_to_target": [0, 3, 64]},          # out of range
    {"draft_to_target": [0, None, 5]},        # not an id
    {"draft_to_target": [0, "3", 5]},
    {"draft_to_target": [0, 3.7, 5.2]},      # floats are not ids (never truncated)
    {"draft_to_target": [False, True]},
    {"draft_to_target": [5, 3]},              # unsorted
    {"draft_to_target": [3, 3]},              # repeated
    {"size": 99},                             # size and list disagree
    {"target_vocab_size": 1000},
])
def test_a_damaged_draft_vocab_record_is_one_clear_error(tmp_path, edit):
    import json

    from models.checkpoints import CheckpointError, load_causal_lm
    from models.vocab import draft_vocab_record
    from models.checkpoints import save_hf_atomic

    d = trimmed(tiny_llama(vocab_size=V, hidden_size=32, num_layers=1), [0, 3, 5, 9])
    save_hf_atomic(d, None, tmp_path / "d", extra={"kind": "distilled",
                                                   "draft_vocab": draft_vocab_record(d.get_output_embeddings())})
    meta = json.loads((tmp_path / "d" / "specdraft.json").read_text())
    meta["draft_vocab"].update(edit)
    (tmp_path / "d" / "specdraft.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"draft_vocab .*(restore it|remove the draft_vocab field)"):
        load_causal_lm(tmp_path / "d", role="draft", need_tokenizer=False)
