"""One training loop for every stage: reference-target pretraining, the cross-entropy baseline, distillation and
LoRA / full fine-tuning (:func:`train`).

The loop runs on ``accelerate`` (one process here; several under ``accelerate launch``). Loss normalisation is
explicit: each micro-batch returns a *summed* loss over its counted tokens, and the optimizer step divides by the
global token count of the whole step, so the update does not depend on how a batch is split into micro-batches
(docs/architecture.md, "Conventions"; tested for 8x1 / 4x2 / 2x4 splits).

Data: the optimizer step ``s`` uses the blocks :func:`batch_indices` picks for ``s`` (a pure function of the step
and seed). A ``batch_hook`` may replace a micro-batch (on-policy distillation swaps in the draft's own
generations); it receives the step and micro-batch index so its randomness is a pure function of them too.

Checkpoints (:mod:`distill.checkpointing`: ``accelerate.save_state`` plus ``trainer_state.json`` and the best
weights, atomically in ``<out_dir>/checkpoint-last``); with ``resume=True`` training continues from there and ends
with the same weights as an uninterrupted run (tested with a real ``kill -9``).

Scale-out (``trainer.strategy``, :mod:`distill.launch`): the same loop runs on one process, under DDP, or under
DeepSpeed ZeRO-2/3 when started with ``accelerate launch --config_file conf/accelerate/<strategy>.yaml``. The
global batch (``trainer.global_batch_size``) is split into per-process micro-batches and accumulation steps, so the
sequences of every optimizer step, and hence the loss curve, do not depend on the process count; each process takes
its contiguous share of the step's block indices. The frozen teacher is replicated, or (ZeRO-3,
``trainer.teacher_placement=zero3``) runs in its own DeepSpeed inference engine. Checkpoints are collective
(DeepSpeed writes one partition per process); the selected weights are gathered on the main process.

Closing the loop: with ``evaluate`` and ``eval_every > 0`` the student is evaluated every ``eval_every`` steps and
at the last step; the weights with the highest ``select_key`` (mean accepted length) are restored at the end.
(A run shorter than ``eval_every`` steps is never evaluated: it keeps its last weights.)

The trainer's pieces live by job: settings in :mod:`distill.trainer_config`, launch and preparation in
:mod:`distill.launch`, checkpoints in :mod:`distill.checkpointing`, the micro-batch losses in
:mod:`distill.step_losses`; their public names are importable from here too.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from data.devices import torch_threads

from .checkpointing import (CheckpointSelector, TrainLog, TrainState, check_finite_params, check_resumable, diverged,
                            resume, save_checkpoint)
from .launch import (Run, check_launch, distributed_state, optimizer_parameters, prepare_run, uses_deepspeed)
from .step_losses import (BatchHook, EvalFn, MicroBatch, StepLoss, count_tokens, cross_entropy_step, evaluate_loss,
                          make_distill_step, next_token_cross_entropy)
from .trainer_config import STRATEGIES, TrainerConfig, cosine_with_warmup

__all__ = [  # the loop, and the trainer's public names from the modules that define them
    "train", "batch_indices", "rows_this_run_uses", "blocks_this_run_uses", "BudgetClock", "TrainerConfig",
    "STRATEGIES", "cosine_with_warmup", "check_launch",
    "distributed_state", "uses_deepspeed", "prepare_run", "optimizer_parameters", "Run", "TrainState",
    "save_checkpoint", "check_resumable", "CheckpointSelector", "TrainLog", "MicroBatch", "StepLoss", "BatchHook",
    "EvalFn", "cross_entropy_step", "make_distill_step", "count_tokens", "next_token_cross_entropy", "evaluate_loss",
]

log = logging.getLogger(__name__)


def batch_indices(num_blocks: int, step: int, global_batch: int, seed: int) -> torch.Tensor:
    """Indices (global_batch,) of the blocks used at optimizer step ``step``: a per-epoch seeded permutation, so the
    data position is a pure function of the step (exact resume, deterministic sharding)."""
    start = step * global_batch
    idx = []
    while len(idx) < global_batch:
        epoch, offset = divmod(start + len(idx), num_blocks)
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        perm = torch.randperm(num_blocks, generator=g)
        take = min(global_batch - len(idx), num_blocks - offset)
        idx.extend(perm[offset : offset + take].tolist())
    return torch.tensor(idx)


def rows_this_run_uses(num_blocks: int, tcfg: TrainerConfig, seed: int, num_processes: int = 1
                       ) -> torch.Tensor | None:
    """The blocks a run of ``tcfg.max_steps`` steps will read, when that is less than one epoch: the first
    ``max_steps * global batch`` indices of the epoch-0 permutation (:func:`batch_indices`); ``None`` when it reads
    all of them."""
    needed = tcfg.max_steps * tcfg.global_batch(num_processes)  # trainer.global_batch_size or mb x accum x world
    return None if needed >= num_blocks else batch_indices(num_blocks, 0, needed, seed)


def blocks_this_run_uses(blocks: torch.Tensor, tcfg: TrainerConfig, seed: int, num_processes: int = 1
                         ) -> torch.Tensor:
    """The training blocks (N, T) a run will read (:func:`rows_this_run_uses`): caching the teacher for only these
    costs the same teacher forwards as the online teacher instead of a pass over the whole domain."""
    rows = rows_this_run_uses(blocks.size(0), tcfg, seed, num_processes)
    return blocks if rows is None else blocks[rows]  # (needed, T)


class BudgetClock:
    """The ``trainer.max_time_s`` clock: training-loop seconds, continued across resumed parts, paused during
    selection evaluations; every process follows the main process's reading (same stop step, same LR). Before
    :meth:`start` (while the run is prepared) no time has been spent."""

    def __init__(self, cfg: TrainerConfig):
        self.cfg, self.run = cfg, None
        self.t0 = time.perf_counter()
        self.shared_s = 0.0  # the last reading shared by all processes

    def start(self, run: Run, elapsed_s: float = 0.0) -> "BudgetClock":
        """Start counting, ``elapsed_s`` seconds already spent (by the resumed parts)."""
        self.run, self.t0, self.shared_s = run, time.perf_counter() - elapsed_s, elapsed_s
        return self

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def sync(self) -> float:
        self.shared_s = self.run.main_value(self.elapsed())
        return self.shared_s

    def pause(self, seconds: float) -> None:
        self.t0 += seconds

    def progress(self) -> float:
        """Spent fraction of the budget with ``schedule_over="time"`` (0 otherwise): drives the cosine."""
        return min(1.0, self.shared_s / self.cfg.max_time_s) if self.cfg.schedule_over == "time" else 0.0

    def exhausted(self) -> bool:
        return bool(self.cfg.max_time_s) and self.sync() >= self.cfg.max_time_s


def exposure(blocks: torch.Tensor, out: dict) -> dict:
    """How much distinct data a run read: ``unique_tokens`` (N x T positions of ``blocks``) and
    ``max_reads_per_token`` (the epochs begun: :func:`batch_indices` reads every block once per epoch)."""
    reads = int(out["steps"]) * int(out["global_batch_sequences"])
    return {"unique_tokens": int(blocks.numel()), "max_reads_per_token": -(-reads // max(1, blocks.size(0)))}


def _with_cfg_threads(fn):
    """Run a ``(student, blocks, out_dir, cfg, ...)`` function with ``cfg.num_threads`` torch threads; ``0``: the
    cores other processes leave free, re-measured during the run (:class:`decode.threads.FreeCoreThreads`, passed
    as ``_threads_update``; the result's ``threads`` lists ``[seconds, count]`` at each change), and add the
    run's :func:`exposure`."""

    @functools.wraps(fn)
    def wrapper(student, blocks, out_dir, cfg, *args, **kwargs):
        if cfg.num_threads:
            with torch_threads(cfg.num_threads):
                out = fn(student, blocks, out_dir, cfg, *args, **kwargs)
            return {**out, **exposure(blocks, out), "threads": [[0.0, cfg.num_threads]]}
        from decode.threads import FreeCoreThreads

        follow = FreeCoreThreads()
        try:
            out = fn(student, blocks, out_dir, cfg, *args, _threads_update=follow.update, **kwargs)
        finally:
            follow.close()
        return {**out, **exposure(blocks, out), "threads": [list(c) for c in follow.changes]}

    return wrapper


@_with_cfg_threads
def train(student: torch.nn.Module, blocks: torch.Tensor, out_dir: str | os.PathLike, cfg: TrainerConfig,
          step_loss: StepLoss = cross_entropy_step, *, teacher: Any = None, seed: int = 0, desc: str = "train",
          on_step: Callable[[int, dict], None] | None = None, batch_hook: BatchHook | None = None,
          evaluate: EvalFn | None = None, eval_every: int = 0, select_key: str = "mean_accepted_length",
          on_eval: Callable[[int, dict], None] | None = None, _threads_update: Callable[[], int] = int) -> dict:
    """Train ``student`` on token ``blocks`` (N, T) for ``cfg.max_steps`` optimizer steps (or until
    ``cfg.max_time_s`` seconds of training-loop wall clock have passed, checked at step boundaries; time spent in
    the ``evaluate`` callback does not count). With ``cfg.schedule_over="time"`` the cosine decay follows the spent
    fraction of that budget (see :func:`cosine_with_warmup`), so a budget-stopped run still anneals.

    Args:
        student: the model to train (its parameters that require grad, and only them, go into the optimizer: all
            of a plain model, the adapters of a peft LoRA model). Under ZeRO-3 a copy is trained and ``student``
            stays unpartitioned; it ends with the gathered weights on the main process (the one that saves).
        blocks: LongTensor (N, T) of packed token blocks.
        out_dir: stage folder; holds ``checkpoint-last`` (resumable state) and ``train_log.jsonl``.
        step_loss: returns (summed loss, token count) for one micro-batch, see :data:`StepLoss`.
        teacher: passed to ``step_loss``; an ``nn.Module`` teacher is kept in eval mode, frozen and never in the
            optimizer (replicated on every process, or a copy in its own ZeRO-3 inference engine with
            ``cfg.teacher_placement="zero3"``); anything else (e.g. a :class:`distill.teacher.TeacherCache`) is
            passed through.
        on_step: called after each logged optimizer step with (step, log record); may add keys to the record.
        batch_hook: may replace each micro-batch, see :data:`BatchHook`.
        evaluate: scores the student (see :data:`EvalFn`); run every ``eval_every`` steps and, when that ran at
            least once, at the last step. The best weights by ``select_key`` (higher is better; ties keep the
            earlier step) are restored into ``student`` before returning; a run shorter than ``eval_every`` is not
            evaluated and keeps its last weights. Runs on every process (under ZeRO-3 on the main process only,
            with the gathered weights); the main process's result decides on every process.
        on_eval: called with (step, eval record) after each evaluation.

    Returns:
        dict with ``final_loss`` (mean loss per token of the last logged window), ``steps`` (optimizer steps
        done), ``train_time_s`` (training-loop wall clock in seconds, summed over resumed parts, without the
        selection evaluations: the clock ``cfg.max_time_s`` budgets), ``selection_eval_s`` (those evaluations),
        ``tokens_seen``, ``stopped_early`` (``"max_time_s"`` or None), ``best`` ({``step``, ``metrics``} or None),
        ``num_processes``, ``grad_accum_steps`` (per process), ``global_batch_sequences``, ``optimizer_parameters``
        (parameters the optimizer updates: the student's count), ...

    Raises:
        FloatingPointError: the loss became NaN/inf; the message names the step, the last good checkpoint stays.
        ValueError: ``eval_every < 0``, ``evaluate`` did not return ``select_key``, a launch that does not match
            ``cfg.strategy`` or the global batch (:func:`check_launch`), a checkpoint that cannot resume here
            (:func:`check_resumable`), a student without a parameter that requires grad.
    """
    if eval_every < 0:
        raise ValueError(f"eval_every must be >= 0 (0 disables evaluation), got {eval_every}")
    run, state, clock, ckpt, best_weights = _start(student, teacher, Path(out_dir), cfg, seed, desc)
    start_step = step = state.step
    write_log = TrainLog(Path(out_dir) / "train_log.jsonl", start_step, run.accelerator.is_main_process)
    select = CheckpointSelector(run, state, clock, evaluate, select_key, desc, write_log, on_eval, best_weights) \
        if evaluate is not None else None
    window, last_loss = _LossWindow(), None
    bar = _progress_bar(cfg, start_step, run.accelerator.is_main_process, desc)
    while step < cfg.max_steps and not _out_of_time(clock, state, cfg, desc, step):
        micro = _micro_batches(run, cfg, blocks, step, seed, batch_hook)
        loss_sum, n_tokens = _optimizer_step(run, cfg, clock, micro, step_loss, step, desc, ckpt)
        last_loss = loss_sum / max(1, n_tokens)
        window.add(loss_sum, n_tokens)
        state.tokens_seen += n_tokens
        step = state.step = step + 1
        state.elapsed_s = clock.elapsed()
        bar.update(1)
        _threads_update()  # trainer.num_threads=0: follow the cores other processes leave free
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            state.final_loss = window.take()
            _log_step(run, state, step, on_step, bar, write_log)
        if select is not None and eval_every and step % eval_every == 0:
            select(step, last_loss)
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
            check_finite_params(run.raw_student, desc, step, ckpt)  # never checkpoint diverged weights
            save_checkpoint(run.accelerator, ckpt, asdict(state), select.best_weights if select else best_weights)
    bar.close()
    if select is not None and state.last_eval_step not in (None, step):
        select(step, last_loss)  # once selection is on, the last weights compete too
    return _finish(run, cfg, state, clock, select.best_weights if select else best_weights, start_step, ckpt, desc)


def _start(student, teacher, out_dir: Path, cfg: TrainerConfig, seed: int, desc: str):
    """``(run, state, clock, checkpoint folder, selected weights)`` of a train() call: the prepared run (its LR
    follows the budget clock), the seed set, and the state of ``checkpoint-last`` when resuming."""
    from accelerate.utils import set_seed

    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.warmup_steps >= cfg.max_steps:  # legal (a short run may want a constant ramp), rarely what was meant
        log.warning("%s: trainer.warmup_steps=%d >= trainer.max_steps=%d: the learning rate only ramps up and never "
                    "decays (it reaches trainer.lr at the last step at most); set trainer.warmup_steps below "
                    "trainer.max_steps for the cosine decay", desc, cfg.warmup_steps, cfg.max_steps)
    clock = BudgetClock(cfg)  # the schedule reads it from the first step
    run = prepare_run(student, teacher, cfg, lambda s: cosine_with_warmup(
        s, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio, clock.progress()))
    acc = run.accelerator
    set_seed(seed)
    ckpt = out_dir / "checkpoint-last"
    state = TrainState(global_batch_sequences=cfg.micro_batch_size * run.accum * acc.num_processes,
                       num_processes=acc.num_processes, strategy=cfg.strategy)
    best_weights = resume(run, cfg, ckpt, state, desc)
    return run, state, clock.start(run, state.elapsed_s), ckpt, best_weights  # the budget counts every resumed part


def _out_of_time(clock: BudgetClock, state: TrainState, cfg: TrainerConfig, desc: str, step: int) -> bool:
    """Whether the wall-clock budget ``trainer.max_time_s`` is spent (then recorded in ``state``)."""
    if not clock.exhausted():
        return False
    state.stopped_early = "max_time_s"
    log.info("%s: wall-clock budget trainer.max_time_s=%.0f s reached after %d steps", desc, cfg.max_time_s, step)
    return True


def _progress_bar(cfg: TrainerConfig, start_step: int, is_main: bool, desc: str):
    # A budgeted run says so: its step total is only a cap, the budget usually ends it first.
    return tqdm(total=cfg.max_steps, initial=start_step, disable=not is_main, dynamic_ncols=True,
                desc=f"{desc} (stops at {cfg.max_time_s:.0f} s of training)" if cfg.max_time_s else desc)


def _micro_batches(run: Run, cfg: TrainerConfig, blocks: torch.Tensor, step: int, seed: int,
                   batch_hook: BatchHook | None) -> list[MicroBatch]:
    """This process's micro-batches of optimizer step ``step`` (each of ``cfg.micro_batch_size`` blocks)."""
    acc, accum = run.accelerator, run.accum
    global_batch = cfg.micro_batch_size * accum * acc.num_processes
    idx = batch_indices(blocks.size(0), step, global_batch, seed)  # (global_batch,)
    # This process's share, then split into micro-batches: (world*accum*mb) -> accum x (mb,)
    mine = idx.view(acc.num_processes, -1)[acc.process_index].view(accum, cfg.micro_batch_size)
    micro = []
    for j, m in enumerate(mine):
        batch = MicroBatch.from_blocks(blocks[m].to(acc.device), m)
        if batch_hook is not None:
            batch = batch_hook(batch, step, acc.process_index * accum + j, run.raw_student)
        micro.append(batch)
    return micro


def _optimizer_step(run: Run, cfg: TrainerConfig, clock: BudgetClock, micro: list[MicroBatch],
                    step_loss: StepLoss, step: int, desc: str, ckpt: Path) -> tuple[float, int]:
    """Forward and backward every micro-batch, then one optimizer and scheduler step. Returns the summed loss and
    the token count over all processes (the loss normaliser: a global token mean, whatever the split)."""
    acc, world, accum = run.accelerator, run.accelerator.num_processes, run.accum
    # Global token count of this optimizer step (all processes, all micro-batches), known before any backward
    # so each micro-batch's backward runs right after its forward (DDP / DeepSpeed sync on the last one).
    counts = [count_tokens(step_loss, b) for b in micro]
    global_tokens = acc.reduce(torch.tensor(float(sum(counts)), device=acc.device), reduction="sum").clamp_min(1.0)
    acc.step = 0  # accumulate() below syncs gradients on this step's last micro-batch
    losses = []
    for batch, expected in zip(micro, counts):
        with acc.accumulate(run.engine):
            with run.precision(cfg.mixed_precision):
                loss_sum, n_tok = step_loss(run.engine, run.teacher, batch)
            if n_tok != expected:
                raise RuntimeError(f"{desc}: the step loss counted {n_tok} tokens, count_tokens {expected}")
            if not torch.isfinite(loss_sum.detach()):
                raise FloatingPointError(diverged(desc, f"loss is {loss_sum.item()}", step + 1, ckpt))
            losses.append(loss_sum.detach().float())
            # DDP / DeepSpeed average gradients over processes and accelerator.backward divides by the
            # accumulation steps; x world x accum turns that into sum over all micro-batches / global tokens.
            acc.backward(loss_sum * (world * accum) / global_tokens)
    if cfg.max_grad_norm > 0:
        acc.clip_grad_norm_(run.engine.parameters(), cfg.max_grad_norm)  # DeepSpeed: gradient_clipping
    run.optimizer.step()
    if cfg.schedule_over == "time":
        clock.sync()  # the LR of the next step follows the spent budget
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return acc.reduce(torch.stack(losses).sum(), reduction="sum").item(), int(global_tokens.item())


@dataclass
class _LossWindow:
    """Summed loss and tokens of the optimizer steps since the last log record."""

    loss: float = 0.0
    tokens: int = 0

    def add(self, loss_sum: float, n_tokens: int) -> None:
        self.loss, self.tokens = self.loss + loss_sum, self.tokens + n_tokens

    def take(self) -> float:
        """Mean loss per token of the window (nats), and a fresh window."""
        mean = self.loss / max(1, self.tokens)
        self.loss, self.tokens = 0.0, 0
        return mean


def _log_step(run: Run, state: TrainState, step: int, on_step, bar, write_log: TrainLog) -> None:
    """One ``train`` log record (window loss, learning rate, tokens, elapsed seconds): to ``on_step`` (which may add
    keys), the progress bar and ``train_log.jsonl``."""
    record = {"kind": "train", "step": step, "loss": state.final_loss, "lr": run.scheduler.get_last_lr()[0],
              "tokens_seen": state.tokens_seen, "elapsed_s": state.elapsed_s}
    if on_step is not None:
        on_step(step, record)
    bar.set_postfix(loss=f"{record['loss']:.3f}")
    write_log(record)


def _finish(run: Run, cfg: TrainerConfig, state: TrainState, clock: BudgetClock, best_weights: dict | None,
            start_step: int, ckpt: Path, desc: str) -> dict:
    """The last checkpoint (finite weights only), the selected weights into the caller's student, and what
    :func:`train` returns (see its docstring)."""
    acc = run.accelerator
    state.elapsed_s = clock.elapsed()
    acc.wait_for_everyone()
    check_finite_params(run.raw_student, desc, state.step, ckpt)
    save_checkpoint(acc, ckpt, asdict(state), best_weights)
    run.finish(state.best is not None, best_weights, cfg.gradient_checkpointing)
    return {"final_loss": state.final_loss, "steps": state.step, "max_steps": cfg.max_steps,
            "train_time_s": state.elapsed_s, "selection_eval_s": state.selection_eval_s,
            "tokens_seen": state.tokens_seen, "global_batch_sequences": state.global_batch_sequences,
            "num_processes": acc.num_processes, "grad_accum_steps": run.accum,
            "optimizer_parameters": sum(getattr(p, "ds_numel", p.numel()) for p in optimizer_parameters(run.optimizer)),
            "resumed_from_step": start_step, "stopped_early": state.stopped_early, "best": state.best,
            "config": asdict(cfg)}
