"""LoRA domain adaptation (distill/lora.py): only the adapters train, the merged checkpoint equals the unmerged
PEFT model (fp32, 1e-5), every saved checkpoint loads with AutoModelForCausalLM and works as transformers'
assistant_model, and the stage writes both artifacts atomically and reuses them on resume."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from tinymodels import tiny_family_lm, tiny_llama

from distill.losses import get_loss
from distill.lora import adapt_draft
from distill.lora import ALL_LINEAR, LoraSectionConfig, adaptable_module_names, adapted_module_names, merge_lora, wrap_lora
from core.errors import LoraError
from distill.trainer import TrainerConfig, make_distill_step, train
from models.checkpoints import SpecdraftMeta


def _adapt_tiny(tmp_path, rank=4, dropout=0.0, modules=None, steps=4, seed=0):
    target = tiny_llama(seed=100, num_layers=3, hidden_size=48, num_heads=4)
    draft = tiny_llama(seed=seed)
    base = copy.deepcopy(draft)
    cfg = LoraSectionConfig(enabled=True, rank=rank, alpha=2.0 * rank, dropout=dropout,
                            target_modules=modules or ["q_proj", "v_proj", "down_proj"])
    model = wrap_lora(draft, cfg, seed=seed)
    blocks = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(seed))  # (N, T)
    tcfg = TrainerConfig(max_steps=steps, micro_batch_size=4, lr=5e-2, warmup_steps=0, save_every=0, log_every=1)
    train(model, blocks, tmp_path / "train", tcfg, make_distill_step(get_loss("forward_kl"), 1.0), teacher=target,
          seed=seed)
    return target, base, model.eval()


@pytest.mark.parametrize("rank,dropout,seed", [(1, 0.0, 0), (4, 0.1, 1), (8, 0.0, 2)])
def test_merged_outputs_equal_the_unmerged_peft_model_fp32(tmp_path, rank, dropout, seed):
    target, base, peft_model = _adapt_tiny(tmp_path, rank=rank, dropout=dropout, seed=seed)
    ids = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(seed + 7))  # (B, T)
    with torch.no_grad():
        unmerged = peft_model(input_ids=ids).logits  # (B, T, V)
        before = base(input_ids=ids).logits
    # only the adapters trained: the base weights are untouched and the adapted outputs moved
    original = dict(base.named_parameters())
    frozen = {n.replace(".base_layer", ""): p for n, p in peft_model.get_base_model().named_parameters()
              if "lora_" not in n}
    assert frozen.keys() == original.keys()
    for n, p in frozen.items():
        assert torch.equal(p, original[n]) and not p.requires_grad, n
    assert (unmerged - before).abs().max() > 1e-3
    merged = merge_lora(copy.deepcopy(peft_model))
    assert type(merged).__name__ == "LlamaForCausalLM" and not any("lora" in n for n, _ in merged.named_modules())
    with torch.no_grad():
        out = merged(input_ids=ids).logits
    torch.testing.assert_close(out, unmerged, atol=1e-5, rtol=0)


def test_saved_merged_checkpoint_loads_and_works_as_assistant_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from models.checkpoints import save_hf_atomic
    from decode import autoregressive_generate, speculative_generate

    target, base, peft_model = _adapt_tiny(tmp_path)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        unmerged = peft_model(input_ids=ids).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    save_hf_atomic(merge_lora(peft_model), None, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    reloaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, unmerged, atol=1e-5, rtol=0)
        torch.testing.assert_close(reloaded(input_ids=ids).logits, unmerged, atol=1e-5, rtol=0)
        assisted = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=merged,
                                   do_sample=False, max_new_tokens=12, pad_token_id=0)
    ours = autoregressive_generate(target, ids, max_new_tokens=12)
    assert torch.equal(assisted, ours.sequences[:, : assisted.size(1)])
    spec = speculative_generate(target, merged, ids, max_new_tokens=12, num_draft_tokens=3)
    assert torch.equal(spec.sequences, ours.sequences)


def test_config_and_module_errors():
    for bad in ({"rank": 0}, {"alpha": 0}, {"dropout": 1.0}, {"target_modules": []}, {"lr": 0},
                {"name": "a/b"}, {"domain": "nope"}):
        with pytest.raises(ValueError):
            LoraSectionConfig(**bad)
    with pytest.raises(LoraError, match=r"\['qkv'\] match no layer LoRA can adapt.*q_proj.*all-linear"):
        wrap_lora(tiny_llama(), LoraSectionConfig(target_modules=["q_proj", "qkv"]))
    for bad in ("q_proj", [""], [3], {"a": 1}):
        with pytest.raises(ValueError, match="lora.target_modules"):
            LoraSectionConfig(target_modules=bad)
    with pytest.raises(LoraError, match="no default LoRA target modules for model type 'phi3'.*all-linear"):
        wrap_lora(tiny_family_lm("phi3"), LoraSectionConfig(target_modules=None))


# ------------------------------------------------------------------ model families (issue 12)
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma", "phi3", "gpt2", "gpt_neox", "opt", "falcon"]


def _randomize_adapters(peft_model, seed: int = 0) -> None:
    """Non-zero A and B in every adapter (peft starts B, or for embeddings A, at 0: the update would vanish)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def _assert_merged_equals_adapted(peft_model, base, vocab: int = 64):
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        adapted, before = peft_model(input_ids=ids).logits, base(input_ids=ids).logits
        merged = merge_lora(peft_model)
        assert not any("lora" in n for n, _ in merged.named_modules())
        # merging adds the float32 products in another order (W + BA vs Wx + B(Ax)): up to 2e-5 apart on the AMD EPYC
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, atol=1e-4, rtol=1e-4)
    assert (adapted - before).abs().max() > 1e-2  # the adapters did change the draft
    return merged


