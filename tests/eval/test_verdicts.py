"""Decisions that follow the evidence (eval.report): every decision is consistent with its numbers (property test
over random metric tables), none recommends a setting measured slower than the target alone, the speedup
interval resamples timing trials as well as prompts, the deployment projection is Leviathan's formula, and the
decision is the same when another process loads the cores during one of two evaluations (slow)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decode.stats import expected_speedup
from eval.metrics import bootstrap_ratio_ci, bootstrap_speedup_ci
from eval.decision import SPECULATE, TARGET_ONLY, decide, interval, model_field
from decision_oracle import check_consistent
from eval.decision import add_projection, deployment_cost_ratios

ROOT = Path(__file__).resolve().parents[2]


@st.composite
def tables(draw):
    """A random metric table of one domain: settings (draft x gamma or policy) with measured speedup, interval
    (or none), expected speedup and tau."""
    n = draw(st.integers(1, 8))
    out, seen = [], set()
    for _ in range(n):
        draft = draw(st.sampled_from(["a", "b", "c"]))
        policy = draw(st.sampled_from(["fixed", "fixed", "fixed", "adaptive"]))
        g = draw(st.sampled_from([1, 2, 3, 4, 6])) if policy == "fixed" else 8
        if (draft, policy, g) in seen:
            continue
        seen.add((draft, policy, g))
        s = draw(st.floats(0.05, 4.0))
        ci = None if draw(st.integers(0, 5)) == 0 else sorted(
            [s - draw(st.floats(0.0, 1.5)), s + draw(st.floats(0.0, 1.5))])
        out.append({"draft": draft, "draft_length_policy": policy, "num_draft_tokens": g, "measured_speedup": s,
                    "measured_speedup_ci": ci, "expected_speedup": draw(st.floats(0.1, 5.0)),
                    # measured verify cost ratios: usually for every setting, sometimes missing (an older file)
                    "expected_speedup_components": draw(st.one_of(st.floats(0.1, 5.0), st.just(None))),
                    "mean_accepted_length": draw(st.floats(1.0, 7.0))})
    return out


@settings(max_examples=300, deadline=None)
@given(cands=tables())
def test_every_decision_is_consistent_with_its_numbers(cands):
    r = decide(cands)
    check_consistent(r, cands)  # the rule, checked independently of how decide() is written
    best = max(cands, key=lambda c: (c["measured_speedup"], interval(c)[1]))  # equal estimates: the wider reach
    if best["measured_speedup"] < 1.0:  # nothing measured faster than the target alone, whatever the intervals
        assert r.action == TARGET_ONLY and r.draft is None  # routing.json: no draft
    else:
        assert r.action == SPECULATE
        chosen = next(c for c in cands if (c["draft"], c["draft_length_policy"], c["num_draft_tokens"]) ==
                      (r.draft, r.draft_length_policy, r.num_draft_tokens))
        assert chosen["measured_speedup"] >= 1.0  # never a setting measured slower than the target alone
        others = [c for c in cands if c is not chosen]
        if r.basis == "measured":  # chosen on speed only when its interval is above every other one
            assert all(interval(c)[1] < interval(chosen)[0] for c in others)
        else:
            assert r.basis == "tie" and r.tied_with and r.model in {"expected_speedup", "expected_speedup_components"}
            tied = [c for c in cands if interval(c)[1] >= interval(best)[0] and c["measured_speedup"] >= 1.0]
            assert any(c is chosen for c in tied)
            above = [c for c in tied if interval(c)[0] >= 1.0]
            if above and interval(chosen)[0] < 1.0:  # a setting measured clearly above 1 gives way only to one that
                field = model_field(tied)  # both the measurement and the cost model rate faster
                assert any(chosen["measured_speedup"] > c["measured_speedup"] and
                           (chosen.get(field) or 0) > (c.get(field) or 0) > 0 for c in above)


def test_check_consistent_catches_a_wrong_decision():
    cands = [{"draft": "a", "draft_length_policy": "fixed", "num_draft_tokens": 2, "measured_speedup": 0.6,
              "measured_speedup_ci": [0.5, 0.7], "expected_speedup": 3.0, "mean_accepted_length": 3.0},
             {"draft": "b", "draft_length_policy": "fixed", "num_draft_tokens": 4, "measured_speedup": 0.8,
              "measured_speedup_ci": [0.7, 0.95], "expected_speedup": 1.0, "mean_accepted_length": 2.0}]
    assert decide(cands).action == TARGET_ONLY
    wrong = {"action": SPECULATE, "basis": "measured", "draft": "b", "draft_length_policy": "fixed",
             "num_draft_tokens": 4}
    with pytest.raises(AssertionError):
        check_consistent(wrong, cands)
    # overlapping intervals above 1: a tie, broken by the cost model (a's higher expected speedup)
    cands[0].update(measured_speedup=1.5, measured_speedup_ci=[1.2, 1.8])
    cands[1].update(measured_speedup=1.6, measured_speedup_ci=[1.3, 1.9])
    r = decide(cands)
    assert (r.basis, r.draft) == ("tie", "a")
    with pytest.raises(AssertionError):
        check_consistent({**r.as_dict(), "draft": "b", "num_draft_tokens": 4}, cands)


def test_a_tie_is_broken_with_the_measured_verify_cost_not_v_equal_1():
    """A distill_med run (medical): gamma 4 measured 1.47x [1.14, 1.75], gamma 3 1.22x [1.01, 1.37], tied. With
    v = 1, Leviathan's model expects more of gamma 3 (1.93x vs 1.90x) and picked the slower setting; with the
    measured verify cost ratios (a 4-position forward cost 1.97 one-token forwards, a 5-position one 1.46) the cost
    model expects tau / (k c + v_k) = 3.13 / (3 x 0.244 + 1.97) = 1.16x against 3.60 / (4 x 0.244 + 1.46) = 1.48x
    and picks gamma 4, the one measured faster."""
    from decode.stats import expected_speedup_from_costs

    c, v = 0.244, {"3": 1.971, "4": 1.457}
    g3 = {"draft": "distilled", "draft_length_policy": "fixed", "num_draft_tokens": 3, "measured_speedup": 1.22,
          "measured_speedup_ci": [1.01, 1.37], "expected_speedup": 1.93, "mean_accepted_length": 3.13,
          "expected_speedup_components": expected_speedup_from_costs(3.13, [0, 0, 0, 10], c, v)}
    g4 = {"draft": "distilled", "draft_length_policy": "fixed", "num_draft_tokens": 4, "measured_speedup": 1.47,
          "measured_speedup_ci": [1.14, 1.75], "expected_speedup": 1.90, "mean_accepted_length": 3.60,
          "expected_speedup_components": expected_speedup_from_costs(3.60, [0, 0, 0, 0, 10], c, v)}
    assert g3["expected_speedup_components"] == pytest.approx(3.13 / (3 * c + 1.971))
    r = decide([g3, g4])
    check_consistent(r, [g3, g4])
    assert (r.basis, r.num_draft_tokens) == ("tie", 4) and r.model == "expected_speedup_components"
    # without measured verify costs (an older metrics.json) both fall back to Leviathan's v = 1, never a mix; that
    # model misses these measurements by 36 % (median) and separates the two by 1.6 %: it cannot order them, so
    # the measured speedup does
    old = [{**x, "expected_speedup_components": None} for x in (g3, g4)]
    r = decide(old)
    check_consistent(r, old)
    assert r.num_draft_tokens == 4 and r.model == "expected_speedup" and round(100 * r.model_error) == 36
    mixed = [g3, {**g4, "expected_speedup_components": None}]
    assert decide(mixed).model == "expected_speedup"  # one setting lacks it: Leviathan's model for both


def test_settings_the_cost_model_cannot_order_go_to_the_measured_speedup():
    """The distill_med run of docs/results.md (medical, `distilled`, every gamma tied): the cost model expected
    gamma 3 1.46x and gamma 4 1.44x, a 1.4 % margin, and missed the five measurements by 4 % (median): within its
    own error it cannot order them, and the measurement picks gamma 4 (1.48x against 1.38x). A margin wider than the
    model's error still decides (gamma 2 is 11 % below: never picked for its measured speed alone)."""
    rows = [(1, 1.178, [1.104, 1.237], 1.229, 1.87), (2, 1.282, [1.125, 1.39], 1.307, 2.57),
            (3, 1.379, [1.143, 1.525], 1.463, 3.13), (4, 1.483, [1.11, 1.753], 1.443, 3.60),
            (6, 1.373, [0.976, 1.702], 1.309, 4.24)]
    cands = [{"draft": "distilled", "draft_length_policy": "fixed", "num_draft_tokens": g, "measured_speedup": s,
              "measured_speedup_ci": ci, "expected_speedup": 2.0, "expected_speedup_components": m,
              "mean_accepted_length": tau} for g, s, ci, m, tau in rows]
    r = decide(cands)
    check_consistent(r, cands)
    assert (r.basis, r.num_draft_tokens) == ("tie", 4) and round(100 * r.model_error) == 4 and len(r.model_near) > 1
    # gamma 2 measured fastest but expected 11 % below gamma 3: outside the model's error, not chosen
    fast2 = [dict(c, measured_speedup=1.6) if c["num_draft_tokens"] == 2 else c for c in cands]
    r = decide(fast2)
    check_consistent(r, fast2)
    assert r.num_draft_tokens != 2
    with pytest.raises(AssertionError):  # the check refuses the slower of two settings the model cannot order
        check_consistent({**decide(cands).as_dict(), "num_draft_tokens": 3}, cands)


