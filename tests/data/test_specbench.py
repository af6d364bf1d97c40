"""The evaluation-only domains added for per-domain acceptance: Spec-Bench's six categories, SciTLDR
summarization and NTREX translation (real data root where present, small synthetic roots for the errors)."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from core.errors import DataFormatError
from data.loading import DataOptions, eval_prompts, iter_examples, load_domain
from data.loading import get_domain
from data.registry import DOMAINS, SPECBENCH_CATEGORIES

SPECBENCH = sorted(SPECBENCH_CATEGORIES)


def test_specbench_domains_are_registered():
    assert SPECBENCH == ["specbench_math_reasoning", "specbench_mt_bench", "specbench_qa", "specbench_rag",
                         "specbench_summarization", "specbench_translation"]
    cats = [c for cs in SPECBENCH_CATEGORIES.values() for c in cs]
    assert len(cats) == len(set(cats)) == 13  # 8 MT-Bench categories + 5 tasks, each in exactly one domain
    for name in SPECBENCH + ["summarization", "translation"]:
        assert get_domain(name).name == name
    for name in SPECBENCH:
        assert all(s.split_policy == "test" for s in DOMAINS[name].sources)


@pytest.fixture(scope="module")
def specbench(real_data_root):
    opts = DataOptions(root=str(real_data_root))
    return {name: list(iter_examples(name, opts)) for name in SPECBENCH}


def test_specbench_categories_partition_the_480_prompts(specbench, real_data_root):
    rows = [json.loads(l) for l in open(real_data_root / "specbench" / "spec_bench_question.jsonl")]
    counts = {name: len(pairs) for name, pairs in specbench.items()}
    assert counts == {"specbench_mt_bench": 80, "specbench_translation": 80, "specbench_summarization": 80,
                      "specbench_qa": 80, "specbench_math_reasoning": 80, "specbench_rag": 80}
    ids = [ex.id.split("/")[-1] for pairs in specbench.values() for ex, _ in pairs]
    assert sorted(ids, key=int) == sorted((str(r["question_id"]) for r in rows), key=int)
    assert Counter(ids).most_common(1)[0][1] == 1
    by_id = {str(r["question_id"]): r for r in rows}
    for name, pairs in specbench.items():
        for ex, split in pairs:
            assert split == "test"
            rec = by_id[ex.id.split("/")[-1]]
            assert rec["category"] in SPECBENCH_CATEGORIES[name]
            # first turn, formatted like the chat domain
            assert ex.prompt.startswith("User: ") and ex.prompt.endswith("\nAssistant:")
            assert rec["turns"][0].split()[0] in ex.prompt


def test_summarization_and_translation_load(real_data_root):
    opts = DataOptions(root=str(real_data_root))
    summ = load_domain("summarization", opts)
    assert len(summ["test"]) > 20 and len(summ["train"]) > 300
    row = summ["test"][0]
    assert row["prompt"].startswith("User: Write a one-sentence TL;DR") and row["completion"].strip()

    pairs = list(iter_examples("translation", opts))
    by_id = {ex.id: ex for ex, _ in pairs}
    # line 1 of src.eng.txt pairs with line 1 of each reference file
    first = by_id["translation/ntrex_deu/1"]
    assert "Welsh AMs worried about 'looking like muppets'" in first.prompt
    assert first.prompt.startswith("User: Translate English to German:")
    assert first.completion.strip().startswith("Mitglieder der Nationalversammlung")
    assert by_id["translation/ntrex_fra/1"].prompt.startswith("User: Translate English to French:")
    assert {ex.id.split("/")[1] for ex, _ in pairs} == {"ntrex_deu", "ntrex_fra", "ntrex_spa"}
    assert {s for _, s in pairs} == {"train", "validation", "test"}
    for name in SPECBENCH + ["summarization", "translation"]:
        prompts = eval_prompts(name, opts, max_prompts=3)
        assert len(prompts) == 3 and all(p.prompt.strip() for p in prompts)


def test_translation_files_must_be_parallel(tmp_path):
    d = tmp_path / "translation"
    d.mkdir()
    (d / "ntrex128_newstest2019-src.eng.txt").write_text("Hello.\r\nGood night.\r\n")
    (d / "ntrex128_newstest2019-ref.deu.txt").write_text("Hallo.\r\nGute Nacht.\r\n")
    (d / "ntrex128_newstest2019-ref.fra.txt").write_text("Bonjour.\r\n")
    (d / "ntrex128_newstest2019-ref.spa.txt").write_text("Hola.\r\nBuenas noches.\r\n")
    opts = DataOptions(root=str(tmp_path))
    with pytest.raises(DataFormatError) as ei:
        list(iter_examples("translation", opts))
    assert "ref.fra.txt" in str(ei.value) and "parallel" in str(ei.value)
    (d / "ntrex128_newstest2019-ref.fra.txt").write_text("Bonjour.\r\nBonne nuit.\r\n")
    exs = {ex.id: ex for ex, _ in iter_examples("translation", opts)}
    assert exs["translation/ntrex_spa/2"].prompt == "User: Translate English to Spanish: Good night.\nAssistant:"
    assert exs["translation/ntrex_spa/2"].completion == " Buenas noches."
