"""distill.drafts: layer-pruned self-drafts are exactly the target with some layers removed, standalone, loadable
by transformers and usable as its assistant_model; layer rules; greedy / beam search within its budget."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distill.drafts import (LayerChoice, LayerSearchConfig, build_layer_pruned, resolve_layers, search_layers,
                               search_evaluations_needed)
from tinymodels import tiny_llama

TARGET = tiny_llama(num_layers=5, seed=3)


def _reference_forward(target, layers: list[int], ids: torch.Tensor) -> torch.Tensor:
    """The target's own forward with only ``layers`` run (a deep copy with the other layers dropped)."""
    ref = copy.deepcopy(target)
    ref.model.layers = torch.nn.ModuleList([ref.model.layers[i] for i in layers])
    for new, layer in enumerate(ref.model.layers):
        layer.self_attn.layer_idx = new
    ref.config.num_hidden_layers = len(layers)
    with torch.no_grad():
        return ref(ids).logits


@settings(max_examples=12, deadline=None)
@given(layers=st.sets(st.integers(0, 4), min_size=1, max_size=4), seed=st.integers(0, 2 ** 16))
def test_pruned_model_is_the_target_without_the_other_layers(layers, seed):
    layers = sorted(layers)
    draft = build_layer_pruned(TARGET, layers)
    assert type(draft) is type(TARGET) and draft.config.num_hidden_layers == len(layers)
    assert [m.self_attn.layer_idx for m in draft.model.layers] == list(range(len(layers)))
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got = draft(ids).logits
    torch.testing.assert_close(got, _reference_forward(TARGET, layers, ids), rtol=0, atol=0)
    # weights are copies: training the draft never changes the target
    for (name, p) in draft.named_parameters():
        assert all(p.data_ptr() != q.data_ptr() for q in TARGET.parameters()), name


def test_keeping_every_layer_reproduces_the_target_and_cache_decoding_matches():
    full = build_layer_pruned(TARGET, list(range(5)))
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(full(ids).logits, TARGET(ids).logits, rtol=0, atol=0)
    draft = build_layer_pruned(TARGET, [1, 3])
    with torch.no_grad():  # the KV cache is indexed by the new layer numbers
        a = draft.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        b = draft.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(a, b)


def test_qwen2_layer_types_follow_the_kept_layers():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
                      sliding_window=8, use_sliding_window=True, max_window_layers=2)
    torch.manual_seed(0)
    target = Qwen2ForCausalLM(cfg).eval()
    draft = build_layer_pruned(target, [1, 2])
    assert draft.config.layer_types == ["sliding_attention", "full_attention"]
    assert draft.config.max_window_layers == 1
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = copy.deepcopy(target)
        ref.model.layers = torch.nn.ModuleList([ref.model.layers[i] for i in (1, 2)])
        for new, layer in enumerate(ref.model.layers):
            layer.self_attn.layer_idx = new
        ref.config = draft.config
        ref.model.config = draft.config
        torch.testing.assert_close(draft(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_unsupported_architecture_names_the_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32))
    with pytest.raises(ValueError, match="llama, mistral, qwen2, qwen3.*GPT2LMHeadModel"):
        build_layer_pruned(gpt2, [0])


def test_saved_self_draft_loads_with_auto_class_and_assists_transformers_generate(tmp_path):
    from transformers import AutoModelForCausalLM

    draft = build_layer_pruned(TARGET, [0, 4])
    draft.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.num_hidden_layers == 2
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, draft(ids).logits)
        assisted = TARGET.generate(ids, assistant_model=loaded, do_sample=False, max_new_tokens=12, pad_token_id=0)
        plain = TARGET.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(assisted, plain)


def test_layer_rules():
    assert resolve_layers(LayerChoice(method="first_k", k=2), 6) == [0, 1]
    assert resolve_layers(LayerChoice(method="every_nth", n=2), 6) == [0, 2, 4]
    assert resolve_layers(LayerChoice(method="list", indices=[5, 0]), 6) == [0, 5]
    with pytest.raises(ValueError, match="out of range: the target has 6 layers"):
        resolve_layers(LayerChoice(method="list", indices=[6]), 6)
    for k in (6, 99):  # the message names the k the user gave
        with pytest.raises(ValueError, match=f"draft.layers.k={k} would keep every layer: the target has 6 layers"):
            resolve_layers(LayerChoice(method="first_k", k=k), 6)
    with pytest.raises(ValueError, match="keeps 6 of the target's 6"):
        resolve_layers(LayerChoice(method="every_nth", n=1), 6)
    with pytest.raises(ValueError, match="draft.layers.method must be one of"):
        LayerChoice(method="last_k")
    with pytest.raises(ValueError, match="needs draft.layers.indices"):
        LayerChoice(method="list")
    with pytest.raises(ValueError, match="strategy must be one of greedy, beam"):
        LayerSearchConfig(strategy="annealing")


