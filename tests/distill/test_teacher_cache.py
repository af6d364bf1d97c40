"""distill.teacher / distill.teacher: the cached teacher top-k is exact, resumable after a kill, checksummed
(a corrupt shard is recomputed), and training from it reproduces online training."""
from __future__ import annotations

import json

import pytest
import torch

from distill.losses import forward_kl
from distill.teacher import ShardStore
from distill.teacher import build_teacher_cache, make_cached_distill_step
from distill.losses import teacher_topk
from distill.trainer import MicroBatch, TrainerConfig, make_distill_step, train
from tinymodels import tiny_llama

V, T = 64, 16


def _blocks(n=12, seed=0):
    return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))


def _sharp_teacher(scale=20.0):
    """A teacher whose top-16 holds >= 99.5% of the probability at every position of :func:`_blocks`."""
    teacher = tiny_llama(vocab_size=V, hidden_size=32, seed=1)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(scale)
    return teacher


def test_cache_content_matches_teacher_and_is_reused(tmp_path):
    teacher, blocks = tiny_llama(vocab_size=V, hidden_size=32, seed=1), _blocks()
    cache, info = build_teacher_cache(teacher, blocks, tmp_path, k=8, shard_blocks=5, batch_size=4)
    assert (info["computed"], info["reused"], info["corrupt"]) == (3, 0, 0)
    with torch.no_grad():
        ref_v, ref_i = teacher_topk(teacher(input_ids=blocks).logits, 8)
    torch.testing.assert_close(cache.values, ref_v, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.indices, ref_i)
    manifest = json.loads((tmp_path / info["path"].split("/")[-1] / "manifest.json").read_text())
    assert len(manifest["shards"]) == 3 and all(len(s["sha256"]) == 64 for s in manifest["shards"].values())
    again, info2 = build_teacher_cache(teacher, blocks, tmp_path, k=8, shard_blocks=5, batch_size=4)
    assert (info2["computed"], info2["reused"]) == (0, 3)
    assert torch.equal(again.values, cache.values)
    # A different teacher or k never reads this cache.
    _, info3 = build_teacher_cache(teacher, blocks, tmp_path, k=4, shard_blocks=5)
    assert info3["path"] != info["path"] and info3["computed"] == 3


def test_prefix_runs_share_one_store(tmp_path):
    """``use``: a run reading the first blocks of an order scores only the shards covering them; a longer run on the
    same order reuses those and scores the rest; the values equal a full pass."""
    teacher, blocks = tiny_llama(vocab_size=V, hidden_size=32, seed=1), _blocks(n=12)
    short, a = build_teacher_cache(teacher, blocks, tmp_path, k=8, shard_blocks=4, use=5)
    assert (a["computed"], a["reused"]) == (2, 0) and short.values.shape[0] == 5 and a["scored_tokens"] == 5 * T
    longer, b = build_teacher_cache(teacher, blocks, tmp_path, k=8, shard_blocks=4, use=12)
    assert (b["computed"], b["reused"]) == (1, 2) and b["path"] == a["path"]
    _, c = build_teacher_cache(teacher, blocks, tmp_path, k=8, shard_blocks=4, use=12)
    assert c["computed"] == 0 and c["cost_s"] == b["cost_s"] > 0  # reused data keeps its cost (the baseline's budget)
    full, _ = build_teacher_cache(teacher, blocks, tmp_path / "full", k=8, shard_blocks=4)
    torch.testing.assert_close(longer.values, full.values)
    torch.testing.assert_close(short.values, full.values[:5])
    for bad in (0, 13):
        with pytest.raises(ValueError, match="use must be in"):
            build_teacher_cache(teacher, blocks, tmp_path, k=8, shard_blocks=4, use=bad)


def test_cached_teacher_runs_in_the_runs_precision(tmp_path):
    """Precision policy: with trainer.mixed_precision=bf16 the cache holds the teacher's bf16 top-k (its forward
    under autocast, as the online teacher runs), under its own key: an fp32 cache is never reused for it."""
    teacher, blocks = tiny_llama(vocab_size=V, hidden_size=32, seed=1), _blocks(n=4)
    fp32, info32 = build_teacher_cache(teacher, blocks, tmp_path, k=8, shard_blocks=4)
    bf16, info16 = build_teacher_cache(teacher, blocks, tmp_path, k=8, shard_blocks=4, precision="bf16")
    assert info16["path"] != info32["path"] and info16["computed"] == 1
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref_v, ref_i = teacher_topk(teacher(input_ids=blocks, attention_mask=torch.ones_like(blocks)).logits, 8)
    assert torch.equal(bf16.values, ref_v) and torch.equal(bf16.indices, ref_i)
    assert not torch.equal(bf16.values, fp32.values)  # the precision really changed what was cached
    assert next(teacher.parameters()).dtype == torch.float32  # the teacher itself is not cast