def test_a_tie_never_goes_to_a_setting_measured_slower_than_the_target_alone_over_one_measured_faster():
    """No tied setting's interval lies wholly above 1; the cost model overrates gamma 6 (expects 1.50x, measured
    0.85x) while matching the others within 2 %: gamma 6 is not picked over settings measured faster than the target
    alone."""
    rows = [(1, 1.10, [0.90, 1.30], 1.12), (2, 1.30, [0.95, 1.65], 1.00), (3, 1.05, [0.80, 1.30], 1.04),
            (4, 1.02, [0.80, 1.25], 1.03), (6, 0.85, [0.60, 1.10], 1.50)]
    cands = [{"draft": "d", "draft_length_policy": "fixed", "num_draft_tokens": g, "measured_speedup": s,
              "measured_speedup_ci": ci, "expected_speedup": m, "expected_speedup_components": m,
              "mean_accepted_length": 1.0 + g / 2} for g, s, ci, m in rows]
    r = decide(cands)
    check_consistent(r, cands)
    assert r.num_draft_tokens != 6 and r.measured_speedup >= 1.0
    assert r.tie_pool == "at_least_one"
    with pytest.raises(AssertionError):  # the check refuses the slower-than-target setting the cost model prefers
        check_consistent({**r.as_dict(), "num_draft_tokens": 6, "basis": "tie"}, cands)


def test_a_domain_whose_fastest_setting_measured_below_1_goes_to_the_target_alone_even_when_its_interval_reaches_1():
    """A distill_med run's code domain: the fastest setting measured 0.89x [0.75, 1.07]. Speculating there was
    recommending the slower path (the interval only says it is not clearly slower): the target alone needs no draft,
    so nothing measured below 1 is recommended, whether or not the interval reaches 1."""
    rows = [(1, 0.89, [0.75, 1.07]), (2, 0.84, [0.70, 1.02]), (4, 0.71, [0.60, 0.85])]
    cands = [{"draft": "distilled", "draft_length_policy": "fixed", "num_draft_tokens": g, "measured_speedup": s,
              "measured_speedup_ci": ci, "expected_speedup": 1.2, "expected_speedup_components": 1.1,
              "mean_accepted_length": 1.3} for g, s, ci in rows]
    r = decide(cands)
    check_consistent(r, cands)
    assert (r.action, r.draft, r.num_draft_tokens) == (TARGET_ONLY, None, None)
    assert r.basis == "below_one" and r.best_measured["measured_speedup_ci"] == [0.75, 1.07]
    with pytest.raises(AssertionError):  # the old rule's answer (speculate with gamma 1) is refused by the check
        check_consistent({"action": SPECULATE, "basis": "measured", "draft": "distilled",
                          "draft_length_policy": "fixed", "num_draft_tokens": 1}, cands)
    # one setting measured at least 1x (and its interval overlapping): speculation with that one, not the target alone
    cands[0].update(measured_speedup=1.01, measured_speedup_ci=[0.85, 1.2])
    r = decide(cands)
    check_consistent(r, cands)
    assert (r.action, r.num_draft_tokens) == (SPECULATE, 1)


