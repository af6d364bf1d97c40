"""eval.sections (and scripts/compare_runs.py, the train multirun callback): a sweep folder becomes one loss x domain
comparison (Markdown + JSON)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import eval.sections as compare_runs

ROOT = Path(__file__).resolve().parents[2]


def _job(sweep: Path, name: str, loss: str, tau: dict, base: dict, step: int = 100, source: str = "dataset",
         meta: dict | None = None) -> None:
    job = sweep / name
    (job / "drafts" / "distilled").mkdir(parents=True)
    drafts = {"distilled": {d: {"mean_accepted_length": v, "acceptance_rate": (v - 1) / 4,
                                "mean_accepted_length_ci": [v - 0.25, v + 0.25]} for d, v in tau.items()},
              "baseline": {d: {"mean_accepted_length": v, "acceptance_rate": (v - 1) / 4} for d, v in base.items()}}
    (job / "metrics.json").write_text(json.dumps({"num_draft_tokens": 4, "drafts": drafts}))
    (job / "resolved_config.json").write_text(json.dumps({"distill": {"loss": loss, "data_source": source,
                                                                      "teacher_signal": "online"}}))
    (job / "drafts" / "distilled" / "specdraft.json").write_text(json.dumps({"selected_step": step, **(meta or {})}))


def test_sweep_comparison(tmp_path):
    base = {"medical": 2.0, "code": 1.5}
    _job(tmp_path, "0_distill.loss=forward_kl", "forward_kl", {"medical": 2.6, "code": 1.8}, base, step=250)
    _job(tmp_path, "1_distill.loss=total_variation", "total_variation", {"medical": 2.8, "code": 1.6}, base)
    (tmp_path / "2_distill.loss=skew_kl").mkdir()  # a job that died before writing metrics: ignored
    # eval keeps each report version under .report/<version>/ (metrics.json is a link into it): counted once
    stored = tmp_path / "0_distill.loss=forward_kl" / ".report" / "v1"
    stored.mkdir(parents=True)
    (stored / "metrics.json").write_text((tmp_path / "0_distill.loss=forward_kl" / "metrics.json").read_text())
    _job(tmp_path, "3_distill.loss=reverse_kl", "reverse_kl", {"medical": 2.2}, {"medical": 2.0})
    assert compare_runs.main([str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "comparison.json").read_text())
    assert doc["domains"] == ["medical", "code"] and doc["num_draft_tokens"] == 4
    assert [r["loss"] for r in doc["runs"]] == ["forward_kl", "total_variation", "reverse_kl"]
    fkl = doc["runs"][0]
    assert fkl["vs_baseline"]["medical"] == pytest.approx(1.3) and fkl["selected_step"] == 250
    assert doc["runs"][2]["mean_accepted_length"]["code"] is None
    assert doc["baseline"]["mean_accepted_length"] == {"medical": 2.0, "code": 1.5}
    assert doc["baseline"]["spread"]["medical"] == 0.0
    md = (tmp_path / "comparison.md").read_text()
    assert "| forward_kl | 2.60 [2.35, 2.85] (1.30x) | 1.80 [1.55, 2.05] (1.20x) | 250 |" in md
    assert doc["runs"][0]["mean_accepted_length_ci"]["medical"] == pytest.approx([2.35, 2.85])
    assert "| baseline (cross-entropy) | 2.00 | 1.50 | - |" in md


def test_duplicate_losses_are_labelled_by_job_and_empty_sweep_fails(tmp_path):
    _job(tmp_path, "0_a", "forward_kl", {"medical": 2.5}, {"medical": 2.0})
    _job(tmp_path, "1_b", "forward_kl", {"medical": 2.7}, {"medical": 2.1})
    runs, _ = compare_runs.collect_runs(tmp_path)
    doc = compare_runs.compare(runs)
    assert [r["label"] for r in doc["runs"]] == ["forward_kl (0_a)", "forward_kl (1_b)"]
    assert doc["baseline"]["spread"]["medical"] == pytest.approx(0.1)
    # Jobs of one loss on different data are labelled by their data source; the cost table shows what each cost.
    sources = tmp_path / "sources"
    _job(sources, "0_x", "forward_kl", {"medical": 2.5}, {"medical": 2.0}, source="teacher",
         meta={"train": {"steps": 200, "train_time_s": 60.0}, "teacher_data": {"time_s": 30.0}})
    _job(sources, "1_y", "forward_kl", {"medical": 2.6}, {"medical": 2.0}, source="on_policy",
         meta={"train": {"steps": 200, "train_time_s": 90.4}, "teacher_cache": {"time_s": 10.0},
               "off_policy_data": "teacher", "on_policy": {"generation_s": 12.0, "target_scoring_s": 8.0}})
    assert compare_runs.main([str(sources)]) == 0
    doc = json.loads((sources / "comparison.json").read_text())
    assert [r["label"] for r in doc["runs"]] == ["forward_kl / teacher", "forward_kl / on_policy"]
    assert doc["runs"][1]["cost"] == {"steps": 200, "train_s": 90.4, "one_off_s": 10.0,
                                      "on_policy_generation_s": 12.0, "on_policy_target_scoring_s": 8.0}
    md = (sources / "comparison.md").read_text()
    assert "| forward_kl / teacher | teacher | 200 | 60 | 30 | - | - |" in md
    assert "| forward_kl / on_policy | on_policy (+ teacher) | 200 | 90 | 10 | 12 | 8 |" in md
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_runs.py"), str(empty)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "no finished run" in proc.stderr


def test_multirun_callback_writes_the_comparison(tmp_path):
    from omegaconf import OmegaConf

    from train.run import CompareSweep

    _job(tmp_path, "0_distill.loss=forward_kl", "forward_kl", {"medical": 2.6}, {"medical": 2.0})
    CompareSweep().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    assert json.loads((tmp_path / "comparison.json").read_text())["runs"][0]["loss"] == "forward_kl"
    # A sweep whose jobs all failed leaves no comparison and does not raise (the jobs' own errors were shown).
    empty = tmp_path / "empty"
    empty.mkdir()
    CompareSweep().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(empty)}}}))
    assert not (empty / "comparison.json").exists()
