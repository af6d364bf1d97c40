"""eval.metrics / eval.report on hand-made per-prompt rows (no models): pooling, bootstrap intervals,
percentiles, the Leviathan numbers, the sweep recommendation, the CSV round trip, verdicts and plots."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decode.stats import expected_speedup, expected_speedup_mixture
from eval.metrics import (PER_PROMPT_COLUMNS, aggregate, loop_overhead_per_step, bootstrap_ratio_ci, cell_metrics, json_clean, percentiles,
                          read_per_prompt_csv)
from eval.report import metrics_document, render_markdown, write_per_prompt_csv, write_report


def row(draft="d", domain="x", g=2, steps=4, accepted=4, emitted=8, new=8, spec_t=1.0, tnew=8, tgt_t=2.0, pid="p",
        hist=None, ppd=None, ppa=None, equal=True, policy="fixed", lengths=None):
    lengths = lengths if lengths is not None else [g] * steps
    return {"draft_length_policy": policy, "draft_lengths": lengths, "draft": draft, "domain": domain, "prompt_id": pid, "num_draft_tokens": g, "prompt_tokens": 10,
            "truncated": False, "new_tokens": new, "verify_steps": steps, "drafted_tokens": sum(lengths),
            "nodes_verified": sum(lengths), "numerical_tie_gap": None, "lookup_drafted_tokens": None,
            "accepted_tokens": accepted, "emitted_tokens": emitted, "draft_time_s": 0.25 * spec_t,
            "verify_time_s": 0.5 * spec_t, "prefill_time_s": 0.1 * spec_t, "speculative_time_s": spec_t,
            "target_new_tokens": tnew, "target_time_s": tgt_t, "greedy_equal": equal,
            "speculative_trial_times_s": [spec_t], "target_trial_times_s": [tgt_t],
            "per_position_drafted": ppd if ppd is not None else [steps, 2],
            "per_position_accepted": ppa if ppa is not None else [2, 1],
            "accepted_length_histogram": hist if hist is not None else [2, 1, 1]}


def test_pooled_ratios_are_ratios_of_sums_not_means_of_means():
    rows = [row(steps=1, emitted=3, accepted=2, pid="a"), row(steps=9, emitted=9, accepted=0, pid="b")]
    e = cell_metrics(rows, 0.5, num_draft_tokens=2, bootstrap_samples=0)
    assert e["mean_accepted_length"] == pytest.approx(12 / 10)  # not (3 + 1) / 2
    assert e["acceptance_rate"] == pytest.approx(2 / 20)
    assert e["mean_accepted_length_ci"] is None
    assert e["stats"]["verify_steps"] == 10 and e["accepted_length_histogram"] == [4, 2, 2]
    assert e["per_position_acceptance"] == pytest.approx([4 / 10, 2 / 4])
    # the Leviathan numbers use the per-token acceptance (accepted / positions reached), pooled
    a = (4 + 2) / (10 + 4)
    assert e["token_acceptance_rate"] == pytest.approx(a)
    assert e["expected_speedup"] == pytest.approx(expected_speedup(a, 2, 0.5))
    assert e["expected_mean_accepted_length"] == pytest.approx((1 - a ** 3) / (1 - a))
    # speedup = pooled speculative tok/s over pooled target tok/s
    assert e["measured_speedup"] == pytest.approx((16 / 2.0) / (16 / 4.0))
    assert e["lossless"] is True


def test_bootstrap_interval_is_seeded_and_brackets_the_pooled_ratio():
    rng = np.random.default_rng(1)
    den = rng.integers(5, 30, size=40).astype(float)
    num = den * rng.uniform(1.0, 4.0, size=40)
    ci = bootstrap_ratio_ci(num, den, samples=500, confidence=0.95, seed=3)
    assert ci == bootstrap_ratio_ci(num, den, samples=500, confidence=0.95, seed=3)  # fixed seed: same interval
    assert ci != bootstrap_ratio_ci(num, den, samples=500, confidence=0.95, seed=4)
    point = num.sum() / den.sum()
    assert ci[0] < point < ci[1]
    narrow = bootstrap_ratio_ci(num, den, samples=500, confidence=0.5, seed=3)
    assert ci[0] <= narrow[0] <= narrow[1] <= ci[1]
    # each resample recomputes the POOLED ratio: a hand-rolled loop with the same draws agrees
    idx = np.random.default_rng(3).integers(0, 40, size=(500, 40))
    stats = [num[i].sum() / den[i].sum() for i in idx]
    assert ci == pytest.approx(list(np.quantile(stats, [0.025, 0.975])))
    # one prompt: a degenerate interval; identical prompts: zero width
    assert bootstrap_ratio_ci(num[:1], den[:1], samples=50, confidence=0.95, seed=0) == pytest.approx(
        [num[0] / den[0]] * 2)
    assert bootstrap_ratio_ci(np.ones(5) * 3, np.ones(5), samples=50, confidence=0.95, seed=0) == [3.0, 3.0]
    assert bootstrap_ratio_ci(num, den, samples=0, confidence=0.95, seed=0) is None


def test_percentiles():
    v = list(range(1, 101))
    p = percentiles(v)
    assert p == {"p50": pytest.approx(np.percentile(v, 50)), "p95": pytest.approx(np.percentile(v, 95)),
                 "p99": pytest.approx(np.percentile(v, 99))}
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None}


def _sweep_rows():
    rows = []
    # draft "a": fastest at gamma 4 on x, at gamma 1 on y; draft "b" is slower everywhere except y at gamma 2
    speed = {("a", "x"): {1: 1.2, 2: 1.5, 4: 1.9}, ("a", "y"): {1: 1.1, 2: 0.9, 4: 0.7},
             ("b", "x"): {1: 1.0, 2: 1.1, 4: 1.2}, ("b", "y"): {1: 0.8, 2: 1.3, 4: 0.6}}
    for (d, dom), by_g in speed.items():
        for g, s in by_g.items():
            for i in range(3):
                rows.append(row(draft=d, domain=dom, g=g, spec_t=2.0 / s, tgt_t=2.0, pid=str(i),
                                ppd=[4] + [2] * (g - 1), ppa=[2] * g, hist=[1, 1, 1] + [1] * (g - 2)))
    return rows


def test_aggregate_recommends_the_fastest_measured_setting_per_domain():
    out = aggregate(_sweep_rows(), {"a": 0.2, "b": 0.1}, primary_num_draft_tokens=3, bootstrap_samples=50)
    rec = out["recommendation"]
    assert (rec["x"]["draft"], rec["x"]["num_draft_tokens"]) == ("a", 4)
    assert (rec["y"]["draft"], rec["y"]["num_draft_tokens"]) == ("b", 2)
    assert rec["y"]["measured_speedup"] == pytest.approx(1.3)
    assert out["drafts"]["a"]["y"]["best_num_draft_tokens"] == 1
    # primary gamma: decode.num_draft_tokens=3 was not measured, the closest (ties: smaller) is reported
    assert out["drafts"]["a"]["x"]["num_draft_tokens"] == 2
    e = out["drafts"]["a"]["x"]
    assert sorted(e["sweep"]) == ["1", "2", "4"]
    curve = e["leviathan_curve"]
    assert curve["num_draft_tokens"] == list(range(1, 9))
    alpha = e["token_acceptance_rate_pooled_over_sweep"]
    assert curve["expected_speedup"][3] == pytest.approx(expected_speedup(alpha, 4, 0.2))


def test_measured_parts_are_unknown_rather_than_guessed_for_an_older_tree_row():
    """A token-tree cell prices its step with the verify cost of its nodes; a row from a file written before
    ``nodes_verified`` existed gives no expectation (null), never the chain formula at the tree's depth."""
    v = {"2": {"verify_cost_ratio": 1.3}, "5": {"verify_cost_ratio": 1.6}}
    tree = [row(g=2, policy="tree:2,1", pid=str(i)) for i in range(3)]
    for r in tree:
        r["nodes_verified"] = 5 * r["verify_steps"]
    e = cell_metrics(tree, 0.2, num_draft_tokens=2, bootstrap_samples=0, draft_length_policy="tree:2,1",
                     verify_cost_ratio=v, step_overhead=0.1)
    assert e["expected_speedup_components"] == pytest.approx(e["mean_accepted_length"] / (2 * 0.2 + 1.6 + 0.1))
    older = [{**r, "nodes_verified": None} for r in tree]
    assert cell_metrics(older, 0.2, num_draft_tokens=2, bootstrap_samples=0, draft_length_policy="tree:2,1",
                        verify_cost_ratio=v, step_overhead=0.1)["expected_speedup_components"] is None
    chain = cell_metrics([{**r, "nodes_verified": None} for r in (row(g=2, pid="c"),)], 0.2, num_draft_tokens=2,
                         bootstrap_samples=0, verify_cost_ratio=v, step_overhead=0.1)
    assert chain["expected_speedup_components"] is not None  # a chain needs no node count