def test_speedup_interval_resamples_timing_trials_as_well_as_prompts():
    n, T = 6, 3
    new = np.full(n, 10.0)
    tnew = np.full(n, 10.0)
    # identical prompts, but the trials' times differ: a prompt-only bootstrap would give a zero-width interval
    spec = np.tile([0.5, 1.0, 2.0], (n, 1))  # (n, T)
    tgt = np.ones((n, T))
    ci = bootstrap_speedup_ci(new, spec, tnew, tgt, samples=400, confidence=0.95, seed=0)
    assert ci[1] - ci[0] > 0.3 and ci[0] < 1 / spec.mean() < ci[1]  # the point: mean times
    assert bootstrap_ratio_ci(new, spec.mean(1), num2=tnew, den2=tgt.mean(1), samples=400, confidence=0.95,
                              seed=0) == pytest.approx([1 / spec.mean(), 1 / spec.mean()])
    # paired: a load burst that slows both sides of the same trial alike leaves the ratio (and interval) unchanged
    burst = np.tile([1.0, 3.0, 1.0], (n, 1))
    steady = bootstrap_speedup_ci(new, np.full((n, T), 0.5), tnew, np.ones((n, T)), samples=200, confidence=0.95,
                                  seed=1)
    bursty = bootstrap_speedup_ci(new, 0.5 * burst, tnew, burst, samples=200, confidence=0.95, seed=1)
    assert steady == pytest.approx([2.0, 2.0]) and bursty == pytest.approx([2.0, 2.0])
    assert bootstrap_speedup_ci(new, spec, tnew, tgt, samples=0, confidence=0.95, seed=0) is None


def test_projection_is_leviathans_formula_with_the_deployments_cost_ratio():
    dep = deployment_cost_ratios({"cost_ratio": None, "target_parameters": 7_000_000_000,
                                  "draft_parameters": 70_000_000}, {"a": 1, "b": 2}, None)
    assert dep["cost_ratio"] == {"a": pytest.approx(0.01), "b": pytest.approx(0.01)}
    assert deployment_cost_ratios({"cost_ratio": 0.05}, {"a": 1}, None)["cost_ratio"] == {"a": 0.05}
    own = deployment_cost_ratios({"memory_bound": True}, {"a": 10, "b": 30}, 100)["cost_ratio"]
    assert own == {"a": 0.1, "b": 0.3}
    assert deployment_cost_ratios({}, {"a": 10}, 100) is None
    doc = {"drafts": {"a": {"x": {"num_draft_tokens": 2, "sweep": {
        str(g): {"num_draft_tokens": g, "token_acceptance_rate": 0.7} for g in (1, 2, 6)}}}}}
    add_projection(doc, dep)
    for g in (1, 2, 6):
        assert doc["drafts"]["a"]["x"]["sweep"][str(g)]["projected_speedup"] == pytest.approx(
            (1 - 0.7 ** (g + 1)) / ((1 - 0.7) * (g * 0.01 + 1)))
        assert doc["drafts"]["a"]["x"]["sweep"][str(g)]["projected_speedup"] == pytest.approx(
            expected_speedup(0.7, g, 0.01))
    assert doc["drafts"]["a"]["x"]["projected_speedup"] == doc["drafts"]["a"]["x"]["sweep"]["2"]["projected_speedup"]


def _rows(draft, domain, g, speed, n=4, emitted=12, steps=4):
    return [{"draft": draft, "domain": domain, "prompt_id": str(i), "num_draft_tokens": g, "prompt_tokens": 10,
             "truncated": False, "new_tokens": 16, "verify_steps": steps, "drafted_tokens": steps * g,
             "accepted_tokens": emitted - steps, "emitted_tokens": emitted, "draft_time_s": 0.1, "verify_time_s": 0.2,
             "speculative_time_s": (1.0 + 0.05 * i) / speed, "target_new_tokens": 16, "target_time_s": 1.0 + 0.05 * i,
             "greedy_equal": True, "per_position_drafted": [steps, steps], "per_position_accepted": [steps, 2],
             "accepted_length_histogram": [0, 2, 2], "draft_length_policy": "fixed", "draft_lengths": [g] * steps,
             "speculative_trial_times_s": [(1.0 + 0.05 * i) / speed * f for f in (0.9, 1.1)],
             "target_trial_times_s": [(1.0 + 0.05 * i) * f for f in (0.9, 1.1)]} for i in range(n)]


def test_report_verdicts_routing_and_summary_agree(tmp_path):
    """slow domain: every setting below 1 -> the target alone, in the verdict and in routing.json (which the
    router loads as a route to no draft); fast domain: a clear winner; the summary printed is report.md's section."""
    from decode.config import load_routing
    from eval.report import render_markdown, write_report
    from eval.decision import write_routing
    from eval.report import verdicts_section

    rows = (_rows("a", "slow", 2, 0.5) + _rows("a", "slow", 4, 0.7) + _rows("b", "slow", 2, 0.6)
            + _rows("b", "slow", 4, 0.4) + _rows("a", "fast", 2, 1.2) + _rows("a", "fast", 4, 2.5)
            + _rows("b", "fast", 2, 1.1) + _rows("b", "fast", 4, 1.3))
    results = {"rows": rows, "cost_ratio": {d: {"cost_ratio": 0.2, "draft_forward_s": 2e-4, "target_forward_s": 1e-3}
                                            for d in "ab"},
               "num_draft_tokens": [2, 4], "max_new_tokens": 16, "sampling": {}, "truncated_prompts": 0,
               "timing_trials": 2, "machine_load": {"slow": {"loadavg_before": [5.0, 1, 1], "loadavg_after": [1.0, 1, 1],
                                                             "cores": 2, "overloaded": True}}}
    dep = deployment_cost_ratios({"cost_ratio": 0.05}, {"a": 1, "b": 1}, None)
    doc = write_report(tmp_path, results, {"experiment_name": "t", "seed": 0}, primary_num_draft_tokens=4,
                       bootstrap_samples=200, plots=False, deployment=dep)
    rec = doc["recommendation"]
    assert rec["slow"]["action"] == TARGET_ONLY and doc["verdicts"]["slow"].startswith("decode with the target alone")
    assert (rec["fast"]["draft"], rec["fast"]["num_draft_tokens"], rec["fast"]["basis"]) == ("a", 4, "measured")
    assert rec["slow"]["noisy"] and "NOISY" in doc["verdicts"]["slow"]
    assert "load average 5.00 above the 2 cores" in " ".join(rec["slow"]["noisy_reasons"])
    assert doc["noisy"] == ["slow"] and doc["timing"]["timing_trials"] == 2
    assert doc["drafts"]["a"]["fast"]["sweep"]["4"]["timing_trials"] == 2
    proj = doc["drafts"]["a"]["fast"]["sweep"]["4"]["projected_speedup"]
    assert proj == pytest.approx(expected_speedup(doc["drafts"]["a"]["fast"]["sweep"]["4"]["token_acceptance_rate"],
                                                  4, 0.05))
    report = (tmp_path / "report.md").read_text()
    section = verdicts_section(doc)
    assert section in report and render_markdown(doc).count("## Verdicts") == 1
    assert "## Projected speedup on the deployment (not measured)" in report and f"{proj:.2f}x" in report
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["recommendation"]["slow"]["draft"] is None and metrics["deployment"]["cost_ratio"] == {
        "a": 0.05, "b": 0.05}
    drafts = {}
    for n in "ab":
        (tmp_path / "drafts" / n).mkdir(parents=True)
        (tmp_path / "drafts" / n / "config.json").write_text("{}")
        drafts[n] = tmp_path / "drafts" / n
    table = write_routing(tmp_path / "routing.json", doc, drafts)
    assert table["routes"]["slow"]["target_only"] and table["routes"]["fast"]["draft"] == "a"
    loaded = load_routing(tmp_path / "routing.json")
    assert loaded.draft_for("slow").target_only and loaded.draft_for("slow").path is None
    assert loaded.draft_for("fast").path == str(drafts["a"].resolve())