def _head_name(model) -> str:
    head = model.get_output_embeddings()
    return next(n for n, m in model.named_modules() if m is head).rsplit(".", 1)[-1]


@pytest.mark.parametrize("family", FAMILIES)
def test_default_targets_exist_in_every_family_and_merge_exactly(family):
    """all-linear (the default) adapts every Linear / Conv1D layer of the family but the head; null takes peft's
    per-family default. Either way every adapted name is a layer of the draft, and merged == adapted."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as MAPPING
    from transformers.pytorch_utils import Conv1D

    base = tiny_family_lm(family)
    linear = {n.rsplit(".", 1)[-1] for n, m in base.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))}
    assert LoraSectionConfig().target_modules == "all-linear"
    model = wrap_lora(copy.deepcopy(base), LoraSectionConfig(rank=2, alpha=4.0), seed=1)
    assert adapted_module_names(model) == sorted(linear - {_head_name(base)}) and len(linear) >= 3
    _randomize_adapters(model)
    _assert_merged_equals_adapted(model, base)
    if base.config.model_type not in MAPPING:  # phi3: no peft default (test_config_and_module_errors)
        return
    model = wrap_lora(copy.deepcopy(base), LoraSectionConfig(rank=2, alpha=4.0, target_modules=None), seed=1)
    assert adapted_module_names(model) == sorted(MAPPING[base.config.model_type])
    assert set(adapted_module_names(model)) <= set(adaptable_module_names(base))
    _randomize_adapters(model)
    _assert_merged_equals_adapted(model, base)


@pytest.mark.parametrize("family,targets", [("gpt2", ["c_attn", "lm_head"]), ("gpt2", ["wte"]),
                                            ("falcon", ["lm_head"]), ("opt", ["fc1", "embed_tokens", "lm_head"])])
def test_tied_head_or_embedding_as_target_is_untied_so_merged_equals_adapted(tmp_path, family, targets):
    """Merging an adapter on one of two tied embeddings used to fold its update into the shared matrix (the other
    one changed too): the head now gets its own copy first, and the saved merged draft reloads untied."""
    from transformers import AutoModelForCausalLM

    base = tiny_family_lm(family)
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight  # tied
    draft = copy.deepcopy(base)
    model = wrap_lora(draft, LoraSectionConfig(rank=4, alpha=8.0, target_modules=targets), seed=0)
    _randomize_adapters(model)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
    merged = _assert_merged_equals_adapted(model, base)
    assert merged.get_output_embeddings().weight is not merged.get_input_embeddings().weight
    merged.save_pretrained(tmp_path / "m")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert reloaded.config.tie_word_embeddings is False
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, adapted, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # a whole lora / adapt stage in-process
def test_gpt2_draft_adapts_through_the_lora_stage(tmp_path):
    """The lora stage on real data with a GPT-2 draft (Conv1D layers) sharing the reference target's tokenizer:
    the default targets are its c_attn / c_proj / c_fc, and the saved merged draft equals the saved adapter on the
    base; with lm_head named too (tied embeddings) the same holds."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from models.checkpoints import load_causal_lm
    from models.checkpoints import save_hf_atomic
    from train.run import validate

    _, tok = load_causal_lm("models/assets/reference_target", role="target")
    draft = tiny_family_lm("gpt2", vocab_size=tok.vocab_size if len(tok) <= tok.vocab_size else len(tok), seed=2,
                        n_positions=256)
    save_hf_atomic(draft, tok, tmp_path / "drafts" / "distilled")
    ids = tok("The patient was admitted with chest pain", return_tensors="pt").input_ids
    for name, targets in (("gpt2_default", "all-linear"), ("gpt2_head", ["c_attn", "lm_head"])):
        cfg = {"stages": ["lora"], "data": {"block_size": 64, "max_train_blocks": 8}, "trainer": {"num_threads": 1},
               "lora": {"enabled": True, "rank": 2, "domain": "medical", "max_steps": 2, "micro_batch_size": 2,
                        "warmup_steps": 0, "save_every": 0, "eval_every": 0, "lr": 0.05, "name": name,
                        "target_modules": targets, "data_source": "dataset", "teacher_signal": "online"}}
        rc = validate(cfg)
        out = adapt_draft(rc, rc.data.options(), tmp_path)
        want = ["c_attn", "c_fc", "c_proj"] if targets == "all-linear" else ["c_attn", "lm_head"]
        assert out["lora"]["adapted_modules"] == want
        merged = AutoModelForCausalLM.from_pretrained(out["path"]).eval()
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "drafts" / "distilled").eval()
        with torch.no_grad():
            before = base(input_ids=ids).logits
            adapted = PeftModel.from_pretrained(base, out["adapter_path"]).eval()(input_ids=ids).logits
            torch.testing.assert_close(merged(input_ids=ids).logits, adapted, atol=1e-5, rtol=1e-5)
        assert (adapted - before).abs().max() > 1e-4  # it trained