def test_csv_round_trip_rebuilds_every_number(tmp_path):
    rows = _sweep_rows()
    rows[0]["greedy_equal"] = None
    write_per_prompt_csv(tmp_path / "per_prompt.csv", rows)
    back = read_per_prompt_csv(tmp_path / "per_prompt.csv")
    assert back == rows
    assert list(back[0]) == list(PER_PROMPT_COLUMNS)
    a = aggregate(rows, {"a": 0.2, "b": 0.1}, primary_num_draft_tokens=2, bootstrap_samples=100, seed=7)
    b = aggregate(back, {"a": 0.2, "b": 0.1}, primary_num_draft_tokens=2, bootstrap_samples=100, seed=7)
    assert json_clean(a) == json_clean(b)


def _results(rows, gammas=(1, 2, 4)):
    return {"rows": rows, "cost_ratio": {d: {"cost_ratio": c, "draft_forward_s": c * 1e-3, "target_forward_s": 1e-3}
                                         for d, c in (("a", 0.2), ("b", 0.1))},
            "num_draft_tokens": list(gammas), "max_new_tokens": 8, "sampling": {}, "truncated_prompts": 0}


def test_verdict_alerts_below_the_threshold_and_report_is_strict_json(tmp_path):
    rows = _sweep_rows()
    doc = metrics_document(_results(rows), {"experiment_name": "t", "seed": 0}, primary_num_draft_tokens=4,
                           bootstrap_samples=50, alert_mean_accepted_length=2.5)
    # every row has tau = 8 / 4 = 2 < 2.5
    assert all("**ALERT**" in v for v in doc["verdicts"].values())
    assert "use `a` with num_draft_tokens=4" in doc["verdicts"]["x"]
    ok = metrics_document(_results(rows), {"experiment_name": "t", "seed": 0}, primary_num_draft_tokens=4,
                          bootstrap_samples=50, alert_mean_accepted_length=2.0)
    assert not any("ALERT" in v for v in ok["verdicts"].values())
    md = render_markdown(ok)
    assert "## Verdicts" in md and "| x | a |" in md
    doc = write_report(tmp_path, _results(rows), {"experiment_name": "t", "seed": 0}, primary_num_draft_tokens=4,
                       bootstrap_samples=20, plots=False)
    text = (tmp_path / "metrics.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert doc["plots"] == {} and (tmp_path / "report.md").exists()


def test_nan_cells_do_not_break_the_report(tmp_path):
    # a prompt that emitted nothing (EOS first) drafts nothing: alpha is undefined, not an error
    rows = [row(draft="a", g=1, steps=0, accepted=0, emitted=0, new=0, ppd=[], ppa=[], hist=[]),
            row(draft="b", g=1, steps=0, accepted=0, emitted=0, new=0, ppd=[], ppa=[], hist=[])]
    doc = write_report(tmp_path, _results(rows, (1,)), {"experiment_name": "t", "seed": 0}, bootstrap_samples=10,
                       plots=True)
    assert doc["drafts"]["a"]["x"]["acceptance_rate"] is None
    assert (tmp_path / "plots" / "acceptance_by_domain.png").stat().st_size > 1000


def _vs_rows(draft: str, emitted: list[int], steps: list[int], gamma: int = 4, domain: str = "medical") -> list[dict]:
    return [{"draft": draft, "domain": domain, "prompt_id": f"p{i}", "num_draft_tokens": gamma,
             "emitted_tokens": e, "verify_steps": v} for i, (e, v) in enumerate(zip(emitted, steps))]


@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30), st.integers(1, 60), st.integers(1, 30)),
                min_size=1, max_size=12))
