"""The ``trainer`` config section (:class:`TrainerConfig`): optimisation, checkpoint interval, wall-clock budget and
scale-out strategy of every training run (reference target, distilled / baseline drafts, LoRA adapters), and the
learning-rate schedule those settings describe (:func:`cosine_with_warmup`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

STRATEGIES = ("single", "ddp", "deepspeed_zero2", "deepspeed_zero3")


def zero_stage(strategy: str) -> int | None:
    """The DeepSpeed ZeRO stage a ``trainer.strategy`` runs under (2 or 3), None for ``single`` / ``ddp``."""
    return {"deepspeed_zero2": 2, "deepspeed_zero3": 3}.get(strategy)


@dataclass
class TrainerConfig:
    """Optimisation settings (the ``trainer`` config group). Steps count optimizer updates."""

    max_steps: int = 300
    micro_batch_size: int = 16  # sequences per micro-batch per process
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    lr: float = 3e-3
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
    num_threads: int = 0  # torch CPU threads while training; 0: the cores other processes leave free, re-measured
    # Scale-out. strategy must match how the run was launched (conf/accelerate/<strategy>.yaml).
    strategy: str = "single"  # single | ddp | deepspeed_zero2 | deepspeed_zero3
    global_batch_size: int = 0  # sequences per optimizer step over all processes (0: micro x accum x processes)
    gradient_checkpointing: bool = False  # recompute the student's activations in backward (less memory)
    teacher_placement: str = "replicate"  # replicate | zero3 (own ZeRO-3 inference engine; deepspeed_zero3 only)

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
            raise ValueError(f"trainer.num_threads must be >= 0 (0: the cores other processes leave free), got "
                             f"{self.num_threads}")
        if not self.max_time_s >= 0:
            raise ValueError(f"trainer.max_time_s must be >= 0 seconds (0 disables the budget), got {self.max_time_s}")
        if self.schedule_over not in ("steps", "time"):
            raise ValueError(f"trainer.schedule_over must be steps or time, got {self.schedule_over!r}")
        if self.schedule_over == "time" and not self.max_time_s > 0:
            raise ValueError("trainer.schedule_over=time needs a wall-clock budget: set trainer.max_time_s > 0 "
                             "(or use trainer.schedule_over=steps)")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError(f"trainer.mixed_precision must be no, bf16 or fp16, got {self.mixed_precision!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"trainer.strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.teacher_placement not in ("replicate", "zero3"):
            raise ValueError(f"trainer.teacher_placement must be replicate or zero3, got {self.teacher_placement!r}")
        if self.teacher_placement == "zero3" and self.strategy != "deepspeed_zero3":
            raise ValueError("trainer.teacher_placement=zero3 needs trainer=deepspeed_zero3 (the teacher's own ZeRO-3 "
                             f"engine), got trainer.strategy={self.strategy}; use teacher_placement=replicate")
        if self.global_batch_size < 0:
            raise ValueError(f"trainer.global_batch_size must be >= 0 (0: micro_batch_size x grad_accum_steps x "
                             f"processes), got {self.global_batch_size}")
        if self.global_batch_size:
            if self.grad_accum_steps != 1:
                raise ValueError("set either trainer.global_batch_size (accumulation is then computed per process "
                                 f"count) or trainer.grad_accum_steps, not both (got {self.grad_accum_steps})")
            if self.global_batch_size % self.micro_batch_size:
                raise ValueError(f"trainer.global_batch_size ({self.global_batch_size}) must be a multiple of "
                                 f"trainer.micro_batch_size ({self.micro_batch_size})")

    def accumulation_steps(self, num_processes: int) -> int:
        """Micro-batches per process per optimizer step for ``num_processes`` processes.

        ``global_batch_size = micro_batch_size x num_processes x accumulation`` when ``global_batch_size`` is set;
        else ``grad_accum_steps``.

        Raises:
            ValueError: ``global_batch_size`` is not divisible by ``micro_batch_size x num_processes``.
        """
        if not self.global_batch_size:
            return self.grad_accum_steps
        per_step = self.micro_batch_size * num_processes
        if self.global_batch_size % per_step:
            raise ValueError(
                f"trainer.global_batch_size={self.global_batch_size} is not divisible by trainer.micro_batch_size "
                f"({self.micro_batch_size}) x processes ({num_processes}) = {per_step}; choose a global batch that is "
                f"a multiple of {per_step}, or a micro_batch_size that divides {self.global_batch_size // num_processes}"
                if self.global_batch_size % num_processes == 0 else
                f"trainer.global_batch_size={self.global_batch_size} is not divisible by trainer.micro_batch_size "
                f"({self.micro_batch_size}) x processes ({num_processes}) = {per_step}; use a multiple of {per_step}")
        return self.global_batch_size // per_step

    def global_batch(self, num_processes: int) -> int:
        """Sequences per optimizer step over all processes."""
        return self.micro_batch_size * self.accumulation_steps(num_processes) * num_processes


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
