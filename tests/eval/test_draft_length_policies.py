"""Draft-length policies selected from the command line (``decode.draft_length_policy`` and its keys).

Each policy, chosen through Hydra overrides and run through ``python -m eval``'s own ``run``, decodes losslessly
(greedy output equals target-only output on every prompt) and records the draft lengths the decoder used: the
``draft_lengths`` of ``per_prompt.csv`` equal those of a direct decode of the same prompt with a fresh policy built
from the same config, they sum to ``drafted_tokens`` over ``verify_steps`` steps, and ``metrics.json``'s pooled
histograms, mean draft lengths and recommendation are rebuilt from the CSV. A sampled run of the confidence policy
built from the config has the target's distribution (chi-square). Bad policy parameters are one-line config errors.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from tinymodels import compose_config, tiny_llama

ROOT = Path(__file__).resolve().parents[2]
TEXT = ["Question: What is diabetes?\nAnswer: A disease of blood sugar.", "def add(a, b):\n    return a + b",
        "User: hello there\nAssistant: hi, how can I help?", "The patient reports chest pain and cough."] * 20

# the keys each policy is selected with on the command line
POLICY_ARGS = {
    "fixed": ["decode.draft_length_policy=fixed", "decode.num_draft_tokens=3"],
    "adaptive": ["decode.draft_length_policy=adaptive", "decode.num_draft_tokens=2", "decode.min_draft_tokens=1",
                 "decode.max_draft_tokens=5", "decode.adaptive_window=1", "decode.adaptive_step=1"],
    "confidence": ["decode.draft_length_policy=confidence", "decode.max_draft_tokens=5",
                   "decode.confidence_threshold=0.8"],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target with a BPE tokenizer, and a draft that is a noisy copy of it (partial agreement)."""
    from data.text import train_bpe_tokenizer

    tmp = tmp_path_factory.mktemp("policy_models")
    tok = train_bpe_tokenizer(iter(TEXT), vocab_size=300, min_frequency=1)
    target = tiny_llama(vocab_size=len(tok), seed=0, eos_token_id=tok.eos_token_id)
    draft = tiny_llama(vocab_size=len(tok), seed=0, eos_token_id=tok.eos_token_id)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in (target, draft):  # peaked distributions (top probabilities from ~0.3 to 1): confidence can decide
            m.lm_head.weight.mul_(30.0)
        for p in draft.parameters():  # noise of 0.3 x each tensor's spread: the draft agrees only partly
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=gen))
    for name, m in (("target", target), ("draft", draft)):
        m.save_pretrained(tmp / name)
        tok.save_pretrained(tmp / name)
    return tmp / "target", tmp / "draft"


def _base(models) -> list[str]:
    target, draft = models
    return [f"target.name_or_path={target}", f"eval.drafts={{noisy: {draft}}}", "eval.domains=[chat]",
            "eval.max_prompts=2", "eval.max_new_tokens=16", "eval.cost_ratio_trials=2", "eval.bootstrap_samples=0",
            "eval.plots=false", "eval.num_threads=1", "eval.lookup_drafts=[]"]  # this draft's policies alone


@pytest.fixture(scope="module")
def policy_runs(models, tmp_path_factory):
    """policy -> (run dir, composed config): one in-process ``python -m eval`` run per policy."""
    from eval.__main__ import run

    out = {}
    for policy, args in POLICY_ARGS.items():
        run_dir = tmp_path_factory.mktemp(f"eval_{policy}")
        cfg = compose_config(_base(models) + args)
        run(cfg, run_dir)
        out[policy] = run_dir, cfg
    return out


def _csv_rows(run_dir: Path) -> list[dict]:
    from eval.metrics import read_per_prompt_csv

    return read_per_prompt_csv(run_dir / "per_prompt.csv")


@pytest.mark.parametrize("policy", list(POLICY_ARGS))
def test_policy_from_the_command_line_decodes_losslessly(policy_runs, policy):
    run_dir, _ = policy_runs[policy]
    doc = json.loads((run_dir / "metrics.json").read_text())
    rows = _csv_rows(run_dir)
    mine = [r for r in rows if r["draft_length_policy"] == policy and r["draft"] == "noisy"]
    assert len(mine) == 2  # both prompts decoded with the chosen policy
    assert all(r["greedy_equal"] is True for r in rows)  # speculative output == target-only output, every decode
    assert doc["lossless_all"] is True
    entry = doc["drafts"]["noisy"]["chat"]
    if policy == "fixed":
        assert "policies" not in entry and set(r["draft_length_policy"] for r in rows) == {"fixed"}
        return
    # the fixed gamma is measured beside the policy, on the same prompts
    assert {r["draft_length_policy"] for r in rows} == {"fixed", policy}
    assert entry["policies"][policy]["lossless"] is True
    assert doc["draft_length_policies"][policy]["draft_length_policy"] == policy
    report = (run_dir / "report.md").read_text()
    assert "## Draft-length policies" in report and policy in report