@settings(max_examples=40, deadline=None)
def test_ratio_vs_baseline_is_the_pooled_ratio_with_a_paired_interval(cells):
    from eval.metrics import ratios_vs_reference

    de, dv, be, bv = (list(c) for c in zip(*cells))
    rows = _vs_rows("distilled", de, dv) + _vs_rows("baseline", be, bv) + _vs_rows("distilled", de, dv, gamma=2)
    out = ratios_vs_reference(rows, num_draft_tokens=4, bootstrap_samples=200)
    r = out["distilled"]["medical"]
    assert r["mean_accepted_length_ratio"] == pytest.approx((sum(de) / sum(dv)) / (sum(be) / sum(bv)))
    assert r["num_prompts"] == len(cells) and "baseline" not in out
    lo, hi = r["ci"]
    assert lo <= r["mean_accepted_length_ratio"] * (1 + 1e-9) and hi >= r["mean_accepted_length_ratio"] * (1 - 1e-9)
    # Identical drafts: every paired resample gives exactly 1 (an unpaired bootstrap would not).
    same = ratios_vs_reference(_vs_rows("a", de, dv) + _vs_rows("baseline", de, dv), num_draft_tokens=4,
                               bootstrap_samples=200)
    assert same["a"]["medical"]["ci"] == pytest.approx([1.0, 1.0])


