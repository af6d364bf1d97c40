"""On-policy distillation with a warm start (distill.on_policy_schedule): the on-policy share of every step follows
the configured schedule, a draft row's generated positions are the only supervised ones (and only those rows run
the target next to a cached teacher), and a run interrupted mid-schedule resumes to the same weights."""
from __future__ import annotations

import math

import pytest
import torch

from distill.config import GenerationConfig, OnPolicySchedule
from distill.generation import OnPolicyHook
from distill.losses import forward_kl, total_variation
from distill.teacher import build_teacher_cache, make_cached_distill_step
from distill.losses import topk_forward_kl
from distill.trainer import MicroBatch, TrainerConfig, train
from tinymodels import tiny_llama

V, T, N = 64, 16, 5  # vocabulary, block length, generated tokens per draft row


@pytest.mark.parametrize("warmup,ramp,final", [(0, 0, 0.5), (3, 0, 1.0), (2, 5, 0.5), (4, 3, 0.3), (0, 7, 0.75)])
def test_the_on_policy_share_per_step_follows_the_schedule(warmup, ramp, final):
    """lambda_s is 0 during the warm-up, rises linearly over the ramp and then stays at the final fraction; each
    micro-batch of B rows gets floor or ceil of lambda_s * B draft rows (exactly that when it is whole), and their
    mean over many micro-batches is lambda_s * B (stochastic rounding with the seeded coin)."""
    sched = OnPolicySchedule(warmup_steps=warmup, ramp_steps=ramp)
    hook = OnPolicyHook(final, GenerationConfig(max_new_tokens=N), seed=7, schedule=sched)
    B, micro = 6, 400
    for step in range(warmup + ramp + 3):
        want = 0.0 if step < warmup else final * (1.0 if ramp == 0 else min(1.0, (step - warmup + 1) / ramp))
        assert hook.fraction_at(step) == pytest.approx(want)
        rows = [hook.rows_at(step, j, B) for j in range(micro)]
        x = want * B
        assert set(rows) <= {math.floor(x + 1e-9), math.ceil(x - 1e-9)}
        assert sum(rows) / micro == pytest.approx(x, abs=0.15)
        assert rows == [hook.rows_at(step, j, B) for j in range(micro)], "a pure function of (seed, step, micro)"
    assert [hook.fraction_at(s) for s in range(warmup)] == [0.0] * warmup
    assert hook.fraction_at(warmup + ramp + 10) == pytest.approx(final)
    with pytest.raises(ValueError, match="warmup_steps and ramp_steps must be >= 0"):
        OnPolicySchedule(warmup_steps=-1)


