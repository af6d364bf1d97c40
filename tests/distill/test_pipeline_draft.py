"""distill.pipeline's distill and baseline stages end to end on real data (code domain, data root) with a tiny saved target:
teacher-generated data + cached top-k teacher, on-policy + online teacher, the CE baseline; acceptance-based
selection is recorded in specdraft.json; inconsistent config is rejected before any model loads."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from distill.pipeline import baseline_stage, distill_stage
from train.run import validate
from tinymodels import save_code_target
from models.checkpoints import SpecdraftMeta

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 4, "intermediate_size": 64, "max_position_embeddings": 128}


pytestmark = pytest.mark.usefixtures("block_cache")  # one packed-block cache for this module (conftest)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    """A 2-layer Llama with a 300-token BPE tokenizer trained on code records, saved as a HF directory."""
    out = tmp_path_factory.mktemp("target") / "target"
    save_code_target(out, num_layers=2, hidden_size=TINY["hidden_size"])
    return out


def _rc(target: Path, **distill):
    return validate({
        "target": {"name_or_path": str(target)},
        "draft": {"arch": TINY},
        "data": {"domain": "code", "block_size": 32, "max_train_blocks": 48},
        "trainer": {"max_steps": 4, "micro_batch_size": 4, "warmup_steps": 1, "log_every": 1, "save_every": 2},
        "decode": {"num_draft_tokens": 3},
        "eval": {"max_prompt_tokens": 32},
        "distill": {"eval_every": 2, "eval_prompts": 2, "eval_max_new_tokens": 6, **distill},
    })


def _events(run_dir: Path):
    def log(event, **fields):
        with open(run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps({"event": event, **fields}, default=str) + "\n")
    return log


def _check_saved(run_dir: Path, kind: str) -> dict:
    from transformers import AutoModelForCausalLM

    meta = json.loads((run_dir / "drafts" / kind / "specdraft.json").read_text())
    assert SpecdraftMeta.read(run_dir / "drafts" / kind).extra == {}  # every field it writes is in the schema
    assert meta["selected_step"] in (2, 4)
    assert 1.0 <= meta["selected_mean_accepted_length"] <= 4.0
    assert meta["selection"]["best"]["step"] == meta["selected_step"]
    AutoModelForCausalLM.from_pretrained(run_dir / "drafts" / kind)
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "train_eval" and e["stage"] == kind]
    assert [e["step"] for e in evals] == [2, 4] and all("loss" in e and "mean_accepted_length" in e for e in evals)
    return meta


def test_teacher_data_with_cached_teacher(tiny_target, tmp_path):
    rc = _rc(tiny_target, data_source="teacher", teacher_signal="cached", cache_top_k=8, cache_shard_blocks=16,
             generation={"max_new_tokens": 24, "max_prompts": 40, "batch_size": 20, "max_prompt_tokens": 24})
    distill_stage(rc, rc.data.options(), tmp_path, events=_events(tmp_path))
    meta = _check_saved(tmp_path, "distilled")
    assert meta["data_source"] == "teacher" and meta["teacher_signal"] == "cached"
    assert meta["teacher_data"]["num_sequences"] == 40 and meta["teacher_data"]["computed"] == 2
    assert meta["teacher_cache"]["top_k"] == 8 and meta["teacher_cache"]["computed"] >= 1
    assert Path(meta["teacher_cache"]["path"]).parent == tmp_path / "teacher_cache"


def test_on_policy_online_and_baseline(tiny_target, tmp_path):
    rc = _rc(tiny_target, data_source="on_policy", on_policy_fraction=0.5, generation={"max_new_tokens": 8})
    distill_stage(rc, rc.data.options(), tmp_path, events=_events(tmp_path))
    meta = _check_saved(tmp_path, "distilled")
    assert meta["data_source"] == "on_policy" and meta["on_policy_generated_batches"] >= 1
    baseline_stage(rc, rc.data.options(), tmp_path, events=_events(tmp_path))
    base = _check_saved(tmp_path, "baseline")
    assert base["loss"] == "cross_entropy" and base["data_source"] == "dataset"


def test_on_policy_warm_start_on_teacher_data_with_cached_teacher(tiny_target, tmp_path):
    """The warm-started recipe of distill_med_onpolicy: target-generated blocks with a cached top-k teacher first,
    then draft rows (scored by the target's forward, only those rows) from step 2 on; the cost lands in
    specdraft.json and in every train-log record."""
    rc = _rc(tiny_target, data_source="on_policy", off_policy_data="teacher", teacher_signal="cached",
             cache_top_k=8, cache_shard_blocks=16, on_policy_fraction=0.5,
             on_policy_schedule={"warmup_steps": 2, "ramp_steps": 1},
             generation={"max_new_tokens": 24, "max_prompts": 40, "batch_size": 20, "max_prompt_tokens": 24,
                         "temperature": 0.0},
             on_policy_generation={"max_new_tokens": 8})
    distill_stage(rc, rc.data.options(), tmp_path, events=_events(tmp_path))
    meta = _check_saved(tmp_path, "distilled")
    assert meta["off_policy_data"] == "teacher" and meta["teacher_data"]["num_sequences"] == 40
    op = meta["on_policy"]
    assert op["generated_rows"] == 2 * 2 and op["generated_tokens"] == 4 * 8  # steps 2, 3: half of 4 rows
    assert op["target_scored_rows"] == 4 and op["generation_s"] > 0 and op["target_scoring_s"] > 0
    assert op["generation"]["max_new_tokens"] == 8 and op["schedule"] == {"warmup_steps": 2, "ramp_steps": 1}
    log = [json.loads(l) for l in (tmp_path / "train" / "distilled" / "train_log.jsonl").read_text().splitlines()]
    train_recs = [r for r in log if r["kind"] == "train"]
    assert [r["on_policy_fraction"] for r in train_recs] == [0.0, 0.0, 0.5, 0.5]
    assert [r["on_policy_rows"] for r in train_recs] == [0, 0, 2, 2]
    assert all(r["on_policy_target_scoring_s"] > 0 for r in train_recs[2:])


def test_baseline_gets_the_distilled_drafts_wall_clock(tiny_target, tmp_path):
    rc = _rc(tiny_target, teacher_signal="cached", cache_top_k=8, cache_shard_blocks=16, baseline_budget="wall_clock",
             baseline_max_steps=10_000)
    with pytest.raises(ValueError, match="run the distill stage before the baseline"):
        baseline_stage(rc, rc.data.options(), tmp_path)
    dist = distill_stage(rc, rc.data.options(), tmp_path, events=_events(tmp_path))
    base = baseline_stage(rc, rc.data.options(), tmp_path, events=_events(tmp_path))
    budget = base["budget"]
    assert budget["kind"] == "wall_clock"
    assert budget["distilled_train_s"] == pytest.approx(dist["train"]["train_time_s"])
    # the one-off passes count at their shards' compute seconds (a store reused from another run keeps its cost)
    assert budget["distilled_one_off_s"] == pytest.approx(dist["teacher_cache"]["cost_s"])
    assert 0 < dist["teacher_cache"]["cost_s"] <= dist["teacher_cache"]["time_s"]
    assert budget["seconds"] == pytest.approx(budget["distilled_train_s"] + budget["distilled_one_off_s"])
    # The baseline ran until the budget was spent (not to its 10 000-step cap), on the time-based schedule.
    assert base["train"]["stopped_early"] == "max_time_s" and base["train"]["steps"] < 10_000
    assert base["train"]["train_time_s"] >= budget["seconds"]
    assert base["trainer"]["schedule_over"] == "time" and base["trainer"]["max_time_s"] == budget["seconds"]
    assert dist["budget"] == {"kind": "steps", "max_steps": 4, "max_time_s": None}


def test_inconsistent_config_is_rejected_before_loading(tmp_path):
    rc = _rc(tmp_path / "does-not-exist", data_source="on_policy", generation={"max_new_tokens": 32})
    with pytest.raises(ValueError, match="must be < data.block_size"):
        distill_stage(rc, rc.data.options(), tmp_path)


@pytest.mark.parametrize("distill,match", [
    ({"teacher_signal": "cached", "loss": "reverse_kl"}, "reverse KL is infinite"),
    ({"teacher_signal": "cached", "loss": "generalized_jsd", "beta": 1.0}, "reverse KL is infinite"),
    ({"data_source": "on_policy", "off_policy_data": "web"}, "distill.off_policy_data"),
    ({"on_policy_schedule": {"warmup_steps": -1}}, "warmup_steps"),
    ({"on_policy_generation": {"top_k": -1}}, "top_k"),
    ({"data_source": "web"}, "distill.data_source"),
    ({"teacher_signal": "lazy"}, "distill.teacher_signal"),
    ({"on_policy_fraction": 1.5}, "on_policy_fraction"),
    ({"eval_every": -1}, "eval_every"),
    ({"generation": {"top_p": 0.0}}, "top_p"),
    ({"generation": {"temperature": -1.0}}, "temperature"),
    ({"baseline_budget": "flops"}, "distill.baseline_budget"),
    ({"baseline_max_steps": -1}, "baseline_max_steps"),
])
def test_bad_distill_config_is_rejected(tmp_path, distill, match):
    with pytest.raises(ValueError, match=match):
        _rc(tmp_path, **distill)


def test_bench_teacher_cache_script_runs_on_a_tiny_saved_target(tiny_target, tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import bench_teacher_cache

    out = tmp_path / "bench.json"
    assert bench_teacher_cache.main(["--target", str(tiny_target), "--steps", "3", "--warmup", "1", "--repeats", "1",
                                     "--micro-batch-size", "2", "--block-size", "16", "--top-k", "4",
                                     "--random-tokens", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["timed_steps_per_variant"] == 3 and res["online_step_s"] > 0 and res["cached_step_s"] > 0
    assert res["speedup"] == pytest.approx(res["online_step_s"] / res["cached_step_s"])


def test_wall_clock_baseline_without_a_distill_stage_is_refused_before_loading(tmp_path):
    from train.run import check_stage_inputs

    rc = _rc(tmp_path / "target", baseline_budget="wall_clock")
    rc.stages = ["baseline", "eval"]
    with pytest.raises(ValueError, match="no distill stage runs before the baseline"):
        check_stage_inputs(rc, tmp_path)
    rc.stages = ["distill", "baseline", "eval"]
    check_stage_inputs(rc, tmp_path)  # distill writes drafts/distilled first: fine


@pytest.mark.parametrize("signal", ["cached", "online"])
def test_trimmed_draft_vocab_distill_and_baseline(tiny_target, tmp_path, signal):
    """draft.draft_vocab_size: the draft trains over N kept ids counted on the target's own answers (the baseline:
    on its training text), is saved as a full-vocabulary export with the id map, and reloads as the trimmed draft."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.checkpoints import load_causal_lm
    from models.vocab import TrimmedLMHead
    from decode import speculative_generate

    rc = _rc(tiny_target, data_source="teacher", teacher_signal=signal, cache_top_k=8, cache_shard_blocks=16,
             generation={"max_new_tokens": 24, "max_prompts": 40, "batch_size": 20, "max_prompt_tokens": 24})
    rc.draft.draft_vocab_size = 120
    distill_stage(rc, rc.data.options(), tmp_path, events=_events(tmp_path))
    baseline_stage(rc, rc.data.options(), tmp_path, events=_events(tmp_path))
    target, tok = load_causal_lm(tiny_target, role="target")
    for kind, counted_on in (("distilled", "target_answers"), ("baseline", "training_blocks")):
        meta = _check_saved(tmp_path, kind)
        dv = meta["draft_vocab"]
        assert dv["size"] == 120 and len(dv["draft_to_target"]) == 120 and dv["counted_on"] == counted_on
        assert dv["target_vocab_size"] == target.config.vocab_size and 0 < dv["counted_share_kept"] <= 1
        assert set(tok.all_special_ids) <= set(dv["draft_to_target"])
        export = AutoModelForCausalLM.from_pretrained(tmp_path / "drafts" / kind)
        assert export.lm_head.weight.shape[0] == target.config.vocab_size
        draft, _ = load_causal_lm(tmp_path / "drafts" / kind, role="draft")
        head = draft.get_output_embeddings()
        assert isinstance(head, TrimmedLMHead) and head.draft_to_target.tolist() == dv["draft_to_target"]
        prompt = torch.tensor([tok("def add(a, b):")["input_ids"]])
        ref = speculative_generate(target, target, prompt, max_new_tokens=16, num_draft_tokens=1)
        out = speculative_generate(target, draft, prompt, max_new_tokens=16, num_draft_tokens=3)
        assert torch.equal(out.sequences, ref.sequences)