# ------------------------------------------------------------------------------------- the must-show CLI check
def _identity_padded_target(tmp: Path):
    """(target, draft, other): a 1-layer draft and a 10-layer target whose extra layers add exactly zero (their
    output projections are zero), so the target's greedy output is the draft's (alpha = 1) at ~10x its cost; and an
    unrelated draft (alpha ~ 0)."""
    import torch
    from tinymodels import tiny_llama

    from data.text import train_bpe_tokenizer

    text = ["Question: What is diabetes?\nAnswer: A disease of blood sugar.", "def add(a, b):\n    return a + b",
            "User: hello there\nAssistant: hi, how can I help?"] * 20
    tok = train_bpe_tokenizer(iter(text), vocab_size=300, min_frequency=1)
    kw = dict(vocab_size=len(tok), hidden_size=128, num_heads=4, eos_token_id=None)
    draft = tiny_llama(num_layers=1, seed=0, **kw)
    target = tiny_llama(num_layers=10, seed=5, **kw)
    with torch.no_grad():
        target.model.embed_tokens.weight.copy_(draft.model.embed_tokens.weight)
        target.model.norm.weight.copy_(draft.model.norm.weight)
        target.lm_head.weight.copy_(draft.lm_head.weight)
        target.model.layers[0].load_state_dict(draft.model.layers[0].state_dict())
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    other = tiny_llama(num_layers=1, seed=9, **kw)
    out = []
    for name, m in (("target", target), ("draft", draft), ("other", other)):
        m.save_pretrained(tmp / name)
        tok.save_pretrained(tmp / name)
        out.append(tmp / name)
    return out


def _eval_cli(target, draft, other, run_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "eval", f"target.name_or_path={target}", f"eval.drafts={{good: {draft}, bad: {other}}}",
         "eval.domains=[chat,code]", "eval.num_draft_tokens=[1,4]", "eval.max_prompts=3", "eval.max_new_tokens=24",
         "eval.timing_trials=2", "eval.cost_ratio_trials=5", "eval.bootstrap_samples=300", "eval.num_threads=1",
         "eval.plots=false", "eval.deployment.memory_bound=true", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=400, env={**os.environ, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run_dir / "metrics.json").read_text()), proc.stdout, (run_dir / "report.md").read_text()


def _burn(seconds: float):
    """A CPU-bound loop for ``seconds`` (another process loading the cores)."""
    import time

    end = time.time() + seconds
    x = 0
    while time.time() < end:
        x += 1


@pytest.mark.slow
@pytest.mark.extended  # two evaluations, one with every core loaded: minutes
def test_recommendation_is_the_same_with_the_cores_loaded(tmp_path):
    import multiprocessing as mp

    target, draft, other = _identity_padded_target(tmp_path)
    quiet, quiet_out, quiet_md = _eval_cli(target, draft, other, tmp_path / "quiet")
    burners = [mp.get_context("spawn").Process(target=_burn, args=(300.0,)) for _ in range(os.cpu_count() or 2)]
    for b in burners:
        b.start()
    try:
        import time

        deadline = time.time() + 120  # the 1-minute load average lags: let it rise above the cores first
        while os.getloadavg()[0] <= len(burners) and time.time() < deadline:
            time.sleep(2)
        busy, busy_out, busy_md = _eval_cli(target, draft, other, tmp_path / "busy")
    finally:
        for b in burners:
            b.terminate()
            b.join()
    for doc, out, md in ((quiet, quiet_out, quiet_md), (busy, busy_out, busy_md)):
        from eval.report import candidates

        for d, r in doc["recommendation"].items():
            check_consistent(r, candidates(doc, d))  # consistent with its own numbers
        section = md[md.index("## Verdicts"):]
        section = section[:section.index("\n## ", 1)].rstrip("\n")
        assert section in out  # the stdout summary is report.md's verdict section
        assert "projected speedup" in md.lower() and doc["deployment"]["cost_ratio"]["good"] == pytest.approx(
            doc["deployment"]["cost_ratio"]["bad"])
    for d in quiet["recommendation"]:
        q, b = quiet["recommendation"][d], busy["recommendation"][d]
        assert (q["draft"], q["num_draft_tokens"]) == (b["draft"], b["num_draft_tokens"]) or (
            q["basis"] == b["basis"] == "tie"), (d, q, b)
        assert q["draft"] in ("good", None) and not math.isnan(q["measured_speedup"])
    assert any(x["overloaded"] for x in busy["timing"]["machine_load"].values())  # the load was recorded


@pytest.mark.parametrize("override,message", [
    ({"timing_trials": 0}, "eval.timing_trials must be >= 1, got 0"),
    ({"noisy_relative_width": 0}, "eval.noisy_relative_width must be > 0, got 0"),
    ({"deployment": {"cost_ratio": -1}}, "eval.deployment.cost_ratio must be > 0"),
    ({"deployment": {"target_parameters": 7000}}, "eval.deployment.target_parameters and "
                                                   "eval.deployment.draft_parameters go together"),
])
def test_bad_timing_and_deployment_settings_are_one_line_config_errors(override, message):
    from eval.config import validate_eval

    with pytest.raises(ValueError) as ei:
        validate_eval({"eval": {"device": "cpu", **override}})
    assert message in str(ei.value) and "\n" not in str(ei.value)


