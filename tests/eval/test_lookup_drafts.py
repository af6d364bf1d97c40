"""Lookup drafts in the evaluation (decode/ngram.py through eval/): the held-out replay equals real decoding; the
verdicts, routing.json and serving.json pick a lookup draft, a trained draft or the target alone from recorded
measurements, and the routing table round-trips a lookup route; a suffix store never sees its own prompt's answer;
a small real evaluation decodes them beside a trained draft, lossless."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinymodels import tiny_llama
from decode.ngram import NgramDraft, ngram_generate
from eval.heldout import ngram_runs, replay

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind", ["prompt_lookup", "suffix"])
def test_the_replay_equals_decoding(kind):
    """Blocks per gamma and acceptance per draft position from :func:`ngram_runs` are the decoder's own."""
    target = tiny_llama(vocab_size=16, hidden_size=32, num_layers=2, seed=4)
    g = torch.Generator().manual_seed(1)
    prompts = [(torch.randint(2, 16, (3,), generator=g).tolist() * 3)[:7 + i] for i in range(4)]
    answers = []
    for p in prompts:
        out = ngram_generate(target, NgramDraft(kind, min_ngram=1), torch.tensor([p]), max_new_tokens=30,
                             eos_token_id=[])
        answers.append(out.sequences[0, len(p):].tolist())
    for gamma in (1, 3, 5):
        draft = NgramDraft(kind, min_ngram=1, max_ngram=3, min_share=0.4)
        runs = ngram_runs(draft, prompts, answers, gamma)
        decoder = NgramDraft(kind, min_ngram=1, max_ngram=3, min_share=0.4)
        for p, a, (run, lengths) in zip(prompts, answers, runs):
            r = replay(None, gamma, runs=run, lengths=lengths)
            out = ngram_generate(target, decoder, torch.tensor([p]), max_new_tokens=len(a), num_draft_tokens=gamma,
                                 eos_token_id=[])
            decoder.observe(a)  # the replay's store order: each answer after its own prompt
            s = out.stats
            assert out.sequences[0, len(p):].tolist() == a
            assert r.blocks[gamma] == s.verify_steps and sum(r.accepted) == s.accepted_tokens
            assert sum(r.proposed) <= s.drafted_tokens  # the replay counts proposals up to the first rejection
            assert r.accepted == s.per_position_accepted[:gamma] + [0] * (gamma - len(s.per_position_accepted))


def _rows(draft, domain, g, speed, n=4, emitted=12, steps=4):
    return [{"draft": draft, "domain": domain, "prompt_id": str(i), "num_draft_tokens": g, "prompt_tokens": 10,
             "truncated": False, "new_tokens": 16, "verify_steps": steps, "drafted_tokens": steps * g,
             "accepted_tokens": emitted - steps, "emitted_tokens": emitted, "draft_time_s": 0.001,
             "verify_time_s": 0.2, "speculative_time_s": (1.0 + 0.05 * i) / speed, "target_new_tokens": 16,
             "target_time_s": 1.0 + 0.05 * i, "greedy_equal": True, "per_position_drafted": [steps, steps],
             "per_position_accepted": [steps, 2], "accepted_length_histogram": [0, 2, 2],
             "draft_length_policy": "fixed", "draft_lengths": [g] * steps,
             "speculative_trial_times_s": [(1.0 + 0.05 * i) / speed * f for f in (0.95, 1.05)],
             "target_trial_times_s": [(1.0 + 0.05 * i) * f for f in (0.95, 1.05)]} for i in range(n)]


