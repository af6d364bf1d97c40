"""Token-tree drafting and verification (decode/tree.py): tree mask, cache compaction, greedy equality, stop rules,
full-depth acceptance, sampled distribution (chi-square), errors. Tiny real models, fixed seeds."""
from __future__ import annotations

import copy

import pytest
import torch

from decode_testutils import hf_greedy, make_pair, random_prompts
from tinymodels import tiny_family, tiny_llama
from decode import DynamicTokenTree, TokenTree, parse_draft_tree, process_logits, speculative_generate
from decode.common import new_kv_state
from decode.tree import _tree_forward

# ------------------------------------------------------------------------------------------------ tree mask


def _random_tree(branching, vocab, seed):
    """(tokens, parents) of a full static tree in breadth-first order, random tokens (repeats allowed)."""
    gen = torch.Generator().manual_seed(seed)
    tokens, parents, level = [], [], [-1]
    for b in branching:
        new = []
        for par in level:
            for _ in range(b):
                tokens.append(int(torch.randint(0, vocab, (1,), generator=gen)))
                parents.append(par)
                new.append(len(tokens) - 1)
        level = new
    return tokens, parents


def _path(parents, i):
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


@pytest.mark.parametrize("family,fast", [("llama", None), ("llama", False), ("mistral", None), ("mistral", False),
                                         ("gemma3", False)])
@torch.inference_mode()
def test_tree_mask_logits_equal_each_root_to_leaf_path_run_separately(family, fast):
    """Every node's logits from one tree forward equal the logits of its root-to-node path run as a plain sequence
    (no cache); then compacting one path into place and decoding one more token equals the plain sequence too.
    Mistral / Gemma-3 have a window of 4 (< prompt + depth), so the window is applied by position in the tree."""
    model = tiny_llama(vocab_size=48, seed=3) if family == "llama" else tiny_family(family, vocab_size=48, seed=3)
    prompt = random_prompts([7], 48, seed=9)[0]
    tokens, parents = _random_tree((3, 2, 2), 48, seed=4)
    state = new_kv_state(model, 1, torch.device("cpu"), 64, fast)
    assert state.fast == (fast is None)
    state.forward(prompt[None, :-1])
    start = state.length
    n = len(tokens)
    depth = [len(_path(parents, i)) for i in range(n)]
    allowed = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    allowed[:, 0] = True
    for i in range(n):
        allowed[1 + i, [1 + a for a in _path(parents, i)]] = True
    positions = [start] + [start + d for d in depth]
    logits = _tree_forward(state, [int(prompt[-1])] + tokens, positions, start, positions, allowed)  # (n+1, V)
    for i in range(-1, n):
        seq = torch.cat([prompt, torch.tensor([tokens[a] for a in _path(parents, i)], dtype=torch.long)])
        ref = model(seq[None]).logits[0, -1]
        torch.testing.assert_close(logits[1 + i], ref, atol=2e-5, rtol=1e-4)
    leaf = n - 1 - 2  # a leaf that is not the first child anywhere on its path: entries must move
    path = _path(parents, leaf)
    state.compact(start, [0] + [1 + a for a in path])
    assert state.length == start + 1 + len(path) and int(state.num_valid[0]) == state.length
    nxt = state.forward(torch.tensor([[5]]))[0, -1]
    seq = torch.cat([prompt, torch.tensor([tokens[a] for a in path] + [5])])
    torch.testing.assert_close(nxt, model(seq[None]).logits[0, -1], atol=2e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------------ greedy

SHAPES = [TokenTree((1,)), TokenTree((2, 2)), TokenTree((3, 2, 1)), TokenTree((4, 3, 2), max_nodes=10),
          TokenTree((3, 3, 3, 3), spine=True), DynamicTokenTree(depth=4, top_k=3, max_nodes=12)]


@pytest.fixture(scope="module")
def noisy_pair():
    target, draft = make_pair(seed=0, noise=0.3)
    prompts = random_prompts([5, 9], 64, seed=1)
    refs = [hf_greedy(target, p[None], torch.ones(1, len(p), dtype=torch.long), 18) for p in prompts]
    return target, draft, prompts, refs


@pytest.mark.parametrize("fast", [None, False], ids=["lean", "hf"])
@pytest.mark.parametrize("tree", SHAPES, ids=lambda t: t.spec())
def test_greedy_equals_target_greedy_for_any_tree(noisy_pair, tree, fast):
    target, draft, prompts, refs = noisy_pair
    taus = []
    for p, ref in zip(prompts, refs):
        out = speculative_generate(target, draft, p[None], max_new_tokens=18, draft_tree=tree, fast_path=fast)
        assert torch.equal(out.sequences, ref)
        assert out.stats.emitted_tokens == 18
        assert out.stats.nodes_verified <= tree.max_nodes * out.stats.verify_steps
        taus.append(out.stats.mean_accepted_length)
    assert max(taus) > 1.0  # the draft is accepted sometimes: the tree path is exercised


def _biased_draft(target, token: int):
    """The target's weights plus an lm_head bias that makes ``token`` the draft's top choice everywhere, so the
    target's choice is always the draft's *second* choice (a real model: the bias is part of lm_head)."""
    draft = copy.deepcopy(target)
    head = torch.nn.Linear(draft.lm_head.in_features, draft.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(draft.lm_head.weight)
        head.bias.zero_()
        head.bias[token] = 1e4
    draft.lm_head = head
    return draft.eval()


def test_right_token_only_ever_second_sibling():
    target = tiny_llama(vocab_size=64, seed=2)
    prompt = random_prompts([6], 64, seed=3)[0][None]
    ref = hf_greedy(target, prompt, torch.ones_like(prompt), 17)
    z = next(t for t in range(64) if t not in ref[0].tolist())  # never the target's choice
    draft = _biased_draft(target, z)
    chain = speculative_generate(target, draft, prompt, max_new_tokens=17, draft_tree=TokenTree((1, 1, 1)))
    assert torch.equal(chain.sequences, ref) and chain.stats.accepted_tokens == 0  # top-1 is always wrong
    out = speculative_generate(target, draft, prompt, max_new_tokens=17, draft_tree=TokenTree((2, 2, 2)))
    assert torch.equal(out.sequences, ref)
    # every step accepts the full depth 3 via second siblings: 4 + 4 + 4 + 4 + 1 (the last step is capped)
    assert out.stats.accepted_length_histogram == [1, 0, 0, 4]
    dyn = speculative_generate(target, draft, prompt, max_new_tokens=17,
                               draft_tree=DynamicTokenTree(depth=3, top_k=2, max_nodes=14))
    # the dynamic tree expands the 2 most probable paths per depth (the draft's always include z), so it reaches
    # the right token at depth 1 on every step but not necessarily deeper
    assert torch.equal(dyn.sequences, ref) and dyn.stats.accepted_length_histogram[0] == 0


@pytest.mark.parametrize("tree", [TokenTree((2, 2, 2)), TokenTree((3, 1, 1, 1)),
                                  DynamicTokenTree(depth=3, top_k=2, max_nodes=10)], ids=lambda t: t.spec())
def test_identical_draft_accepts_the_full_depth(tree):
    target = tiny_llama(vocab_size=64, seed=4)
    prompt = random_prompts([5], 64, seed=5)[0][None]
    n = 3 * (tree.depth + 1)
    out = speculative_generate(target, target, prompt, max_new_tokens=n, draft_tree=tree)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, torch.ones_like(prompt), n))
    assert out.stats.verify_steps == 3 and out.stats.accepted_tokens == 3 * tree.depth
    assert out.stats.per_position_acceptance == [1.0] * tree.depth