def test_an_evaluation_on_every_core_is_not_noisy_by_its_own_load(monkeypatch):
    """The load average counts the evaluation's own busy threads: on 2 cores an evaluation using both holds it at
    about 2 by itself, which must not mark the timing noisy; another process keeping a core busy must."""
    import eval.evaluate as ev

    monkeypatch.setattr(ev, "cpu_cores", lambda: 2)
    alone = ev.load_record([2.03, 1, 1], [1.98, 1, 1], own_cores=1.95)
    assert not alone["overloaded"] and alone["other_load"] == pytest.approx(0.08)
    busy = ev.load_record([3.1, 1, 1], [2.9, 1, 1], own_cores=1.6)  # a burner took about 1.5 cores
    assert busy["overloaded"] and busy["other_load"] == pytest.approx(1.5)
    one_thread = ev.load_record([1.9, 1, 1], [1.9, 1, 1], own_cores=1.0)  # one core left to another process
    assert one_thread["overloaded"]
    old = ev.load_record([2.5, 1, 1], [1.0, 1, 1])  # no own-CPU figure: the core count is the limit
    assert old["overloaded"] and old["other_load"] is None
    # measured directly (the machine's busy CPU seconds minus this process's, per wall second): the 1-minute load
    # average lags, so a burner started just before is seen at once and one stopped just before is not
    lagging = ev.load_record([1.0, 1, 1], [1.2, 1, 1], own_cores=1.3, other_cores=0.66)
    assert lagging["overloaded"] and lagging["other_load"] == pytest.approx(0.66)
    quiet = ev.load_record([2.4, 1, 1], [2.1, 1, 1], own_cores=1.0, other_cores=0.02)
    assert not quiet["overloaded"]
    assert ev.busy_cpu_seconds() is None or ev.busy_cpu_seconds() > 0
    # LoadMeter: this process's busy cores from its CPU time, the others' from the machine's busy CPU seconds
    monkeypatch.setattr(ev, "busy_cpu_seconds", iter([100.0, 100.0 + 3.0]).__next__)  # 3 busy CPU-s in all
    monkeypatch.setattr(ev.time, "process_time", iter([10.0, 11.0]).__next__)  # 1 of them this process's
    monkeypatch.setattr(ev.time, "perf_counter", iter([0.0, 2.0]).__next__)  # over 2 wall seconds
    with ev.LoadMeter() as meter:
        pass
    assert meter.seconds == 2.0 and meter.record["own_cores"] == 0.5 and meter.record["other_load"] == 1.0
    assert meter.record["overloaded"]
    monkeypatch.undo()
    from eval.report import noisy_reasons

    doc = {"timing": {"machine_load": {"x": busy}}}
    reasons = noisy_reasons(doc, "x", {"measured_speedup": 1.0, "measured_speedup_ci": [0.95, 1.05]}, 0.5)
    assert reasons == ["other processes kept 1.50 cores busy while timing (load average 3.10, this evaluation 1.60 "
                       "of 2 cores)"]


def test_a_setting_clearly_above_1_gives_way_to_one_both_measurement_and_model_rate_faster():
    """The re-evaluation of a distill_med run on the AVX-512 Xeon (medical, 5 prompts x 2 trials): gamma 1 was the
    only setting whose interval lay above 1 (1.20x [1.02, 1.50]) because prompt-to-prompt spread widens the longer
    drafts' intervals; gamma 4 measured 1.32x [0.89, 1.90] and the cost model expected 1.56x against 1.30x. The
    verdict was gamma 1, the slower path on both counts; now gamma 4 (among 2, 3, 4, which beat gamma 1 on both
    numbers, the cost model cannot tell apart, and gamma 4 measured fastest). Without such a setting the filter
    stands: a setting above 1 still beats one measured faster that the model expects slower."""
    def s(g, m, ci, comp, tau):
        return {"draft": "distilled", "draft_length_policy": "fixed", "num_draft_tokens": g, "measured_speedup": m,
                "measured_speedup_ci": ci, "expected_speedup": comp + 0.2, "expected_speedup_components": comp,
                "mean_accepted_length": tau}

    cands = [s(1, 1.204, [1.02, 1.50], 1.302, 1.76), s(2, 1.313, [0.95, 1.82], 1.519, 2.40),
             s(3, 1.243, [0.87, 1.70], 1.533, 2.77), s(4, 1.320, [0.89, 1.90], 1.563, 3.20),
             s(6, 1.194, [0.68, 1.83], 1.459, 3.69)]
    r = decide(cands)
    check_consistent(r, cands)
    assert (r.basis, r.num_draft_tokens) == ("tie", 4)
    assert r.tie_pool == "displaced" and r.displaced["num_draft_tokens"] == 1
    with pytest.raises(AssertionError, match="beats none of them on both numbers"):
        check_consistent({**r.as_dict(), "num_draft_tokens": 6}, cands)  # 6 beats 1 on the model only
    cands[3]["expected_speedup_components"] = 1.25  # the model now rates gamma 4 below gamma 1, and 2 / 3 as before
    cands[1]["expected_speedup_components"] = cands[2]["expected_speedup_components"] = 1.28
    r = decide(cands)
    check_consistent(r, cands)
    assert r.num_draft_tokens == 1 and r.tie_pool == "above_one"


def test_a_speedup_above_tau_is_marked_noisy():
    """A smoke re-evaluation under heavy load measured 1.69x [0.64, 2.51] at tau 1.04: no step can yield more than
    tau tokens per target forward, so the timing was disturbed and the verdict says so (and not for 1.1x at 1.04)."""
    from eval.report import noisy_reasons

    d = {"measured_speedup": 1.69, "measured_speedup_ci": [1.6, 1.8], "mean_accepted_length": 1.04}
    assert noisy_reasons({}, "code", d, 0.5) == [
        "measured speedup 1.69x exceeds the mean accepted length 1.04: a verify step emits tau tokens on average for "
        "one verify forward, so the speedup cannot be much above that"]
    assert noisy_reasons({}, "code", {**d, "measured_speedup": 1.1, "measured_speedup_ci": [1.05, 1.15]}, 0.5) == []


def test_the_measurement_overrules_a_tie_break_it_contradicts():
    """An adversarial table: gamma 6 measured 1.20x [1.02, 1.50] overlaps the fastest, gamma 2 at 1.40x [1.35,
    1.45], and the cost model (which misses gamma 6 by 26 % but the domain's median setting by 2 %) rates gamma 6
    highest. Gamma 2's whole interval lies above 1.20: the measurement says it is faster more surely than the
    tie-break can overturn, so gamma 2 is chosen. Reversed interval ends are read as an interval."""
    def s(g, m, ci, model):
        return {"draft": "d", "draft_length_policy": "fixed", "num_draft_tokens": g, "measured_speedup": m,
                "measured_speedup_ci": ci, "expected_speedup": model, "expected_speedup_components": model,
                "mean_accepted_length": 1.0 + g / 3}

    cands = [s(1, 1.15, [1.12, 1.18], 1.15), s(2, 1.40, [1.35, 1.45], 1.40), s(3, 1.32, [1.29, 1.34], 1.35),
             s(4, 1.30, [1.27, 1.33], 1.60), s(6, 1.20, [1.02, 1.50], 1.55)]
    r = decide(cands)
    check_consistent(r, cands)
    assert (r.basis, r.num_draft_tokens) == ("tie", 2)
    assert r.model_pick["num_draft_tokens"] == 6 and r.model_pick["measured_speedup"] == 1.20
    with pytest.raises(AssertionError, match="whole interval lies above the pick's speedup"):
        check_consistent({**r.as_dict(), "num_draft_tokens": 6}, cands)
    cands[4]["measured_speedup_ci"] = [1.50, 1.02]  # ends reversed: the same interval
    assert decide(cands).num_draft_tokens == 2


