"""One training loop for every stage: reference-target pretraining, the cross-entropy baseline and distillation.

The loop runs on ``accelerate`` (one process here; several under ``accelerate launch``). Loss normalisation is
explicit: each micro-batch returns a *summed* loss over its tokens, and the optimizer step divides by the global
token count of the whole step, so the update does not depend on how a batch is split into micro-batches
(DESIGN.md, style point 7).

Checkpoints (``accelerate.save_state``: model, optimizer, scheduler, RNG) and the data position (the step) are
written atomically to ``<out_dir>/checkpoint-last``; with ``resume=True`` training continues from there.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

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


def cosine_with_warmup(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def causal_lm_loss_sum(student_logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy. student_logits (B,T,V), input_ids (B,T), mask (B,T) -> scalar.

    Position t predicts token t+1; the last position has no label and is dropped.
    """
    logits = student_logits[:, :-1].float()  # (B, T-1, V)
    labels = input_ids[:, 1:].masked_fill(~mask[:, 1:].bool(), -100)  # (B, T-1)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="sum")


# A step loss: (student, teacher or None, input_ids (B,T), mask (B,T)) -> (summed loss, token count)
StepLoss = Callable[[torch.nn.Module, "torch.nn.Module | None", torch.Tensor, torch.Tensor], "tuple[torch.Tensor, int]"]


def cross_entropy_step(student, teacher, input_ids, mask):
    out = student(input_ids=input_ids, attention_mask=mask)
    return causal_lm_loss_sum(out.logits, input_ids, mask), int(mask[:, 1:].sum())


def make_distill_step(loss_fn, temperature: float, shared_vocab: int | None = None, **loss_kwargs) -> StepLoss:
    """A step loss for distillation: teacher forward under no_grad (eval mode), divergence ``loss_fn`` summed.

    ``loss_fn`` is a :mod:`distill.losses` function called with ``reduction="sum"``; logits are cut to the
    ``shared_vocab`` ids when the two models' embedding matrices are padded to different sizes.
    """

    def step(student, teacher, input_ids, mask):
        with torch.no_grad():
            t_logits = teacher(input_ids=input_ids, attention_mask=mask).logits  # (B, T, V_t)
        s_logits = student(input_ids=input_ids, attention_mask=mask).logits  # (B, T, V_s)
        if shared_vocab is not None:
            s_logits, t_logits = s_logits[..., :shared_vocab], t_logits[..., :shared_vocab]
        loss = loss_fn(s_logits, t_logits, mask.bool(), temperature=temperature, reduction="sum", **loss_kwargs)
        return loss, int(mask.sum())

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


def train(
    student: torch.nn.Module,
    blocks: torch.Tensor,
    out_dir: str | os.PathLike,
    cfg: TrainerConfig,
    step_loss: StepLoss = cross_entropy_step,
    *,
    teacher: torch.nn.Module | None = None,
    seed: int = 0,
    desc: str = "train",
    on_step: Callable[[int, dict], None] | None = None,
) -> dict:
    """Train ``student`` on token ``blocks`` (N, T) for ``cfg.max_steps`` optimizer steps.

    Args:
        student: the model to train (all its parameters, and only them, go into the optimizer).
        blocks: LongTensor (N, T) of packed token blocks.
        out_dir: stage folder; holds ``checkpoint-last`` (resumable state) and ``train_log.jsonl``.
        step_loss: returns (summed loss, token count) for one micro-batch, see :data:`StepLoss`.
        teacher: frozen model passed to ``step_loss`` (kept in eval mode, never in the optimizer).
        on_step: called after each optimizer step with (step, log record); may add keys to the record.

    Returns:
        dict with ``final_loss`` (mean loss per token of the last logged window), ``steps``, ``train_time_s``,
        ``tokens_seen``.

    Raises:
        FloatingPointError: the loss became NaN/inf; the message names the step, the last good checkpoint stays.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(gradient_accumulation_steps=1, mixed_precision=cfg.mixed_precision)
    set_seed(seed)
    if teacher is not None:
        teacher.eval().requires_grad_(False)
        teacher.to(accelerator.device)
    student.train()
    optimizer = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: cosine_with_warmup(s, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    )
    student, optimizer, scheduler = accelerator.prepare(student, optimizer, scheduler)

    ckpt = out_dir / "checkpoint-last"
    start_step = 0
    if cfg.resume and (ckpt / "trainer_state.json").exists():
        accelerator.load_state(str(ckpt))
        start_step = json.loads((ckpt / "trainer_state.json").read_text())["step"]
        log.info("resumed %s from step %d", desc, start_step)

    world, rank = accelerator.num_processes, accelerator.process_index
    global_batch = cfg.micro_batch_size * cfg.grad_accum_steps * world  # sequences per optimizer step
    log_path = out_dir / "train_log.jsonl"
    if start_step == 0 and accelerator.is_main_process:
        log_path.unlink(missing_ok=True)
    window_loss, window_tokens, tokens_seen = 0.0, 0, start_step * global_batch * blocks.size(1)
    t0 = time.perf_counter()
    record: dict = {}
    bar = tqdm(range(start_step, cfg.max_steps), desc=desc, initial=start_step, total=cfg.max_steps,
               disable=not accelerator.is_main_process, dynamic_ncols=True)
    for step in bar:
        idx = _batch_indices(blocks.size(0), step, global_batch, seed)  # (global_batch,)
        # This process's share, then split into micro-batches: (world*accum*mb) -> accum x (mb,)
        mine = idx.view(world, -1)[rank].view(cfg.grad_accum_steps, cfg.micro_batch_size)
        micro = [blocks[m].to(accelerator.device) for m in mine]
        masks = [torch.ones_like(x) for x in micro]
        # Global token count of this optimizer step (all processes, all micro-batches).
        local_tokens = torch.tensor(0.0, device=accelerator.device)
        losses = []
        for x, m in zip(micro, masks):
            with accelerator.autocast():
                loss_sum, n_tok = step_loss(student, teacher, x, m)
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

        global_loss_sum = accelerator.reduce(step_loss_sum.clone(), reduction="sum")
        window_loss += global_loss_sum.item()
        window_tokens += int(global_tokens.item())
        tokens_seen += int(global_tokens.item())
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.max_steps:
            record = {"step": done, "loss": window_loss / max(1, window_tokens), "lr": scheduler.get_last_lr()[0],
                      "tokens_seen": tokens_seen, "elapsed_s": time.perf_counter() - t0}
            window_loss, window_tokens = 0.0, 0
            if on_step is not None:
                on_step(done, record)
            bar.set_postfix(loss=f"{record['loss']:.3f}")
            if accelerator.is_main_process:
                with open(log_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
        if cfg.save_every and done % cfg.save_every == 0 and done < cfg.max_steps:
            save_checkpoint(accelerator, ckpt, done)
    accelerator.wait_for_everyone()
    save_checkpoint(accelerator, ckpt, cfg.max_steps)
    student = accelerator.unwrap_model(student)
    student.eval()
    return {"final_loss": record.get("loss"), "steps": cfg.max_steps, "train_time_s": time.perf_counter() - t0,
            "tokens_seen": tokens_seen, "global_batch_sequences": global_batch, "resumed_from_step": start_step,
            "config": asdict(cfg)}


def save_checkpoint(accelerator, ckpt: Path, step: int) -> None:
    """Resumable state at ``step``, written atomically (a killed save leaves the previous checkpoint intact)."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with atomic_dir(ckpt) as tmp:
            accelerator.save_state(str(tmp), safe_serialization=True)
            write_json_atomic(tmp / "trainer_state.json", {"step": step})
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