def test_eos_and_max_new_tokens_inside_an_accepted_path():
    target = tiny_llama(vocab_size=64, seed=6)
    prompt = random_prompts([5], 64, seed=7)[0][None]
    ones = torch.ones_like(prompt)
    ref = hf_greedy(target, prompt, ones, 16)[0, 5:].tolist()
    # an EOS that first appears in the middle of the second step's path (steps emit 4 tokens: indices 4..7)
    j = next(j for j in range(5, 7) if ref[j] not in ref[:j])
    eos = ref[j]
    tree = TokenTree((2, 2, 2))
    out = speculative_generate(target, target, prompt, max_new_tokens=16, draft_tree=tree, eos_token_id=eos,
                               pad_token_id=0)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, ones, 16, eos_token_id=eos, pad_token_id=0))
    assert int(out.num_new_tokens[0]) == j + 1 and out.stats.verify_steps == 2
    # max_new_tokens = 6: the second step drafts depth 1 only and stops exactly at 6
    out = speculative_generate(target, target, prompt, max_new_tokens=6, draft_tree=tree)
    assert out.sequences[0, 5:].tolist() == ref[:6] and int(out.num_new_tokens[0]) == 6
    assert out.stats.draft_lengths == [3, 1] and out.stats.emitted_tokens == 6


# ------------------------------------------------------------------------------------------------ sampling
scipy_stats = pytest.importorskip("scipy.stats")
V = 6
N = 300
ALPHA = 1e-4
PROMPT = torch.tensor([[3, 5, 1]])


