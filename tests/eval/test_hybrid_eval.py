"""Hybrid drafts in the evaluation (decode/hybrid.py through eval/): the held-out replay equals real decoding; the
cost ratio of a cell counts only the model's drafted tokens; routing.json and serving.json carry a hybrid route
(its trained draft checked, the engines given the trained draft alone); `python -m eval` with
eval.hybrid_lookups decodes the hybrids beside the drafts, lossless, and a routing table that routes a domain to a
hybrid re-evaluates it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decode.hybrid import HybridDraft, hybrid_generate
from decode.ngram import NgramDraft
from eval.heldout import hybrid_runs, replay
from tinymodels import perturbed_copy, save_tiny_lm, tiny_llama

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind", ["prompt_lookup", "suffix"])
def test_the_replay_equals_decoding(kind):
    """Blocks per gamma and accepted tokens per draft position from :func:`hybrid_runs` are the decoder's own, on
    prompts where the lookup and the model both take steps."""
    target = tiny_llama(vocab_size=16, hidden_size=32, num_layers=2, seed=4)
    model = perturbed_copy(target, 0.4, seed=9)
    g = torch.Generator().manual_seed(1)
    prompts = [(torch.randint(2, 16, (3,), generator=g).tolist() * 3)[:7 + i] for i in range(4)]
    answers = []
    for p in prompts:
        out = hybrid_generate(target, HybridDraft(NgramDraft(kind, min_ngram=2), model), torch.tensor([p]),
                              max_new_tokens=30, eos_token_id=[])
        answers.append(out.sequences[0, len(p):].tolist())
    both = [0, 0]
    for gamma in (1, 3, 5):
        draft = HybridDraft(NgramDraft(kind, min_ngram=2, max_ngram=3, min_share=0.4), model)
        runs = hybrid_runs(draft, prompts, answers, gamma, vocab=16)
        decoder = HybridDraft(NgramDraft(kind, min_ngram=2, max_ngram=3, min_share=0.4), model)
        for p, a, (run, lengths) in zip(prompts, answers, runs):
            r = replay(None, gamma, runs=run, lengths=lengths)
            out = hybrid_generate(target, decoder, torch.tensor([p]), max_new_tokens=len(a), num_draft_tokens=gamma,
                                  eos_token_id=[])
            decoder.observe(a)  # the replay's store order: each answer after its own prompt
            s = out.stats
            assert out.sequences[0, len(p):].tolist() == a
            assert r.blocks[gamma] == s.verify_steps and sum(r.accepted) == s.accepted_tokens
            assert r.accepted == s.per_position_accepted[:gamma] + [0] * (gamma - len(s.per_position_accepted))
            both[0] += s.lookup_drafted_tokens
            both[1] += s.drafted_tokens - s.lookup_drafted_tokens
    assert both[0] > 0 and both[1] > 0  # the lookup and the model both drafted


def test_a_cells_cost_ratio_counts_the_models_tokens_only():
    from eval.metrics import cell_cost_ratio

    hybrid = [{"drafted_tokens": 30, "lookup_drafted_tokens": 20}, {"drafted_tokens": 10, "lookup_drafted_tokens": 0}]
    assert cell_cost_ratio(hybrid, 0.4) == pytest.approx(0.4 * 20 / 40)
    assert cell_cost_ratio([{"drafted_tokens": 9, "lookup_drafted_tokens": None}], 0.4) == 0.4  # not a hybrid
    assert cell_cost_ratio([{"drafted_tokens": 0, "lookup_drafted_tokens": 0}], 0.4) == 0.4
    assert cell_cost_ratio([{"drafted_tokens": 8}], 0.3) == 0.3  # an older per_prompt.csv: no such column


def test_a_hybrid_route_round_trips_and_serves_its_trained_draft(tmp_path):
    from core.errors import RoutingError
    from decode.config import load_routing
    from eval.sections import serving_document

    model = tmp_path / "drafts" / "distilled"
    spec = f"ngram:suffix+{model}"
    table = {"routes": {"clinical": {"draft": "suffix+distilled", "path": spec, "num_draft_tokens": 3}}}
    (tmp_path / "routing.json").write_text(json.dumps(table))
    with pytest.raises(RoutingError, match="no config.json"):  # the trained draft behind the lookup must exist
        load_routing(tmp_path / "routing.json")
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    assert load_routing(tmp_path / "routing.json").draft_for("clinical").path == spec  # kept as written
    (tmp_path / "bad.json").write_text(json.dumps({"routes": {"x": {"draft": "h", "path": "ngram:bigram+/x"}}}))
    with pytest.raises(RoutingError, match="unknown lookup draft"):
        load_routing(tmp_path / "bad.json")
    doc = {"recommendation": {"clinical": {"draft": "suffix+distilled", "num_draft_tokens": 3, "measured_speedup": 1.3,
                                           "draft_length_policy": "fixed"}},
           "drafts": {"suffix+distilled": {"clinical": {"sweep": {"3": {"measured_speedup": 1.3,
                                                                        "mean_accepted_length": 2.0}}}}}}
    serving = serving_document(doc, {"suffix+distilled": spec}, str(tmp_path / "target"), tmp_path / "gguf")
    clin = serving["domains"]["clinical"]
    assert clin["draft_path"] == spec and clin["vllm"]["speculative_config"]["model"] == str(model)
    assert "serve distilled alone" in clin["note"] and "-md" in clin["llama_cpp"]["args"]


def _eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eval", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "WANDB_MODE": "offline"})


def test_python_m_eval_decodes_hybrids_and_routes_to_one(tmp_path):
    text = ["User: hello there\nAssistant: hi, how can I help?", "The patient reports chest pain and cough."] * 20
    target, mine = save_tiny_lm(tmp_path / "target", text, 300, 0), save_tiny_lm(tmp_path / "mine", text, 300, 1)
    run_dir = tmp_path / "run"
    common = [f"target.name_or_path={target}", "eval.domains=[chat]", "eval.max_prompts=2", "eval.max_new_tokens=8",
              "eval.cost_ratio_trials=2", "eval.bootstrap_samples=100", "eval.num_threads=1",
              "eval.heldout.max_prompts=2", "eval.heldout.train_prompts=0", "eval.engine.enabled=false"]
    proc = _eval(*common, f"eval.drafts={{mine: {mine}}}", "eval.lookup_drafts=[]", "eval.hybrid_lookups=[suffix]",
                 "eval.num_draft_tokens=[2]", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert list(doc["drafts"]) == ["mine", "suffix+mine"] and doc["lossless_all"] is True
    assert doc["context"]["drafts"]["suffix+mine"] == f"ngram:suffix+{mine.resolve()}"
    rows = list((run_dir / "per_prompt.csv").read_text().splitlines())
    assert "lookup_drafted_tokens" in rows[0]
    heldout = json.loads((run_dir / "metrics.json").read_text()).get("heldout") or {}
    assert "suffix+mine" in json.dumps(heldout)  # the replay measured it
    routing = tmp_path / "routing.json"
    routing.write_text(json.dumps({"routes": {"chat": {"draft": "suffix+mine", "path": f"ngram:suffix+{mine}",
                                                       "num_draft_tokens": 2}}}))
    rerun = tmp_path / "routed"
    proc = _eval(*common, f"decode.draft_routing={routing}", f"hydra.run.dir={rerun}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((rerun / "metrics.json").read_text())
    assert list(doc["drafts"]) == ["suffix+mine"] and doc["lossless_all"] is True
    proc = _eval(*common, "eval.drafts={h: 'ngram:suffix+/nowhere/draft'}", f"hydra.run.dir={tmp_path / 'bad'}")
    assert proc.returncode != 0 and "/nowhere/draft" in proc.stderr


def test_two_drafts_with_one_name_are_refused(tmp_path):
    """A checkpoint named like a lookup kind or like the hybrid eval.hybrid_lookups makes would silently replace
    one draft with another: the check names both."""
    from eval.config import check_draft_names, validate_eval
    from tinymodels import compose_config

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    for drafts, extra in ((f"{{mine: {mine}, suffix: {mine}}}", []),
                          (f"{{mine: {mine}, suffix+mine: {mine}}}", ["eval.hybrid_lookups=[suffix]"]),
                          (f"{{mine: {mine}, suffix+mine: 'ngram:prompt_lookup+{mine}'}}", ["eval.hybrid_lookups=[suffix]"])):
        rc = validate_eval(compose_config(["eval.domains=[chat]", f"eval.drafts={drafts}", *extra]))
        paths = {n: Path(p) for n, p in rc.eval.drafts.items() if not str(p).startswith("ngram:")}
        with pytest.raises(ValueError, match="two drafts are named"):
            check_draft_names(rc, paths)
    rc = validate_eval(compose_config(["eval.domains=[chat]", f"eval.drafts={{mine: {mine}}}",
                                       "eval.hybrid_lookups=[suffix]"]))
    check_draft_names(rc, {"mine": mine})  # prompt_lookup, suffix, mine, suffix+mine: all different


def test_a_relative_hybrid_route_resolves_against_the_tables_folder_and_bad_specs_are_refused(tmp_path):
    from core.errors import RoutingError
    from decode.config import load_routing
    from decode.hybrid import parse_hybrid_spec

    (tmp_path / "sub" / "mine").mkdir(parents=True)
    (tmp_path / "sub" / "mine" / "config.json").write_text("{}")
    (tmp_path / "routing.json").write_text(json.dumps({"routes": {"chat": {"path": "ngram:suffix+sub/mine"}}}))
    route = load_routing(tmp_path / "routing.json").draft_for("chat")
    assert route.path == f"ngram:suffix+{tmp_path / 'sub' / 'mine'}" and route.draft == "suffix+mine"
    with pytest.raises(ValueError, match="not of another lookup"):
        parse_hybrid_spec("ngram:suffix+ngram:prompt_lookup")
    (tmp_path / "nested.json").write_text(json.dumps({"routes": {"c": {"path": "ngram:suffix+ngram:suffix"}}}))
    with pytest.raises(RoutingError, match="not of another lookup"):
        load_routing(tmp_path / "nested.json")


def test_domain_sampling_is_checked_against_decodes_settings_and_recorded_per_route():
    from eval.config import EvalConfig, validate_eval
    from eval.decision import routing_table
    from tinymodels import compose_config

    with pytest.raises(ValueError, match="do_sample must be true or false"):
        validate_eval(compose_config(["eval.domains=[chat]", "eval.domain_sampling={chat: {do_sample: 'false'}}"]))
    cfg = EvalConfig(domains=["chat"], domain_sampling={"chat": {"temperature": 0}})
    with pytest.raises(ValueError, match="eval.domain_sampling.chat with decode's settings"):
        cfg.sampling_for("chat", {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0})
    sampled = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    doc = {"drafts": {}, "recommendation": {"chat": {"draft": None}, "medical": {"draft": None}},
           "num_draft_tokens_swept": [3], "decoding": "greedy", "domain_sampling": {"chat": sampled}}
    routes = routing_table(doc, {})["routes"]
    assert routes["chat"]["decoding"] == "sampling" and routes["chat"]["sampling"] == sampled
    assert "decoding" not in routes["medical"]  # decoded as the document's top-level decoding says


def test_a_hybrid_named_by_a_runs_draft_path_reads_the_runs_draft(tmp_path, monkeypatch):
    """``ngram:suffix+drafts/distilled`` names the run's own draft, as ``drafts/distilled`` does for a plain draft:
    resolved against the run directory (not the working directory), and in a training run that has not written it
    yet, left to the eval stage instead of refused as a missing folder."""
    from eval.config import hybrid_paths, validate_eval
    from eval.pipeline import check_eval_inputs
    from tinymodels import compose_config

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    rc = validate_eval(compose_config(["eval.drafts={d: ngram:suffix+drafts/distilled}", "eval.domains=[chat]"]))
    assert hybrid_paths(rc, run) == {"d": run / "drafts" / "distilled"}  # the run's, written or not
    assert check_eval_inputs(rc, run, need_drafts=False)[0] == {}  # not written yet: checked when eval runs
    with pytest.raises(ValueError, match="is not a directory"):  # an evaluation alone needs it now
        check_eval_inputs(rc, run)
    (run / "drafts" / "distiled").mkdir(parents=True)  # a near name beside it: offered
    (run / "drafts" / "distiled" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"is not a directory \(.* holds distiled; did you mean .*distiled\?\)"):
        check_eval_inputs(rc, run)
    (tmp_path / "drafts" / "distilled").mkdir(parents=True)  # only the working directory has one: that one
    assert hybrid_paths(rc, run) == {"d": Path("drafts/distilled")}