@pytest.mark.parametrize("loss_name,dense", [("forward_kl", forward_kl), ("total_variation", total_variation)])
def test_only_the_generated_positions_of_draft_rows_are_supervised(tmp_path, loss_name, dense):
    """A micro-batch with 2 draft rows of 4: those rows count only positions T-N-1 .. T-1 (the predictions of the
    generated tokens); the other rows count every position against the cache. The step's loss equals the cached
    loss over the other rows plus the dense divergence against one target forward over the draft rows at those
    positions, and changing a draft row's prompt-side teacher signal cannot change it (masked), while changing a
    generated token does."""
    teacher, student = tiny_llama(vocab_size=V, hidden_size=32, seed=1), tiny_llama(vocab_size=V, hidden_size=32, seed=3)
    blocks = torch.randint(0, V, (4, T), generator=torch.Generator().manual_seed(1))
    cache, _ = build_teacher_cache(teacher, blocks, tmp_path, k=V)  # k = V: the cached loss is the dense one
    hook = OnPolicyHook(0.5, GenerationConfig(max_new_tokens=N), seed=0)
    batch = hook(MicroBatch.from_blocks(blocks, torch.arange(4)), 0, 0, student)
    gen = batch.generated
    assert gen.tolist() == [True, True, False, False]
    keep = batch.counted()
    assert keep[gen].sum(1).tolist() == [N + 1, N + 1] and keep[gen][:, T - N - 1 :].all()
    assert keep[~gen].all(), "the off-policy rows keep every position"
    step = make_cached_distill_step(loss_name, 1.0, online_teacher=teacher.eval())
    with torch.no_grad():
        loss, count = step(student, cache, batch)
        assert count == 2 * T + 2 * (N + 1) and step.stats["online_rows"] == 2
        s = student(input_ids=batch.input_ids).logits
        t = teacher(input_ids=batch.input_ids).logits
        mask = torch.zeros(4, T, dtype=torch.bool)
        mask[2:] = True
        mask[:2, T - N - 1 :] = True
        if loss_name == "forward_kl":
            off = topk_forward_kl(s[2:], cache.values[2:], cache.indices[2:].long(), mask[2:], reduction="sum")
        else:
            off = dense(s[2:], t[2:], mask[2:], reduction="sum")
        want = off + dense(s[:2], t[:2], mask[:2], reduction="sum")
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
        # The generated tokens matter; nothing before position T-N-1 of a draft row is a training target.
        other = MicroBatch(batch.input_ids.clone(), batch.attention_mask, batch.loss_mask, batch.block_index, gen)
        other.input_ids[0, -1] = (other.input_ids[0, -1] + 1) % V
        assert not torch.allclose(step(student, cache, other)[0], loss)
        per_tok = dense(s[:2], t[:2], mask[:2], reduction="none")
        assert (per_tok[:, : T - N - 1] == 0).all() and (per_tok[:, T - N - 1 :] > 0).all()
    with pytest.raises(ValueError, match="online_teacher"):
        make_cached_distill_step(loss_name, 1.0)(student, cache, batch)


def _run(out_dir, blocks, resume: bool, stop_after: int | None = None):
    """10 steps of 2 micro-batches: 3 off-policy steps, then the draft's share ramps over 4 steps to 0.5, with the
    cached teacher and the target scoring the draft rows (distill_med_onpolicy's recipe at toy size)."""
    teacher, student = tiny_llama(vocab_size=V, hidden_size=32, seed=1), tiny_llama(vocab_size=V, hidden_size=32, seed=3)
    cache, _ = build_teacher_cache(teacher, blocks, out_dir / "cache", k=8)
    hook = OnPolicyHook(0.5, GenerationConfig(max_new_tokens=N), seed=0,
                        schedule=OnPolicySchedule(warmup_steps=3, ramp_steps=4))
    cfg = TrainerConfig(max_steps=10, micro_batch_size=4, grad_accum_steps=2, warmup_steps=2, save_every=2,
                        log_every=1, lr=1e-2, resume=resume)

    def on_step(step, record):
        if stop_after is not None and step == stop_after:
            raise KeyboardInterrupt  # an interruption right after step `stop_after` (last checkpoint: the one before)

    train(student, blocks, out_dir / "train", cfg, make_cached_distill_step("forward_kl", 1.0, teacher.eval()),
          teacher=cache, seed=0, on_step=on_step, batch_hook=hook)
    return student, hook


def test_resuming_mid_schedule_gives_the_same_weights(tmp_path):
    """Interrupted after step 5 (inside the ramp; the checkpoint holds step 4) and resumed: the same weights as an
    uninterrupted run, bit for bit. The schedule, the coins and the samples are pure functions of (seed, step,
    micro-batch); model, optimizer, scheduler and RNG come from the checkpoint; on one CPU thread the replayed
    steps run the same kernels in the same order, so nothing is left to tolerance."""
    blocks = torch.randint(0, V, (24, T), generator=torch.Generator().manual_seed(1))
    full, full_hook = _run(tmp_path / "full", blocks, resume=False)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "cut", blocks, resume=False, stop_after=5)
    resumed, resumed_hook = _run(tmp_path / "cut", blocks, resume=True)
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    # Both parts generated draft rows (a schedule that never fired would pass the comparison too); the resumed
    # part replays steps 4..9 only, all past the warm-up.
    assert 0 < resumed_hook.generated_rows < full_hook.generated_rows