def test_killed_pass_resumes_and_corrupt_shard_is_recomputed(tmp_path):
    calls = []

    def compute(i, fail_at=None):
        calls.append(i)
        if i == fail_at:
            raise KeyboardInterrupt  # the process dies while computing shard 2
        return {"x": torch.full((3,), float(i))}

    store = ShardStore(tmp_path, {"k": 1}, num_shards=4)
    with pytest.raises(KeyboardInterrupt):
        store.ensure(lambda i: compute(i, fail_at=2))
    assert store.status() == {0: "ok", 1: "ok", 2: "missing", 3: "missing"}
    assert not list(tmp_path.glob(".*tmp*")), "no temporary file survives"
    calls.clear()
    counts = store.ensure(compute)
    assert {k: counts[k] for k in ("reused", "computed", "corrupt")} == {"reused": 2, "computed": 2, "corrupt": 0}
    assert counts["cost_s"] >= 0  # every shard's compute time, the reused ones' as recorded when they were written
    assert calls == [2, 3]
    # Flip one byte of shard 1: detected by its SHA-256 and recomputed; nothing else is touched.
    path = store.shard_path(1)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert store.status()[1] == "corrupt"
    calls.clear()
    counts = store.ensure(compute)
    assert {k: counts[k] for k in ("reused", "computed", "corrupt")} == {"reused": 3, "computed": 1, "corrupt": 1}
    assert calls == [1] and torch.equal(store.load(1)["x"], torch.full((3,), 1.0))
    # Different meta: the old shards are stale.
    assert ShardStore(tmp_path, {"k": 2}, num_shards=4).status() == {i: "missing" for i in range(4)}


def test_cached_loss_matches_online_loss_when_topk_covers_the_mass(tmp_path):
    """Stated tolerance: |cached - online| <= 1% of the online loss + 0.01 nats/token when every position's top-k
    holds >= 99.5% of the teacher's probability (k = V reproduces it exactly, up to float rounding)."""
    teacher, student, blocks = _sharp_teacher(), tiny_llama(vocab_size=V, hidden_size=32, seed=2), _blocks(8)
    with torch.no_grad():
        p = teacher(input_ids=blocks).logits.softmax(-1)
    assert p.topk(16, -1).values.sum(-1).min() > 0.995
    online = make_distill_step(forward_kl, 1.0)
    batch = MicroBatch.from_blocks(blocks, torch.arange(blocks.size(0)))
    with torch.no_grad():
        ref, n_ref = online(student, teacher, batch)
        for k, exact in ((V, True), (16, False)):
            cache, _ = build_teacher_cache(teacher, blocks, tmp_path, k=k, shard_blocks=4)
            got, n = make_cached_distill_step("forward_kl", 1.0)(student, cache, batch)
            assert n == n_ref
            if exact:
                torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
            else:
                assert abs(got - ref) <= 0.01 * ref + 0.01 * n


@pytest.mark.parametrize("loss", ["forward_kl", "total_variation"])
def test_training_from_full_cache_reproduces_online_training(tmp_path, loss):
    from distill.losses import get_loss

    teacher, blocks = tiny_llama(vocab_size=V, hidden_size=32, seed=1), _blocks(16)
    cfg = TrainerConfig(max_steps=4, micro_batch_size=4, warmup_steps=1, save_every=0, log_every=1, lr=1e-2)
    a = tiny_llama(vocab_size=V, hidden_size=32, seed=3)
    b = tiny_llama(vocab_size=V, hidden_size=32, seed=3)
    sa = train(a, blocks, tmp_path / "online", cfg, make_distill_step(get_loss(loss), 1.0), teacher=teacher)
    cache, _ = build_teacher_cache(teacher, blocks, tmp_path / "cache", k=V, shard_blocks=8)
    sb = train(b, blocks, tmp_path / "cached", cfg, make_cached_distill_step(loss, 1.0), teacher=cache)
    assert sa["final_loss"] == pytest.approx(sb["final_loss"], rel=1e-4, abs=1e-5)
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4, msg=n)


def test_cached_step_rejects_generated_batches(tmp_path):
    teacher, blocks = tiny_llama(vocab_size=V, hidden_size=32, seed=1), _blocks(4)
    cache, _ = build_teacher_cache(teacher, blocks, tmp_path, k=4)
    with pytest.raises(ValueError, match="generated"):
        make_cached_distill_step("forward_kl", 1.0)(teacher, cache, MicroBatch.from_blocks(blocks))