@pytest.mark.parametrize("policy", list(POLICY_ARGS))
def test_recorded_draft_lengths_are_what_the_decoder_ran(policy_runs, policy):
    """per_prompt.csv's draft lengths = those of a direct decode with a fresh policy from the same config; they
    add up to the row's counts, and metrics.json's pooled histograms / means are rebuilt from them."""
    from models.checkpoints import load_causal_lm
    from decode import speculative_generate
    from eval.config import validate_eval
    from eval.evaluate import encode_prompt
    from eval.metrics import aggregate, json_clean
    from eval.pipeline import load_prompts

    run_dir, cfg = policy_runs[policy]
    rc = validate_eval(cfg)
    rows = [r for r in _csv_rows(run_dir) if r["draft_length_policy"] == policy]
    target, tok = load_causal_lm(rc.target.name_or_path, role="target")
    draft, _ = load_causal_lm(rc.eval.drafts["noisy"], role="draft")
    prompts = load_prompts(["chat"], rc.data.options(), rc.eval.max_prompts)["chat"]
    assert [p.id for p in prompts] == [r["prompt_id"] for r in rows]
    lengths_seen = []
    for p, r in zip(prompts, rows):
        ids, _ = encode_prompt(tok, p.text, rc.eval.max_prompt_tokens)
        out = speculative_generate(target, draft, ids, max_new_tokens=rc.eval.max_new_tokens,
                                   draft_length_policy=rc.decode.make_policy(), eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id)
        assert r["draft_lengths"] == out.stats.draft_lengths
        assert len(r["draft_lengths"]) == r["verify_steps"] and sum(r["draft_lengths"]) == r["drafted_tokens"]
        lengths_seen += r["draft_lengths"]
    cap = rc.decode.num_draft_tokens if policy == "fixed" else rc.decode.max_draft_tokens
    assert max(lengths_seen) <= cap
    if policy == "fixed":  # gamma, fewer only where the token budget ran out
        assert Counter(lengths_seen).most_common(1)[0][0] == cap
    else:  # the policy really varied the draft length
        assert len(set(lengths_seen) - {0}) > 1, lengths_seen
    # metrics.json: pooled histogram and mean draft length of the cell come from the CSV's draft lengths
    doc = json.loads((run_dir / "metrics.json").read_text())
    entry = doc["drafts"]["noisy"]["chat"]
    cell = entry["policies"][policy] if policy != "fixed" else entry["sweep"][str(rc.decode.num_draft_tokens)]
    counts = Counter(lengths_seen)
    assert cell["draft_length_histogram"] == [counts.get(k, 0) for k in range(max(counts) + 1)]
    assert cell["mean_draft_length"] == pytest.approx(sum(lengths_seen) / len(lengths_seen))
    again = json_clean(aggregate(_csv_rows(run_dir), {n: c["cost_ratio"] for n, c in doc["cost_ratio"].items()},
                                 primary_num_draft_tokens=doc["num_draft_tokens"], bootstrap_samples=0,
                                 seed=doc["context"]["seed"], verify_cost_ratio=doc["verify_cost_ratio"],
                                 target_forward_s={n: c["target_forward_s"] for n, c in doc["cost_ratio"].items()}))
    assert again["drafts"] == doc["drafts"] and again["recommendation"] == doc["best_measured"]


