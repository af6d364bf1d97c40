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
        "--repeats", "1", "--cost-steps", "3", "--json-out", str(out_json), "--device", "cpu", "--dtype", "float32",
        "--block-threads", "2",
    ])
    table = capsys.readouterr().out
    assert torch.get_num_threads() == threads_before  # --num-threads is restored after the run
    assert result["num_threads"] == 1 and result["fast_path_used"] == {"target": True, "draft": True}
    for needle in ("tokens/s ours speculative", "ours / transformers", "cost ratio c", "expected speedup",
                   "measured / expected", "mean accepted length tau", "cpu / float32, float32 / 1", "auto (yes, yes)",
                   "verify cost ratio v", "loop efficiency", "expected speedup (measured c and v)",
                   "prefill / draft / verify / other", "machine load while timing (other processes' busy cores)",
                   "several-row products (row layout; auto", "draft head: rows, ms per position",
                   "target memory bound", "ours / transformers generate (target only)"):
        assert needle in table
    assert result["load"]["cores"] >= 1 and set(result["load"]) >= {"other_load", "overloaded", "own_cores"}
    # all agree, also target-only with every forward at the block thread count (timed as a second peer)
    assert result["greedy_output_mismatches"] == {"ours_speculative": 0, "hf_assisted": 0, "hf_target_only": 0,
                                                  "target_only_block_threads": 0}
    assert result["ours_over_transformers_target_only"] == tps_ratio(result, "hf_target_only")
    head, bound = result["draft_head"], result["target_memory_bound"]
    assert head["head_rows"] > 0 and 0 < head["share_of_draft_forward"]
    assert bound["weight_bytes"] > 0 and bound["bandwidth_gb_s"] > 0 and bound["verify_over_bound"] > 0
    assert result["block_threads"] == {"setting": "2", "threads": 2} and "cpu / float32, float32 / 1, 2" in table
    tps = result["tokens_per_s"]  # the speedup is over the faster of the two target-only runs
    assert result["ours_over_target_only"] == tps["ours_speculative"] / max(tps["target_only"],
                                                                             tps["target_only_block_threads"])
    assert 0.0 <= result["acceptance_rate"] <= 1.0
    assert 1.0 <= result["mean_accepted_length"] <= 4.0
    assert result["cost_ratio"] > 0 and result["expected_speedup"] > 0
    st = result["stats"]
    assert result["token_acceptance_rate"] == sum(st["per_position_accepted"]) / sum(st["per_position_drafted"])
    assert result["expected_speedup"] == bench.expected_speedup(result["token_acceptance_rate"], 3, result["cost_ratio"])
    assert all(v > 0 for v in result["tokens_per_s"].values())
    saved = json.loads(out_json.read_text())
    assert saved["runtime"]["device"] == "cpu" and saved["runtime"]["torch"] == torch.__version__
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
    assert result["token_acceptance_rate"] >= result["acceptance_rate"]  # accepted / tested >= accepted / drafted


def test_bench_decode_family_runs_a_windowed_model(capsys):
    bench = _load_script()
    result = bench.main(["--family", "mistral", "--family-layers", "2", "--family-hidden", "32",
                         "--family-window", "4", "--num-prompts", "1", "--prompt-len", "6", "--num-draft-tokens", "2",
                         "--max-new-tokens", "8", "--repeats", "1", "--cost-steps", "2"])
    assert "mistral" in capsys.readouterr().out
    assert result["family"] == "mistral" and result["fast_path_used"] == {"target": True, "draft": True}
    assert result["greedy_output_mismatches"]["ours_speculative"] == 0


def test_expected_speedup_uses_the_per_token_acceptance():
    """Hand-computed: 4 verify steps at gamma 3 accepting 3, 2, 0 and 1 drafts. Positions reached 4 + 3 + 2 = 9, of
    which 3 + 2 + 1 = 6 accepted: per-token alpha = 2/3 (accepted / drafted would be 6/12 = 1/2). With c = 0.1,
    Leviathan's Thm 3.8 gives (1 - (2/3)^4) / ((1/3)(3 * 0.1 + 1)) = (65/81) * 3 / 1.3 = 195 / 105.3."""
    from decode import AcceptanceStats

    bench = _load_script()
    stats = AcceptanceStats(verify_steps=4, drafted_tokens=12, accepted_tokens=6, emitted_tokens=10,
                            per_position_drafted=[4, 3, 2], per_position_accepted=[3, 2, 1],
                            accepted_length_histogram=[1, 1, 1, 1])
    alpha, expected = bench.leviathan_expectation(stats, 3, 0.1)
    assert alpha == 2 / 3 and stats.acceptance_rate == 0.5
    assert abs(expected - 195 / 105.3) < 1e-12
    assert abs(bench.expected_speedup(0.5, 3, 0.1) - 0.9375 / 0.65) < 1e-12  # what the old estimator printed
    nothing, nan = bench.leviathan_expectation(AcceptanceStats(), 3, 0.1)
    assert nothing != nothing and nan != nan  # NaN when nothing was drafted


