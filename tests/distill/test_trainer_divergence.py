"""distill.trainer under a diverging loss: it stops at the first non-finite loss (or non-finite weights) with the
step number in the message, and checkpoint-last keeps the last good state (finite weights, an earlier step).
The end-to-end version through ``python -m train`` is in tests/train/test_cli_errors.py."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file

from distill.trainer import TrainerConfig, cross_entropy_step, train
from tinymodels import tiny_llama

V, T = 64, 12


@settings(max_examples=6, deadline=None)
@given(bad_step=st.integers(min_value=1, max_value=7), save_every=st.integers(min_value=1, max_value=3),
       value=st.sampled_from([float("nan"), float("inf"), -float("inf")]))
def test_non_finite_loss_stops_naming_the_step_and_keeps_the_last_checkpoint(tmp_path_factory, bad_step, save_every,
                                                                            value):
    out = tmp_path_factory.mktemp("diverge")
    calls = {"n": 0}

    def step_loss(student, teacher, batch):  # real CE; the loss of optimizer step ``bad_step`` is non-finite
        calls["n"] += 1
        loss, n = cross_entropy_step(student, teacher, batch)
        return (loss * value if calls["n"] == bad_step else loss), n

    step_loss.count_tokens = getattr(cross_entropy_step, "count_tokens", None) or (lambda b: b.counted().sum())
    blocks = torch.randint(0, V, (16, T), generator=torch.Generator().manual_seed(0))
    cfg = TrainerConfig(max_steps=8, micro_batch_size=4, warmup_steps=1, save_every=save_every, log_every=1, lr=1e-3)
    with pytest.raises(FloatingPointError) as ei:
        train(tiny_llama(vocab_size=V, seed=0), blocks, out, cfg, step_loss, seed=0)
    msg = str(ei.value)
    assert f"at step {bad_step};" in msg and "trainer.lr" in msg, msg
    ckpt = out / "checkpoint-last"
    last_good = (bad_step - 1) // save_every * save_every  # checkpoints are written after steps save_every, 2*...
    if last_good == 0:
        assert not ckpt.exists() and "no checkpoint was written yet" in msg
        return
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == last_good
    assert f"(step {last_good}) is kept" in msg
    assert all(bool(torch.isfinite(t).all()) for t in load_file(str(ckpt / "model.safetensors")).values())
