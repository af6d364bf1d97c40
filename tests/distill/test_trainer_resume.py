"""distill.trainer resume: a run killed with SIGKILL after a checkpoint and resumed with ``resume=True`` ends with
the same weights as an uninterrupted run (model, optimizer, scheduler, RNG, data position, on-policy draws and the
best-checkpoint selection all restored)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distill.config import GenerationConfig
from distill.generation import OnPolicyHook, make_acceptance_eval
from distill.losses import forward_kl
from distill.trainer import TrainerConfig, make_distill_step, train
from tinymodels import kill_9_when, tiny_llama

pytestmark = pytest.mark.slow  # whole python -m train / eval runs: outside the fast lane (pytest -m "not slow")

ROOT = Path(__file__).resolve().parents[2]
V, T, MAX_STEPS, SAVE_EVERY = 64, 16, 12, 3


def run_training(out_dir, resume: bool, stop_after: int | None = None, sleep_s: float = 0.0) -> torch.nn.Module:
    """Distil a tiny student for MAX_STEPS steps (2 micro-batches each) with on-policy micro-batches (lambda 0.5)
    and acceptance-based selection every 4 steps; checkpoints every SAVE_EVERY steps.

    ``stop_after``: raise right after that step (an in-process interruption); ``sleep_s``: slow each step down so
    the test can kill the process between checkpoints."""
    torch.set_num_threads(1)
    teacher, student = tiny_llama(vocab_size=V, hidden_size=32, seed=1), tiny_llama(vocab_size=V, hidden_size=32, seed=3)
    blocks = torch.randint(0, V, (24, T), generator=torch.Generator().manual_seed(1))
    prompts = [blocks[i : i + 1, :6] for i in range(2)]
    cfg = TrainerConfig(max_steps=MAX_STEPS, micro_batch_size=4, grad_accum_steps=2, warmup_steps=2,
                        save_every=SAVE_EVERY, log_every=1, lr=1e-2, resume=resume)

    def on_step(step, record):
        if sleep_s:
            time.sleep(sleep_s)
        if stop_after is not None and step == stop_after:
            raise KeyboardInterrupt  # in-process stand-in for a kill right after a checkpoint

    train(student, blocks, out_dir, cfg, make_distill_step(forward_kl, 1.0), teacher=teacher, seed=0,
          on_step=on_step, batch_hook=OnPolicyHook(0.5, GenerationConfig(max_new_tokens=5), seed=0),
          evaluate=make_acceptance_eval(teacher, prompts, num_draft_tokens=3, max_new_tokens=6), eval_every=4)
    return student


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module):
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5, msg=name)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run_training(tmp_path_factory.mktemp("full"), resume=False)


def test_kill_9_then_resume_gives_the_same_weights(tmp_path, uninterrupted):
    code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]; "
            f"sys.path.append({str(ROOT / 'tests' / 'distill')!r}); import test_trainer_resume as t; "
            f"t.run_training({str(tmp_path)!r}, resume=False, sleep_s=0.4)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, "TQDM_DISABLE": "1"})
    state = tmp_path / "checkpoint-last" / "trainer_state.json"
    kill_9_when(proc, state.exists, timeout_s=90, what="no checkpoint appeared")
    killed_at = json.loads(state.read_text())["step"]
    assert 0 < killed_at < MAX_STEPS
    resumed = run_training(tmp_path, resume=True)
    final = json.loads(state.read_text())
    assert final["step"] == MAX_STEPS
    _assert_same_weights(resumed, uninterrupted)
    steps = [json.loads(l)["step"] for l in (tmp_path / "train_log.jsonl").read_text().splitlines()
             if json.loads(l)["kind"] == "train"]
    assert steps == list(range(1, MAX_STEPS + 1)), "replayed steps are logged once"


def test_simulated_interrupt_then_resume_gives_the_same_weights(tmp_path, uninterrupted):
    with pytest.raises(KeyboardInterrupt):
        run_training(tmp_path, resume=False, stop_after=7)  # last checkpoint at step 6, after the step-4 eval
    assert json.loads((tmp_path / "checkpoint-last" / "trainer_state.json").read_text())["step"] == 6
    _assert_same_weights(run_training(tmp_path, resume=True), uninterrupted)
    # Resuming a finished run trains nothing and returns the same (selected) weights.
    _assert_same_weights(run_training(tmp_path, resume=True), uninterrupted)


@pytest.mark.parametrize("damage", ["weights", "state"])
def test_damaged_checkpoint_is_a_clear_error_on_resume(tmp_path, damage):
    """A truncated model file or an unreadable trainer_state.json stops the resume with a message naming the
    checkpoint and the fix, never a library traceback."""
    with pytest.raises(KeyboardInterrupt):
        run_training(tmp_path, resume=False, stop_after=SAVE_EVERY + 1)
    ckpt = tmp_path / "checkpoint-last"
    if damage == "weights":
        target = next(ckpt.glob("model*.safetensors"))
        target.write_bytes(target.read_bytes()[:100])
    else:
        (ckpt / "trainer_state.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot resume.*(damaged|incomplete)") as ei:
        run_training(tmp_path, resume=True)
    assert str(ckpt) in str(ei.value) and "Delete" in str(ei.value)