@pytest.mark.slow  # a whole lora / adapt stage in-process
def test_adapt_domains_stage_adapts_low_domains_writes_routing_and_resumes(tmp_path):
    """The adapt stage on real data with tiny sizes: a domain below the threshold is adapted, a test-only one is
    reported as not adaptable, the routing table loads, and a resumed run reuses every finished part."""
    from models.checkpoints import load_causal_lm
    from models.checkpoints import save_hf_atomic
    from decode.config import load_routing
    from distill.drafts import LlamaArch, build_llama
    from train.stages import adapt_domains
    from train.run import validate

    _, tok = load_causal_lm("models/assets/reference_target", role="target")
    arch = LlamaArch(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=256)
    save_hf_atomic(build_llama(arch, tok, seed=0), tok, tmp_path / "drafts" / "distilled")
    cfg = {"stages": ["adapt"], "data": {"block_size": 64, "max_train_blocks": 16}, "trainer": {"num_threads": 1},
           "distill": {"generation": {"max_new_tokens": 8, "temperature": 0}, "cache_dir": str(tmp_path / "cache")},
           "lora": {"enabled": True, "rank": 2, "max_steps": 2, "micro_batch_size": 2, "warmup_steps": 0,
                    "save_every": 0, "eval_every": 0, "generation_prompts": 4},
           "adapt": {"draft": "drafts/distilled", "min_mean_accepted_length": 5.0},  # tau <= gamma + 1 = 5
           "eval": {"domains": ["medical", "specbench_qa"], "max_prompts": 1, "max_new_tokens": 4,
                    "max_prompt_tokens": 32, "cost_ratio_trials": 1, "bootstrap_samples": 0, "plots": False}}
    rc = validate(cfg)
    s = adapt_domains(rc, rc.data.options(), tmp_path)
    med = s["domains"]["medical"]
    assert med["action"].startswith("adapted, adapter ") and med["adapter_decision"] in ("separated", "overlap",
                                                                                       "worse", "no_interval")
    assert med["adapter_kept"] is False  # eval.bootstrap_samples=0: no interval, so the adapter cannot be kept
    assert json.loads((tmp_path / "drafts" / "lora_medical" / "specdraft.json").read_text())["teacher_signal"] == \
        "cached"
    assert s["domains"]["specbench_qa"]["action"].startswith("not adaptable")
    assert set(s["drafts"]) == {"distilled", "lora_medical"}
    table = load_routing(tmp_path / "routing.json")
    assert set(table.routes) == {"medical", "specbench_qa"}
    route = table.draft_for("medical")  # the refused adapter is never routed: the base, or the target alone
    assert route.draft == "distilled" or (route.target_only and route.draft is None)
    after = json.loads((tmp_path / "adapt" / "after" / "metrics.json").read_text())
    assert set(after["drafts"]) == {"distilled", "lora_medical"}  # every draft on every domain
    report = (tmp_path / "adapt_report.md").read_text()
    assert "| medical |" in report and "adapter refused" in report and "no interval" in report
    rc = validate({**cfg, "trainer": {"num_threads": 1, "resume": True}})
    again = adapt_domains(rc, rc.data.options(), tmp_path)
    assert again["domains"]["medical"]["reused"] is True


