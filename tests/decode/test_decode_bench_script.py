"""The decoder benchmark runs end to end on two tiny saved models (random-id prompts, no tokenizer)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from decode_testutils import make_pair

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_decode.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_decode_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_decode_runs_on_tiny_models(tmp_path, capsys):
    target, draft = make_pair(seed=1, noise=0.3)
    target.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    bench = _load_script()
    threads_before = torch.get_num_threads()
    out_json = tmp_path / "bench.json"
    result = bench.main([
        "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompt-ids",
        "--num-prompts", "2", "--prompt-len", "5", "--num-draft-tokens", "3", "--max-new-tokens", "8",
        "--repeats", "1", "--cost-steps", "3", "--json-out", str(out_json),
    ])
    table = capsys.readouterr().out
    assert torch.get_num_threads() == threads_before  # --num-threads is restored after the run
    assert result["num_threads"] == 1 and result["fast_path_used"] == {"target": True, "draft": True}
    for needle in ("tokens/s ours speculative", "ours / transformers", "cost ratio c", "expected speedup",
                   "measured / expected", "mean accepted length tau", "cpu / float32, float32 / 1", "auto (yes, yes)",
                   "verify cost ratio v", "loop efficiency", "expected speedup (measured c and v)",
                   "prefill / draft / verify / other"):
        assert needle in table
    assert result["greedy_output_mismatches"] == {"ours_speculative": 0, "hf_assisted": 0}  # all agree
    assert 0.0 <= result["acceptance_rate"] <= 1.0
    assert 1.0 <= result["mean_accepted_length"] <= 4.0
    assert result["cost_ratio"] > 0 and result["expected_speedup"] > 0
    assert all(v > 0 for v in result["tokens_per_s"].values())
    saved = json.loads(out_json.read_text())
    assert saved["num_draft_tokens"] == 3 and saved["stats"]["emitted_tokens"] == 2 * 8
    # the phases add up to the wall time of the speculative calls; forwards are most of it
    bd = result["time_breakdown"]["ours_speculative"]
    assert bd["prefill_s"] > 0 and bd["draft_s"] > 0 and bd["verify_s"] > 0 and bd["other_s"] >= 0
    assert bd["prefill_s"] + bd["draft_s"] + bd["verify_s"] + bd["other_s"] == pytest.approx(bd["wall_s"])
    assert 0 < bd["loop_efficiency"] <= 1
    assert result["verify_cost_ratio"] > 0 and result["in_loop"]["verify_cost_ratio"] > 0
    # with the measured verify cost ratio v the expectation is Leviathan's with (gamma c + v) in the denominator
    assert result["expected_speedup_components"] == pytest.approx(
        result["expected_speedup"] * (3 * result["cost_ratio"] + 1)
        / (3 * result["cost_ratio"] + result["verify_cost_ratio"]))
    assert result["per_token_acceptance"] >= result["acceptance_rate"]  # accepted / tested >= accepted / drafted


def test_bench_decode_family_runs_a_windowed_model(capsys):
    bench = _load_script()
    result = bench.main(["--family", "mistral", "--family-layers", "2", "--family-hidden", "32",
                         "--family-window", "4", "--num-prompts", "1", "--prompt-len", "6", "--num-draft-tokens", "2",
                         "--max-new-tokens", "8", "--repeats", "1", "--cost-steps", "2"])
    assert "mistral" in capsys.readouterr().out
    assert result["family"] == "mistral" and result["fast_path_used"] == {"target": True, "draft": True}
    assert result["greedy_output_mismatches"]["ours_speculative"] == 0
