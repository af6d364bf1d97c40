"""The domain registry against the real data root: every domain loads, every source contributes records."""
from __future__ import annotations

from collections import Counter

import pytest

from core.errors import UnknownDomainError
from data.loading import DataOptions, eval_prompts, iter_examples, load_domain
from data.loading import get_domain
from data.registry import DOMAINS, Example, Source
from data.loading import SPLITS

KNOWN_REPEATED_IDS = {"medquad_cancergov"}  # sources whose published files repeat a record id (see below)


@pytest.fixture(scope="module")
def loaded(real_data_root):
    """``{domain: [(example, split), ...]}`` for every registered domain, read once from the real data root."""
    opts = DataOptions(root=str(real_data_root))
    return {name: list(iter_examples(name, opts)) for name in DOMAINS}


@pytest.mark.parametrize("name", sorted(DOMAINS))
def test_every_domain_loads_with_non_empty_examples(loaded, name):
    pairs = loaded[name]
    assert pairs, f"domain {name} yielded no records"
    splits = {split for _, split in pairs}
    assert splits <= set(SPLITS)
    assert splits & {"train", "test"}, f"domain {name} has neither train nor test records"
    for ex, _ in pairs:
        assert isinstance(ex, Example)
        assert (ex.prompt + ex.completion).strip(), ex.id
        assert ex.text == ex.prompt + ex.completion
        assert ex.id.startswith(f"{name}/")
    # Ids are unique, except where a published file itself repeats its id field: MedQuAD CancerGov has a few
    # documents whose sub-documents share one qid. Such records share one key, hence one split (no leak).
    split_of: dict[str, set[str]] = {}
    for ex, split in pairs:
        split_of.setdefault(ex.id, set()).add(split)
    dup_sources = {i.split("/")[1] for i, _ in Counter(ex.id for ex, _ in pairs).items() if _ > 1}
    assert dup_sources <= KNOWN_REPEATED_IDS, f"duplicate record ids in {name}: {dup_sources}"
    assert all(len(s) == 1 for s in split_of.values())


@pytest.mark.parametrize("name", sorted(DOMAINS))
def test_every_source_contributes_records(loaded, name):
    counts = {s.name: 0 for s in DOMAINS[name].sources}
    for ex, _ in loaded[name]:
        counts[ex.id.split("/")[1]] += 1
    assert all(counts.values()), f"sources without records in {name}: {[s for s, n in counts.items() if not n]}"


@pytest.mark.parametrize(
    "name, prefixes",
    [
        ("medical", ["pubmedqa", "medquad_", "meqsum", "mtsdialog_"]),
        ("code", ["humaneval", "mbpp"]),
        ("chat", ["mt_bench", "oasst_"]),
        ("math", ["gsm8k_"]),
    ],
)
def test_domain_sources(name, prefixes):
    names = [s.name for s in get_domain(name).sources]
    for prefix in prefixes:
        assert any(n.startswith(prefix) for n in names), f"{name} lacks a {prefix}* source: {names}"


def test_source_definitions_are_consistent():
    from data.registry import READERS

    seen = set()
    for dom in DOMAINS.values():
        for src in dom.sources:
            assert isinstance(src, Source)
            assert src.format in READERS, (dom.name, src.name, src.format)
            assert src.split_policy in ("hash", "train", "test"), (dom.name, src.name)
            assert "/" not in src.name  # the id is "{domain}/{source}/{record_id}"
            assert (dom.name, src.name) not in seen
            seen.add((dom.name, src.name))
            assert src.license, f"{dom.name}/{src.name} has no license"


def test_benchmarks_are_test_only_and_train_files_never_test(loaded):
    by_source: dict[str, set[str]] = {}
    for name in ("code", "chat", "math", "medical"):
        for ex, split in loaded[name]:
            by_source.setdefault("/".join(ex.id.split("/")[:2]), set()).add(split)
    for key in ("code/humaneval", "chat/mt_bench", "math/gsm8k_test", "medical/mtsdialog_validation"):
        assert by_source[key] == {"test"}, key
    for key in ("math/gsm8k_train", "medical/mtsdialog_train"):
        assert "test" not in by_source[key], key


@pytest.mark.parametrize("name", ["medical", "code", "chat", "math"])
def test_eval_prompts_are_non_empty_and_deterministic(real_data_root, name):
    opts = DataOptions(root=str(real_data_root))
    first = eval_prompts(name, opts, max_prompts=32)
    full = eval_prompts(name, opts)
    assert first, name
    assert len(first) == min(32, len(full))
    assert all(p.prompt.strip() for p in full)
    # same list twice: the capped list is exactly the prefix of a second, uncapped call (hash order)
    assert [(p.id, p.prompt, p.completion) for p in full[: len(first)]] == [
        (p.id, p.prompt, p.completion) for p in first
    ]


def test_load_domain_columns_and_hash_order(real_data_root):
    from data.loading import order_key

    ds = load_domain("chat", DataOptions(root=str(real_data_root)))
    assert set(ds) == set(SPLITS)
    for split in SPLITS:
        assert ds[split].column_names == ["id", "source", "prompt", "completion", "messages"]
        keys = [order_key(i) for i in ds[split]["id"]]
        assert keys == sorted(keys)
        assert all(row["id"].split("/")[1] == row["source"] for row in ds[split])


@pytest.mark.parametrize("domain", ["medical", "code", "chat"])
def test_first_records_of_a_split_are_a_fair_sample(real_data_root, domain):
    """Taking a split's first N records (teacher prompts, evaluation prompts) samples its sources in proportion:
    a source with a fixed split policy (MTS-Dialog's training file, HumanEval's test-only file) must not cluster
    at the front. Each source's count among the first N is within 5 binomial standard deviations (plus 2 records)
    of its share of the split: a false failure has probability below 1e-5 per source."""
    import collections
    import math

    ds = load_domain(domain, DataOptions(root=str(real_data_root)))
    for split in SPLITS:
        rows = ds[split]
        n = min(256, len(rows) // 2)
        if n < 20:
            continue
        share = collections.Counter(rows["source"])
        head = collections.Counter(rows.select(range(n))["source"])
        for src, k in share.items():
            p = k / len(rows)
            assert abs(head[src] - n * p) <= 5 * math.sqrt(n * p * (1 - p)) + 2, (domain, split, src, head[src], n * p)


def test_unknown_domain_lists_known_ones():
    with pytest.raises(UnknownDomainError) as ei:
        get_domain("nope")
    msg = str(ei.value)
    assert "'nope'" in msg
    for name in DOMAINS:
        assert name in msg
    assert isinstance(ei.value, ValueError)
    with pytest.raises(UnknownDomainError):
        list(iter_examples("nope"))
