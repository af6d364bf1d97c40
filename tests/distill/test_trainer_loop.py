"""distill.trainer: the update does not depend on the micro-batch split (global token count), the wall-clock
budget stops at a step boundary with the max_steps cosine schedule, acceptance-based checkpoint selection keeps
the best-scoring weights and logs loss and score, and bad config is rejected."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distill.losses import forward_kl
from distill.trainer import MicroBatch, TrainerConfig, cosine_with_warmup, cross_entropy_step, make_distill_step, train
from tinymodels import tiny_llama

V, T = 64, 16


def _blocks(n=32, seed=0):
    return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))


def _cfg(**kw):
    base = dict(max_steps=3, micro_batch_size=8, grad_accum_steps=1, warmup_steps=1, save_every=0, log_every=1,
                lr=1e-2)
    return TrainerConfig(**{**base, **kw})


def _ragged_mask_hook(batch: MicroBatch, step, micro, student) -> MicroBatch:
    """Rows count different numbers of positions, so micro-batches carry unequal token counts."""
    keep = torch.arange(T)[None, :] < (4 + 3 * (batch.block_index % 4))[:, None]  # (B, T)
    return MicroBatch(batch.input_ids, batch.attention_mask, keep, batch.block_index)


@pytest.mark.parametrize("kind", ["cross_entropy", "forward_kl"])
def test_update_does_not_depend_on_micro_batch_split(tmp_path, kind):
    teacher = tiny_llama(vocab_size=V, hidden_size=32, seed=1)
    step = cross_entropy_step if kind == "cross_entropy" else make_distill_step(forward_kl, 1.0)
    blocks, weights = _blocks(), []
    for mb, accum in ((8, 1), (4, 2), (2, 4)):
        student = tiny_llama(vocab_size=V, hidden_size=32, seed=3)
        train(student, blocks, tmp_path / f"{mb}x{accum}", _cfg(micro_batch_size=mb, grad_accum_steps=accum), step,
              teacher=teacher, batch_hook=_ragged_mask_hook)
        weights.append(student.state_dict())
    # Float tolerance: 0.2% of one step's size (lr). AdamW divides each coordinate by sqrt(v), so coordinates
    # whose gradient is ~0 turn float summation-order noise into update noise of up to ~1e-3 lr (measured 7e-6).
    for other in weights[1:]:
        for name, w in weights[0].items():
            diff = (other[name] - w).abs().max().item()
            assert diff <= 2e-3 * 1e-2, f"{name}: max |diff| {diff:.2e}"


def test_wall_clock_budget_stops_at_a_step_boundary_with_the_max_steps_schedule(tmp_path):
    import time

    cfg = _cfg(max_steps=50, max_time_s=0.3, warmup_steps=2, lr=1e-2)
    student = tiny_llama(vocab_size=V, hidden_size=32, seed=3)
    stats = train(student, _blocks(), tmp_path, cfg, on_step=lambda s, r: time.sleep(0.1))
    assert stats["stopped_early"] == "max_time_s"
    assert 1 <= stats["steps"] < 50 and stats["train_time_s"] >= 0.3  # stopped by the budget (0.1 s+ per step)
    records = [json.loads(l) for l in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    last = records[-1]
    assert last["step"] == stats["steps"]
    # The LR is the cosine over max_steps=50, not squeezed into the steps that fit the budget.
    assert last["lr"] == pytest.approx(1e-2 * cosine_with_warmup(last["step"], 2, 50, cfg.min_lr_ratio))
    state = json.loads((tmp_path / "checkpoint-last" / "trainer_state.json").read_text())
    assert state["step"] == stats["steps"] and state["stopped_early"] == "max_time_s"


def test_time_schedule_anneals_within_the_budget(tmp_path):
    import time

    # max_steps is far away; with schedule_over=time the cosine follows the spent budget, so the LR of the last
    # logged step is well below the peak although only a few of the 1000 steps ran.
    cfg = _cfg(max_steps=1000, max_time_s=0.4, warmup_steps=1, lr=1e-2, log_every=1, schedule_over="time")
    student = tiny_llama(vocab_size=V, hidden_size=32, seed=3)
    stats = train(student, _blocks(), tmp_path, cfg, on_step=lambda s, r: time.sleep(0.05))
    assert stats["stopped_early"] == "max_time_s" and stats["steps"] < 100
    lrs = [json.loads(l)["lr"] for l in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert lrs[-1] < 0.5 * 1e-2  # past half the budget: below the cosine midpoint
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))  # decays monotonically after warmup
    steps_lr = 1e-2 * cosine_with_warmup(stats["steps"], 1, 1000, cfg.min_lr_ratio)
    assert lrs[-1] < 0.6 * steps_lr  # what the step-based schedule would have left


def test_time_schedule_needs_a_budget():
    with pytest.raises(ValueError, match="max_time_s"):
        _cfg(schedule_over="time")
    with pytest.raises(ValueError, match="schedule_over"):
        _cfg(schedule_over="epochs")


def test_selection_evaluations_do_not_spend_the_budget(tmp_path):
    import time

    def slow_eval(model):
        time.sleep(0.6)
        return {"mean_accepted_length": 1.0}

    # Each evaluation takes longer than the whole 0.5 s budget: if it counted, training would stop after the
    # evaluation at step 1. The three tiny steps themselves take a few milliseconds.
    cfg = _cfg(max_steps=3, max_time_s=0.5, warmup_steps=1, lr=1e-2)
    student = tiny_llama(vocab_size=V, hidden_size=32, seed=3)
    stats = train(student, _blocks(), tmp_path, cfg, evaluate=slow_eval, eval_every=1)
    assert stats["steps"] == 3 and stats["stopped_early"] is None
    assert stats["selection_eval_s"] >= 0.6 * 3
    assert stats["train_time_s"] < 0.5


def test_best_checkpoint_by_acceptance_is_kept_and_logged(tmp_path):
    scores = iter([1.5, 2.5, 2.0])  # steps 2, 4, 6: step 4 is the best although the loss keeps falling
    seen = {}

    def evaluate(model):
        assert not model.training and not torch.is_grad_enabled()
        seen[len(seen)] = {k: v.clone() for k, v in model.state_dict().items()}
        return {"mean_accepted_length": next(scores), "acceptance_rate": 0.5}

    evals = []
    student = tiny_llama(vocab_size=V, hidden_size=32, seed=3)
    stats = train(student, _blocks(), tmp_path, _cfg(max_steps=6), evaluate=evaluate, eval_every=2,
                  on_eval=lambda s, r: evals.append(r))
    assert stats["best"]["step"] == 4 and stats["best"]["metrics"]["mean_accepted_length"] == 2.5
    for name, w in student.state_dict().items():
        assert torch.equal(w, seen[1][name]), name  # the step-4 weights, not the last ones
    assert [e["step"] for e in evals] == [2, 4, 6] and [e["best_step"] for e in evals] == [2, 4, 4]
    log = [json.loads(l) for l in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    ev = [r for r in log if r["kind"] == "eval"]
    assert [r["mean_accepted_length"] for r in ev] == [1.5, 2.5, 2.0]
    assert all(isinstance(r["loss"], float) for r in ev)
    assert (tmp_path / "checkpoint-last" / "best_model.safetensors").is_file()


def test_last_step_is_evaluated_once_selection_is_on(tmp_path):
    steps = []

    def evaluate(model):
        steps.append(1)
        return {"mean_accepted_length": float(len(steps))}

    stats = train(tiny_llama(vocab_size=V, hidden_size=32, seed=3), _blocks(), tmp_path, _cfg(max_steps=5),
                  evaluate=evaluate, eval_every=2)
    assert len(steps) == 3 and stats["best"]["step"] == 5  # steps 2, 4 and the last one, 5
    steps.clear()
    short = train(tiny_llama(vocab_size=V, hidden_size=32, seed=3), _blocks(), tmp_path / "short", _cfg(max_steps=3),
                  evaluate=evaluate, eval_every=4)
    assert steps == [] and short["best"] is None  # shorter than eval_every: not scored, last weights kept
    with pytest.raises(ValueError, match="without 'mean_accepted_length'"):
        train(tiny_llama(vocab_size=V, hidden_size=32, seed=3), _blocks(), tmp_path / "b", _cfg(max_steps=2),
              evaluate=lambda m: {"loss": 1.0}, eval_every=1)


@pytest.mark.parametrize("kw,match", [({"max_time_s": -1}, "max_time_s"), ({"max_steps": 0}, "max_steps"),
                                      ({"mixed_precision": "fp8"}, "mixed_precision"),
                                      ({"num_threads": -1}, "num_threads"),
                                      ({"follow_free_cores": True, "num_threads": 2}, "trainer.num_threads=0")])
def test_bad_trainer_config_is_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainerConfig(**kw)


def test_num_threads_applies_inside_training_only(tmp_path):
    torch.set_num_threads(2)
    inside = []
    train(tiny_llama(vocab_size=V, hidden_size=32, seed=3), _blocks(), tmp_path, _cfg(max_steps=1, num_threads=1),
          on_step=lambda s, r: inside.append(torch.get_num_threads()))
    assert inside == [1] and torch.get_num_threads() == 2


def test_a_runs_weights_do_not_depend_on_how_busy_the_machine_is(tmp_path, monkeypatch):
    """trainer.num_threads=0 keeps the thread count torch has when the run starts, whatever the free cores (the
    count changes the summation order): the same run with 1 and with 2 cores free trains at the same count, records
    it once and ends with the same weights; trainer.follow_free_cores=true takes the count from the free cores."""
    from decode import fast_settings

    torch.set_num_threads(2)
    weights = []
    for free in (1, 2):
        monkeypatch.setattr(fast_settings, "free_cores", lambda window_s=0.5, free=free: free)
        student, inside = tiny_llama(vocab_size=V, hidden_size=32, seed=3), []
        out = train(student, _blocks(), tmp_path / f"free{free}", _cfg(),
                    on_step=lambda s, r: inside.append(torch.get_num_threads()))
        assert inside == [2, 2, 2] and out["threads"] == [[0.0, 2]]
        weights.append(student.state_dict())
    assert all(torch.equal(w, weights[1][k]) for k, w in weights[0].items())
    monkeypatch.setattr(fast_settings, "free_cores", lambda window_s=0.5: 1)
    inside = []
    out = train(tiny_llama(vocab_size=V, hidden_size=32, seed=3), _blocks(), tmp_path / "follow",
                _cfg(follow_free_cores=True), on_step=lambda s, r: inside.append(torch.get_num_threads()))
    assert inside == [1, 1, 1] and out["threads"] == [[0.0, 1]] and torch.get_num_threads() == 2


@given(n=st.integers(2, 300), steps=st.integers(1, 40), mb=st.integers(1, 8), seed=st.integers(0, 5))
@settings(max_examples=60, deadline=None)
def test_cached_run_covers_exactly_the_blocks_training_reads(n, steps, mb, seed):
    from distill.trainer import blocks_this_run_uses
    from distill.trainer import batch_indices

    blocks = torch.arange(n).view(n, 1)  # row i holds i
    cfg = _cfg(max_steps=steps, micro_batch_size=mb)
    kept = blocks_this_run_uses(blocks, cfg, seed)[:, 0].tolist()
    read = {i for s in range(steps) for i in batch_indices(n, s, mb, seed).tolist()}
    assert set(kept) == read and len(kept) == len(set(kept))  # no block twice, none missing, none extra
    assert len(kept) == min(n, steps * mb)


@given(n=st.integers(2, 300), unique=st.integers(1, 60), steps=st.integers(1, 40), mb=st.integers(1, 8),
       seed=st.integers(0, 5))
@settings(max_examples=60, deadline=None)
def test_unique_blocks_is_a_prefix_of_the_epoch_order_shared_by_every_size(n, unique, steps, mb, seed):
    """trainer.unique_blocks=N keeps the first N blocks of the epoch-0 order (what a one-read run of N blocks reads),
    whatever max_steps; a smaller N keeps a prefix of a larger one's (the curve's sizes share one cache)."""
    from distill.trainer import batch_indices, blocks_this_run_uses

    blocks = torch.arange(n).view(n, 1)
    kept = blocks_this_run_uses(blocks, _cfg(max_steps=steps, micro_batch_size=mb, unique_blocks=unique), seed)
    kept = kept[:, 0].tolist()
    assert len(kept) == min(n, unique, steps * mb) and len(set(kept)) == len(kept)
    if len(kept) == n:  # every block: the blocks as they are
        assert kept == list(range(n))
        return
    assert kept == batch_indices(n, 0, n, seed).tolist()[:len(kept)]
    wider = blocks_this_run_uses(blocks, _cfg(max_steps=steps, micro_batch_size=mb, unique_blocks=unique + 7), seed)
    assert len(wider) == n or wider[:len(kept), 0].tolist() == kept


def test_unique_blocks_reads_the_same_blocks_several_times(tmp_path):
    """A run of 6 steps x 2 blocks over unique_blocks=4 reads those 4 blocks three times each and no other."""
    from distill.trainer import blocks_this_run_uses

    blocks = _blocks()
    cfg = _cfg(max_steps=6, micro_batch_size=2, unique_blocks=4, warmup_steps=0)
    subset = blocks_this_run_uses(blocks, cfg, 0)
    out = train(tiny_llama(vocab_size=V, hidden_size=32, seed=3), subset, tmp_path, cfg)
    assert subset.shape[0] == 4 and out["unique_tokens"] == subset.numel() and out["max_reads_per_token"] == 3


@pytest.mark.parametrize("warmup, warned", [(3, True), (5, True), (2, False)])
def test_warmup_that_covers_every_step_is_warned(tmp_path, caplog, warmup, warned):
    # max_steps=3: a warmup of 3 or more never reaches the cosine decay; the warning names both keys
    student = tiny_llama(vocab_size=V, hidden_size=32, seed=3)
    with caplog.at_level("WARNING", logger="distill.trainer"):
        train(student, _blocks(), tmp_path, _cfg(warmup_steps=warmup))
    hits = [r.getMessage() for r in caplog.records if "never decays" in r.getMessage()]
    assert bool(hits) is warned
    if warned:
        assert f"trainer.warmup_steps={warmup}" in hits[0] and "trainer.max_steps=3" in hits[0]
