"""Draft sources end to end (train.run.run, real data, tiny saved target): a searched layer-pruned self-draft saved
before distillation, distilled, INT8, next to the small-config draft; a pretrained draft distilled further. Every
checkpoint loads with AutoModelForCausalLM and works as transformers' assistant_model; the report compares them and
its INT8 row is measured. Bad pretrained drafts fail with clear errors before training."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models.checkpoints import save_hf_atomic
from distill.drafts import LlamaArch, build_llama
from train.run import run
from train.run import validate
from tinymodels import save_code_target
from models.checkpoints import SpecdraftMeta

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 4, "intermediate_size": 64, "max_position_embeddings": 128}


pytestmark = pytest.mark.usefixtures("block_cache")  # one packed-block cache for this module (conftest)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A 3-layer target (wider than the small draft) with a 300-token BPE tokenizer trained on code records, and that tokenizer."""
    out = tmp_path_factory.mktemp("target") / "target"
    tok, rows = save_code_target(out, num_layers=3, hidden_size=48)
    return {"target": out, "tokenizer": tok, "texts": rows.select(range(20))["prompt"]}


def _cfg(target: Path, stages: list[str], draft: dict) -> dict:
    return {
        "stages": stages, "target": {"name_or_path": str(target)},
        "draft": {"arch": TINY, **draft},
        "data": {"domain": "code", "block_size": 32, "max_train_blocks": 24},
        "trainer": {"max_steps": 3, "micro_batch_size": 4, "warmup_steps": 1, "log_every": 1, "save_every": 3},
        "decode": {"num_draft_tokens": 3},
        "distill": {"eval_every": 0, "teacher_signal": "cached", "cache_top_k": 8, "cache_shard_blocks": 16},
        "eval": {"domains": ["code"], "max_prompts": 2, "max_new_tokens": 8, "max_prompt_tokens": 32,
                 "cost_ratio_trials": 2, "bootstrap_samples": 0, "plots": False},
    }


