"""distill.trainer scale-out: the global batch is split, not assumed; two processes (DDP on gloo) give the loss curve
of one process with the same global batch, and their checkpoint resumes on one process; the optimizer holds exactly
the student's parameters; the launch must match ``trainer.strategy``. (DeepSpeed ZeRO-2 on two CPU processes:
tests/train/test_smoke_e2e.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distill.trainer import (STRATEGIES, TrainerConfig, check_launch, check_resumable, make_distill_step,
                             optimizer_parameters, prepare_run, train)
from distill.losses import forward_kl
from tinymodels import tiny_llama

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "distill" / "dist_worker.py"
sys.path.append(str(ROOT / "tests" / "distill"))
import dist_worker  # noqa: E402


def _losses(out: Path) -> dict[int, float]:
    recs = [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines() if l.strip()]
    return {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(config: str, out: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE",
                                                                     "LOCAL_RANK", "MASTER_"))}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "conf/accelerate" / config),
           "--num_processes", "2", "--num_cpu_threads_per_process", "1", "--main_process_port", str(_free_port()),
           str(WORKER), str(out), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          # two CPU processes (gloo), also on a machine with one GPU
                          env={**env, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process, accumulation 4 x micro-batch 2 = global batch 8."""
    out = tmp_path_factory.mktemp("one")
    stats = dist_worker.run(out, eval_every=2)
    assert stats["num_processes"] == 1 and stats["grad_accum_steps"] == 4
    return out, stats


def _assert_same_curve(a: dict[int, float], b: dict[int, float]):
    assert sorted(a) == sorted(b) and len(a) >= 3
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-5), (step, a, b)