def test_an_unavailable_device_ends_the_benchmark_with_one_line(monkeypatch):
    bench = _load_script()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        bench.resolve_device_dtype("cuda", "auto")
    except SystemExit as e:
        assert str(e).startswith("error: --device=cuda but no CUDA device is available")
    else:
        raise AssertionError("cuda was accepted without a GPU")
    assert bench.resolve_device_dtype("auto", "auto") == (torch.device("cpu"), torch.float32)


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


def test_domain_prompts_and_argument_errors(capsys):
    """--domain NAME takes the first --max-prompts evaluation prompts of that domain (the same texts as
    data.loading.eval_prompts, tokenized by the target's tokenizer); the prompt sources are alternatives; an unknown
    domain or block-thread value is a one-line usage error."""
    from pathlib import Path as P

    from transformers import AutoTokenizer

    from data.loading import eval_prompts
    from data.loading import default_data_root

    root = default_data_root()
    if root is None or not P(root).is_dir():  # the data root of README's setup
        pytest.skip("no data root (set SPECDRAFT_DATA_ROOT or provide ../shared/data beside the repo)")
    bench = _load_script()
    ref = str(Path(__file__).resolve().parents[2] / "models" / "assets" / "reference_target")
    args = bench.parse_args(["--target", ref, "--draft", ref, "--domain", "medical", "--max-prompts", "3"])
    tok = AutoTokenizer.from_pretrained(ref)
    got = bench.load_prompts(args, tok, 4096)
    want = [tok(e.prompt, return_tensors="pt").input_ids for e in eval_prompts("medical", max_prompts=3, tokenizer=tok)]
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want))
    for argv, needle in ((["--domain", "medical", "--prompt-ids"], "alternatives"),
                         (["--domain", "nope"], "--domain: unknown domain 'nope'"),
                         (["--domain", "medicl"], "Fix --domain, or declare it"),
                         (["--block-threads", "0"], "--block-threads: decode.block_threads must be auto, off")):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--target", ref, "--draft", ref, *argv])
        assert e.value.code == 2 and needle in capsys.readouterr().err


def test_bad_prompt_files_and_numbers_are_one_line_usage_errors(tmp_path, capsys):
    """--prompts-file problems (missing, blank, not JSON, no field, a non-string or empty text), --max-prompts /
    --family-layers below 1, an impossible --family-hidden and a --row-layout-peer equal to --row-layout (or without
    the lean forward) stop before anything loads, with exit 2 and no traceback."""
    bench = _load_script()
    ref = str(Path(__file__).resolve().parents[2] / "models" / "assets" / "reference_target")
    files = {"blank.jsonl": "\n \n", "bad.jsonl": '{"text": "a"}\n{oops\n', "nofield.jsonl": '{"prompt": "a"}\n',
             "number.jsonl": '{"text": 5}\n', "empty.jsonl": '{"text": "  "}\n'}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    cases = [(["--prompts-file", str(tmp_path / "missing.jsonl")], "cannot read"),
             (["--prompts-file", str(tmp_path / "blank.jsonl")], "holds no prompt"),
             (["--prompts-file", str(tmp_path / "bad.jsonl")], "line 2: not JSON"),
             (["--prompts-file", str(tmp_path / "nofield.jsonl")], "line 1: no field 'text'"),
             (["--prompts-file", str(tmp_path / "number.jsonl")], "must be a non-empty string, got 5"),
             (["--prompts-file", str(tmp_path / "empty.jsonl")], "must be a non-empty string"),
             (["--domain", "medical", "--max-prompts", "0"], "--max-prompts must be >= 1"),
             (["--row-layout-peer", "auto"], "is --row-layout itself"),
             (["--row-layout-peer", "weight_left", "--fast-path", "off"], "needs the lean forward")]
    for argv, needle in cases:
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--target", ref, "--draft", ref, *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and "Traceback" not in err, (argv, err)
    for argv, needle in ((["--family-layers", "0"], "--family-layers must be >= 1"),
                         (["--family-hidden", "10"], "--family-hidden 10: must be a multiple"),
                         (["--family-hidden", "0"], "--family-hidden must be >= 1"),
                         (["--family-hidden", "-8"], "--family-hidden must be >= 1"),
                         (["--json-out", str(tmp_path / "no" / "such" / "out.json")], "--json-out")):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--family", "llama", *argv])
        assert e.value.code == 2 and needle in capsys.readouterr().err
    args = bench.parse_args(["--target", ref, "--draft", ref, "--prompts-file", str(tmp_path / "bad.jsonl"),
                             "--max-prompts", "1"])  # stops reading at --max-prompts: the bad line is never read
    assert args.prompt_texts == ["a"]


