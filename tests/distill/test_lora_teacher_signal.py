"""LoRA adaptation with the teacher's signal (issue 20): the cached-top-k distillation loss of a LoRA draft is the
full model's loss at the merged weights on the same batch, and its adapter gradients are the full-weight gradient
pulled back through W + s B A; a draft trained this way merges to the same outputs."""
from __future__ import annotations

import copy

import pytest
import torch

from tinymodels import tiny_llama

from distill.lora import LoraSectionConfig, merge_lora, wrap_lora
from distill.teacher import build_teacher_cache, make_cached_distill_step
from distill.trainer import MicroBatch, TrainerConfig, train


def _randomize_adapters(peft_model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def _setup(tmp_path, seed: int, loss: str, rank: int = 4):
    target = tiny_llama(seed=100 + seed, num_layers=2, hidden_size=48, num_heads=4)
    blocks = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(seed))  # (N, T)
    cache, _ = build_teacher_cache(target, blocks, tmp_path / f"cache{seed}", k=8, shard_blocks=4)
    cfg = LoraSectionConfig(enabled=True, rank=rank, alpha=2.0 * rank, target_modules=["q_proj", "v_proj",
                                                                                          "down_proj"])
    model = wrap_lora(tiny_llama(seed=seed), cfg, seed=seed)
    _randomize_adapters(model, seed)
    step = make_cached_distill_step(loss, 1.5)
    idx = torch.tensor([1, 4, 6])
    batch = MicroBatch.from_blocks(blocks[idx], idx)
    return cache, model, step, batch, cfg


@pytest.mark.parametrize("seed,loss", [(0, "forward_kl"), (1, "forward_kl"), (2, "total_variation"),
                                       (3, "generalized_jsd")])
def test_lora_teacher_loss_and_gradients_equal_the_full_models_at_the_merged_weights(tmp_path, seed, loss):
    cache, model, step, batch, cfg = _setup(tmp_path, seed, loss)
    model.train()
    lora_loss, n = step(model, cache, batch)
    lora_loss.backward()
    # the full model: the merged weights W' = W + (alpha / r) B A as plain, trainable parameters
    full = merge_lora(copy.deepcopy(model)).train()
    for p in full.parameters():
        p.requires_grad_(True)
    full_loss, n_full = step(full, cache, batch)
    full_loss.backward()
    assert n == n_full == int(batch.counted().sum()) > 0
    torch.testing.assert_close(lora_loss, full_loss, atol=1e-5, rtol=1e-5)
    # chain rule through W' = W + s B A: dL/dB = s dL/dW' A^T, dL/dA = s B^T dL/dW'
    s = cfg.alpha / cfg.rank
    fullp = dict(full.named_parameters())
    checked = 0
    for name, mod in model.named_modules():
        if not hasattr(mod, "lora_A") or "default" not in mod.lora_A:
            continue
        A, B = mod.lora_A["default"].weight, mod.lora_B["default"].weight  # (r, in), (out, r)
        gW = fullp[name.replace("base_model.model.", "", 1) + ".weight"].grad  # (out, in)
        torch.testing.assert_close(B.grad, s * gW @ A.detach().T, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(A.grad, s * B.detach().T @ gW, atol=1e-5, rtol=1e-4)
        checked += 1
    assert checked == 2 * 3  # 2 layers x (q_proj, v_proj, down_proj)
    # only the adapters carry gradients in the LoRA model: the base weights are frozen
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


def test_a_draft_trained_on_the_cached_teacher_merges_to_the_adapted_outputs(tmp_path):
    cache, model, step, _, _ = _setup(tmp_path, 4, "forward_kl")
    blocks = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(4))  # the cached blocks
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    tcfg = TrainerConfig(max_steps=3, micro_batch_size=4, lr=5e-2, warmup_steps=0, save_every=0, log_every=1)
    train(model, blocks, tmp_path / "train", tcfg, step, teacher=cache, seed=0)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if "lora_" in n)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(9))
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        merged = merge_lora(model)(input_ids=ids).logits
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=1e-5)


def test_lora_signal_settings_are_checked_before_any_model_loads():
    from train.run import validate

    for bad, msg in (({"data_source": "on_policy"}, "lora.data_source must be teacher"),
                     ({"teacher_signal": "disk"}, "lora.teacher_signal must be cached"),
                     ({"generation_prompts": 0}, "lora.generation_prompts must be >= 1"),
                     ({"finetune_lr": 0.0}, "lora.finetune_lr must be > 0")):
        with pytest.raises(ValueError, match=msg):
            LoraSectionConfig(enabled=True, **bad)
    with pytest.raises(ValueError, match="reverse KL is infinite against a cached top-k teacher"):
        validate({"stages": ["lora"], "distill": {"loss": "reverse_kl"},
                  "lora": {"enabled": True, "base": "drafts/distilled"}})
    ok = validate({"stages": ["lora", "finetune"], "distill": {"loss": "reverse_kl"},
                   "lora": {"enabled": True, "base": "drafts/distilled", "teacher_signal": "online"}})
    assert ok.lora.data_source == "teacher" and ok.lora.teacher_signal == "online"