@pytest.mark.slow
def test_two_ddp_processes_match_one_and_resume_on_one(tmp_path, one_process):
    ref_dir, ref = one_process
    out = tmp_path / "two"
    # Two processes (accumulation 2 each) until step 4, checkpoint at step 3, then interrupted.
    proc = _launch("ddp.yaml", out, "--strategy", "ddp", "--save-every", "3", "--stop-after", "4", "--eval-every", "2")
    assert proc.returncode != 0 and (out / "checkpoint-last").is_dir(), proc.stderr[-3000:]
    state = json.loads((out / "checkpoint-last" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["num_processes"] == 2 and state["global_batch_sequences"] == 8
    two_curve = _losses(out)
    assert sorted(two_curve) == [1, 2, 3]
    # ... resumed on one process (the same global batch, accumulation 4) to the end.
    stats = dist_worker.run(out, strategy="single", resume=True, eval_every=2)
    assert stats["resumed_from_step"] == 3 and stats["num_processes"] == 1
    assert stats["best"] == {**ref["best"], "metrics": {**ref["best"]["metrics"],
                                                        "eval_decode_s": stats["best"]["metrics"]["eval_decode_s"]}}
    _assert_same_curve(_losses(ref_dir), _losses(out))
    from safetensors.torch import load_file

    a, b = load_file(str(ref_dir / "hf" / "model.safetensors")), load_file(str(out / "hf" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=2e-5, rtol=1e-4, msg=name)


def _evals(out: Path) -> list[tuple[int, float, int]]:
    recs = [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines() if l.strip()]
    return [(r["step"], r["mean_accepted_length"], r["best_step"]) for r in recs if r["kind"] == "eval"]


def _assert_same_evals(ours: list[tuple[int, float, int]], ref: list[tuple[int, float, int]]) -> None:
    """Same evaluation steps and selections exactly, the same tau up to float noise (pytest.approx compares flat
    sequences only since pytest 9, so the tuples are compared field by field)."""
    assert [(s, b) for s, _, b in ours] == [(s, b) for s, _, b in ref], (ours, ref)
    assert [t for _, t, _ in ours] == pytest.approx([t for _, t, _ in ref]), (ours, ref)


@pytest.mark.slow
def test_deepspeed_zero3_with_the_teacher_in_its_own_engine_matches_one_process(tmp_path, one_process):
    """ZeRO-3 partitions the student and (teacher_placement=zero3) the teacher; the selection evaluations run on
    the gathered weights; curve, scores, selected step and saved weights are the one-process run's."""
    pytest.importorskip("deepspeed")
    from transformers import AutoModelForCausalLM

    ref_dir, ref = one_process
    out = tmp_path / "zero3"
    proc = _launch("deepspeed_zero3.yaml", out, "--strategy", "deepspeed_zero3", "--teacher-placement", "zero3",
                   "--eval-every", "2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    stats = json.loads((out / "stats.json").read_text())
    assert stats["num_processes"] == 2 and stats["optimizer_parameters"] == ref["student_parameters"]
    _assert_same_curve(_losses(ref_dir), _losses(out))
    _assert_same_evals(_evals(out), _evals(ref_dir))
    assert stats["best"]["step"] == ref["best"]["step"]
    model, expected = (AutoModelForCausalLM.from_pretrained(d / "hf") for d in (out, ref_dir))
    for (name, w), (_, e) in zip(model.state_dict().items(), expected.state_dict().items()):
        torch.testing.assert_close(w, e, atol=2e-5, rtol=1e-4, msg=name)


def test_optimizer_holds_exactly_the_students_parameters(tmp_path):
    teacher, student = tiny_llama(seed=1), tiny_llama(seed=3)
    run = prepare_run(student, teacher, TrainerConfig(max_steps=2, micro_batch_size=2))
    held = optimizer_parameters(run.optimizer)
    assert [id(p) for p in held] == [id(p) for p in student.parameters()]
    assert not {id(p) for p in teacher.parameters()} & {id(p) for p in held}
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    # And through train(): the teacher is untouched, its parameters never updated.
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    blocks = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))
    stats = train(tiny_llama(seed=3), blocks, tmp_path, TrainerConfig(max_steps=2, micro_batch_size=4, save_every=0),
                  make_distill_step(forward_kl, 1.0), teacher=teacher)
    assert stats["optimizer_parameters"] == sum(p.numel() for p in tiny_llama(seed=3).parameters())
    assert all(torch.equal(v, before[k]) for k, v in teacher.state_dict().items()) and not teacher.training


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("micro", [1, 2, 4, 8])
@pytest.mark.parametrize("global_batch", [8, 24, 64])
def test_global_batch_is_split_per_process_count(world, micro, global_batch):
    cfg = TrainerConfig(micro_batch_size=micro, global_batch_size=global_batch)
    if global_batch % (micro * world):
        with pytest.raises(ValueError, match=f"global_batch_size={global_batch} is not divisible"):
            cfg.accumulation_steps(world)
    else:
        accum = cfg.accumulation_steps(world)
        assert micro * accum * world == cfg.global_batch(world) == global_batch
    # Without global_batch_size the global batch grows with the process count.
    legacy = TrainerConfig(micro_batch_size=micro, grad_accum_steps=3)
    assert legacy.global_batch(world) == micro * 3 * world


@pytest.mark.parametrize("kw,match", [
    ({"strategy": "fsdp"}, "trainer.strategy"),
    ({"global_batch_size": 10, "micro_batch_size": 4}, "multiple of trainer.micro_batch_size"),
    ({"global_batch_size": 16, "grad_accum_steps": 2}, "not both"),
    ({"teacher_placement": "zero3", "strategy": "deepspeed_zero2"}, "deepspeed_zero3"),
    ({"teacher_placement": "cpu"}, "teacher_placement"),
    ({"global_batch_size": -1}, "global_batch_size"),
])
def test_bad_scale_out_config_is_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainerConfig(**kw)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("launch", [("plain", 1, False, None), ("ddp", 2, False, None), ("zero2", 2, True, 2),
                                    ("zero3", 2, True, 3)])
def test_launch_must_match_the_strategy(strategy, launch):
    name, world, ds, stage = launch
    fits = {"single": name == "plain", "ddp": name in ("plain", "ddp"), "deepspeed_zero2": name == "zero2",
            "deepspeed_zero3": name == "zero3"}[strategy]
    cfg = TrainerConfig(strategy=strategy, micro_batch_size=2, global_batch_size=8)
    if fits:
        check_launch(cfg, world, ds, stage)
    else:
        with pytest.raises(ValueError, match="trainer"):
            check_launch(cfg, world, ds, stage)


def test_resume_refuses_another_global_batch_or_deepspeed_layout(tmp_path):
    now = {"global_batch_sequences": 8, "num_processes": 1, "strategy": "single"}
    check_resumable({"global_batch_sequences": 8, "num_processes": 2, "strategy": "ddp"}, now, tmp_path)
    with pytest.raises(ValueError, match="trainer.global_batch_size=16"):
        check_resumable({**now, "global_batch_sequences": 16, "num_processes": 2}, now, tmp_path)
    with pytest.raises(ValueError, match="DeepSpeed partitions"):
        check_resumable({**now, "num_processes": 2, "strategy": "deepspeed_zero2"},
                         {**now, "strategy": "deepspeed_zero2"}, tmp_path)


def test_gradient_checkpointing_and_bf16_switches(tmp_path):
    blocks = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))
    weights = []
    for gc in (False, True):
        student = tiny_llama(seed=3)
        train(student, blocks, tmp_path / str(gc), TrainerConfig(max_steps=2, micro_batch_size=4, save_every=0,
                                                                  gradient_checkpointing=gc))
        assert not student.is_gradient_checkpointing and not student.training
        weights.append(student.state_dict())
    for name, w in weights[0].items():  # recomputing activations does not change the update
        torch.testing.assert_close(weights[1][name], w, atol=1e-6, rtol=1e-5, msg=name)
    stats = train(tiny_llama(seed=3), blocks, tmp_path / "bf16", TrainerConfig(max_steps=2, micro_batch_size=4,
                                                                             save_every=0, mixed_precision="bf16"))
    assert stats["final_loss"] == pytest.approx(stats["final_loss"]) and 0 < stats["final_loss"] < 10