@torch.inference_mode()
def _exact_joint(model, cfg) -> torch.Tensor:
    """``(V, V)`` float64: p(x1) p(x2 | x1) after the shared sampling pipeline."""
    p1 = process_logits(model(PROMPT).logits[0, -1], **cfg)
    seqs = torch.cat([PROMPT.repeat(V, 1), torch.arange(V)[:, None]], 1)
    return (p1[:, None] * process_logits(model(seqs).logits[:, -1], **cfg)).double()


def _pvalue(counts, probs) -> float:
    """Chi-square goodness of fit; cells with expected count < 5 merged into one, zero-probability cells left out
    (their counts are asserted to be 0 separately)."""
    expected = probs.flatten() * counts.sum()
    big = expected >= 5
    small = ~big & (expected > 0)
    obs, exp = counts[big], expected[big]
    if small.any():
        obs = torch.cat([obs, counts[small].sum()[None]])
        exp = torch.cat([exp, expected[small].sum()[None]])
    return float(scipy_stats.chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue)


@pytest.mark.parametrize("tree,cfg", [
    (TokenTree((2, 2)), dict(temperature=1.0)),
    (TokenTree((3, 1)), dict(temperature=0.8, top_k=6)),
    (DynamicTokenTree(depth=2, top_k=3, max_nodes=6), dict(temperature=1.2, top_p=0.9)),
], ids=["2,2", "3,1-topk", "dynamic-topp"])
def test_sampled_first_two_tokens_follow_the_target_exactly(tree, cfg):
    """The first two new tokens of N = 300 single-prompt calls (3 new tokens, so the first step's tree is never
    capped and both tokens can come from one accepted path) follow the target's exact joint p(x1) p(x2 | x1)
    (chi-square, V = 6: 36 cells). False failure: the test fails when p < 1e-4, i.e. with probability 1e-4 for a
    correct decoder (3 checks: < 3e-4 per run; deterministic under the fixed seed). Power: the same counts must
    reject the draft's own joint (p < 1e-4), and some but not all first candidates are rejected."""
    target = tiny_llama(vocab_size=V, hidden_size=16, num_layers=1, seed=1)
    draft = tiny_llama(vocab_size=V, hidden_size=16, num_layers=1, seed=5)
    gen = torch.Generator().manual_seed(11)
    counts = torch.zeros(V * V, dtype=torch.float64)
    first_step_rejected = 0
    for _ in range(N):
        out = speculative_generate(target, draft, PROMPT, max_new_tokens=3, draft_tree=tree, do_sample=True,
                                   generator=gen, **cfg)
        counts[int(out.sequences[0, 3]) * V + int(out.sequences[0, 4])] += 1
        first_step_rejected += out.stats.accepted_length_histogram[0] > 0  # some step accepted no node
    joint = _exact_joint(target, cfg)
    assert counts[joint.flatten() == 0].sum() == 0
    assert _pvalue(counts, joint) > ALPHA
    assert _pvalue(counts, _exact_joint(draft, cfg)) < ALPHA
    assert 0.02 * N < first_step_rejected < 0.98 * N


# ------------------------------------------------------------------------------------------------ errors / specs
def test_batch_with_a_tree_is_refused_with_the_fix():
    target, draft = make_pair(seed=0, noise=0.3)
    with pytest.raises(ValueError, match="batch size 1 only .*draft_tree=None"):
        speculative_generate(target, draft, torch.ones(2, 4, dtype=torch.long), max_new_tokens=4,
                             draft_tree=TokenTree((2, 2)))


def test_tree_specs_parse_and_bad_shapes_are_refused():
    assert parse_draft_tree("3,2,1") == TokenTree((3, 2, 1)) and TokenTree((3, 2, 1)).max_nodes == 15
    assert parse_draft_tree([2, 2]) == TokenTree((2, 2))
    assert parse_draft_tree("4,2/6").max_nodes == 6 and parse_draft_tree("4,2/6").spec() == "4,2/6"
    assert parse_draft_tree("dynamic:5,4,20") == DynamicTokenTree(5, 4, 20)
    spine = parse_draft_tree("spine:3,3,2")
    assert spine == TokenTree((3, 3, 2), spine=True) and spine.max_nodes == 8 and spine.spec() == "spine:3,3,2"
    assert parse_draft_tree(None) is None and parse_draft_tree("") is None
    for spec in ("3,0", "a,b", "dynamic:5,4", [], "3,2/0"):
        with pytest.raises(ValueError, match="draft tree|branching|max_nodes"):
            parse_draft_tree(spec)
    with pytest.raises(ValueError, match="depth must be an int >= 1"):
        DynamicTokenTree(depth=0)
