"""eval.evaluate.evaluate_drafts in-process on tiny real models: greedy runs pass the lossless check, sampling runs
report it as not applicable, a draft identical to the target is always accepted (greedy and sampling), and one row
per draft x domain x prompt x num_draft_tokens comes back."""
from __future__ import annotations

import pytest

from tinymodels import tiny_llama
from eval.evaluate import Prompt, encode_prompt, evaluate_drafts
from eval.metrics import aggregate

TEXT = ["Question: What is diabetes?\nAnswer: A disease of blood sugar.", "def add(a, b):\n    return a + b",
        "User: hello there\nAssistant: hi, how can I help?"] * 10


@pytest.fixture(scope="module")
def setup():
    import torch

    from data.text import train_bpe_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # batch-1 decoding of tiny models: one thread is fastest and steadiest

    tok = train_bpe_tokenizer(iter(TEXT), vocab_size=280, min_frequency=1)
    target = tiny_llama(vocab_size=len(tok), seed=0, eos_token_id=tok.eos_token_id)
    other = tiny_llama(vocab_size=len(tok), seed=5, eos_token_id=tok.eos_token_id)
    prompts = {"qa": [Prompt("qa", "qa/0", "Question: What is"), Prompt("qa", "qa/1", "Question: hello")],
               "code": [Prompt("code", "code/0", "def add(a, b):")]}
    yield tok, target, other, prompts
    torch.set_num_threads(threads)


@pytest.mark.parametrize("decode_kwargs", [{}, {"do_sample": True, "temperature": 0.8, "top_k": 0, "top_p": 0.95}])
def test_rows_lossless_and_identical_draft(setup, decode_kwargs):
    tok, target, other, prompts = setup
    events = []
    res = evaluate_drafts(target, tok, {"twin": target, "other": other}, prompts, num_draft_tokens=[1, 3],
                          max_new_tokens=6, max_prompt_tokens=32, cost_ratio_trials=2, decode_kwargs=decode_kwargs,
                          seed=0, events=lambda name, **f: events.append(name))
    rows = res["rows"]
    assert len(rows) == 2 * 3 * 2  # drafts x prompts x gammas
    assert res["num_draft_tokens"] == [1, 3] and set(res["cost_ratio"]) == {"twin", "other"}
    # (k + 1)-position / 1-position target forward for the gammas and every draft length a step used (the end of a
    # decode drafts fewer than gamma), the v_k of every step the cost model prices
    used = {k for r in rows for k in r["draft_lengths"] if k > 0}
    assert {1, 3} <= used and set(res["verify_cost_ratio"]) == {str(k) for k in used}
    assert all(r["nodes_verified"] == r["drafted_tokens"] for r in rows)  # chains: every drafted token is scored
    assert all(v["verify_cost_ratio"] > 0 and v["verify_forward_s"] > 0 for v in res["verify_cost_ratio"].values())
    assert events.count("eval_domain_done") == 2
    sampling = bool(decode_kwargs)
    for r in rows:
        assert r["greedy_equal"] is (None if sampling else True)
        assert r["emitted_tokens"] == r["new_tokens"] <= 6
        assert sum(r["accepted_length_histogram"]) == r["verify_steps"]
        assert 0 < r["prefill_time_s"] and r["prefill_time_s"] + r["draft_time_s"] + r["verify_time_s"] <= r[
            "speculative_time_s"]
    out = aggregate(rows, {n: c["cost_ratio"] for n, c in res["cost_ratio"].items()}, primary_num_draft_tokens=3,
                    bootstrap_samples=20, check_lossless=True)
    for dom in prompts:
        twin = out["drafts"]["twin"][dom]
        assert twin["acceptance_rate"] == 1.0 and twin["lossless"] is (None if sampling else True)
        assert out["drafts"]["other"][dom]["lossless"] is (None if sampling else True)


def test_encode_prompt_truncates_from_the_left(setup):
    tok = setup[0]
    ids, truncated = encode_prompt(tok, " ".join(["hello there"] * 50), 16)
    assert truncated and ids.shape == (1, 16)
    ids2, truncated2 = encode_prompt(tok, "hello", 16)
    assert not truncated2 and ids2.shape[1] < 16