def _assists(draft_dir: Path, target_dir: Path, texts: list[str]) -> None:
    """The checkpoint loads with the Auto class and transformers' assisted generation with it equals the target's
    own greedy output."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
    tok = AutoTokenizer.from_pretrained(draft_dir)
    ids = tok(texts[0], return_tensors="pt")
    with torch.no_grad():
        kw = dict(do_sample=False, max_new_tokens=10, pad_token_id=tok.pad_token_id)
        assert torch.equal(target.generate(**ids, assistant_model=draft, **kw), target.generate(**ids, **kw))


@pytest.fixture(scope="module")
def selfdraft_run(tiny, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("selfdraft")
    draft = {"init": "layer_pruned", "quantize": "int8",
             "layers": {"method": "search", "k": 1,
                        "search": {"strategy": "beam", "beam_width": 2, "max_evaluations": 3, "prompts": 2,
                                   "max_new_tokens": 6}}}
    out = run(_cfg(tiny["target"], ["draft_init", "distill", "distill_small", "eval"], draft), run_dir)
    return run_dir, out


def test_selfdraft_run_writes_every_draft_and_each_is_a_transformers_assistant(selfdraft_run, tiny):
    run_dir, out = selfdraft_run
    names = sorted(p.name for p in (run_dir / "drafts").iterdir() if not p.name.startswith("."))
    assert names == ["distilled", "distilled_int8", "layer_pruned", "layer_pruned_int8", "small_distilled"]
    before = json.loads((run_dir / "drafts/layer_pruned/specdraft.json").read_text())
    after = json.loads((run_dir / "drafts/distilled/specdraft.json").read_text())
    search = before["layer_search"]
    assert search["evaluations"] == 3 and len(search["trace"]) == 3  # k=1 of 3: every single layer measured
    assert before["layers"] == search["layers"] == [max(search["trace"], key=lambda t: (t["score"], -t["layers"][0]))
                                                     ["layers"][0]]
    assert before["distilled"] is False and after["distilled"] is True and after["layers"] == before["layers"]
    assert after["train"]["steps"] == 3 and after["init"] == "layer_pruned"
    assert json.loads((run_dir / "drafts/distilled_int8/specdraft.json").read_text())["quantize"] == "int8"
    small = json.loads((run_dir / "drafts/small_distilled/specdraft.json").read_text())
    assert small["init"] == "config" and small["quantize"] == "none" and small["draft_parameters"] < \
        after["draft_parameters"]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert sum(e["event"] == "layer_search_candidate" for e in events) == 3  # distill reused the saved init draft
    for n in names:
        _assists(run_dir / "drafts" / n, tiny["target"], tiny["texts"])
        assert SpecdraftMeta.read(run_dir / "drafts" / n).extra == {}  # every field written is in the schema


def test_selfdraft_report_compares_sources_and_measures_int8(selfdraft_run):
    run_dir, _ = selfdraft_run
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert doc["lossless_all"] is True  # the INT8 drafts too: speculative greedy == target greedy
    src = doc["draft_sources"]
    assert src["layer_pruned"]["distilled"] is False and src["distilled"]["distilled"] is True
    assert src["small_distilled"]["init"] == "config" and src["distilled_int8"]["quantize"] == "int8"
    row = doc["int8_vs_fp32"]["distilled_int8"]
    assert row["fp32_draft"] == "distilled"
    code = row["domains"]["code"]
    fp32, int8 = doc["drafts"]["distilled"]["code"], doc["drafts"]["distilled_int8"]["code"]
    assert code["mean_accepted_length"] == {"fp32": fp32["mean_accepted_length"], "int8": int8["mean_accepted_length"]}
    assert code["draft_tokens_per_s"]["int8"] == pytest.approx(
        int8["stats"]["drafted_tokens"] / int8["stats"]["draft_time_s"])
    assert code["draft_speedup"] == pytest.approx(code["draft_tokens_per_s"]["int8"] / code["draft_tokens_per_s"]["fp32"])
    report = (run_dir / "report.md").read_text()
    assert "## Draft sources" in report and "### INT8 vs fp32: `distilled_int8` against `distilled`" in report
    assert "### Mean accepted length by draft" in report


def _pretrained(tiny, tmp_path, vocab: int | None = None, tokenizer=None) -> Path:
    model = build_llama(LlamaArch(**TINY), tiny["tokenizer"], seed=11, vocab_size=vocab)
    out = tmp_path / f"pre_{vocab}"
    save_hf_atomic(model, tokenizer or tiny["tokenizer"], out)
    return out


def test_pretrained_draft_distilled_further(tiny, tmp_path):
    from distill.draft_init import load_pretrained_draft

    padded = _pretrained(tiny, tmp_path, vocab=320)  # padded rows beyond the tokenizer pass the checks
    target = build_llama(LlamaArch(**TINY), tiny["tokenizer"], seed=0)
    assert load_pretrained_draft(str(padded), target, tiny["tokenizer"])[0].config.vocab_size == 320
    pre = _pretrained(tiny, tmp_path)  # transformers' assisted generation needs equal vocab sizes
    out = run(_cfg(tiny["target"], ["draft_init", "distill", "eval"], {"init": "pretrained", "name_or_path": str(pre)}),
              tmp_path / "run")
    drafts = tmp_path / "run" / "drafts"
    meta = json.loads((drafts / "distilled" / "specdraft.json").read_text())
    assert meta["init"] == "pretrained" and meta["pretrained_from"] == str(pre) and meta["distilled"]
    assert out["draft_init"]["pretrained_from"] == str(pre)
    for n in ("pretrained", "distilled"):
        _assists(drafts / n, tiny["target"], tiny["texts"])
    doc = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert set(doc["drafts"]) == {"pretrained", "distilled", "prompt_lookup", "suffix"} and doc["lossless_all"] is True


def test_bad_pretrained_drafts_fail_clearly_before_training(tiny, tmp_path):
    from data.text import train_bpe_tokenizer
    from core.errors import TokenizerMismatchError
    from core.errors import VocabMismatchError

    other = train_bpe_tokenizer(["completely different text " * 5, "zzz yyy xxx"] * 20, vocab_size=280)
    cases = [(_pretrained(tiny, tmp_path / "a", tokenizer=other), TokenizerMismatchError, "not compatible"),
             (_pretrained(tiny, tmp_path / "b", vocab=200), VocabMismatchError, "fewer output rows"),
             (tmp_path / "missing", ValueError, "does not exist")]
    for i, (path, err, msg) in enumerate(cases):
        run_dir = tmp_path / f"r{i}"
        with pytest.raises(err, match=msg):
            run(_cfg(tiny["target"], ["distill"], {"init": "pretrained", "name_or_path": str(path)}), run_dir)
        assert not (run_dir / "drafts").exists() and not (run_dir / "train").exists()
    with pytest.raises(ValueError, match="draft.init=pretrained needs draft.name_or_path"):
        validate({"draft": {"init": "pretrained"}})
    with pytest.raises(ValueError, match="stage draft_init needs draft.init=layer_pruned or pretrained"):
        validate({"stages": ["draft_init"]})
    with pytest.raises(ValueError, match="draft.quantize must be one of none, int8"):
        validate({"draft": {"quantize": "int4"}})


def test_int8_vs_fp32_needs_the_fp32_draft_under_another_name():
    """An int8 draft evaluated under its fp32 draft's name (distill_med's eval.drafts: distilled ->
    drafts/distilled_int8) has no fp32 partner in the run: no INT8 vs fp32 table pairing it with itself."""
    from eval.sections import _int8_vs_fp32

    entry = {"acceptance_rate": 0.2, "mean_accepted_length": 1.5, "measured_speedup": 1.2,
             "stats": {"drafted_tokens": 30, "draft_time_s": 0.1}}
    doc = {"drafts": {"distilled": {"medical": entry}, "plain": {"medical": entry}, "plain_int8": {"medical": entry}},
           "cost_ratio": {}}
    src = {"distilled": {"quantize": "int8", "fp32_draft": "distilled"},
           "plain": {"quantize": "none", "fp32_draft": None},
           "plain_int8": {"quantize": "int8", "fp32_draft": "plain"}}
    out = _int8_vs_fp32(doc, ["distilled", "plain", "plain_int8"], ["medical"], src)
    assert list(out) == ["plain_int8"] and out["plain_int8"]["fp32_draft"] == "plain"