@settings(max_examples=200, deadline=None)
@given(cands=tables(), min_tau=st.sampled_from([1.0, 1.5, 2.5]))
def test_a_setting_that_cannot_pay_for_itself_is_never_recommended(cands, min_tau):
    """Settings with tau below eval.min_mean_accepted_length, or measured faster than 1.1 tau (out of physical reach),
    are set aside before the rule; when none is left the domain goes to the target alone (basis low_tau)."""
    from eval.report import add_decisions

    doc = {"context": {"min_mean_accepted_length": min_tau}, "drafts": {}}
    for c in cands:
        e = doc["drafts"].setdefault(c["draft"], {}).setdefault("d", {"sweep": {}, "policies": {}})
        entry = {k: c[k] for k in ("num_draft_tokens", "measured_speedup", "measured_speedup_ci", "expected_speedup",
                                   "expected_speedup_components", "mean_accepted_length")}
        if c["draft_length_policy"] == "fixed":
            e["sweep"][str(c["num_draft_tokens"])] = entry
        else:
            e["policies"][c["draft_length_policy"]] = entry
    add_decisions(doc)
    r = doc["recommendation"]["d"]
    payable = [c for c in cands if c["mean_accepted_length"] >= min_tau
               and c["measured_speedup"] <= 1.1 * c["mean_accepted_length"]]
    if r["action"] == SPECULATE:
        chosen = next(c for c in cands if (c["draft"], c["draft_length_policy"], c["num_draft_tokens"]) ==
                      (r["draft"], r["draft_length_policy"], r["num_draft_tokens"]))
        assert chosen in payable and chosen["mean_accepted_length"] >= min_tau
        same = ("action", "basis", "draft", "draft_length_policy", "num_draft_tokens", "measured_speedup")
        assert {k: r[k] for k in same} == {k: getattr(decide(payable), k) for k in same}
    if not payable:
        assert r["action"] == TARGET_ONLY and r["basis"] == "low_tau" and r["draft"] is None
    assert len(r["set_aside"]) == len(cands) - len(payable)


def test_the_loaded_smollm2_drafts_at_tau_1_are_not_routed(tmp_path):
    """A loaded SmolLM2 smoke run recommended drafts at tau 1.00 and 1.04 (measured 1.10x and 1.84x) and wrote them
    into routing.json and serving.json: now both domains go to the target alone and the default route too."""
    from eval.report import write_report
    from eval.decision import write_routing
    from eval.decision import recommended_settings

    rows = _rows("a", "medical", 2, 1.1, emitted=4, steps=4) + _rows("a", "code", 2, 1.84, emitted=4, steps=4)
    results = {"rows": rows, "cost_ratio": {"a": {"cost_ratio": 0.2, "draft_forward_s": 2e-4,
                                                  "target_forward_s": 1e-3}},
               "num_draft_tokens": [2], "max_new_tokens": 16, "sampling": {}, "truncated_prompts": 0,
               "timing_trials": 2, "machine_load": {}}
    doc = write_report(tmp_path, results, {"experiment_name": "t", "seed": 0, "min_mean_accepted_length": 1.5},
                       primary_num_draft_tokens=2, bootstrap_samples=100, plots=False)
    for d in ("medical", "code"):
        r = doc["recommendation"][d]
        assert doc["drafts"]["a"][d]["mean_accepted_length"] == 1.0
        assert (r["action"], r["basis"], r["draft"]) == (TARGET_ONLY, "low_tau", None), r
        assert "no setting pays for itself: best tau 1.00 < 1.5" in doc["verdicts"][d]  # the actual reason
        assert r["set_aside_reasons"] == {"low_tau": 1} and r["highest_tau"] == 1.0
        assert recommended_settings(doc)[d]["draft"] is None
    (tmp_path / "drafts" / "a").mkdir(parents=True)
    table = write_routing(tmp_path / "routing.json", doc, {"a": tmp_path / "drafts" / "a"})
    assert all(r["target_only"] for r in table["routes"].values()) and table["default"]["draft"] is None


def test_the_speedup_bound_follows_the_measured_verify_cost():
    """speedup <= tau / v: on SmolLM2 on a 2-core EPYC a 2-position verify forward cost 0.65 of the decoder's
    one-token forward, and gamma 1 measured 1.38x at tau 1.34: real, not disturbed timing."""
    from eval.decision import paying_settings, speedup_bound

    c = {"draft": "d", "draft_length_policy": "fixed", "num_draft_tokens": 1, "mean_accepted_length": 1.6,
         "measured_speedup": 1.9}
    v = {"1": {"verify_cost_ratio": 0.65}, "3": {"verify_cost_ratio": 1.3}}
    assert speedup_bound(c, v) == pytest.approx(1.6 / 0.65)
    assert speedup_bound({**c, "num_draft_tokens": 3}, v) == pytest.approx(1.6)  # v above 1: tau itself
    assert paying_settings([c], 1.5, v) == ([c], [])
    kept, dropped = paying_settings([c], 1.5, None)  # no measured v: the bound is tau
    assert kept == [] and "disturbed timing" in dropped[0]


def test_a_speedup_its_tau_cannot_explain_is_never_deployed_and_the_verdict_asks_to_re_measure():
    """gamma 4 measured 3.5x at tau 2.0 (out of physical reach: disturbed timing) beside gamma 2 at 1.3x, tau 1.8:
    the decision is gamma 2, the disturbed setting is set aside by name, and the verdict is flagged RE-MEASURE."""
    from eval.report import add_decisions, flags, verdict_line

    def e(g, s, tau):
        return {"num_draft_tokens": g, "measured_speedup": s, "measured_speedup_ci": [s - 0.1, s + 0.1],
                "expected_speedup": 1.2, "expected_speedup_components": 1.2, "mean_accepted_length": tau,
                "lossless": True}

    doc = {"context": {}, "alert_mean_accepted_length": 1.0, "drafts": {"d": {"medical": {
        "sweep": {"2": e(2, 1.3, 1.8), "4": e(4, 3.5, 2.0)}, "mean_accepted_length": 1.8}}}}
    add_decisions(doc)
    r = doc["recommendation"]["medical"]
    assert (r["action"], r["num_draft_tokens"], r["basis"]) == ("speculate", 2, "measured")
    assert len(r["set_aside"]) == 1 and "num_draft_tokens=4" in r["set_aside"][0]
    assert "RE-MEASURE" in flags(doc, "medical") and "RE-MEASURE" in verdict_line(doc, "medical")