def test_pipeline_checks_the_base_draft_before_any_stage_runs(tmp_path):
    from train.run import run

    cfg = {"stages": ["lora", "eval"], "lora": {"enabled": True, "base": "drafts/distilled"}}
    with pytest.raises(LoraError, match="drafts/distilled.*distill / baseline stage earlier"):
        run(cfg, tmp_path)
    assert not (tmp_path / "events.jsonl").exists()  # nothing ran
    bad = tmp_path / "routing.json"
    bad.write_text("[]")
    from core.errors import RoutingError

    with pytest.raises(RoutingError, match="JSON object"):
        run({"stages": ["eval"], "decode": {"draft_routing": str(bad)}}, tmp_path)


@pytest.mark.slow  # a whole lora / adapt stage in-process
def test_adaptation_artifacts_and_interrupted_resume_to_the_same_weights(tmp_path, monkeypatch):
    """The lora stage on real data (reference target, a small config-built draft sharing its tokenizer) writes both
    artifacts; killed right after its step-2 checkpoint, a resumed adaptation ends with the uninterrupted run's
    weights."""
    import distill.trainer as trainer_mod
    from models.checkpoints import load_causal_lm
    from models.checkpoints import save_hf_atomic
    from distill.drafts import LlamaArch, build_llama
    from train.run import validate

    _, tok = load_causal_lm("models/assets/reference_target", role="target")
    arch = LlamaArch(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=256)
    for run in ("full", "killed"):
        save_hf_atomic(build_llama(arch, tok, seed=0), tok, tmp_path / run / "drafts" / "distilled")
    cfg = {"stages": ["lora"], "data": {"block_size": 64, "max_train_blocks": 16}, "trainer": {"num_threads": 1},
           "distill": {"generation": {"max_new_tokens": 8, "temperature": 0}, "cache_dir": str(tmp_path / "cache")},
           "lora": {"enabled": True, "rank": 2, "domain": "medical", "max_steps": 4, "micro_batch_size": 2,
                    "warmup_steps": 0, "save_every": 2, "eval_every": 0, "generation_prompts": 4}}
    rc = validate(cfg)
    out = adapt_draft(rc, rc.data.options(), tmp_path / "full")
    # the stage's artifacts: merged standalone draft + peft adapter, both complete, nothing temporary left
    assert out["path"] == str(tmp_path / "full" / "drafts" / "lora_medical")
    meta = json.loads((tmp_path / "full" / "drafts" / "lora_medical" / "specdraft.json").read_text())
    assert meta["kind"] == "lora" and meta["domain"] == "medical" and meta["lora"]["rank"] == 2
    for artifact in ("drafts", "adapters"):  # every field both files hold is in the schema
        assert SpecdraftMeta.read(tmp_path / "full" / artifact / "lora_medical").extra == {}
    assert meta["trainable_parameters"] > 0 and meta["train"]["steps"] == 4
    # the teacher's signal: target continuations of 4 medical prompts, cached top-k, both passes computed here
    assert meta["data_source"] == "teacher" and meta["teacher_signal"] == "cached"
    assert meta["teacher_data"]["computed"] > 0 and meta["teacher_cache"]["computed"] > 0
    assert meta["adapter_bytes"] > 0 and meta["merge_time_s"] >= 0
    assert meta["adaptation_time_s"] >= meta["train"]["train_time_s"]
    assert (tmp_path / "full" / "adapters" / "lora_medical" / "adapter_model.safetensors").is_file()
    assert not list(tmp_path.rglob(".*tmp-*"))
    from transformers import AutoModelForCausalLM

    assert type(AutoModelForCausalLM.from_pretrained(out["path"])).__name__ == "LlamaForCausalLM"
    # a base draft that does not exist is a clear error before any model loads
    bad = validate({**cfg, "lora": {**cfg["lora"], "base": str(tmp_path / "missing"), "name": "x"}})
    with pytest.raises(LoraError, match="no draft checkpoint"):
        adapt_draft(bad, bad.data.options(), tmp_path / "full")

    class Killed(Exception):
        pass

    save = trainer_mod.save_checkpoint

    def save_then_die(acc, ckpt, state, best=None):
        save(acc, ckpt, state, best)
        if state["step"] == 2:
            raise Killed

    monkeypatch.setattr(trainer_mod, "save_checkpoint", save_then_die)
    with pytest.raises(Killed):
        adapt_draft(rc, rc.data.options(), tmp_path / "killed")
    monkeypatch.setattr(trainer_mod, "save_checkpoint", save)
    assert not (tmp_path / "killed" / "drafts" / "lora_medical").exists()  # nothing half-written
    rc = validate({**cfg, "trainer": {"num_threads": 1, "resume": True}})
    out = adapt_draft(rc, rc.data.options(), tmp_path / "killed")
    assert out["train"]["resumed_from_step"] == 2
    # another run (run directory) with the same target and settings paid no pass again: both came from the cache
    assert out["teacher_data"]["computed"] == 0 and out["teacher_cache"]["computed"] == 0
    want = load_causal_lm(tmp_path / "full" / "drafts" / "lora_medical")[0].state_dict()
    got = load_causal_lm(tmp_path / "killed" / "drafts" / "lora_medical")[0].state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_lora_batch_is_its_own_whatever_the_trainers_global_batch():
    """The smoke experiment's trainer sets global_batch_size 4 with micro-batch 2; the adapter's 16-sequence
    micro-batch must not be checked against that (it used to fail after the models had loaded)."""
    from train.run import validate

    rc = validate({"stages": ["lora"], "lora": {"enabled": True, "base": "drafts/distilled", "micro_batch_size": 16},
                   "trainer": {"micro_batch_size": 2, "global_batch_size": 4}})
    tcfg = rc.lora.trainer_config(rc.trainer)
    assert tcfg.micro_batch_size == 16 and tcfg.global_batch_size == 0 and tcfg.grad_accum_steps == 1