def test_ratio_vs_baseline_pairs_prompts_and_needs_the_baseline():
    from eval.metrics import ratios_vs_reference

    rows = _vs_rows("distilled", [10, 20, 30], [5, 5, 5]) + _vs_rows("baseline", [10, 20], [10, 10])
    r = ratios_vs_reference(rows, num_draft_tokens=4, bootstrap_samples=0)["distilled"]["medical"]
    assert r["num_prompts"] == 2 and r["mean_accepted_length_ratio"] == pytest.approx((30 / 10) / (30 / 20))
    assert r["ci"] is None
    assert ratios_vs_reference(_vs_rows("distilled", [1], [1]), num_draft_tokens=4) == {}


def _policy_rows(speed: float, lengths: list[int], domain: str = "y", policy: str = "adaptive"):
    """3 prompts of one draft-length policy on draft "b": measured speedup ``speed``, these draft lengths each."""
    return [row(draft="b", domain=domain, g=max(lengths), steps=len(lengths), spec_t=2.0 / speed, tgt_t=2.0,
                pid=str(i), policy=policy, lengths=lengths, ppd=[len(lengths), 2], ppa=[2, 1]) for i in range(3)]


def test_a_policy_faster_than_every_gamma_is_recommended_and_reported_per_domain(tmp_path):
    lengths = [2, 3, 4, 3]
    rows = _sweep_rows() + _policy_rows(1.6, lengths) + _policy_rows(0.5, [5, 1, 1, 0], policy="confidence")
    out = aggregate(rows, {"a": 0.2, "b": 0.1}, primary_num_draft_tokens=2, bootstrap_samples=0)
    rec = out["recommendation"]
    assert rec["y"]["draft"] == "b" and rec["y"]["draft_length_policy"] == "adaptive"  # 1.6x beats b@2's 1.3x
    assert rec["y"]["measured_speedup"] == pytest.approx(1.6) and rec["y"]["num_draft_tokens"] == 4  # its cap
    assert rec["x"]["draft_length_policy"] == "fixed" and rec["x"]["num_draft_tokens"] == 4  # the sweep still wins x
    pol = out["drafts"]["b"]["y"]["policies"]
    assert sorted(pol) == ["adaptive", "confidence"] and "policies" not in out["drafts"]["a"]["y"]
    a = pol["adaptive"]
    assert a["draft_length_histogram"] == [0, 0, 3, 6, 3] and a["mean_draft_length"] == pytest.approx(3.0)
    alpha = a["token_acceptance_rate"]
    assert a["expected_speedup"] == pytest.approx(expected_speedup_mixture(alpha, [0, 0, 3, 6, 3], 0.1))
    # policy rows never leak into the sweep's cells
    assert out["drafts"]["b"]["y"]["sweep"]["4"]["num_prompts"] == 3
    assert pol["confidence"]["draft_length_histogram"] == [3, 6, 0, 0, 0, 3]
    doc = metrics_document(_results(rows), {"experiment_name": "t", "seed": 0}, primary_num_draft_tokens=2,
                           bootstrap_samples=0)
    assert doc["verdicts"]["y"].startswith("use `b` with draft_length_policy=adaptive: measured speedup 1.60x")
    md = render_markdown(doc)
    assert "## Draft-length policies" in md and "| y | b | **adaptive** |" in md
    assert "2:3 3:6 4:3" in md  # the draft lengths actually used, as length:steps
    # and the CSV rebuilds it all
    write_per_prompt_csv(tmp_path / "per_prompt.csv", rows)
    again = aggregate(read_per_prompt_csv(tmp_path / "per_prompt.csv"), {"a": 0.2, "b": 0.1},
                      primary_num_draft_tokens=2, bootstrap_samples=0)
    assert json_clean(again) == json_clean(out)


