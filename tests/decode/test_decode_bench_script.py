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
                   "measured / expected", "mean accepted length tau", "cpu / float32 / 1", "auto (yes, yes)"):
        assert needle in table
    assert result["greedy_output_mismatches"] == {"ours_speculative": 0, "hf_assisted": 0}  # all agree
    assert 0.0 <= result["acceptance_rate"] <= 1.0
    assert 1.0 <= result["mean_accepted_length"] <= 4.0
    assert result["cost_ratio"] > 0 and result["expected_speedup"] > 0
    assert all(v > 0 for v in result["tokens_per_s"].values())
    saved = json.loads(out_json.read_text())
    assert saved["num_draft_tokens"] == 3 and saved["stats"]["emitted_tokens"] == 2 * 8


def test_bench_decode_with_a_draft_length_policy(tmp_path, capsys):
    """--draft-length-policy reaches our decoder (lossless, its draft lengths recorded); bad parameters are refused
    with the config's own message before any model loads."""
    target, draft = make_pair(seed=2, noise=0.3)
    target.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    bench = _load_script()
    common = ["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompt-ids",
              "--num-prompts", "2", "--prompt-len", "5", "--num-draft-tokens", "2", "--max-new-tokens", "12",
              "--repeats", "1", "--cost-steps", "3"]
    result = bench.main(common + ["--draft-length-policy", "adaptive", "--policy-param", "max_draft_tokens=5",
                                  "--policy-param", "adaptive_window=1"])
    assert result["greedy_output_mismatches"]["ours_speculative"] == 0
    assert result["draft_length_policy"] == {"draft_length_policy": "adaptive", "num_draft_tokens": 2,
                                             "min_draft_tokens": 1, "max_draft_tokens": 5, "adaptive_window": 1,
                                             "adaptive_step": 1}
    lengths = result["stats"]["draft_lengths"]
    assert max(lengths) <= 5 and len(set(lengths)) > 1  # the adaptive policy moved the draft length
    assert result["mean_draft_length"] == sum(lengths) / len(lengths)
    assert "ours: draft-length policy (mean draft length)" in capsys.readouterr().out
    for bad, needle in ((["--policy-param", "confidence_threshold=2"], "decode.confidence_threshold"),
                        (["--policy-param", "window=3"], "expected KEY=VALUE"),
                        (["--draft-length-policy", "adaptive", "--policy-param", "max_draft_tokens=1"],
                         "decode.num_draft_tokens (the adaptive policy's starting draft length)")):
        with pytest.raises(SystemExit) as ei:
            bench.parse_args(common + bad)
        assert ei.value.code == 2 and needle in capsys.readouterr().err
