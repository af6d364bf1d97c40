"""Keeping or refusing a domain's adapter: kept exactly when the adapted draft's tau interval lies wholly
above the base draft's (eval.decision.adapter_decision), and the adapt stage's routing table then sends a domain
to its adapter only when it was kept, else to the base draft or, when the base is not faster, the target alone."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from eval.decision import adapter_decision, candidates, decide
from train.stages import adapted_routing, render_adapt_report

finite = st.floats(1.0, 5.0, allow_nan=False)


def _interval(draw_lo, draw_w):
    return [draw_lo, draw_lo + draw_w]


@settings(max_examples=300, deadline=None)
@given(blo=finite, bw=st.floats(0, 2), alo=finite, aw=st.floats(0, 2), missing=st.sampled_from([None, "a", "b"]))
def test_an_adapter_is_kept_exactly_when_its_interval_lies_above_the_bases(blo, bw, alo, aw, missing):
    b, a = _interval(blo, bw), _interval(alo, aw)
    bt, at = blo + bw / 2, alo + aw / 2
    d = adapter_decision(bt, None if missing == "b" else b, at, None if missing == "a" else a)
    if missing:
        assert not d["keep"] and d["basis"] == "no_interval"
        return
    assert d["keep"] == (a[0] > b[1])
    assert d["basis"] == ("separated" if a[0] > b[1] else "worse" if a[1] < b[0] else "overlap")
    assert isinstance(d["reason"], str) and "tau" in d["reason"]


def _entry(tau, tau_ci, speedup, speedup_ci):
    e = {"num_draft_tokens": 3, "mean_accepted_length": tau, "mean_accepted_length_ci": tau_ci,
         "measured_speedup": speedup, "measured_speedup_ci": speedup_ci, "expected_speedup": speedup,
         "acceptance_rate": 0.5, "num_prompts": 4}
    return {**e, "sweep": {"3": dict(e)}}


cell = st.tuples(finite, st.floats(0, 1), st.floats(0.3, 2.5), st.floats(0, 0.6))


@settings(max_examples=60, deadline=None)
@given(cells=st.lists(st.tuples(cell, cell), min_size=1, max_size=4))
def test_routing_uses_an_adapter_only_where_it_was_kept(cells):
    domains = [f"d{i}" for i in range(len(cells))]
    drafts = {"general": {}} | {f"lora_{d}": {} for d in domains}
    rows = {}
    for d, (base, ad) in zip(domains, cells):
        for name, (tau, w, sp, sw) in (("general", base), (f"lora_{d}", ad)):
            drafts[name][d] = _entry(tau, [tau - w / 2, tau + w / 2], sp, [sp - sw / 2, sp + sw / 2])
        b, a = drafts["general"][d], drafts[f"lora_{d}"][d]
        v = adapter_decision(b["mean_accepted_length"], b["mean_accepted_length_ci"], a["mean_accepted_length"],
                             a["mean_accepted_length_ci"])
        rows[d] = {"adapted_draft": f"lora_{d}", "adapter_kept": v["keep"], "adapter_reason": v["reason"]}
    for name in drafts:  # every draft measured on every domain (adapters on the other domains too)
        for d in domains:
            drafts[name].setdefault(d, _entry(1.5, [1.4, 1.6], 0.9, [0.8, 1.0]))
    doc = {"drafts": drafts, "recommendation": {d: {} for d in domains}, "num_draft_tokens": 3,
           "num_draft_tokens_swept": [3]}
    table = adapted_routing(doc, rows, "general", {n: f"/drafts/{n}" for n in drafts})
    for d in domains:
        r = table["routes"][d]
        allowed = {"general"} | ({f"lora_{d}"} if rows[d]["adapter_kept"] else set())
        assert r["draft"] in allowed | {None}
        cands = [c for c in candidates(doc, d) if c["draft"] in allowed]
        if r["draft"] is None:  # the target alone: only when no allowed draft was measured at least 1x
            assert all(c["measured_speedup"] < 1.0 for c in cands)
        # the route is the evaluation's decision rule over the allowed drafts only (a refused adapter never wins)
        assert r["draft"] == decide(cands).draft
    kept = {f"lora_{d}" for d in domains if rows[d]["adapter_kept"]}
    assert table["default"] is None or table["default"]["draft"] in {"general", None} | kept


def test_the_report_says_which_domains_were_left_alone_and_why():
    s = {"draft": "/g", "draft_name": "general", "min_mean_accepted_length": 3.0, "num_draft_tokens": 3,
         "routing": "/r/routing.json", "reports": {"before": "b", "after": "a"},
         "times_s": {"before_eval": 1.0, "adapt": {"medical": 2.0, "code": 2.0}, "after_eval": 3.0, "total": 8.0},
         "domains": {
             "medical": {"before_mean_accepted_length": 2.0, "action": "adapted, adapter kept",
                         "adapted_draft": "lora_medical", "adapter_kept": True,
                         "adapter_reason": "intervals separated: ...", "after_base_mean_accepted_length": 2.0,
                         "after_base_mean_accepted_length_ci": [1.8, 2.2], "after_mean_accepted_length": 3.0,
                         "after_mean_accepted_length_ci": [2.7, 3.3], "routed_draft": "lora_medical"},
             "code": {"before_mean_accepted_length": 2.5, "action": "adapted, adapter refused",
                      "adapted_draft": "lora_code", "adapter_kept": False,
                      "adapter_reason": "intervals overlap (...): the measurement does not show a lift",
                      "after_base_mean_accepted_length": 2.5, "routed_draft": "general"},
             "chat": {"before_mean_accepted_length": 3.4, "action": "left alone (tau >= threshold)",
                      "routed_draft": None}}}
    md = render_adapt_report(s)
    assert "adapter kept (its tau interval lies wholly above" in md and ": medical" in md
    assert "left alone: code, chat" in md
    assert "intervals overlap" in md and "tau 3.40 >= 3" in md and "the target alone" in md


def test_adaptation_table_rows_come_from_the_drafts_specdraft_and_the_evaluation(tmp_path):
    from eval.sections import AdaptationSection

    doc = {"drafts": {n: {"medical": {"mean_accepted_length": t, "mean_accepted_length_ci": [t - .1, t + .1],
                                      "measured_speedup": sp, "measured_speedup_ci": [sp - .1, sp + .1]}}
                      for n, t, sp in (("general", 2.0, 0.9), ("lora_medical", 3.0, 1.2), ("distilled", 3.2, 1.3))}}
    meta = {"lora_medical": {"kind": "lora", "domain": "medical", "base": str(tmp_path / "g"), "lora": {"rank": 8},
                             "data_source": "teacher", "teacher_signal": "cached", "trainable_parameters": 100,
                             "train": {"steps": 50, "train_time_s": 20.0}, "teacher_data": {"time_s": 5.0},
                             "teacher_cache": {"time_s": 1.0}, "adapter_bytes": 4096, "merge_time_s": 0.01},
            "distilled": {"distilled": True, "data_source": "teacher", "teacher_signal": "cached",
                          "draft_parameters": 1000, "train": {"steps": 50, "train_time_s": 30.0},
                          "teacher_data": {"time_s": 0.1, "computed": 0}}}
    from models.checkpoints import SpecdraftMeta

    meta = {n: SpecdraftMeta.from_dict(m) for n, m in meta.items()}
    sec = AdaptationSection(meta, {"general": tmp_path / "g", "lora_medical": tmp_path / "l",
                                   "distilled": tmp_path / "d"})
    md = sec(doc)
    rows = {r["draft"]: r for r in sec.rows}
    assert rows["general"]["base"] and rows["general"]["tau_vs_base"] == 1.0
    assert rows["lora_medical"]["total_time_s"] == 26.0 and rows["lora_medical"]["tau_vs_base"] == 1.5
    assert rows["distilled"]["total_time_s"] == 30.1 and rows["distilled"]["trainable_parameters"] == 1000
    assert "## Adaptation (medical)" in md and "| 4096 | 0.010 |" in md and "26 (20 + 6) |" in md
    assert "30 (30 + 0, passes reused) |" in md and not rows["lora_medical"]["passes_reused"]
    assert AdaptationSection({}, {})(doc) == ""  # no adapted draft: no section


def test_eval_drafts_named_drafts_slash_name_are_the_run_directorys(tmp_path, monkeypatch):
    """lora_med evaluates the committed general draft beside drafts its stages write: ``drafts/<name>`` in
    eval.drafts is looked up in the run directory (unless only the working directory has it), also before the
    stage that writes it has run."""
    from types import SimpleNamespace

    from eval.pipeline import draft_paths

    run = tmp_path / "run"
    (run / "drafts" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "drafts" / "cwd_only").mkdir(parents=True)
    rc = SimpleNamespace(decode=SimpleNamespace(draft_routing=None), eval=SimpleNamespace(
        drafts={"mine": "drafts/mine", "cwd_only": "drafts/cwd_only", "later": "drafts/later",
                "abs": str(tmp_path / "g")}))
    got = draft_paths(rc, run)
    assert got["mine"] == run / "drafts" / "mine" and got["later"] == run / "drafts" / "later"
    assert got["cwd_only"] == tmp_path.joinpath("drafts", "cwd_only").relative_to(tmp_path)
    assert got["abs"] == tmp_path / "g"