def test_routing_picks_the_kind_that_paid(tmp_path):
    """clinical_notes: the lookup draft paid -> routed to it (path ngram:prompt_lookup, vLLM's ngram method); code:
    the trained draft paid -> routed to it; chat: nothing paid -> the target alone, with no speedup of its own."""
    from decode.config import load_routing
    from eval.decision import write_routing
    from eval.report import write_report
    from eval.sections import serving_document

    rows = (_rows("prompt_lookup", "clinical_notes", 4, 1.45) + _rows("distilled", "clinical_notes", 4, 0.9)
            + _rows("prompt_lookup", "code", 4, 0.95) + _rows("distilled", "code", 4, 1.4)
            + _rows("prompt_lookup", "chat", 4, 0.97, emitted=8) + _rows("distilled", "chat", 4, 0.8, emitted=8))
    results = {"rows": rows, "cost_ratio": {"prompt_lookup": {"cost_ratio": 0.002, "draft_forward_s": 2e-6,
                                                               "target_forward_s": 1e-3},
                                            "distilled": {"cost_ratio": 0.1, "draft_forward_s": 1e-4,
                                                          "target_forward_s": 1e-3}},
               "num_draft_tokens": [4], "max_new_tokens": 16, "sampling": {}, "truncated_prompts": 0,
               "timing_trials": 2, "machine_load": {}}
    doc = write_report(tmp_path, results, {"experiment_name": "t", "seed": 0}, primary_num_draft_tokens=4,
                       bootstrap_samples=200, plots=False)
    rec = doc["recommendation"]
    assert rec["clinical_notes"]["draft"] == "prompt_lookup" and rec["code"]["draft"] == "distilled"
    assert rec["chat"]["draft"] is None
    (tmp_path / "distilled").mkdir()
    (tmp_path / "distilled" / "config.json").write_text("{}")
    paths = {"prompt_lookup": "ngram:prompt_lookup", "distilled": tmp_path / "distilled"}
    table = write_routing(tmp_path / "routing.json", doc, paths)
    assert table["routes"]["clinical_notes"]["path"] == "ngram:prompt_lookup"
    loaded = load_routing(tmp_path / "routing.json")  # a lookup route needs no directory
    assert loaded.draft_for("clinical_notes").path == "ngram:prompt_lookup"
    assert loaded.draft_for("code").path == str((tmp_path / "distilled").resolve())
    assert loaded.draft_for("chat").target_only
    settings = {"prompt_lookup": NgramDraft("prompt_lookup", min_ngram=3, max_ngram=5).settings()}
    serving = serving_document(doc, paths, str(tmp_path / "target"), tmp_path / "gguf", lookup_settings=settings)
    clin = serving["domains"]["clinical_notes"]
    assert clin["vllm"]["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4,
                                                  "prompt_lookup_min": 3, "prompt_lookup_max": 5}
    assert clin["llama_cpp"]["args"][2:6] == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3"]
    assert clin["transformers"]["prompt_lookup_num_tokens"] == 4 and clin["sglang"] is None
    chat = serving["domains"]["chat"]  # the target alone: the refused draft's number is not the target's
    assert chat["measured_speedup"] is None and chat["fastest_refused_draft"]["draft"] == "prompt_lookup"
    assert chat["fastest_refused_draft"]["measured_speedup"] == pytest.approx(rec["chat"]["measured_speedup"])


def test_a_bad_lookup_route_is_a_routing_error(tmp_path):
    from core.errors import RoutingError
    from decode.config import load_routing

    (tmp_path / "routing.json").write_text(json.dumps({"routes": {"x": {"draft": "l", "path": "ngram:trigram"}}}))
    with pytest.raises(RoutingError, match="ngram:prompt_lookup"):
        load_routing(tmp_path / "routing.json")


def test_an_evaluation_decodes_lookup_drafts_losslessly_and_its_suffix_store_holds_earlier_answers_only():
    """evaluate_drafts on a tiny real target: both lookup kinds beside a trained draft, every greedy output the
    target's own; the suffix store starts empty per domain and holds the earlier prompts' answers only (two trials
    of each prompt see the same store, so their counts agree); c is a lookup against a target forward."""
    from data.text import train_bpe_tokenizer
    from eval.evaluate import Prompt, evaluate_drafts

    text = ["Patient: I have a cough and a fever. Note: The patient reports a cough and a fever.",
            "def add(a, b):\n    return a + b"] * 20
    tok = train_bpe_tokenizer(iter(text), vocab_size=200, min_frequency=1)
    target = tiny_llama(vocab_size=len(tok), seed=0, eos_token_id=tok.eos_token_id)
    other = tiny_llama(vocab_size=len(tok), seed=5, eos_token_id=tok.eos_token_id)
    suffix = NgramDraft("suffix", min_ngram=1, max_ngram=3, min_share=0.3)
    drafts = {"trained": other, "prompt_lookup": NgramDraft("prompt_lookup", min_ngram=1), "suffix": suffix}
    prompts = {"notes": [Prompt("notes", f"n/{i}", "Patient: I have a cough and a fever. Note:") for i in range(3)],
               "code": [Prompt("code", "c/0", "def add(a, b):")]}
    res = evaluate_drafts(target, tok, drafts, prompts, num_draft_tokens=[2, 4], max_new_tokens=10,
                          max_prompt_tokens=64, cost_ratio_trials=2, seed=0, timing_trials=2)
    rows = res["rows"]
    assert len(rows) == 3 * 4 * 2 and all(r["greedy_equal"] is True for r in rows)
    assert 0 < res["cost_ratio"]["prompt_lookup"]["cost_ratio"] < 1
    by = {(r["draft"], r["prompt_id"], r["num_draft_tokens"]): r for r in rows}
    # the same prompt three times: n/0 decoded with an empty store (as a fresh draft), n/1 with n/0's answer in it
    from data.text import encode_prompt

    ids, _ = encode_prompt(tok, prompts["notes"][0].text, 64)
    replica = NgramDraft("suffix", min_ngram=1, max_ngram=3, min_share=0.3)
    for i in range(3):  # what each prompt's decodes must have seen: the answers before it, never its own
        want = ngram_generate(target, replica, ids, max_new_tokens=10, num_draft_tokens=4).stats
        got = by[("suffix", f"n/{i}", 4)]
        assert (got["drafted_tokens"], got["accepted_tokens"]) == (want.drafted_tokens, want.accepted_tokens), i
        replica.observe(res["target_outputs"]["notes"][f"n/{i}"])
    assert by[("suffix", "n/1", 4)]["drafted_tokens"] > by[("suffix", "n/0", 4)]["drafted_tokens"]  # the store
    assert list(suffix._stores["notes"]) == [res["target_outputs"]["notes"][f"n/{i}"] for i in range(3)]
    assert list(suffix._stores["code"]) == [res["target_outputs"]["code"]["c/0"]]


