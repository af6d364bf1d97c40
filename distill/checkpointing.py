"""Resumable checkpoints and checkpoint selection of :func:`distill.trainer.train`.

``<out_dir>/checkpoint-last`` holds ``accelerate.save_state`` (model, optimizer, scheduler, RNG; DeepSpeed: one
partition per process), ``trainer_state.json`` (:class:`TrainState`) and the selected weights so far
(``best_model.safetensors``), written atomically by :func:`save_checkpoint`; :func:`resume` loads them back after
:func:`check_resumable` has compared the stored launch with this one. :class:`CheckpointSelector` scores the student
during training and keeps the best weights; :class:`TrainLog` is ``train_log.jsonl``.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from data.io import atomic_dir, write_json_atomic

from .launch import Run, state_dict_copy
from .trainer_config import TrainerConfig, zero_stage

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """What a resumable checkpoint records (``checkpoint-last/trainer_state.json``, same keys)."""

    step: int = 0  # optimizer steps done
    elapsed_s: float = 0.0  # training-loop wall clock so far, resumed parts included, selection evaluations not
    tokens_seen: int = 0
    final_loss: float | None = None  # mean loss per token of the last logged window
    best: dict | None = None  # {"step", "metrics"} of the selected weights
    last_eval_step: int | None = None
    stopped_early: str | None = None  # "max_time_s" when the budget ended the run
    selection_eval_s: float = 0.0  # time spent in selection evaluations
    global_batch_sequences: int = 0
    num_processes: int = 1
    strategy: str = "single"


def save_checkpoint(accelerator, ckpt: Path, state: dict, best_weights: dict[str, torch.Tensor] | None = None) -> None:
    """Resumable state (``state["step"]`` etc.), written atomically: a killed save leaves the previous checkpoint
    intact. ``best_weights`` (the selected weights so far) go to ``best_model.safetensors`` beside it.

    Collective: every process calls it. The main process picks the temporary folder; every process writes its part
    of ``accelerator.save_state`` there (DeepSpeed: its partition; RNG state), then the main process renames it.
    """
    from contextlib import nullcontext

    from safetensors.torch import save_file

    accelerator.wait_for_everyone()
    main = accelerator.is_main_process
    with atomic_dir(ckpt) if main else nullcontext() as tmp:
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            tmp = Path(broadcast_object_list([str(tmp) if main else None], from_process=0)[0])
        accelerator.save_state(str(tmp), safe_serialization=True)
        accelerator.wait_for_everyone()
        if main:
            if best_weights is not None:
                save_file(best_weights, str(tmp / "best_model.safetensors"))
            write_json_atomic(tmp / "trainer_state.json", state)
    accelerator.wait_for_everyone()


def check_resumable(saved: dict, now: dict, ckpt: Path) -> None:
    """A checkpoint resumes under another process count only with the same global batch, and (DeepSpeed keeps
    one optimizer partition per process) only outside DeepSpeed.

    Raises:
        ValueError: naming the stored and the new setting and the fix.
    """
    gb = saved.get("global_batch_sequences")
    if gb is not None and gb != now["global_batch_sequences"]:
        raise ValueError(f"{ckpt} was trained with {gb} sequences per optimizer step; this launch gives "
                         f"{now['global_batch_sequences']} (micro_batch_size x accumulation x {now['num_processes']} "
                         f"processes). Set trainer.global_batch_size={gb} so the batch stays the same across "
                         f"process counts.")
    was, strategy = saved.get("strategy", "single"), now["strategy"]
    deepspeed = zero_stage(was) is not None or zero_stage(strategy) is not None
    if deepspeed and (was != strategy or saved.get("num_processes", 1) != now["num_processes"]):
        raise ValueError(f"{ckpt} holds a {was} checkpoint of {saved.get('num_processes', 1)} process(es); resuming it "
                         f"as {strategy} on {now['num_processes']} is not supported (DeepSpeed partitions the optimizer "
                         f"state per process). Resume with trainer={was} on {saved.get('num_processes', 1)} "
                         f"process(es), or start a new run directory.")


def resume(run: Run, cfg: TrainerConfig, ckpt: Path, state: TrainState, desc: str) -> dict | None:
    """Load ``ckpt`` into the prepared objects and ``state`` (with ``cfg.resume``); returns the selected weights
    saved with it (None when there are none or this process does not keep them).

    Raises:
        ValueError: a damaged checkpoint, or one that cannot resume under this launch (:func:`check_resumable`).
    """
    from safetensors.torch import load_file

    if not cfg.resume:
        return None
    if not (ckpt / "trainer_state.json").exists():
        log.warning("%s: trainer.resume=true but no checkpoint in %s (checkpoints are written every "
                    "trainer.save_every=%d steps); starting from step 0", desc, ckpt, cfg.save_every)
        return None
    try:
        saved = json.loads((ckpt / "trainer_state.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{desc}: cannot resume, {ckpt / 'trainer_state.json'} is damaged ({e}). Delete "
                         f"{ckpt} to start this stage over, or start a new run directory.") from None
    check_resumable(saved, asdict(state), ckpt)
    try:
        run.accelerator.load_state(str(ckpt))
    except Exception as e:  # noqa: BLE001  (safetensors, torch.load, missing files: all mean a damaged checkpoint)
        raise ValueError(f"{desc}: cannot resume, the checkpoint {ckpt} is damaged or incomplete "
                         f"({type(e).__name__}: {e}). Delete {ckpt} to start this stage over, or start a new run "
                         f"directory.") from None
    known = {k: v for k, v in saved.items() if k in TrainState.__dataclass_fields__}
    # the launch's own process count and strategy; a new budget (or none) applies to the continuation
    state.__dict__.update({**known, "num_processes": state.num_processes, "strategy": state.strategy,
                           "stopped_early": None})
    log.info("resumed %s from step %d", desc, state.step)
    if state.best is not None and (ckpt / "best_model.safetensors").exists() and run.keeps_best:
        return load_file(str(ckpt / "best_model.safetensors"))
    return None


def diverged(desc: str, what: str, step: int, ckpt: Path) -> str:
    """The message of a run that stopped on a non-finite loss or weights: the step, the checkpoint kept, the fix."""
    kept = f"the last good checkpoint {ckpt} (step {_ckpt_step(ckpt)}) is kept" if ckpt.exists() else \
        "no checkpoint was written yet"
    return (f"{desc}: {what} at step {step}; training stopped and {kept}. Start a new run with a lower trainer.lr "
            f"(or a larger trainer.warmup_steps / smaller trainer.max_grad_norm), or check the data; resuming "
            f"needs the same settings.")


def _ckpt_step(ckpt: Path):
    try:
        return json.loads((ckpt / "trainer_state.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return "?"


def check_finite_params(model: torch.nn.Module, desc: str, step: int, ckpt: Path) -> None:
    """Raise FloatingPointError when a parameter holds NaN/inf (an optimizer step overflowed): such weights are
    never saved over the last good checkpoint."""
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise FloatingPointError(diverged(desc, f"weights became non-finite ({', '.join(bad[:3])})", step, ckpt))


class TrainLog:
    """``train_log.jsonl`` (main process only): one JSON record per logged step and per evaluation. A resumed run
    first drops the records written after its checkpoint (they are replayed)."""

    def __init__(self, path: Path, start_step: int, is_main: bool):
        self.path, self.is_main = path, is_main
        if is_main and start_step == 0:
            path.unlink(missing_ok=True)
        elif is_main and path.exists():
            keep = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= start_step]
            path.write_text("".join(line + "\n" for line in keep))

    def __call__(self, rec: dict) -> None:
        if self.is_main:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")


def _score(value) -> float:
    """A selection score; NaN or None (e.g. no verify step) ranks below every number."""
    return -math.inf if value is None or value != value else float(value)


class CheckpointSelector:
    """Scores the student with ``evaluate`` and keeps a CPU copy of the best weights by ``select_key`` (higher is
    better; ties keep the earlier step). Evaluation time pauses the budget clock
    (:class:`distill.trainer.BudgetClock`)."""

    def __init__(self, run: Run, state: TrainState, clock: Any, evaluate, select_key: str,
                 desc: str, write_log: TrainLog, on_eval, best_weights: dict | None):
        self.run, self.state, self.clock, self.evaluate = run, state, clock, evaluate
        self.select_key, self.desc, self.write_log, self.on_eval = select_key, desc, write_log, on_eval
        self.best_weights = best_weights

    def __call__(self, done: int, last_loss: float | None) -> None:
        t_eval = time.perf_counter()
        model = self.run.eval_model()  # ZeRO-3: full weights gathered on the main process only (None elsewhere)
        metrics = None
        if model is not None:
            model.eval()
            with torch.no_grad():
                metrics = dict(self.evaluate(model))
            model.train(model is self.run.raw_student)
        metrics = self.run.main_value(metrics)  # every process selects by the main process's numbers
        if self.select_key not in metrics:
            raise ValueError(f"{self.desc}: the evaluation returned {sorted(metrics)}, without {self.select_key!r}")
        best = self.state.best
        if best is None or _score(metrics[self.select_key]) > _score(best["metrics"][self.select_key]):
            self.state.best = {"step": done, "metrics": metrics}
            self.best_weights = state_dict_copy(model) if model is not None else None
        self.state.last_eval_step = done
        eval_s = time.perf_counter() - t_eval
        self.clock.pause(eval_s)  # selection evaluations are not training: they don't spend the budget
        self.state.selection_eval_s += eval_s
        rec = {"kind": "eval", "step": done, "loss": last_loss, **metrics, "eval_time_s": eval_s,
               "best_step": self.state.best["step"]}
        self.write_log(rec)
        if self.on_eval is not None:
            self.on_eval(done, rec)