def _kept_layers(draft) -> tuple[int, ...]:
    """Which target layers a pruned draft holds (matched by their q_proj weights)."""
    out = []
    for layer in draft.model.layers:
        w = layer.self_attn.q_proj.weight
        out.append(next(i for i, t in enumerate(TARGET.model.layers) if torch.equal(t.self_attn.q_proj.weight, w)))
    return tuple(out)


def test_greedy_finds_the_best_subset_of_an_additive_score_and_beam_beats_greedy_on_a_trap():
    n, k = 5, 2
    gain = [0.1, 0.5, 0.2, 0.4, 0.3]
    found = search_layers(TARGET, lambda d: sum(gain[i] for i in _kept_layers(d)), k,
                          LayerSearchConfig(strategy="greedy", max_evaluations=100))
    assert found["layers"] == [1, 3] and found["evaluations"] == search_evaluations_needed(n, k, 1) == 9
    # a trap: layer 1 alone is best, but the best pair avoids it
    table = {c: 0.1 * sum(c) for r in (1, 2) for c in itertools.combinations(range(n), r)}
    table[(1,)] = 10.0
    table[(2,)] = 9.0
    table[(2, 4)] = 20.0
    score = lambda d: table[_kept_layers(d)]  # noqa: E731
    greedy = search_layers(TARGET, score, k, LayerSearchConfig(strategy="greedy", max_evaluations=100))
    beam = search_layers(TARGET, score, k, LayerSearchConfig(strategy="beam", beam_width=2, max_evaluations=100))
    assert greedy["layers"] != [2, 4] and beam["layers"] == [2, 4] and beam["score"] == 20.0
    assert beam["evaluations"] <= search_evaluations_needed(n, k, 2)
    # exhaustive check: the beam's answer is the true optimum here
    assert beam["score"] == max(v for c, v in table.items() if len(c) == k)


def test_search_refuses_a_budget_it_cannot_keep_before_measuring_anything():
    calls = []
    with pytest.raises(ValueError, match="measures up to 9 candidate subsets.*max_evaluations=5; raise it to 9"):
        search_layers(TARGET, lambda d: calls.append(1) or 0.0, 2, LayerSearchConfig(max_evaluations=5))
    assert not calls
    with pytest.raises(ValueError, match=r"k=5 must be in \[1, 5\)"):
        search_layers(TARGET, lambda d: 0.0, 5, LayerSearchConfig())


def test_search_with_measured_acceptance_on_tiny_models():
    """The real score: mean accepted length of greedy speculative decoding (distill.generation)."""
    from distill.generation import make_acceptance_eval

    prompts = [torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    score_fn = make_acceptance_eval(TARGET, prompts, num_draft_tokens=3, max_new_tokens=8)
    found = search_layers(TARGET, lambda d: score_fn(d)["mean_accepted_length"], 2,
                          LayerSearchConfig(max_evaluations=9))
    assert len(found["layers"]) == 2 and found["evaluations"] == 9
    assert found["score"] == max(t["score"] for t in found["trace"] if len(t["layers"]) == 2)
    assert 1.0 <= found["score"] <= 4.0


def test_expected_acceptance_is_one_minus_tvd_along_the_targets_own_continuations():
    """The search's default score: 1 for the target itself, the mean of sum_v min(p, q) over the generated positions
    for another draft (checked against a direct computation), and continuous, so it ranks drafts whose decoded tau
    would all be 1."""
    from decode import autoregressive_generate
    from distill.draft_init import expected_acceptance_score

    prompts = [torch.tensor([[3, 8, 1, 9]]), torch.tensor([[7, 7, 2]])]
    score = expected_acceptance_score(TARGET, prompts, max_new_tokens=6)
    assert score(TARGET) == pytest.approx(1.0, abs=1e-5)
    draft = build_layer_pruned(TARGET, [0, 4])
    total, n = 0.0, 0
    with torch.no_grad():
        for ids in prompts:
            seq = autoregressive_generate(TARGET, ids, max_new_tokens=6).sequences
            p = torch.softmax(TARGET(seq).logits[0, ids.size(1) - 1: -1], -1)
            q = torch.softmax(draft(seq).logits[0, ids.size(1) - 1: -1], -1)
            total += float(torch.minimum(p, q).sum())
            n += p.size(0)
    assert score(draft) == pytest.approx(total / n, rel=1e-5)
    assert 0.0 < score(draft) < 1.0
    found = search_layers(TARGET, score, 2, LayerSearchConfig(max_evaluations=9))
    assert found["score"] == max(e["score"] for e in found["trace"] if len(e["layers"]) == 2)