def test_an_impossible_speedup_at_a_low_tau_also_asks_to_re_measure():
    """A loaded machine: gamma 3 measured 1.84x at tau 1.04 (below the floor, and above the 1.1 tau it allows): set
    aside for its tau, and the phrase and the verdict also say the timing was disturbed (RE-MEASURE); 1.0x at tau
    1.04 is only low."""
    from eval.report import add_decisions, flags

    def doc(speedup):
        e = {"num_draft_tokens": 3, "measured_speedup": speedup, "measured_speedup_ci": [speedup - 0.1, speedup + 0.1],
             "expected_speedup": 0.9, "expected_speedup_components": 0.9, "mean_accepted_length": 1.04,
             "lossless": True}
        d = {"context": {}, "alert_mean_accepted_length": 1.0, "drafts": {"d": {"medical": {
            "sweep": {"3": e}, "mean_accepted_length": 1.04}}}}
        add_decisions(d)
        return d

    loaded, quiet = doc(1.84), doc(1.0)
    r = loaded["recommendation"]["medical"]
    assert r["action"] != "speculate" and "tau 1.04 < 1.5" in r["set_aside"][0], r
    assert "disturbed timing, re-measure" in r["set_aside"][0] and "RE-MEASURE" in flags(loaded, "medical")
    assert "disturbed" not in quiet["recommendation"]["medical"]["set_aside"][0]
    assert "RE-MEASURE" not in flags(quiet, "medical")


def test_min_tau_zero_lets_every_draft_in_and_an_unknown_tau_never_pays():
    from eval.report import add_decisions

    def doc(min_tau, tau):
        return {"context": {"min_mean_accepted_length": min_tau}, "drafts": {"a": {"d": {"sweep": {"2": {
            "num_draft_tokens": 2, "measured_speedup": 1.2, "measured_speedup_ci": [1.1, 1.3],
            "expected_speedup": 1.2, "expected_speedup_components": None, "mean_accepted_length": tau}}}}}}

    for min_tau, tau, action in [(0, 1.2, SPECULATE), (1.5, 1.2, TARGET_ONLY), (1.0, 1.2, SPECULATE),
                                 (1.5, None, TARGET_ONLY), (1.5, float("nan"), TARGET_ONLY)]:
        d = doc(min_tau, tau)
        add_decisions(d)
        assert d["recommendation"]["d"]["action"] == action, (min_tau, tau)


@settings(max_examples=100, deadline=None)
@given(cands=tables(), min_tau=st.sampled_from([0.0, 1.5]), noisy=st.booleans())
def test_the_verdicts_are_one_row_per_domain_and_short_lines(cands, min_tau, noisy):
    """The verdict section: the table (one row per domain: deploy, measured speedup, tau, flags); every
    verdict line at most 40 words, whatever the decision and its flags; the reasoning sits under its own heading."""
    from eval.report import add_decisions, verdict_line, verdicts_section

    doc = {"context": {"min_mean_accepted_length": min_tau}, "drafts": {}, "alert_mean_accepted_length": 2.0,
           "confidence": 0.95, "num_draft_tokens": 4, "num_draft_tokens_swept": [4], "decoding": "greedy",
           "max_new_tokens": 8, "bootstrap_samples": 10, "lossless_all": True, "cost_ratio": {}, "summary": {}}
    for i, dom in enumerate(("medical", "code")):
        for c in cands:
            e = doc["drafts"].setdefault(c["draft"], {}).setdefault(dom, {"sweep": {}, "policies": {},
                                                                         "mean_accepted_length": 1.0})
            entry = {k: c[k] for k in ("num_draft_tokens", "measured_speedup", "measured_speedup_ci",
                                       "expected_speedup", "expected_speedup_components", "mean_accepted_length")}
            entry["lossless"] = not (noisy and i)
            (e["sweep"].__setitem__(str(c["num_draft_tokens"]), entry) if c["draft_length_policy"] == "fixed"
             else e["policies"].__setitem__(c["draft_length_policy"], entry))
    if noisy:
        doc["timing"] = {"machine_load": {"medical": {"loadavg_before": [5.0, 1, 1], "loadavg_after": [1.0, 1, 1],
                                                      "cores": 2, "overloaded": True}}}
    add_decisions(doc)
    doc["verdicts"] = {d: verdict_line(doc, d) for d in doc["recommendation"]}
    for d, line in doc["verdicts"].items():
        assert len(line.split()) <= 40, line
    lines = verdicts_section(doc).splitlines()  # report.md opens with it (tests/train/test_smoke_e2e.py)
    assert lines[0] == "## Verdicts" and lines[2].startswith("| domain | deploy | measured speedup")
    rows = lines[4:4 + len(doc["recommendation"])]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == list(doc["recommendation"])
    for row, (d, r) in zip(rows, doc["recommendation"].items()):
        assert ("target alone" in row) == (r["action"] == TARGET_ONLY)
        assert ("NOISY" in row) == r["noisy"]


@st.composite
def grid_tables(draw):
    """Metric tables on a coarse grid: exact ties of measured speedup and tau, intervals that miss their own point
    estimate (a bootstrap of very few resamples), settings without a speedup."""
    grid = st.sampled_from([None, 0.8, 1.0, 1.05, 1.2, 1.4])
    out, seen = [], set()
    for _ in range(draw(st.integers(1, 6))):
        draft, g = draw(st.sampled_from("xyz")), draw(st.sampled_from([1, 2, 3]))
        if (draft, g) in seen:
            continue
        seen.add((draft, g))
        s, lo, hi = draw(grid), draw(grid), draw(grid)
        out.append({"draft": draft, "draft_length_policy": "fixed", "num_draft_tokens": g, "measured_speedup": s,
                    "measured_speedup_ci": None if lo is None or hi is None else [lo, hi],
                    "expected_speedup": draw(st.sampled_from([1.5, 2.0])),
                    "expected_speedup_components": draw(st.sampled_from([None, 1.2, 1.5])),
                    "mean_accepted_length": draw(st.sampled_from([1.6, 2.0, 3.0]))})
    return out


@settings(max_examples=2000, deadline=None)
@given(cands=grid_tables())
def test_exact_ties_and_intervals_that_miss_their_estimate_pass_the_oracle(cands):
    """Found by an adversarial pass: with equal measured speedups the oracle broke the tie otherwise than the rule
    (by the higher tau), and an interval [1.21, 1.21] around an estimate of 1.20 made the pick 'lie below itself'."""
    check_consistent(decide(cands), cands)


