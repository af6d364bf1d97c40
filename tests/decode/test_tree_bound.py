"""scripts/tree_bound.py: Sequoia's dynamic programme against every tree enumerated by hand (random rank
distributions), its chain special case, and the rank distribution measured on real tiny models."""
from __future__ import annotations

import copy
import functools
import importlib.util
from pathlib import Path

import pytest
import torch
from decode_testutils import make_pair
from hypothesis import given, settings
from hypothesis import strategies as st

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tree_bound.py"


@pytest.fixture(scope="module")
def tb():
    spec = importlib.util.spec_from_file_location("tree_bound_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.lru_cache(maxsize=None)
def forests(n: int, d: int) -> tuple:
    """Every ordered forest (the k-th tree hangs under the draft's k-th likeliest token) of exactly ``n`` nodes and
    depth <= ``d``; a tree is the forest of its children."""
    if n == 0:
        return ((),)
    if d == 0:
        return ()
    out = []
    for m in range(1, n + 1):  # the first tree has m nodes
        for kids in forests(m - 1, d - 1):
            for rest in forests(n - m, d):
                out.append((kids, *rest))
    return tuple(out)


def expected(forest, p) -> float:
    """Expected accepted tokens of a forest under independent ranks: sum_k p_k (1 + E(child k's forest))."""
    return sum(p[k] * (1.0 + expected(kids, p)) for k, kids in enumerate(forest) if k < len(p))


@settings(max_examples=40, deadline=None)
@given(raw=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4), n=st.integers(0, 6), d=st.integers(1, 3))
def test_the_dynamic_programme_is_the_best_of_every_tree(tb, raw, n, d):
    total = sum(raw)
    p = sorted([x / max(total, 1.0) for x in raw], reverse=True)  # a rank distribution: descending, sum <= 1
    best = max((expected(f, p) for m in range(n + 1) for f in forests(m, d)), default=0.0)
    assert tb.best_tree(p, n, d)(n, d) == pytest.approx(1.0 + best, abs=1e-9)


def test_one_candidate_per_rank_is_the_chain_and_more_nodes_never_hurt(tb):
    a = 0.78
    tau = tb.best_tree([a], 12, 6)
    for d in range(1, 7):
        chain = sum(a ** i for i in range(d + 1))  # Leviathan et al. 2023, eq. (1) numerator / (1 - a)
        assert tau(d, d) == pytest.approx(chain) and tau(12, d) == pytest.approx(chain)  # no second choice to add
    tau = tb.best_tree([0.6, 0.2, 0.1], 12, 4)
    assert all(tau(n + 1, 4) >= tau(n, 4) - 1e-12 for n in range(12))
    assert tau(2, 1) == pytest.approx(1.8)  # both first-level candidates: 0.6 + 0.2


def test_rank_distribution_on_real_tiny_models(tb):
    target, draft = make_pair(seed=3, noise=0.5)
    prompts = [torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    p_same, n = tb.rank_distribution(target, copy.deepcopy(target), prompts, 12, 4)
    assert n == 36 and p_same[0] == pytest.approx(1.0)  # a draft identical to the target: always its first choice
    p, n = tb.rank_distribution(target, draft, prompts, 12, 4)
    assert n == 36 and sum(p) <= 1.0 + 1e-9 and p[0] < 1.0


@pytest.mark.parametrize("argv,needle", [
    (["--depths", "x"], "--depths 'x': expected comma-separated whole numbers"),
    (["--depths", "0,3"], "each >= 1"),
    (["--depths", ","], "give at least one depth"),
    (["--depths", "4", "--max-nodes", "3"], "--max-nodes 3 is below the deepest --depths 4"),
    (["--top", "0"], "--top must be >= 1"),
    (["--steps", "-1"], "--steps must be >= 1"),
    (["--overhead", "nan"], "--overhead must be a finite number >= 0"),
    (["--overhead", "-0.5"], "--overhead must be a finite number >= 0"),
    (["--domain", "nope"], "--domain: unknown domain 'nope'"),
])
def test_bad_arguments_are_one_line_usage_errors(tb, capsys, argv, needle):
    ref = str(SCRIPT.parents[1] / "models" / "assets" / "reference_target")
    with pytest.raises(SystemExit) as e:
        tb.parse_args(["--target", ref, "--draft", ref, *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "Traceback" not in err


def test_the_programme_runs_at_any_depth_and_rank_count(tb):
    """Bottom-up, not recursive: depth 100 with 100 nodes and 64 ranks (a RecursionError before) gives a tau
    between the chain's and the node budget's."""
    p = [0.6, 0.2] + [0.1 / 62] * 62
    tau = tb.best_tree(p, 100, 100)
    chain = sum(0.6 ** i for i in range(101))
    assert chain <= tau(100, 100) <= 101 and tau(100, 100) >= tau(50, 100) >= tau(50, 10)