@pytest.mark.slow
def test_deepspeed_zero2_selection_evaluations_decode_the_current_weights(tmp_path):
    """ZeRO-2's optimizer writes the updated weights through ``.data`` (no version bump): every selection
    evaluation's acceptance numbers, which pick the checkpoint, are the Hugging Face forward's on that step's
    weights (issue 12: the lean forward used to decode the step-1 weights)."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "zero2"
    proc = _launch("deepspeed_zero2.yaml", out, "--strategy", "deepspeed_zero2", "--max-steps", "3",
                   "--eval-every", "1", "--check-fast-path")
    assert proc.returncode == 0, proc.stderr[-4000:]
    checks = [json.loads(l) for l in (out / "fast_path_check.jsonl").read_text().splitlines()]
    assert len(checks) == 3
    for c in checks:
        assert c["fast"] == pytest.approx(c["hf"]) and c["logit_diff"] < 1e-4, c
    assert len({tuple(c["probe"]) for c in checks}) == 3  # the weights did change between the evaluations
    evals = [(e[1], e[0]) for e in _evals(out)]  # what selection saw is what the check recorded
    assert [m for m, _ in evals] == pytest.approx([c["fast"]["mean_accepted_length"] for c in checks])


def test_more_local_processes_than_gpus_is_refused(monkeypatch):
    """Faked one-GPU machine: two ranks would share cuda:0 under NCCL; refused with both fixes named. One process
    per GPU passes (accelerate's defaults), and without a GPU two processes take the gloo path."""
    from distill.launch import launch_kwargs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"2 processes on this machine but only 1 visible CUDA device.*"
                                         r"CUDA_VISIBLE_DEVICES= \(gloo\)"):
        launch_kwargs()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert launch_kwargs() == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert launch_kwargs() == {"cpu": True}