def test_eval_compares_all_policies_and_can_recommend_one(models, tmp_path):
    """eval.draft_length_policies=[fixed,adaptive,confidence] beside a gamma sweep: one report row per setting; the
    recommendation is the setting with the highest measured speedup, a policy included."""
    from eval.__main__ import run
    from eval.report import setting_label

    compare = ["decode.confidence_threshold=0.8", "eval.num_draft_tokens=[1,3]",
               "eval.draft_length_policies=[fixed,adaptive,confidence]"]
    cfg = compose_config(_base(models) + POLICY_ARGS["adaptive"][1:] + compare)
    out = run(cfg, tmp_path)
    doc = json.loads((tmp_path / "metrics.json").read_text())
    entry = doc["drafts"]["noisy"]["chat"]
    assert sorted(entry["sweep"]) == ["1", "3"] and sorted(entry["policies"]) == ["adaptive", "confidence"]
    settings = [entry["sweep"]["1"], entry["sweep"]["3"], *entry["policies"].values()]
    best = max(settings, key=lambda e: e["measured_speedup"])
    fastest = doc["best_measured"]["chat"]  # the fastest measured setting, a policy included
    assert fastest["measured_speedup"] == best["measured_speedup"]
    assert fastest["draft_length_policy"] == best["draft_length_policy"]
    rec = doc["recommendation"]["chat"]  # the verdict's decision follows from those numbers (eval.report)
    from eval.decision import candidates
    from decision_oracle import check_consistent

    check_consistent(rec, candidates(doc, "chat"))
    assert out["recommended_setting"]["chat"] == (setting_label(rec) if rec["draft"] else "the target alone")
    for e in settings:  # the Leviathan number of a policy is pooled over the draft lengths it used
        assert e["mean_draft_length"] > 0 and sum(e["draft_length_histogram"]) == e["stats"]["verify_steps"]
    report = (tmp_path / "report.md").read_text()
    for label in ("fixed gamma=1", "fixed gamma=3", "adaptive (start 2, [1, 5], window 1, step 1)",
                  "confidence (threshold 0.8, at most 5)"):
        assert label in report
    routing = json.loads((tmp_path / "routing.json").read_text())
    if rec["draft"] is None:
        assert routing["routes"]["chat"]["target_only"]
    else:
        assert routing["routes"]["chat"]["draft_length_policy"] == rec["draft_length_policy"]


ADAPTIVE_START = "decode.num_draft_tokens (the adaptive policy's starting draft length) must be in"
BAD = {  # case -> (overrides, the message)
    "unknown_policy": (["decode.draft_length_policy=greedy"],
                       "decode.draft_length_policy must be one of fixed, adaptive, confidence, got 'greedy'"),
    "adaptive_start_above_max": (["decode.draft_length_policy=adaptive", "decode.num_draft_tokens=10"],
                                 ADAPTIVE_START + " [decode.min_draft_tokens, decode.max_draft_tokens] = [1, 8], "
                                 "got 10"),
    "adaptive_compared_in_eval_start_above_max": (["eval.draft_length_policies=[adaptive]",
                                                   "decode.max_draft_tokens=3"], ADAPTIVE_START),
    "min_draft_tokens_0": (["decode.min_draft_tokens=0"], "decode.min_draft_tokens must be >= 1, got 0"),
    "max_below_min": (["decode.min_draft_tokens=4", "decode.max_draft_tokens=2"],
                      "decode.max_draft_tokens must be >= decode.min_draft_tokens (4), got 2"),
    "window_0": (["decode.adaptive_window=0"], "decode.adaptive_window must be >= 1 verify step, got 0"),
    "step_0": (["decode.adaptive_step=0"], "decode.adaptive_step must be >= 1 token, got 0"),
    "threshold_above_1": (["decode.confidence_threshold=1.5"],
                          "decode.confidence_threshold must be a probability in [0, 1], got 1.5"),
    "window_not_an_int": (["decode.adaptive_window=four"], "decode.adaptive_window"),
    "unknown_policy_in_eval_list": (["eval.draft_length_policies=[fixed,fast]"],
                                    "eval.draft_length_policies must be null or a non-empty list of"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_policy_parameters_are_one_line_config_errors(case):
    """The eval root and the training root both refuse them with one ``invalid config: ...`` line."""
    from eval.config import validate_eval
    from train.run import validate

    overrides, message = BAD[case]
    cfg = compose_config(overrides)
    for check in (validate_eval, validate):
        with pytest.raises(ValueError) as ei:
            check(cfg)
        text = str(ei.value)
        assert text.startswith("invalid config: ") and message in text and "\n" not in text, text


@pytest.mark.slow
def test_python_m_eval_compares_the_three_policies(models, tmp_path):
    """The real command line (a subprocess): fixed, adaptive and confidence side by side, all lossless, the
    recommendation printed per domain."""
    import os
    import subprocess
    import sys

    args = _base(models) + POLICY_ARGS["adaptive"][1:] + [
        "decode.confidence_threshold=0.8", "eval.domains=[chat,medical]",
        "eval.draft_length_policies=[fixed,adaptive,confidence]", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run([sys.executable, "-m", "eval", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "WANDB_MODE": "offline", "TQDM_DISABLE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "metrics.json").read_text())
    assert doc["lossless_all"] is True
    for domain in ("chat", "medical"):
        assert sorted(doc["drafts"]["noisy"][domain]["policies"]) == ["adaptive", "confidence"]
        r = doc["recommendation"][domain]  # the verdict may be the target alone: the noisy draft is slow
        said = f"- **{domain}**: use `noisy` with " if r["action"] == "speculate" else \
            f"- **{domain}**: decode with the target alone"
        assert said in proc.stdout
    policies = {r["draft_length_policy"] for r in _csv_rows(tmp_path)}
    assert policies == {"fixed", "adaptive", "confidence"}
