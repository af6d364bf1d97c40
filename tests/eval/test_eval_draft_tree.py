"""``eval.draft_tree``: token-tree shapes measured by ``python -m eval`` beside the chain, as policies
``tree:<shape>`` (decode/tree.py), and refused with one config line when malformed."""
from __future__ import annotations

import json

import pytest

from tinymodels import compose_config


@pytest.mark.parametrize("value,specs", [
    ("[3,2,1]", ["3,2,1"]),
    ('["2,2","dynamic:4,3,10","2,2"]', ["2,2", "dynamic:4,3,10"]),
    ("null", []),
])
def test_draft_tree_key_gives_the_shapes(value, specs):
    from eval.config import validate_eval

    rc = validate_eval(compose_config([f"eval.draft_tree={value}"]))
    assert [t.spec() for t in rc.eval.trees()] == specs


@pytest.mark.parametrize("value", ["[3,0]", '["2,x"]', '["dynamic:4,3"]'])
def test_bad_draft_tree_is_a_one_line_config_error(value):
    from eval.config import validate_eval

    with pytest.raises(ValueError) as ei:
        validate_eval(compose_config([f"eval.draft_tree={value}"]))
    text = str(ei.value)
    assert text.startswith("invalid config: ") and "eval.draft_tree" in text and "\n" not in text, text


@pytest.mark.slow
def test_eval_measures_trees_beside_the_chain_losslessly(tmp_path):
    """A whole in-process ``python -m eval`` run with two tree shapes beside gamma 3: every decode is lossless, each
    tree is a policy cell ``tree:<shape>`` whose mean draft length is the tree depth, and it competes for the
    recommendation."""
    from data.text import train_bpe_tokenizer
    from eval.__main__ import run
    from tinymodels import tiny_llama

    text = ["Question: What is diabetes?\nAnswer: A disease of blood sugar.", "def add(a, b):\n    return a + b",
            "User: hello there\nAssistant: hi, how can I help?"] * 20
    tok = train_bpe_tokenizer(iter(text), vocab_size=300, min_frequency=1)
    for name, seed in (("target", 0), ("draft", 1)):
        m = tiny_llama(vocab_size=len(tok), seed=seed, eos_token_id=tok.eos_token_id)
        m.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    cfg = compose_config([f"target.name_or_path={tmp_path / 'target'}", f"eval.drafts={{d: {tmp_path / 'draft'}}}",
                          "eval.domains=[chat]", "eval.max_prompts=2", "eval.max_new_tokens=12",
                          "eval.cost_ratio_trials=2", "eval.bootstrap_samples=0", "eval.plots=false",
                          "eval.num_threads=1", "decode.num_draft_tokens=3", 'eval.draft_tree=["2,2,1","dynamic:3,2,6"]'])
    run(cfg, tmp_path / "run")
    doc = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert doc["lossless_all"] is True
    entry = doc["drafts"]["d"]["chat"]
    assert sorted(entry["policies"]) == ["tree:2,2,1", "tree:dynamic:3,2,6"]
    assert entry["policies"]["tree:2,2,1"]["mean_draft_length"] <= 3
    assert doc["draft_length_policies"]["tree:2,2,1"]["max_nodes"] == 2 + 4 + 4
    assert "tree:2,2,1" in (tmp_path / "run" / "report.md").read_text()