def test_trimmed_draft_vocab_config_errors(tiny_target, tmp_path):
    with pytest.raises(ValueError, match="draft_vocab_size"):
        validate({"target": {"name_or_path": str(tiny_target)}, "draft": {"draft_vocab_size": 0}})
    rc = _rc(tiny_target, data_source="on_policy", on_policy_fraction=0.5, generation={"max_new_tokens": 8})
    rc.draft.draft_vocab_size = 100
    with pytest.raises(ValueError, match="on_policy"):
        distill_stage(rc, rc.data.options(), tmp_path)
    rc = _rc(tiny_target, data_source="dataset")
    rc.draft.draft_vocab_size = 10_000
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[1, "):
        distill_stage(rc, rc.data.options(), tmp_path)


@pytest.mark.parametrize("train_head", [True, False])
def test_trimmed_head_rows_train_alone(tiny_target, tmp_path, train_head):
    """draft.train_head=true with draft.train_embeddings=false: only the N kept head rows move; the embedding stays
    the target's. false: the head rows stay the target's too."""
    import torch
    from transformers import AutoModelForCausalLM

    rc = validate({
        "target": {"name_or_path": str(tiny_target)},
        "draft": {"init": "layer_pruned", "layers": {"method": "list", "indices": [0]}, "train_embeddings": False,
                  "train_head": train_head, "draft_vocab_size": 100},
        "data": {"domain": "code", "block_size": 32, "max_train_blocks": 48},
        "trainer": {"max_steps": 4, "micro_batch_size": 4, "warmup_steps": 1, "lr": 1e-2},
        "eval": {"max_prompt_tokens": 32},
        "distill": {"eval_every": 0},
    })
    distill_stage(rc, rc.data.options(), tmp_path, events=_events(tmp_path))
    target = AutoModelForCausalLM.from_pretrained(tiny_target)
    export = AutoModelForCausalLM.from_pretrained(tmp_path / "drafts" / "distilled")
    kept = json.loads((tmp_path / "drafts" / "distilled" / "specdraft.json").read_text())["draft_vocab"]
    kept = torch.tensor(kept["draft_to_target"])
    emb = target.get_input_embeddings().weight
    assert torch.equal(export.get_input_embeddings().weight, emb)
    moved = (export.lm_head.weight[kept] - emb[kept]).abs().amax().item()
    assert (moved > 1e-4) if train_head else (moved == 0.0)


def test_train_head_config_errors(tiny_target):
    with pytest.raises(ValueError, match="draft.train_head applies to a trimmed head only"):
        validate({"target": {"name_or_path": str(tiny_target)}, "draft": {"train_head": True}})
    with pytest.raises(ValueError, match="draft.train_head: Value 'abc' is not a valid bool"):
        validate({"target": {"name_or_path": str(tiny_target)}, "draft": {"train_head": "abc",
                                                                          "draft_vocab_size": 100}})