@pytest.mark.parametrize("floor", ["break_even", 1.5])
def test_the_break_even_floor_keeps_a_cheap_lookup_and_refuses_a_costly_draft_at_the_same_tau(tmp_path, floor):
    """Both drafts accept tau 4/3 at gamma 4 and were timed at 1.2x on every prompt. With the fixed floor 1.5 both are
    refused (the target alone). With ``break_even`` each must reach the tau its own measured costs need
    (``k c + v`` + the loop's overhead): the lookup (c 0.002) is kept and routed; the trained draft (c 0.4, its
    measured draft time 1.6 target forwards per step) is set aside, and the verdict names its break-even."""
    from eval.decision import candidates, tau_floor
    from eval.report import write_report

    t1, steps, n = 0.05, 12, 16  # one target forward (s); verify steps and tokens per prompt: tau 16 / 12
    rows = []
    for draft, c in (("suffix", 0.002), ("distilled", 0.4)):
        for r in _rows(draft, "clinical_notes", 4, 1.2, emitted=n, steps=steps):
            spec = r["target_time_s"] / 1.2
            rows.append({**r, "target_time_s": n * t1 * (1 + 0.05 * int(r["prompt_id"])),
                         "speculative_time_s": n * t1 * (1 + 0.05 * int(r["prompt_id"])) / 1.2,
                         "speculative_trial_times_s": [spec * f for f in (0.95, 1.05)],
                         "prefill_time_s": 0.0, "draft_time_s": steps * 4 * c * t1, "verify_time_s": steps * 1.1 * t1,
                         "accepted_tokens": n - steps, "per_position_drafted": [steps] * 4,
                         "per_position_accepted": [n - steps, 0, 0, 0], "accepted_length_histogram": [8, 4]})
    results = {"rows": rows, "cost_ratio": {d: {"cost_ratio": c, "draft_forward_s": c * t1, "target_forward_s": t1}
                                            for d, c in (("suffix", 0.002), ("distilled", 0.4))},
               "verify_cost_ratio": {"0": {"verify_cost_ratio": 1.0, "target_forward_s": t1},
                                     "4": {"verify_cost_ratio": 1.1, "target_forward_s": t1}},
               "num_draft_tokens": [4], "max_new_tokens": n, "sampling": {}, "truncated_prompts": 0,
               "timing_trials": 2, "machine_load": {}}
    doc = write_report(tmp_path, results, {"experiment_name": "t", "seed": 0, "min_mean_accepted_length": floor},
                       primary_num_draft_tokens=4, bootstrap_samples=200, plots=False)
    rec = doc["recommendation"]["clinical_notes"]
    if floor == 1.5:
        assert rec["draft"] is None and rec["basis"] == "low_tau"
        return
    by_draft = {c["draft"]: c for c in candidates(doc, "clinical_notes")}
    lookup, trained = by_draft["suffix"], by_draft["distilled"]
    assert tau_floor(lookup, "break_even") < lookup["mean_accepted_length"] < tau_floor(trained, "break_even")
    o = doc["drafts"]["suffix"]["clinical_notes"]["loop_overhead_per_step"]
    assert tau_floor(lookup, "break_even") == pytest.approx(4 * 0.002 + 1.1 + o, rel=1e-6)
    assert rec["draft"] == "suffix"
    assert any("`distilled`" in s and "break-even" in s for s in rec["set_aside"])