def test_the_two_adversarial_tables():
    def c(d, g, s, ci, exp, tau):
        return {"draft": d, "draft_length_policy": "fixed", "num_draft_tokens": g, "measured_speedup": s,
                "measured_speedup_ci": ci, "expected_speedup": exp, "expected_speedup_components": None,
                "mean_accepted_length": tau}

    cands = [c("x", 2, 1.4, [0.99, 1.8], 2.0, 2.0), c("y", 1, 1.05, [1.0, 1.15], 1.5, 1.6),
             c("z", 3, 1.05, [1.0, 1.45], 2.0, 3.0)]
    r = decide(cands)
    check_consistent(r, cands)
    assert (r.draft, r.basis) == ("z", "tie")  # equal measured speedups: the higher tau
    cands = [c("a", 2, 1.30, [1.10, 1.50], 1.5, 3.0), c("a", 4, 1.20, [1.21, 1.21], 3.0, 3.0)]
    check_consistent(decide(cands), cands)


def test_a_kept_setting_without_a_speedup_does_not_hide_the_ones_set_aside():
    """gamma 2 has no measured speedup, gamma 4 measured 1.3x at tau 1.0 (set aside): the target alone, basis low_tau,
    with the reason in the report; not 'no measurement'."""
    import numpy as np

    from eval.decision import decide_domain

    every = [{"draft": "a", "draft_length_policy": "fixed", "num_draft_tokens": 2, "measured_speedup": None,
              "measured_speedup_ci": None, "mean_accepted_length": 3.0},
             {"draft": "a", "draft_length_policy": "fixed", "num_draft_tokens": 4, "measured_speedup": 1.3,
              "measured_speedup_ci": [1.2, 1.4], "mean_accepted_length": 1.0}]
    r, _ = decide_domain(every, 1.5)
    assert (r.action, r.basis, r.set_aside_reasons) == (TARGET_ONLY, "low_tau", {"low_tau": 1})
    numpy_valued = [{**every[1], "measured_speedup": np.float32(1.6), "mean_accepted_length": np.float32(2.0)}]
    r = decide(numpy_valued)  # numpy scalars are numbers
    assert r.action == SPECULATE
    check_consistent(r, numpy_valued)


def test_target_alone_never_records_a_speedup_its_tau_cannot_explain():
    """A loaded machine timed a tau-1.00 setting at 5.35x (a new user's shrunk distill_med run): the domain goes to
    the target alone, and the speedup recorded beside it (report, routing.json) is the fastest *plausible* setting's,
    or none when every one is above 1.1 tau / min(1, v)."""
    import math

    from eval.decision import decide_domain

    def s(g, speedup, tau):
        return {"draft": "a", "draft_length_policy": "fixed", "num_draft_tokens": g, "measured_speedup": speedup,
                "measured_speedup_ci": [speedup * 0.9, speedup * 1.1], "mean_accepted_length": tau}

    every = [s(2, 5.35, 1.0), s(3, 0.92, 1.3)]
    r, _ = decide_domain(every, 1.5, {"3": {"verify_cost_ratio": 1.0}, "4": {"verify_cost_ratio": 1.0}})
    assert (r.action, r.basis) == (TARGET_ONLY, "low_tau")
    assert r.measured_speedup == 0.92 and r.mean_accepted_length == 1.3
    r, _ = decide_domain([s(2, 5.35, 1.0)], 1.5)
    assert r.action == TARGET_ONLY and math.isnan(r.measured_speedup)


def test_alert_reads_every_setting_of_a_draft_not_only_the_tables_gamma():
    """gamma 4 (the tables' gamma) reached tau 1.9, gamma 6 2.4 at 1.6x: the verdict deploys gamma 6 and is no ALERT
    (alert below 2): the alert is about drafts that accept too little at every setting."""
    from eval.report import add_decisions, flags

    def e(g, s, tau):
        return {"num_draft_tokens": g, "measured_speedup": s, "measured_speedup_ci": [s - .05, s + .05],
                "expected_speedup": 1.2, "expected_speedup_components": None, "mean_accepted_length": tau,
                "lossless": True}

    doc = {"context": {}, "alert_mean_accepted_length": 2.0, "drafts": {"a": {"m": {
        "sweep": {"4": e(4, 1.1, 1.9), "6": e(6, 1.6, 2.4)}, "mean_accepted_length": 1.9}}}}
    add_decisions(doc)
    assert doc["recommendation"]["m"]["num_draft_tokens"] == 6 and "ALERT" not in flags(doc, "m")
    doc["drafts"]["a"]["m"]["sweep"]["6"]["mean_accepted_length"] = 1.95
    add_decisions(doc)
    assert "ALERT" in flags(doc, "m")


@pytest.mark.parametrize("g4", [(0.8, 2.0), (1.2, 2.0), (1.2, 1.2)])
def test_serving_and_the_default_route_give_engines_only_a_fixed_gamma_that_pays(tmp_path, g4):
    """An adversarial table: gamma 2 measured 6.0x at tau 2.0 (disturbed: set aside), an adaptive policy 1.3x at tau
    3 (the decision). Engines need a fixed gamma: serving.json gives gamma 4 only where it pays (at least 1x, tau at
    least 1.5), else the target alone; routing.json's default never rests on the set-aside 6.0x."""
    from eval.decision import routing_table
    from eval.decision import recommended_settings
    from eval.report import add_decisions

    def e(g, s, tau):
        return {"num_draft_tokens": g, "measured_speedup": s, "measured_speedup_ci": [s - .05, s + .05],
                "expected_speedup": 1.2, "expected_speedup_components": None, "mean_accepted_length": tau,
                "lossless": True, "acceptance_rate": 0.5}

    entry = {"sweep": {"2": e(2, 6.0, 2.0), "4": e(4, *g4)}, "policies": {"adaptive": e(8, 1.3, 3.0)},
             "best_num_draft_tokens": 2, "num_draft_tokens": 4, "mean_accepted_length": g4[1]}
    doc = {"context": {}, "alert_mean_accepted_length": 1.0, "num_draft_tokens": 4, "num_draft_tokens_swept": [2, 4],
           "drafts": {"a": {"m": {**entry, **entry["sweep"]["4"]}}}}
    add_decisions(doc)
    assert doc["recommendation"]["m"]["draft_length_policy"] == "adaptive"
    served = recommended_settings(doc)["m"]
    table = routing_table(doc, {"a": tmp_path})
    if g4 == (1.2, 2.0):
        assert (served["draft"], served["num_draft_tokens"], served["measured_speedup"]) == ("a", 4, 1.2)
        assert (table["default"]["draft"], table["default"]["num_draft_tokens"]) == ("a", 4)
    else:  # gamma 4 slower than the target, or below the tau floor: no fixed gamma pays
        assert served["draft"] is None and served["num_draft_tokens"] == 0 and "target" in served["note"]
        assert table["default"]["target_only"]