@settings(max_examples=60, deadline=None)
@given(a=st.floats(0.0, 1.0), g=st.integers(0, 12), c=st.floats(0.0, 2.0), n=st.integers(1, 50))
def test_expected_speedup_of_one_draft_length_is_leviathans(a, g, c, n):
    hist = [0] * g + [n]
    assert expected_speedup_mixture(a, hist, c) == pytest.approx(expected_speedup(a, g, c))


def test_expected_speedup_mixture_pools_over_steps_not_a_mean_of_speedups():
    a, c = 0.6, 0.3
    tokens = 3 * (1 - a ** 2) / (1 - a) + 1 * (1 - a ** 6) / (1 - a)  # 3 steps of length 1, 1 step of length 5
    cost = 3 * (c + 1) + (5 * c + 1)
    assert expected_speedup_mixture(a, [0, 3, 0, 0, 0, 1], c) == pytest.approx(tokens / cost)
    assert expected_speedup_mixture(a, [], c) != expected_speedup_mixture(a, [], c)  # NaN: no steps
    with pytest.raises(ValueError, match="acceptance_rate"):
        expected_speedup_mixture(1.5, [1], c)


@given(st.lists(st.tuples(st.floats(0.01, 5.0), st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
                min_size=1, max_size=6), st.floats(0.5, 3.0))
@settings(max_examples=30, deadline=None)
def test_time_breakdown_splits_the_wall_time_and_prices_the_measured_components(cells, v):
    """Per (draft, domain): prefill + draft + verify + other = the speculative wall time (pooled over prompts),
    loop efficiency = time in forwards / wall, the in-loop ratios divide per-step / per-token times by the target's
    one-position forward, and the expected speedup from measured components is the cell's tau over k c + v."""
    from eval.evaluate import time_breakdown, time_breakdown_section

    rows = []
    for i, (wall, fp, fd, fv) in enumerate(cells):
        r = row(draft="a", g=2, spec_t=wall, pid=str(i))
        total = fp + fd + fv or 1.0
        r.update(prefill_time_s=wall * fp / total * 0.9, draft_time_s=wall * fd / total * 0.9,
                 verify_time_s=wall * fv / total * 0.9)
        rows.append(r)
    rows.append(row(draft="a", g=4, spec_t=100.0, pid="other gamma"))  # another gamma: not in the gamma-2 cell
    results = {**_results(rows, (2, 4)), "verify_cost_ratio": {"2": {"verify_cost_ratio": v}}}
    doc = metrics_document(results, {"experiment_name": "t", "seed": 0}, primary_num_draft_tokens=2,
                           bootstrap_samples=0)
    e = doc["time_breakdown"]["a"]["x"]
    cell = rows[:-1]
    wall = sum(r["speculative_time_s"] for r in cell)
    parts = [sum(r[k] for r in cell) for k in ("prefill_time_s", "draft_time_s", "verify_time_s")]
    assert e["wall_s"] == pytest.approx(wall)
    assert e["prefill_s"] + e["draft_s"] + e["verify_s"] + e["other_s"] == pytest.approx(wall)
    assert [e["prefill_s"], e["draft_s"], e["verify_s"]] == pytest.approx(parts)
    assert e["loop_efficiency"] == pytest.approx(sum(parts) / wall) and e["loop_efficiency"] <= 0.9 + 1e-9
    steps, drafted = sum(r["verify_steps"] for r in cell), sum(r["drafted_tokens"] for r in cell)
    assert e["verify_cost_ratio_in_loop"] == pytest.approx(parts[2] / steps / 1e-3)
    assert e["cost_ratio_in_loop"] == pytest.approx(parts[1] / drafted / 1e-3)
    a = doc["drafts"]["a"]["x"]["token_acceptance_rate"]
    assert e["expected_speedup_leviathan"] == pytest.approx(doc["drafts"]["a"]["x"]["expected_speedup"])
    tau = doc["drafts"]["a"]["x"]["mean_accepted_length"]
    o = (wall - sum(parts)) / steps / 1e-3  # the loop's own work per step, in target forwards (1 ms each here)
    assert doc["drafts"]["a"]["x"]["loop_overhead_per_step"] == pytest.approx(
        loop_overhead_per_step(rows[:-1] + [rows[-1]], 1e-3))  # every setting of the draft and domain pooled
    o = doc["drafts"]["a"]["x"]["loop_overhead_per_step"]
    assert e["expected_speedup_components"] == pytest.approx(tau / (2 * 0.2 + v + o))  # every step drafted 2 tokens
    assert e["expected_speedup_components"] == doc["drafts"]["a"]["x"]["expected_speedup_components"]
    assert e["measured_speedup"] == doc["drafts"]["a"]["x"]["measured_speedup"]
    md = "\n".join(time_breakdown_section(doc))
    assert "## Where decoding time goes (gamma = 2)" in md and f"| {e['verify_cost_ratio']:.2f} (" in md
    # rows of an older per_prompt.csv (no prefill_time_s): the split is unknown, never invented
    old = time_breakdown([{k: x for k, x in r.items() if k != "prefill_time_s"} for r in cell],
                         results["cost_ratio"], None, doc["drafts"], 2)["a"]["x"]
    assert old["prefill_s"] is old["other_s"] is old["loop_efficiency"] is old["expected_speedup_components"] is None
    assert "n/a" in "\n".join(time_breakdown_section({**doc, "time_breakdown": {"a": {"x": old}}}))