def test_each_domain_decodes_with_its_own_sampling():
    """eval.domain_sampling: one domain sampled, the other greedy, in one evaluation; the greedy domain is checked
    for losslessness and the sampled one is not (its outputs differ from the target-only sample); reseeded decodes
    repeat their samples, so two trials agree."""
    from data.text import train_bpe_tokenizer
    from eval.evaluate import Prompt, evaluate_drafts

    text = ["Patient: I have a cough and a fever. Note: The patient reports a cough and a fever.",
            "User: hello there\nAssistant: hi, how can I help?"] * 20
    tok = train_bpe_tokenizer(iter(text), vocab_size=200, min_frequency=1)
    target = tiny_llama(vocab_size=len(tok), seed=0, eos_token_id=tok.eos_token_id)
    drafts = {"suffix": NgramDraft("suffix", min_ngram=1, max_ngram=3, min_share=0.3)}
    prompts = {"notes": [Prompt("notes", f"n/{i}", "Patient: I have a cough and a fever. Note:") for i in range(2)],
               "chat": [Prompt("chat", f"c/{i}", "User: hello there\nAssistant:") for i in range(2)]}
    sampled = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    res = evaluate_drafts(target, tok, drafts, prompts, num_draft_tokens=3, max_new_tokens=12, max_prompt_tokens=64,
                          cost_ratio_trials=2, seed=0, timing_trials=2, domain_sampling={"chat": sampled})
    by = {r["domain"]: r for r in res["rows"]}
    assert by["notes"]["greedy_equal"] is True and by["chat"]["greedy_equal"] is None
    assert res["domain_sampling"] == {"chat": sampled} and res["sampling"] == {}
    greedy = res["target_outputs"]["chat"]
    assert greedy["c/0"] != greedy["c/1"]  # two seeds, two samples of the same prompt: chat was sampled


@pytest.mark.parametrize("override,needle", [
    ("eval.domain_sampling={code: {do_sample: true}}", "not among the evaluated domains"),
    ("eval.domain_sampling={chat: {temp: 1.0}}", "must map some of"),
    ("eval.domain_sampling={chat: {do_sample: true, temperature: 0}}", "eval.domain_sampling.chat: temperature=0"),
])
def test_bad_domain_sampling_is_refused(override, needle):
    from eval.config import validate_eval
    from tinymodels import compose_config

    with pytest.raises(ValueError) as ei:
        validate_eval(compose_config(["eval.domains=[chat]", override]))
    assert needle in str(ei.value)


def test_sampling_for_merges_the_domain_entry_over_decode():
    from eval.config import EvalConfig

    cfg = EvalConfig(domains=["chat", "medical"], domain_sampling={"chat": {"do_sample": True, "temperature": 0.7}})
    assert cfg.sampling_for("medical", {}) == {}
    assert cfg.sampling_for("chat", {}) == {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}
    assert cfg.sampling_for("chat", {"do_sample": True, "temperature": 1.0, "top_k": 5, "top_p": 0.9})["top_k"] == 5
    greedy_chat = EvalConfig(domains=["chat"], domain_sampling={"chat": {"do_sample": False}})
    assert greedy_chat.sampling_for("chat", {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}) == {}


@pytest.mark.parametrize("entry,default,refused", [
    ({"temperature": 0.7}, {}, "temperature"),                                    # greedy decode, no do_sample
    ({"do_sample": False, "top_p": 0.9}, {"do_sample": True, "temperature": 1.0}, "top_p"),
    ({"top_k": 5}, {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}, None),  # decode samples
    ({"temperature": 1.0}, {}, None),                                             # the no-op value
])
def test_a_sampling_setting_for_a_greedy_domain_is_refused_not_ignored(entry, default, refused):
    """A domain entry that sets temperature / top_k / top_p while the domain decodes greedily (neither it nor decode
    samples) would be decoded greedily in silence; it is refused, naming the entry and the fix."""
    from eval.config import EvalConfig

    cfg = EvalConfig(domains=["chat"], domain_sampling={"chat": entry})
    if refused is None:
        cfg.sampling_for("chat", default)
        return
    with pytest.raises(ValueError) as ei:
        cfg.sampling_for("chat", default)
    msg = str(ei.value)
    assert msg.startswith("eval.domain_sampling.chat sets ") and refused in msg and "do_sample: true" in msg, msg
