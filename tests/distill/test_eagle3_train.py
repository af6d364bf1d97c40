"""Training EAGLE-3 heads (distill/eagle3.py): the training-time-test loss learns (distilled and cross-entropy), the
cached float16 teacher gives the loss the online teacher gives and resumes shard by shard, the held-out replay of a
head (eval/heldout.py) equals its decoder, and `python -m train +experiment=smoke draft=eagle3` runs end to end."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinymodels import tiny_llama
from decode import autoregressive_generate
from decode.eagle3 import eagle3_generate
from distill.eagle3 import FeatureCache, make_eagle3_step
from distill.trainer import MicroBatch
from eval.heldout import eagle3_runs, replay
from models.eagle3 import Eagle3Config, Eagle3Draft

ROOT = Path(__file__).resolve().parents[2]


def _pair(seed=0, layers=6, vocab=48, draft_vocab=32, how="target"):
    target = tiny_llama(vocab_size=vocab, hidden_size=32, num_layers=layers, seed=seed)
    head = Eagle3Draft(Eagle3Config.from_target(target.config, draft_vocab))
    head.init_from_target(target, torch.arange(draft_vocab), how=how, seed=seed)
    return target, head


def _greedy_blocks(target, n=8, prompt=4, new=28, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (n, prompt), generator=g)
    return autoregressive_generate(target, ids, max_new_tokens=new, eos_token_id=[]).sequences


@pytest.mark.parametrize("distilled", [True, False], ids=["kd", "ce"])
def test_the_ttt_loss_learns_the_targets_continuations(distilled):
    torch.manual_seed(0)
    target, head = _pair(draft_vocab=48)  # every id proposable: acceptance measures what the head learned
    blocks = _greedy_blocks(target)
    step = make_eagle3_step(distilled, steps=3, weight=0.8)
    batch = MicroBatch.from_blocks(blocks)

    def alpha_1():  # the decoder's acceptance at draft position 1 on these continuations
        out = eagle3_generate(target, head.eval(), blocks[:4, :4], max_new_tokens=20, num_draft_tokens=3,
                              eos_token_id=[])
        assert torch.equal(out.sequences, blocks[:4, :24])
        return out.stats.per_position_accepted[0] / out.stats.per_position_drafted[0]

    before = alpha_1()
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(40):
        loss, n = step(head.train(), target, batch)
        assert n == step.count_tokens(batch) == blocks.shape[0] * (blocks.shape[1] - 1)
        first = float(loss.detach()) / n if first is None else first
        opt.zero_grad()
        (loss / n).backward()
        opt.step()
    last = float(step(head.eval(), target, batch)[0].detach()) / n
    assert last < 0.5 * first, (first, last)
    assert head.embed_tokens.weight is target.model.embed_tokens.weight and not head.embed_tokens.weight.requires_grad
    after = alpha_1()
    assert after > 0.5 and after > before + 0.2, (before, after)


def test_cached_features_give_the_online_loss_and_resume(tmp_path):
    target, head = _pair(seed=2)
    blocks = _greedy_blocks(target, n=6, seed=1)
    cache = FeatureCache(target, blocks, tmp_path, head.cfg.target_layers, k=48, shard_blocks=4, batch=2)
    assert (cache.computed, cache.reused) == (2, 0) and len(list(cache.dir.glob("shard-*.safetensors"))) == 2
    batch = MicroBatch.from_blocks(blocks[[1, 5]], torch.tensor([1, 5]))
    step = make_eagle3_step(True, steps=3, weight=0.8)
    online, n1 = step(head, target, batch)
    cached, n2 = step(head, cache, batch)
    assert n1 == n2 and float(cached) == pytest.approx(float(online), rel=2e-2)
    again = FeatureCache(target, blocks, tmp_path, head.cfg.target_layers, k=48, shard_blocks=4)
    assert (again.computed, again.reused) == (0, 2) and again.dir == cache.dir
    other = FeatureCache(target, blocks[:3], tmp_path, head.cfg.target_layers, k=48, shard_blocks=4)
    assert other.dir != cache.dir  # keyed by the blocks' content
    # a run reading a prefix of the same block order scores only its shards, and a longer one reuses them
    part = FeatureCache(target, blocks, tmp_path / "prefix", head.cfg.target_layers, k=48, shard_blocks=4, use=3)
    assert (part.computed, part.reused) == (1, 0) and part.record()["scored_tokens"] == 3 * blocks.shape[1]
    whole = FeatureCache(target, blocks, tmp_path / "prefix", head.cfg.target_layers, k=48, shard_blocks=4)
    assert (whole.computed, whole.reused) == (1, 1) and whole.dir == part.dir
    with pytest.raises(ValueError, match="use must be"):
        FeatureCache(target, blocks, tmp_path, head.cfg.target_layers, k=48, shard_blocks=4, use=7)


@pytest.mark.parametrize("seed", [1, 2])
def test_heldout_replay_of_a_head_equals_its_decoder(seed):
    """The replay (eval/heldout.py) from one unroll gives the decoder's own blocks and per-position acceptance."""
    target, head = _pair(seed=seed, how=("target", "random", "target")[seed])
    if seed == 2:  # a trained head: long accepted runs
        blocks = _greedy_blocks(target, n=6, seed=3)
        step, opt = make_eagle3_step(True, 3, 0.8), torch.optim.AdamW(
            [p for p in head.parameters() if p.requires_grad], lr=3e-3)
        for _ in range(30):
            loss, n = step(head.train(), target, MicroBatch.from_blocks(blocks))
            opt.zero_grad()
            (loss / n).backward()
            opt.step()
        head.eval()
    g = torch.Generator().manual_seed(seed + 10)
    prompts = [torch.randint(0, 32, (int(k),), generator=g).tolist() for k in (3, 5, 4)]
    answers = [autoregressive_generate(target, torch.tensor([p]), max_new_tokens=18, eos_token_id=[])
               .sequences[0, len(p):].tolist() for p in prompts]
    runs = eagle3_runs(target, head, prompts, answers, max_gamma=4, batch_size=2)
    for p, a, r in zip(prompts, answers, runs):
        rep = replay(None, 4, runs=r)
        for gamma in (1, 2, 4):
            out = eagle3_generate(target, head, torch.tensor([p]), max_new_tokens=len(a), num_draft_tokens=gamma,
                                  eos_token_id=[])
            assert out.sequences[0, len(p):].tolist() == a
            assert out.stats.verify_steps == rep.blocks[gamma], (gamma, r)
            if gamma == 4:
                assert out.stats.per_position_accepted == rep.accepted[:len(out.stats.per_position_accepted)]
                assert sum(rep.accepted) == out.stats.accepted_tokens


