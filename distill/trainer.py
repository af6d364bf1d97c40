"""One training loop for every stage: reference-target pretraining, the cross-entropy baseline and distillation.

The loop runs on ``accelerate`` (one process here; several under ``accelerate launch``). Loss normalisation is
explicit: each micro-batch returns a *summed* loss over its counted tokens, and the optimizer step divides by the
global token count of the whole step, so the update does not depend on how a batch is split into micro-batches
(DESIGN.md, style point 7; tested for 8x1 / 4x2 / 2x4 splits).

Data: the optimizer step ``s`` uses the blocks :func:`_batch_indices` picks for ``s`` (a pure function of the step
and seed). A ``batch_hook`` may replace a micro-batch (on-policy distillation swaps in the draft's own
generations); it receives the step and micro-batch index so its randomness is a pure function of them too.

Checkpoints (``accelerate.save_state``: model, optimizer, scheduler, RNG) plus ``trainer_state.json`` (step,
elapsed seconds, tokens seen, the best evaluation so far) and the best weights are written atomically to
``<out_dir>/checkpoint-last``; with ``resume=True`` training continues from there and ends with the same weights
as an uninterrupted run (tested with a real ``kill -9``).

Closing the loop: with ``evaluate`` and ``eval_every > 0`` the student is evaluated every ``eval_every`` steps and
at the last step; the weights with the highest ``select_key`` (mean accepted length) are restored at the end.
(A run shorter than ``eval_every`` steps is never evaluated: it keeps its last weights.)
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from data.io import atomic_dir, write_json_atomic

log = logging.getLogger(__name__)


@dataclass
class TrainerConfig:
    """Optimisation settings (the ``trainer`` config group). Steps count optimizer updates."""

    max_steps: int = 300
    micro_batch_size: int = 8  # sequences per micro-batch per process
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    log_every: int = 10
    save_every: int = 100  # steps between resumable checkpoints (0: only at the end)
    resume: bool = False
    mixed_precision: str = "no"  # no | bf16 | fp16 (accelerate)
    max_time_s: float = 0.0  # wall-clock budget of the training loop in seconds (0: off)
    schedule_over: str = "steps"  # steps: cosine spans max_steps | time: spans the max_time_s budget (or max_steps)
    num_threads: int = 0  # torch CPU threads while training (0: torch's setting); 1: fastest for tiny models

    def __post_init__(self):
        for name in ("max_steps", "micro_batch_size", "grad_accum_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"trainer.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"trainer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.save_every < 0 or self.log_every < 1:
            raise ValueError("trainer.warmup_steps and trainer.save_every must be >= 0, trainer.log_every >= 1")
        if self.num_threads < 0:
            raise ValueError(f"trainer.num_threads must be >= 0 (0 keeps torch's setting), got {self.num_threads}")
        if not self.max_time_s >= 0:
            raise ValueError(f"trainer.max_time_s must be >= 0 seconds (0 disables the budget), got {self.max_time_s}")
        if self.schedule_over not in ("steps", "time"):
            raise ValueError(f"trainer.schedule_over must be steps or time, got {self.schedule_over!r}")
        if self.schedule_over == "time" and not self.max_time_s > 0:
            raise ValueError("trainer.schedule_over=time needs a wall-clock budget: set trainer.max_time_s > 0 "
                             "(or use trainer.schedule_over=steps)")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError(f"trainer.mixed_precision must be no, bf16 or fp16, got {self.mixed_precision!r}")


def cosine_with_warmup(step: int, warmup: int, total: int, min_ratio: float, time_progress: float = 0.0) -> float:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``.

    ``time_progress`` in [0, 1] (the fraction of a wall-clock budget spent) advances the decay when it is ahead of
    the step count, so a run stopped by its budget still ends its schedule there: the budget-aware schedule of
    Li, Yumer & Ramanan, "Budgeted Training", ICLR 2020 (Sec. 3, decay tied to the budget instead of the steps).
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, max((step - warmup) / max(1, total - warmup), time_progress))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def causal_lm_loss_sum(student_logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy. student_logits (B,T,V), input_ids (B,T), mask (B,T) -> scalar.

    Position t predicts token t+1; the last position has no label and is dropped.
    """
    logits = student_logits[:, :-1].float()  # (B, T-1, V)
    labels = input_ids[:, 1:].masked_fill(~mask[:, 1:].bool(), -100)  # (B, T-1)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="sum")


