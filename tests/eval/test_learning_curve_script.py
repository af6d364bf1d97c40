"""scripts/learning_curve.py: curve points from finished run folders, the log-linear fit, the projection."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "learning_curve.py"
spec = importlib.util.spec_from_file_location("learning_curve", SCRIPT)
lc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lc)


def _run(root: Path, tokens: int, alpha: float, cost_s: float, reads: int = 1) -> Path:
    run = root / f"r{tokens}x{reads}"
    (run / "drafts" / "distilled").mkdir(parents=True)
    cell = {"prompts": 32, "alpha": [alpha, 0.5], "alpha_ci": [[alpha - 0.05, alpha + 0.05], None],
            "tau": {"1": 1.3, "3": 1 + alpha * 2}, "tau_ci": {"3": [1.0, 2.0]}}
    doc = {"heldout": {"drafts": {"distilled_int8": {"medical": cell, "chat": {**cell, "alpha": [alpha / 2, 0]},
                                                     "train:medical": {**cell, "alpha": [alpha + 0.2, 0]}}}}}
    (run / "metrics.json").write_text(json.dumps(doc))
    meta = {"train": {"unique_tokens": tokens, "max_reads_per_token": reads, "steps": reads * tokens // 1024,
                      "train_time_s": 10.0}, "teacher_cache": {"time_s": 1.0, "cost_s": cost_s}}
    (run / "drafts" / "distilled" / "specdraft.json").write_text(json.dumps(meta))
    return run


def test_fit_projection_and_files(tmp_path):
    # alpha_1 = 0.1 + 0.05 log10(tokens): 0.6 needs 1e10 tokens; scoring here at 1,000 tokens/s
    for t in (10_000, 100_000, 1_000_000):
        _run(tmp_path, t, 0.1 + 0.05 * math.log10(t), cost_s=t / 1000)
    assert lc.main([str(tmp_path), "--gpu-tokens-per-s", "1e5"]) == 0
    doc = json.loads((tmp_path / "learning_curve.json").read_text())
    assert doc["fit"]["b_per_decade"] == pytest.approx(0.05) and doc["fit"]["a"] == pytest.approx(0.1)
    assert doc["tokens_for_target"] == pytest.approx(1e10, rel=1e-6)
    assert doc["projection"]["cpu_hours_here"] == pytest.approx(1e10 / 1000 / 3600, rel=1e-6)
    assert doc["projection"]["gpu_hours"] == pytest.approx(1e10 / 1e5 / 3600, rel=1e-6)
    md = (tmp_path / "learning_curve.md").read_text()
    assert "Projection (extrapolated from the fit, not measured)" in md and "| 1,000,000 | 1 |" in md
    assert (tmp_path / "learning_curve.png").stat().st_size > 0
    assert [p["train_alpha_1"] for p in doc["points"]][0] == pytest.approx(0.1 + 0.2 + 0.2)


def test_flat_curve_has_no_projection_and_too_few_runs_fail(tmp_path, capsys):
    _run(tmp_path, 10_000, 0.3, 10)
    assert lc.main([str(tmp_path)]) == 2 and "at least two" in capsys.readouterr().err
    _run(tmp_path, 100_000, 0.29, 100)
    assert lc.main([str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "learning_curve.json").read_text())
    assert doc["tokens_for_target"] is None and doc["projection"] is None
    assert "does not rise" in (tmp_path / "learning_curve.md").read_text()


def test_points_read_several_times_are_their_own_series(tmp_path):
    """A size trained for several reads (trainer.unique_blocks) is not a point of the one-read curve: it gets its own
    series, without a fit when it has one token count."""
    for t in (10_000, 100_000):
        _run(tmp_path, t, 0.1 + 0.05 * math.log10(t), cost_s=1)
    _run(tmp_path, 10_000, 0.4, cost_s=1, reads=4)
    assert lc.main([str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "learning_curve.json").read_text())
    assert doc["fit"]["b_per_decade"] == pytest.approx(0.05)  # the one-read points alone
    assert set(doc["kinds"]) == {"draft", "draft, several reads"} and doc["kinds"]["draft, several reads"] is None
    assert "One token count: no fit." in (tmp_path / "learning_curve.md").read_text()


def test_the_scoring_rate_counts_only_the_shards_a_run_computed(tmp_path):
    """A larger size reuses the shards a smaller one wrote: its teacher seconds scored only the rest."""
    for t, computed in ((10_000, 10_000), (100_000, 90_000), (1_000_000, 900_000)):
        run = _run(tmp_path, t, 0.1 + 0.05 * math.log10(t), cost_s=computed / 500)
        meta_path = run / "drafts" / "distilled" / "specdraft.json"
        meta = json.loads(meta_path.read_text())
        meta["teacher_cache"].update(reused_shards=1, computed_tokens=computed)
        meta_path.write_text(json.dumps(meta))
    assert lc.main([str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "learning_curve.json").read_text())
    assert doc["projection"]["cpu_tokens_per_s"] == pytest.approx(500)