@pytest.mark.slow  # a python -m train subprocess
def test_smoke_with_an_eagle3_head_end_to_end(tmp_path):
    """The distill stage (cached features) and the evaluation with the head, as a user runs them (the baseline
    stage's cross-entropy loss: test_the_ttt_loss_learns_the_targets_continuations[ce])."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "train", "+experiment=smoke", "draft=eagle3", "stages=[distill,eval]",
                           "distill.teacher_signal=cached", "eval.drafts={distilled: drafts/distilled}",
                           "draft.draft_vocab_size=512", "eval.engine.enabled=false", f"hydra.run.dir={run}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((run / "drafts" / "distilled" / "config.json").read_text())
    assert doc["architectures"] == ["LlamaForCausalLMEagle3"] and doc["draft_vocab_size"] == 512
    meta = json.loads((run / "drafts" / "distilled" / "specdraft.json").read_text())
    assert meta["init"] == "eagle3" and meta["distilled"] is True and meta["teacher_signal"] == "cached"
    assert meta["eagle3"]["ttt_steps"] == 3 and meta["eagle3"]["target_layers"] == [1, 3, 5]
    assert meta["teacher_cache"]["computed_shards"] >= 1
    m = json.loads((run / "metrics.json").read_text())
    assert m["lossless_all"] is True and set(m["drafts"]) == {"distilled"}
    assert set(m["heldout"]["drafts"]) == {"distilled"}
    from eval.sections import engine_settings

    e = engine_settings(str(run / "target"), str(run / "drafts" / "distilled"), 3)  # serving.json's entry for it
    assert e["vllm"]["speculative_config"]["method"] == "eagle3" and "EAGLE3" in e["sglang"]["args"]
    llama = e["llama_cpp"]["args"]
    assert llama[llama.index("--spec-type") + 1] == "draft-eagle3" and "convert_hf_to_gguf.py" in e["llama_cpp"]["export"]
    assert e["transformers"] is None
    report = (run / "report.md").read_text()
    assert "Held-out acceptance" in report
    assert "| distilled | eagle3 | reads target layers [1, 3, 5] | 512 ids | yes" in report  # Draft sources
    assert m["draft_sources"]["distilled"]["target_layers"] == [1, 3, 5]


def test_several_reads_of_fewer_blocks_share_the_feature_store(tmp_path):
    """trainer.unique_blocks reads a prefix of the block order that a one-read run scored: no shard is scored again,
    with the channel-normalised fc and a frozen head (draft.eagle3.feature_norm, train_lm_head)."""
    store = tmp_path / "features"
    common = [sys.executable, "-m", "train", "+experiment=smoke", "draft=eagle3", "stages=[distill]",
              "distill.teacher_signal=cached", f"distill.cache_dir={store}", "distill.cache_shard_blocks=4",
              "draft.draft_vocab_size=512"]
    metas = []
    for i, extra in enumerate((["trainer.max_steps=6"],
                               ["trainer.max_steps=8", "trainer.unique_blocks=6", "draft.eagle3.feature_norm=channel",
                                "draft.eagle3.train_lm_head=false"])):
        proc = subprocess.run(common + extra + [f"hydra.run.dir={tmp_path / str(i)}"], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        metas.append(json.loads((tmp_path / str(i) / "drafts" / "distilled" / "specdraft.json").read_text()))
    assert len(list(store.glob("eagle3-*"))) == 1
    first, again = metas[0]["teacher_cache"], metas[1]["teacher_cache"]
    blocks = metas[0]["train"]["unique_tokens"] // 64  # 6 steps x the global batch
    assert first["computed_shards"] == -(-blocks // 4) and first["computed_tokens"] == blocks * 64
    assert again["computed_shards"] == 0 and again["reused_shards"] == 2 and again["computed_tokens"] == 0
    assert metas[1]["train"]["unique_tokens"] == 6 * 64 and metas[1]["eagle3"]["feature_norm"] == "channel"
    from safetensors.torch import load_file

    from models.checkpoints import load_causal_lm

    target = load_causal_lm(str(ROOT / "models" / "assets" / "reference_target"), role="target")[0]
    w = [load_file(str(tmp_path / str(i) / "drafts" / "distilled" / "model.safetensors")) for i in (0, 1)]
    rows = target.get_output_embeddings().weight.detach()[torch.arange(512) + w[1]["d2t"]]
    assert torch.equal(w[1]["lm_head.weight"], rows)  # train_lm_head=false: the target's rows, as initialised
    assert not torch.equal(w[0]["lm_head.weight"], rows)  # they train by default
    assert "feature_scale" not in w[1]


@pytest.mark.parametrize("how", ["target", "random"])
def test_feature_normalisation_keeps_the_function_and_folds_into_the_saved_fc(tmp_path, how):
    """draft.eagle3.feature_norm=channel reparametrises fc (same fused feature, per-channel unit-RMS inputs); the
    saved head reads raw features, as engines do, and loads back to the same logits."""
    from models.eagle3 import load_eagle3, save_eagle3

    target, head = _pair(how=how)
    ids = _greedy_blocks(target, n=2)
    from distill.eagle3 import target_outputs

    feats, _ = target_outputs(target, ids, torch.ones_like(ids), head.cfg.target_layers)
    feats = feats * torch.linspace(0.1, 50.0, feats.shape[-1])  # channels of very different scales
    before = head.fuse(feats)
    rms = head.normalize_features(feats)
    assert torch.allclose(head.fuse(feats), before, rtol=1e-4, atol=1e-4)
    assert torch.allclose((feats * head.feature_scale).pow(2).mean((0, 1)).sqrt(), torch.ones_like(rms), atol=1e-4)
    with torch.no_grad():
        head.fc.weight.add_(0.01 * torch.randn_like(head.fc.weight))  # a trained fc, as the optimiser leaves it
    want = head.logits(head.unroll(ids[:, 1:], head.fuse(feats[:, :-1]), 2)[-1])
    save_eagle3(head, None, tmp_path / "h")
    from safetensors.torch import load_file

    assert "feature_scale" not in load_file(str(tmp_path / "h" / "model.safetensors"))
    back = load_eagle3(tmp_path / "h", target)
    assert torch.equal(back.feature_scale, torch.ones_like(back.feature_scale))
    got = back.logits(back.unroll(ids[:, 1:], back.fuse(feats[:, :-1]), 2)[-1])
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