def test_a_target_sharing_its_weight_otherwise_is_refused():
    """Weights shared other than as tied embeddings (here two layers' q_proj): merging would change both layers,
    whichever of them is named."""
    for named in ("layers.0.self_attn.q_proj", "layers.1.self_attn.q_proj"):
        draft = tiny_llama(seed=4)
        draft.model.layers[1].self_attn.q_proj.weight = draft.model.layers[0].self_attn.q_proj.weight
        with pytest.raises(LoraError, match=r"lora.target_modules: .*q_proj shares its weight with .*q_proj.*drop"):
            wrap_lora(draft, LoraSectionConfig(target_modules=[named]))


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # a tied Llama head, GPT-2's Conv1D layers + tied wte
def test_modules_to_save_trains_the_head_in_full_and_merged_equals_adapted(tmp_path, family):
    """lora.modules_to_save=[<head>]: the head is trained in full beside the adapters (peft modules_to_save): it
    alone of the base's layers requires grad, the tied input embedding keeps its values, and the merged draft (the
    trained head swapped in) equals the adapted one, also after saving and reloading."""
    from transformers import AutoModelForCausalLM

    base = tiny_family_lm(family)
    if family == "llama":  # tie it, as the project's drafts are (draft.arch.tie_word_embeddings)
        base.config.tie_word_embeddings = True
        base.tie_weights()
    head = _head_name(base)
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight  # tied
    model = wrap_lora(copy.deepcopy(base), LoraSectionConfig(rank=2, alpha=4.0, target_modules=ALL_LINEAR,
                                                             modules_to_save=[head]), seed=0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or f"{head}.modules_to_save" in n for n in trainable)
    assert any(f"{head}.modules_to_save" in n for n in trainable)
    _randomize_adapters(model)
    with torch.no_grad():  # train the head copy: any change must reach the merged draft and only the head
        for n, p in model.named_parameters():
            if f"{head}.modules_to_save" in n:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(9)))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
    merged = _assert_merged_equals_adapted(model, base)
    assert torch.equal(merged.get_input_embeddings().weight, base.get_input_embeddings().weight)
    assert not torch.equal(merged.get_output_embeddings().weight, base.get_output_embeddings().weight)
    merged.save_pretrained(tmp_path / "m")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert reloaded.config.tie_word_embeddings is False
    with torch.no_grad():
        # W + BA in one matrix adds the float32 products in another order than Wx + B(Ax): up to 2e-5 apart on the
        # 2-core AMD EPYC (1e-5 held on the Xeon), so the tolerance is float32 rounding, not a looser check
        torch.testing.assert_close(reloaded(input_ids=ids).logits, adapted, atol=1e-4, rtol=1e-4)