@dataclass
class MicroBatch:
    """One micro-batch of token sequences.

    Attributes:
        input_ids: LongTensor (B, T).
        attention_mask: LongTensor (B, T), 1 = real token (what the models attend to).
        loss_mask: BoolTensor (B, T): ``True`` where the prediction made *at* position t counts (its next-token
            distribution for distillation; the label ``input_ids[t+1]`` for cross-entropy, which also needs
            ``attention_mask[t+1]``).
        block_index: LongTensor (B,) rows of the training blocks this came from (looks up a cached teacher);
            ``None`` for generated sequences.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    block_index: torch.Tensor | None = None

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, block_index: torch.Tensor | None = None) -> "MicroBatch":
        """Every position of packed blocks (B, T) is real and counts."""
        return cls(blocks, torch.ones_like(blocks), torch.ones(blocks.shape, dtype=torch.bool, device=blocks.device),
                   block_index)

    def counted(self) -> torch.Tensor:
        """BoolTensor (B, T): positions whose prediction counts (loss mask on real tokens)."""
        return self.loss_mask.bool() & self.attention_mask.bool()


# A step loss: (student, teacher or None, micro-batch) -> (summed loss over counted tokens, token count).
StepLoss = Callable[[torch.nn.Module, Any, MicroBatch], "tuple[torch.Tensor, int]"]
# A batch hook: (micro-batch, optimizer step, micro-batch index within the step over all processes, unwrapped
# student) -> the micro-batch to train on. Must be a deterministic function of its arguments (and the seed it
# closed over) so resumed runs replay it exactly.
BatchHook = Callable[[MicroBatch, int, int, torch.nn.Module], MicroBatch]
# An evaluation: unwrapped student (eval mode, no grad) -> metrics, e.g. {"mean_accepted_length": 2.1, ...}.
EvalFn = Callable[[torch.nn.Module], dict]


def cross_entropy_step(student, teacher, batch: MicroBatch):
    """Summed next-token cross-entropy over positions t with ``counted()[t]`` and a real label at t+1."""
    out = student(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    logits = out.logits[:, :-1].float()  # (B, T-1, V)
    keep = batch.counted()[:, :-1] & batch.attention_mask[:, 1:].bool()  # (B, T-1)
    labels = batch.input_ids[:, 1:].masked_fill(~keep, -100)  # (B, T-1)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="sum")
    return loss, int(keep.sum())


def make_distill_step(loss_fn, temperature: float, shared_vocab: int | None = None, **loss_kwargs) -> StepLoss:
    """A step loss for distillation: teacher forward under no_grad (eval mode), divergence ``loss_fn`` summed over
    the counted positions.

    ``loss_fn`` is a :mod:`distill.losses` function called with ``reduction="sum"``; logits are cut to the
    ``shared_vocab`` ids when the two models' embedding matrices are padded to different sizes.
    """

    def step(student, teacher, batch: MicroBatch):
        ids, attn, keep = batch.input_ids, batch.attention_mask, batch.counted()
        with torch.no_grad():
            t_logits = teacher(input_ids=ids, attention_mask=attn).logits  # (B, T, V_t)
        s_logits = student(input_ids=ids, attention_mask=attn).logits  # (B, T, V_s)
        if shared_vocab is not None:
            s_logits, t_logits = s_logits[..., :shared_vocab], t_logits[..., :shared_vocab]
        loss = loss_fn(s_logits, t_logits, keep, temperature=temperature, reduction="sum", **loss_kwargs)
        return loss, int(keep.sum())

    return step


def _batch_indices(num_blocks: int, step: int, global_batch: int, seed: int) -> torch.Tensor:
    """Indices of the blocks used at optimizer step ``step``: a per-epoch seeded permutation, so the data
    position is a pure function of the step (exact resume, deterministic sharding)."""
    start = step * global_batch
    idx = []
    while len(idx) < global_batch:
        epoch, offset = divmod(start + len(idx), num_blocks)
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        perm = torch.randperm(num_blocks, generator=g)
        take = min(global_batch - len(idx), num_blocks - offset)
        idx.extend(perm[offset : offset + take].tolist())
    return torch.tensor(idx)


def _state_dict_copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of every tensor of the state dict (tied weights become separate copies, safetensors-safe)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}


def _score(value) -> float:
    """A selection score; NaN or None (e.g. no verify step) ranks below every number."""
    return -math.inf if value is None or value != value else float(value)


def _trim_log(path: Path, step: int) -> None:
    """Drop records after ``step`` (written by a run killed after its last checkpoint; they are replayed)."""
    if not path.exists():
        return
    keep = [l for l in path.read_text().splitlines() if l.strip() and json.loads(l).get("step", 0) <= step]
    path.write_text("".join(l + "\n" for l in keep))


@contextmanager
def torch_threads(n: int):
    """Run the block with ``n`` torch CPU threads (``n = 0``: unchanged), restoring the previous count after."""
    prev = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def _with_cfg_threads(fn):
    """Run a ``(student, blocks, out_dir, cfg, ...)`` function with ``cfg.num_threads`` torch threads."""

    @functools.wraps(fn)
    def wrapper(student, blocks, out_dir, cfg, *args, **kwargs):
        with torch_threads(cfg.num_threads):
            return fn(student, blocks, out_dir, cfg, *args, **kwargs)

    return wrapper


@_with_cfg_threads
def train(
    student: torch.nn.Module,
    blocks: torch.Tensor,
    out_dir: str | os.PathLike,
    cfg: TrainerConfig,
    step_loss: StepLoss = cross_entropy_step,
    *,
    teacher: Any = None,
    seed: int = 0,
    desc: str = "train",
    on_step: Callable[[int, dict], None] | None = None,
    batch_hook: BatchHook | None = None,
    evaluate: EvalFn | None = None,
    eval_every: int = 0,
    select_key: str = "mean_accepted_length",
    on_eval: Callable[[int, dict], None] | None = None,
) -> dict:
    """Train ``student`` on token ``blocks`` (N, T) for ``cfg.max_steps`` optimizer steps (or until
    ``cfg.max_time_s`` seconds of training-loop wall clock have passed, checked at step boundaries; time spent in
    the ``evaluate`` callback does not count). With ``cfg.schedule_over="time"`` the cosine decay follows the spent
    fraction of that budget (see :func:`cosine_with_warmup`), so a budget-stopped run still anneals.

    Args:
        student: the model to train (all its parameters, and only them, go into the optimizer).
        blocks: LongTensor (N, T) of packed token blocks.
        out_dir: stage folder; holds ``checkpoint-last`` (resumable state) and ``train_log.jsonl``.
        step_loss: returns (summed loss, token count) for one micro-batch, see :data:`StepLoss`.
        teacher: passed to ``step_loss``; an ``nn.Module`` teacher is kept in eval mode, frozen and never in the
            optimizer; anything else (e.g. a :class:`distill.teacher.TeacherCache`) is passed through.
        on_step: called after each logged optimizer step with (step, log record); may add keys to the record.
        batch_hook: may replace each micro-batch, see :data:`BatchHook`.
        evaluate: scores the student (see :data:`EvalFn`); run every ``eval_every`` steps and, when that ran at
            least once, at the last step. The best weights by ``select_key`` (higher is better; ties keep the
            earlier step) are restored into ``student`` before returning; a run shorter than ``eval_every`` is not
            evaluated and keeps its last weights. Runs on every process (it must be deterministic, e.g. greedy).
        on_eval: called with (step, eval record) after each evaluation.

    Returns:
        dict with ``final_loss`` (mean loss per token of the last logged window), ``steps`` (optimizer steps
        done), ``train_time_s`` (training-loop wall clock in seconds, summed over resumed parts, without the
        selection evaluations: the clock ``cfg.max_time_s`` budgets), ``selection_eval_s`` (those evaluations),
        ``tokens_seen``,
        ``stopped_early`` (``"max_time_s"`` or None), ``best`` ({``step``, ``metrics``} or None), ...

    Raises:
        FloatingPointError: the loss became NaN/inf; the message names the step, the last good checkpoint stays.
        ValueError: ``eval_every < 0``, or ``evaluate`` did not return ``select_key``.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from safetensors.torch import load_file

    if eval_every < 0:
        raise ValueError(f"eval_every must be >= 0 (0 disables evaluation), got {eval_every}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(gradient_accumulation_steps=1, mixed_precision=cfg.mixed_precision)
    set_seed(seed)
    if isinstance(teacher, torch.nn.Module):
        teacher.eval().requires_grad_(False)
        teacher.to(accelerator.device)
    student.train()
    optimizer = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    clock = {"t0": time.perf_counter()}  # start of the budget clock (moved past resumed parts and evaluations)

    def time_progress() -> float:
        if cfg.schedule_over != "time":
            return 0.0
        return min(1.0, (time.perf_counter() - clock["t0"]) / cfg.max_time_s)

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: cosine_with_warmup(s, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio, time_progress())
    )
    student, optimizer, scheduler = accelerator.prepare(student, optimizer, scheduler)
    raw_student = accelerator.unwrap_model(student)

    ckpt = out_dir / "checkpoint-last"
    state: dict = {"step": 0, "elapsed_s": 0.0, "tokens_seen": 0, "final_loss": None, "best": None,
                   "last_eval_step": None, "stopped_early": None, "selection_eval_s": 0.0}
    best_weights: dict[str, torch.Tensor] | None = None
    if cfg.resume and (ckpt / "trainer_state.json").exists():
        accelerator.load_state(str(ckpt))
        state.update(json.loads((ckpt / "trainer_state.json").read_text()))
        state["stopped_early"] = None  # a new budget (or none) applies to the continuation
        if state["best"] is not None and (ckpt / "best_model.safetensors").exists():
            best_weights = load_file(str(ckpt / "best_model.safetensors"))
        log.info("resumed %s from step %d", desc, state["step"])
    elif cfg.resume:
        log.warning("%s: trainer.resume=true but no checkpoint in %s (checkpoints are written every "
                    "trainer.save_every=%d steps); starting from step 0", desc, ckpt, cfg.save_every)
    start_step = state["step"]

    world, rank = accelerator.num_processes, accelerator.process_index
    global_batch = cfg.micro_batch_size * cfg.grad_accum_steps * world  # sequences per optimizer step
    log_path = out_dir / "train_log.jsonl"
    if accelerator.is_main_process:
        if start_step == 0:
            log_path.unlink(missing_ok=True)
        else:
            _trim_log(log_path, start_step)

    def write_log(rec: dict) -> None:
        if accelerator.is_main_process:
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    def run_eval(done: int, last_loss: float | None) -> None:
        nonlocal best_weights
        raw_student.eval()
        t_eval = time.perf_counter()
        with torch.no_grad():
            metrics = dict(evaluate(raw_student))
        raw_student.train()
        if select_key not in metrics:
            raise ValueError(f"{desc}: the evaluation returned {sorted(metrics)}, without {select_key!r}")
        best = state["best"]
        if best is None or _score(metrics[select_key]) > _score(best["metrics"][select_key]):
            state["best"] = {"step": done, "metrics": metrics}
            best_weights = _state_dict_copy(raw_student)
        state["last_eval_step"] = done
        eval_s = time.perf_counter() - t_eval
        clock["t0"] += eval_s  # selection evaluations are not training: they don't spend the budget
        state["selection_eval_s"] = state.get("selection_eval_s", 0.0) + eval_s
        rec = {"kind": "eval", "step": done, "loss": last_loss, **metrics, "eval_time_s": eval_s,
               "best_step": state["best"]["step"]}
        write_log(rec)
        if on_eval is not None:
            on_eval(done, rec)

    window_loss, window_tokens = 0.0, 0
    clock["t0"] = time.perf_counter() - float(state["elapsed_s"])  # the budget counts every resumed part
    last_loss: float | None = None
    bar = tqdm(total=cfg.max_steps, desc=desc, initial=start_step, disable=not accelerator.is_main_process,
               dynamic_ncols=True)
    step = start_step
    while step < cfg.max_steps:
        if cfg.max_time_s and time.perf_counter() - clock["t0"] >= cfg.max_time_s:
            state["stopped_early"] = "max_time_s"
            log.info("%s: wall-clock budget trainer.max_time_s=%.0f s reached after %d steps", desc, cfg.max_time_s,
                     step)
            break
        idx = _batch_indices(blocks.size(0), step, global_batch, seed)  # (global_batch,)
        # This process's share, then split into micro-batches: (world*accum*mb) -> accum x (mb,)
        mine = idx.view(world, -1)[rank].view(cfg.grad_accum_steps, cfg.micro_batch_size)
        micro = []
        for j, m in enumerate(mine):
            batch = MicroBatch.from_blocks(blocks[m].to(accelerator.device), m)
            if batch_hook is not None:
                batch = batch_hook(batch, step, rank * cfg.grad_accum_steps + j, raw_student)
            micro.append(batch)
        # Global token count of this optimizer step (all processes, all micro-batches).
        local_tokens = torch.tensor(0.0, device=accelerator.device)
        losses = []
        for batch in micro:
            with accelerator.autocast():
                loss_sum, n_tok = step_loss(student, teacher, batch)
            losses.append(loss_sum)
            local_tokens += n_tok
        global_tokens = accelerator.reduce(local_tokens.clone(), reduction="sum").clamp_min(1.0)
        step_loss_sum = torch.stack([l.detach().float() for l in losses]).sum()
        if not torch.isfinite(step_loss_sum):
            raise FloatingPointError(
                f"{desc}: loss is {step_loss_sum.item()} at step {step}; stopped. The last good checkpoint "
                f"({ckpt if ckpt.exists() else 'none yet'}) is kept. Lower trainer.lr or check the data."
            )
        # DDP averages gradients over processes; scale by world so the sum over processes / global tokens results.
        for l in losses:
            accelerator.backward(l * world / global_tokens)
        if cfg.max_grad_norm > 0:
            accelerator.clip_grad_norm_(student.parameters(), cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        global_loss_sum = accelerator.reduce(step_loss_sum.clone(), reduction="sum").item()
        n_global = int(global_tokens.item())
        last_loss = global_loss_sum / max(1, n_global)
        window_loss += global_loss_sum
        window_tokens += n_global
        state["tokens_seen"] += n_global
        step = done = step + 1
        state["step"] = done
        state["elapsed_s"] = time.perf_counter() - clock["t0"]
        bar.update(1)
        if done % cfg.log_every == 0 or done == cfg.max_steps:
            state["final_loss"] = window_loss / max(1, window_tokens)
            record = {"kind": "train", "step": done, "loss": state["final_loss"],
                      "lr": scheduler.get_last_lr()[0], "tokens_seen": state["tokens_seen"],
                      "elapsed_s": state["elapsed_s"]}
            window_loss, window_tokens = 0.0, 0
            if on_step is not None:
                on_step(done, record)
            bar.set_postfix(loss=f"{record['loss']:.3f}")
            write_log(record)
        if evaluate is not None and eval_every and done % eval_every == 0:
            run_eval(done, last_loss)
        if cfg.save_every and done % cfg.save_every == 0 and done < cfg.max_steps:
            save_checkpoint(accelerator, ckpt, state, best_weights)
    bar.close()
    if evaluate is not None and state["last_eval_step"] not in (None, step):
        run_eval(step, last_loss)  # once selection is on, the last weights compete too
    state["elapsed_s"] = time.perf_counter() - clock["t0"]
    accelerator.wait_for_everyone()
    save_checkpoint(accelerator, ckpt, state, best_weights)
    if best_weights is not None:
        raw_student.load_state_dict(best_weights)
    raw_student.eval()
    return {"final_loss": state["final_loss"], "steps": step, "max_steps": cfg.max_steps,
            "train_time_s": state["elapsed_s"], "selection_eval_s": state.get("selection_eval_s", 0.0),
            "tokens_seen": state["tokens_seen"],
            "global_batch_sequences": global_batch, "resumed_from_step": start_step,
            "stopped_early": state["stopped_early"], "best": state["best"], "config": asdict(cfg)}


def save_checkpoint(accelerator, ckpt: Path, state: dict, best_weights: dict[str, torch.Tensor] | None = None) -> None:
    """Resumable state (``state["step"]`` etc.), written atomically: a killed save leaves the previous checkpoint
    intact. ``best_weights`` (the selected weights so far) go to ``best_model.safetensors`` beside it."""
    from safetensors.torch import save_file

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with atomic_dir(ckpt) as tmp:
            accelerator.save_state(str(tmp), safe_serialization=True)
            if best_weights is not None:
                save_file(best_weights, str(tmp / "best_model.safetensors"))
            write_json_atomic(tmp / "trainer_state.json", state)
    accelerator.wait_for_everyone()


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats per token) of ``model`` over ``blocks`` (N, T)."""
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for i in range(0, blocks.size(0), batch_size):
        x = blocks[i : i + batch_size].to(device)
        m = torch.ones_like(x)
        total += causal_lm_loss_sum(model(input_ids=x, attention_mask=m).logits, x, m).item()
        count += int(m[:, 1:].sum())
    return total / max(1, count)
