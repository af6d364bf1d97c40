"""The routing table: written from measured numbers (best measured speedup per domain), loaded by the decoder side
(decode.config.load_routing) with clear errors, and used by the evaluation (each domain decoded with its draft)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from decode.config import DEFAULT_KEY, load_routing
from core.errors import RoutingError
from eval.report import metrics_document
from eval.decision import write_routing


def _row(draft, domain, pid, g, spec_t, emitted, steps):
    return {"draft": draft, "domain": domain, "prompt_id": pid, "num_draft_tokens": g, "prompt_tokens": 10,
            "truncated": False, "new_tokens": 16, "verify_steps": steps, "drafted_tokens": steps * g,
            "accepted_tokens": emitted - steps, "emitted_tokens": emitted, "draft_time_s": 0.2 * spec_t,
            "verify_time_s": 0.6 * spec_t, "speculative_time_s": spec_t, "target_new_tokens": 16,
            "target_time_s": 1.0, "greedy_equal": True, "per_position_drafted": [steps],
            "per_position_accepted": [min(steps, emitted - steps)], "accepted_length_histogram": [steps]}


def _fake_drafts(tmp_path: Path, names) -> dict[str, Path]:
    out = {}
    for n in names:
        d = tmp_path / "drafts" / n
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        out[n] = d
    return out


def _doc(rng: random.Random, drafts, domains, gammas=(2, 4)):
    rows = []
    for dr in drafts:
        for dom in domains:
            for g in gammas:
                for p in range(3):
                    steps = rng.randint(4, 16)
                    rows.append(_row(dr, dom, f"p{p}", g, rng.uniform(0.2, 2.0), rng.randint(steps, steps * (g + 1)),
                                     steps))
    results = {"rows": rows, "cost_ratio": {d: {"cost_ratio": 0.3} for d in drafts}, "num_draft_tokens": list(gammas),
               "max_new_tokens": 16, "sampling": {}, "truncated_prompts": 0}
    return metrics_document(results, {"target": "t"}, primary_num_draft_tokens=4, bootstrap_samples=0)


# seeds 14 and 47: some domains route to a draft whose geometric-mean speedup is still below 1 (fallback: target alone)
@pytest.mark.parametrize("seed", [*range(6), 14, 47])
def test_each_domain_routes_to_the_draft_with_the_best_measured_speedup(tmp_path, seed):
    rng = random.Random(seed)
    drafts, domains = ["a", "b", "c"][: rng.randint(1, 3)], ["medical", "code", "chat"]
    doc = _doc(rng, drafts, domains)
    paths = _fake_drafts(tmp_path, drafts)
    table = write_routing(tmp_path / "routing.json", doc, paths)
    for dom in domains:
        best = max(((dr, g) for dr in drafts for g in ("2", "4")),
                   key=lambda k: doc["drafts"][k[0]][dom]["sweep"][k[1]]["measured_speedup"])
        r = table["routes"][dom]
        if doc["drafts"][best[0]][dom]["sweep"][best[1]]["measured_speedup"] < 1:  # no draft pays: the target alone
            assert r["target_only"] and r["draft"] is None and r["path"] is None
            continue
        assert (r["draft"], str(r["num_draft_tokens"])) == best
        assert r["measured_speedup"] == doc["drafts"][best[0]][dom]["sweep"][best[1]]["measured_speedup"]
        assert set(r["candidates"]) == set(drafts)  # the numbers behind the choice
    loaded = load_routing(tmp_path / "routing.json")
    assert {d: r.path for d, r in loaded.routes.items()} == {
        d: str(paths[table["routes"][d]["draft"]].resolve()) if table["routes"][d]["draft"] else None
        for d in domains}
    assert all(loaded.draft_for(d).target_only == (table["routes"][d]["draft"] is None) for d in domains)
    import math

    # the fallback: the (draft, fixed gamma) with the best geometric-mean speedup over the domains, among the pairs
    # that pay for themselves in every domain (tau floor, tau bound, at least 1x) and whose draft some domain routes
    # to; else the target alone (computed here from the numbers, not with the router's helpers)
    floor = doc["min_mean_accepted_length"]
    routed = {r["draft"] for r in table["routes"].values() if r["draft"]}
    geo = {}
    for dr in routed:
        for g in ("2", "4"):
            cells = [doc["drafts"][dr][d]["sweep"][g] for d in domains]
            if all(c["measured_speedup"] >= 1 and c["mean_accepted_length"] >= floor
                   and c["measured_speedup"] <= 1.1 * c["mean_accepted_length"] for c in cells):
                geo[(dr, int(g))] = sum(math.log(c["measured_speedup"]) for c in cells)
    if not geo:
        assert loaded.default.target_only and table[DEFAULT_KEY]["draft"] is None
        assert loaded.draft_for("math").target_only
        return
    best = max(geo, key=geo.get)
    assert (loaded.default.draft, table[DEFAULT_KEY]["num_draft_tokens"]) == best
    assert loaded.draft_for("math") == loaded.default  # unrouted domain -> default


def test_loader_errors_name_the_problem(tmp_path):
    with pytest.raises(RoutingError, match="does not exist"):
        load_routing(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(RoutingError, match="not valid JSON"):
        load_routing(bad)
    bad.write_text(json.dumps({"routes": {"medical": {"draft": "x"}}}))
    with pytest.raises(RoutingError, match="routes.medical.*path"):
        load_routing(bad)
    bad.write_text(json.dumps({"routes": {"medical": {"path": str(tmp_path / "missing")}}}))
    with pytest.raises(RoutingError, match="no config.json"):
        load_routing(bad)
    bad.write_text(json.dumps({"schema": "other/9", "routes": {}}))
    with pytest.raises(RoutingError, match="schema"):
        load_routing(bad)
    paths = _fake_drafts(tmp_path, ["a"])
    bad.write_text(json.dumps({"routes": {"medical": {"path": "drafts/a"}}}))  # relative to the table's folder
    table = load_routing(bad)
    assert table.draft_for("medical").path == str(paths["a"]) and table.default is None
    with pytest.raises(RoutingError, match="no route for domain 'code'.*default"):
        table.draft_for("code")
    assert table.as_paths() == {"medical": str(paths["a"])}
    bad.write_text(json.dumps({"routes": {}, DEFAULT_KEY: {"path": "drafts/a"}}))
    assert load_routing(bad).draft_for("anything").path == str(paths["a"])


def _save_tiny_draft(out: Path, seed: int):
    from models.checkpoints import load_causal_lm
    from models.checkpoints import save_hf_atomic
    from distill.drafts import LlamaArch, build_llama

    _, tok = load_causal_lm("models/assets/reference_target", role="target")
    arch = LlamaArch(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=256)
    save_hf_atomic(build_llama(arch, tok, seed=seed), tok, out)
    return out


def test_evaluation_with_routing_decodes_each_domain_with_its_routed_draft(tmp_path):
    from train.run import validate

    from eval.pipeline import evaluate_run

    a = _save_tiny_draft(tmp_path / "drafts" / "a", 0)
    b = _save_tiny_draft(tmp_path / "drafts" / "b", 1)
    table = tmp_path / "routing.json"
    table.write_text(json.dumps({"routes": {"medical": {"draft": "a", "path": str(a)},
                                            "code": {"draft": "b", "path": str(b)},
                                            "chat": {"draft": None, "path": None, "target_only": True}}}))
    cfg = {"target": {"name_or_path": "models/assets/reference_target"}, "decode": {"draft_routing": str(table)},
           "eval": {"domains": ["medical", "code", "chat"], "max_prompts": 1, "max_new_tokens": 4, "max_prompt_tokens": 32,
                    "cost_ratio_trials": 1, "bootstrap_samples": 0, "plots": True}}  # plots of a sparse doc
    rc = validate(cfg)
    out = evaluate_run(rc, rc.data.options(), tmp_path / "run")
    assert len(out["plots"]) == 4
    rows = (tmp_path / "run" / "per_prompt.csv").read_text().splitlines()[1:]
    assert sorted({(r.split(",")[0], r.split(",")[1]) for r in rows}) == [("a", "medical"), ("b", "code")]
    assert out["routed"] == {"medical": "a", "code": "b", "chat": None}  # chat: routed to no draft
    assert not (tmp_path / "run" / "routing.json").exists()  # the input table is never overwritten
    doc = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert doc["context"]["draft_routing"]["routes"] == {"medical": "a", "code": "b", "chat": None}
    chat = doc["context"]["draft_routing"]["target_only"]["chat"]  # decoded with the target alone
    assert chat["prompts"] == 1 and chat["new_tokens"] == 4 and chat["tokens_per_s"] > 0
    assert "- **chat**: decoded with the target alone" in (tmp_path / "run" / "report.md").read_text()
    # each routed group measured v for its own draft lengths; the document keeps every group's
    from eval.metrics import read_per_prompt_csv

    used = {k for r in read_per_prompt_csv(tmp_path / "run" / "per_prompt.csv") for k in r["draft_lengths"] if k}
    assert used and used <= {int(k) for k in doc["verify_cost_ratio"]}
    assert all(doc["drafts"][n][d]["expected_speedup_components"] is not None for n, d in (("a", "medical"),
                                                                                          ("b", "code")))

    # a table that sends every domain to the target alone (a smoke run's): decoded, no plots, no traceback
    alone = tmp_path / "alone.json"
    alone.write_text(json.dumps({"routes": {d: {"draft": None, "path": None, "target_only": True}
                                            for d in ("medical", "code")}}))
    rc = validate({**cfg, "decode": {"draft_routing": str(alone)},
                   "eval": {**cfg["eval"], "domains": ["medical", "code"]}})
    out = evaluate_run(rc, rc.data.options(), tmp_path / "alone")
    assert out["plots"] == {} and out["routed"] == {"medical": None, "code": None}
    report = (tmp_path / "alone" / "report.md").read_text()
    assert "## Plots" not in report and "- **code**: decoded with the target alone" in report

    # a domain without a route (and no default) fails before any model loads
    cfg["eval"]["plots"] = False
    rc = validate({**cfg, "eval": {**cfg["eval"], "domains": ["medical", "math"]}})
    with pytest.raises(RoutingError, match="no route for domain 'math'"):
        evaluate_run(rc, rc.data.options(), tmp_path / "run2")
    rc = validate({**cfg, "eval": {**cfg["eval"], "drafts": {"x": str(a)}}})
    with pytest.raises(RoutingError, match="both name drafts"):
        evaluate_run(rc, rc.data.options(), tmp_path / "run3")


def test_the_routing_section_says_what_the_target_alone_rows_speedup_is():
    """A domain sent to the target alone shows the fastest draft setting whose timing its tau can explain (a
    disturbed, faster one is only among the other drafts), not "the fastest draft"."""
    from eval.decision import routing_section

    table = {"routes": {"code": {"target_only": True, "draft": None, "measured_speedup": 0.52,
                                 "candidates": {"distilled": {"mean_accepted_length": 1.0, "measured_speedup": 0.52},
                                                "baseline": {"mean_accepted_length": 1.0, "measured_speedup": 1.39}}}}}
    row = [r for r in routing_section(table, "routing.json").splitlines() if r.startswith("| code |")][0]
    assert "0.52x (fastest draft setting whose tau explains its timing)" in row and "`baseline` 1.00, 1.39x" in row


def test_a_target_alone_verdict_shows_the_tau_beside_the_speedup_it_shows():
    """The verdict row of a domain no draft measured faster on gives the tau of the setting whose speedup it shows;
    one whose every setting was set aside for its tau gives the best tau measured."""
    from eval.report import verdicts_table

    best = {"draft": "d", "draft_length_policy": "fixed", "num_draft_tokens": 3, "measured_speedup": 0.75,
            "measured_speedup_ci": [0.63, 0.84], "mean_accepted_length": 1.5}
    doc = {"recommendation": {"code": {"action": "target_only", "basis": "measured", "best_measured": best},
                              "chat": {"action": "target_only", "basis": "low_tau", "best_measured": best,
                                       "highest_tau": 1.2}},
           "verdicts": {}, "flags": {}, "drafts": {}}
    rows = {r.split(" | ")[0][2:]: r.split(" | ") for r in verdicts_table(doc)[2:]}
    assert rows["code"][3] == "1.50" and "0.75x" in rows["code"][2]
    assert rows["chat"][3] == "1.20"