def test_modules_to_save_errors_name_the_key():
    for bad in ("lm_head", [], [""], [3]):
        with pytest.raises(ValueError, match="lora.modules_to_save must be null or a non-empty list"):
            LoraSectionConfig(modules_to_save=bad)
    with pytest.raises(ValueError, match=r"both name \['lm_head'\]"):
        LoraSectionConfig(target_modules=["q_proj", "lm_head"], modules_to_save=["lm_head"])
    with pytest.raises(LoraError, match=r"lora.modules_to_save \['head'\] match no layer"):
        wrap_lora(tiny_llama(), LoraSectionConfig(modules_to_save=["head"]))
    # a layer that also gets an adapter (all-linear, the family default, a list) or that contains adapted layers:
    # peft would train it in full instead, or find nothing to adapt
    for targets, saved in ((ALL_LINEAR, "q_proj"), (None, "v_proj"), (["q_proj"], "self_attn"), (["down_proj"], "model")):
        with pytest.raises(LoraError, match=rf"modules_to_save names '{saved}', but .* gets an adapter"):
            wrap_lora(tiny_llama(), LoraSectionConfig(target_modules=targets, modules_to_save=[saved]))


def test_module_names_are_checked_from_the_base_config_before_any_weights_load(tmp_path):
    from distill.lora import check_modules_before_loading

    tiny_llama().save_pretrained(tmp_path / "base")
    (tmp_path / "base" / "model.safetensors").unlink()  # only config.json is read
    check_modules_before_loading("base", tmp_path, LoraSectionConfig(modules_to_save=["lm_head"]))
    with pytest.raises(LoraError, match=r"modules_to_save \['nope'\] match no layer"):
        check_modules_before_loading("base", tmp_path, LoraSectionConfig(modules_to_save=["nope"]))
    with pytest.raises(LoraError, match=r"target_modules \['qkv'\] match no layer"):
        check_modules_before_loading(str(tmp_path / "base"), tmp_path, LoraSectionConfig(target_modules=["qkv"]))
    check_modules_before_loading("drafts/distilled", tmp_path, LoraSectionConfig(modules_to_save=["nope"]))  # later


@pytest.mark.parametrize("signal", ["online", "cached"])
def test_a_trimmed_base_draft_adapts_over_its_kept_ids(tmp_path, signal):
    """LoRA on a draft with a trimmed vocabulary (models/vocab.py): the teacher is read over the kept ids, the
    merged draft keeps the id map (saved as the full-vocabulary export) and reloads trimmed."""
    from models.checkpoints import load_causal_lm
    from models.vocab import TrimmedLMHead, draft_vocab_record, install_trimmed_head
    from models.checkpoints import save_hf_atomic
    from decode import speculative_generate
    from train.run import validate

    target, tok = load_causal_lm("models/assets/reference_target", role="target")
    draft = tiny_family_lm("llama", vocab_size=target.config.vocab_size, seed=3, max_position_embeddings=256)
    head = install_trimmed_head(draft, torch.arange(0, target.config.vocab_size, 3))
    save_hf_atomic(draft, tok, tmp_path / "drafts" / "distilled",
                   extra={"kind": "distilled", "draft_vocab": draft_vocab_record(head, counted_on="test")})
    cfg = {"stages": ["lora"], "data": {"block_size": 64, "max_train_blocks": 8}, "trainer": {"num_threads": 1},
           "lora": {"enabled": True, "rank": 2, "domain": "medical", "max_steps": 2, "micro_batch_size": 2,
                    "warmup_steps": 0, "save_every": 0, "eval_every": 0, "lr": 0.05, "name": f"trim_{signal}",
                    "data_source": "dataset", "teacher_signal": signal}}
    rc = validate(cfg)
    out = adapt_draft(rc, rc.data.options(), tmp_path)
    assert out["draft_vocab"]["size"] == head.num_kept
    merged, _ = load_causal_lm(out["path"], role="draft")
    assert isinstance(merged.get_output_embeddings(), TrimmedLMHead)
    ids = tok("The patient was admitted with chest pain", return_tensors="pt").input_ids
    ref = speculative_generate(target, target, ids, max_new_tokens=12, num_draft_tokens=1)
    got = speculative_generate(target, merged, ids, max_new_tokens=12, num_draft_tokens=3)
    assert torch.equal(got.sequences, ref.sequences)