def tps_ratio(result: dict, peer: str) -> float:
    return result["tokens_per_s"]["ours_speculative"] / result["tokens_per_s"][peer]


def test_bench_decode_with_a_trimmed_draft_keeps_the_targets_whole_vocabulary(tmp_path, capsys):
    """A draft with a trimmed vocabulary (models/vocab.py) has an N-row head but scores every id: the benchmark
    must decode the target over its whole vocabulary (it once cut both models to the draft's N rows, so every
    method agreed with each other and none with the target's real greedy output)."""
    from models.vocab import draft_vocab_record, install_trimmed_head
    from models.checkpoints import save_hf_atomic

    target, draft = make_pair(seed=2, noise=0.3)
    head = install_trimmed_head(draft, torch.arange(0, 64, 2))  # the even ids: half the target's argmaxes are odd
    target.save_pretrained(tmp_path / "target")
    save_hf_atomic(draft, None, tmp_path / "draft", extra={"kind": "distilled",
                                                           "draft_vocab": draft_vocab_record(head)})
    bench = _load_script()
    result = bench.main([
        "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompt-ids",
        "--num-prompts", "3", "--prompt-len", "5", "--num-draft-tokens", "3", "--max-new-tokens", "12",
        "--repeats", "1", "--cost-steps", "3", "--device", "cpu", "--dtype", "float32",
    ])
    capsys.readouterr()
    # transformers' own greedy generate is the independent reference for the target's output
    assert result["greedy_output_mismatches"]["hf_target_only"] == 0
    assert result["greedy_output_mismatches"]["ours_speculative"] == 0
    assert result["draft_head"]["head_rows"] == 32


def test_bench_decode_int8_draft_from_its_directory_and_by_flag(tmp_path, capsys):
    """``--draft-quantize auto`` quantizes a draft whose specdraft.json says int8 (drafts/<name>_int8), ``int8``
    any fp32 draft; the trimmed head is quantized too, ours runs it in the lean forward, every method stays
    lossless; an int8 draft in another dtype is a one-line error."""
    from models.vocab import draft_vocab_record, install_trimmed_head
    from models.checkpoints import save_hf_atomic

    target, draft = make_pair(seed=4, noise=0.3)
    head = install_trimmed_head(draft, torch.arange(0, 64, 2))
    target.save_pretrained(tmp_path / "target")
    save_hf_atomic(draft, None, tmp_path / "draft_int8", extra={"kind": "distilled", "quantize": "int8",
                                                                "draft_vocab": draft_vocab_record(head)})
    bench = _load_script()
    common = ["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft_int8"), "--prompt-ids",
              "--num-prompts", "2", "--prompt-len", "5", "--num-draft-tokens", "3", "--max-new-tokens", "10",
              "--repeats", "1", "--cost-steps", "3", "--device", "cpu"]
    for flag in ("auto", "int8"):
        result = bench.main(common + ["--draft-quantize", flag])
        assert "float32, int8" in capsys.readouterr().out
        assert result["draft_dtype"] == "int8" and result["fast_path_used"]["draft"]
        assert result["greedy_output_mismatches"]["ours_speculative"] == 0
        assert result["greedy_output_mismatches"]["hf_assisted"] == 0
    result = bench.main(common + ["--draft-quantize", "none", "--no-hf"])
    assert result["draft_dtype"] == "float32"
    capsys.readouterr()
    with pytest.raises(SystemExit, match="int8 kernels take a float32 draft"):
        bench.main(common + ["--draft-dtype", "bfloat16"])
