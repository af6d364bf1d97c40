"""One training loop for every stage: reference-target pretraining, the cross-entropy baseline and distillation.

The loop runs on ``accelerate`` (one process here; several under ``accelerate launch``). Loss normalisation is
explicit: each micro-batch returns a *summed* loss over its counted tokens, and the optimizer step divides by the
global token count of the whole step, so the update does not depend on how a batch is split into micro-batches
(docs/architecture.md, "Conventions"; tested for 8x1 / 4x2 / 2x4 splits).

Data: the optimizer step ``s`` uses the blocks :func:`_batch_indices` picks for ``s`` (a pure function of the step
and seed). A ``batch_hook`` may replace a micro-batch (on-policy distillation swaps in the draft's own
generations); it receives the step and micro-batch index so its randomness is a pure function of them too.

Checkpoints (``accelerate.save_state``: model, optimizer, scheduler, RNG) plus ``trainer_state.json`` (step,
elapsed seconds, tokens seen, the best evaluation so far) and the best weights are written atomically to
``<out_dir>/checkpoint-last``; with ``resume=True`` training continues from there and ends with the same weights
as an uninterrupted run (tested with a real ``kill -9``).

Scale-out (``trainer.strategy``): the same loop runs on one process, under DDP, or under DeepSpeed ZeRO-2/3 when
started with ``accelerate launch --config_file conf/accelerate/<strategy>.yaml``. The global batch
(``trainer.global_batch_size``) is split into per-process micro-batches and accumulation steps, so the sequences of
every optimizer step, and hence the loss curve, do not depend on the process count; each process takes its
contiguous share of the step's block indices. The frozen teacher is replicated, or (ZeRO-3,
``trainer.teacher_placement=zero3``) runs in its own DeepSpeed inference engine. Checkpoints are collective
(DeepSpeed writes one partition per process); the selected weights are gathered on the main process.

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from data.devices import torch_threads
from data.io import atomic_dir, write_json_atomic

log = logging.getLogger(__name__)


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
    num_threads: int = 0  # torch CPU threads while training (0: torch's setting); 1: fastest for tiny models
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


STRATEGIES = ("single", "ddp", "deepspeed_zero2", "deepspeed_zero3")


def _launch_kwargs() -> dict:
    """``Accelerator``/``PartialState`` arguments for how this process was launched.

    Without a GPU, a multi-process launch needs help: DDP runs as accelerate's MULTI_CPU (``cpu=True``, gloo) and
    DeepSpeed needs the gloo backend named (accelerate would otherwise treat it as one process).

    Raises:
        ValueError: more processes on this machine (``LOCAL_WORLD_SIZE``) than visible CUDA devices (NCCL needs one
            GPU per rank); the message names both fixes.
    """
    import torch.cuda

    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1 or os.environ.get("LOCAL_RANK") is not None
    if torch.cuda.is_available() and multi:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        if local > torch.cuda.device_count():  # NCCL would put two ranks on one GPU and fail or hang
            raise ValueError(f"{local} processes on this machine but only {torch.cuda.device_count()} visible CUDA "
                             f"device(s): launch at most one process per GPU (--num_processes), or run on CPU with "
                             f"CUDA_VISIBLE_DEVICES= (gloo)")
    if torch.cuda.is_available() or not multi:
        return {}
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        from accelerate.utils import InitProcessGroupKwargs

        return {"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}
    return {"cpu": True}


def distributed_state():
    """The process's :class:`accelerate.PartialState` (initialises the process group under ``accelerate launch``)."""
    from accelerate import PartialState

    kw = _launch_kwargs()
    return PartialState(cpu=kw.get("cpu", False),
                        **({"backend": "gloo"} if "kwargs_handlers" in kw else {}))


def check_launch(cfg: "TrainerConfig", num_processes: int, uses_deepspeed: bool, zero_stage: int | None) -> None:
    """``trainer.strategy`` must match how the run was launched (checked before any model loads).

    Raises:
        ValueError: naming the strategy, the launch and the ``accelerate launch --config_file`` that fits.
    """
    fix = f"accelerate launch --config_file conf/accelerate/{cfg.strategy}.yaml -m train ... trainer={cfg.strategy}"
    if cfg.strategy.startswith("deepspeed"):
        want = 2 if cfg.strategy == "deepspeed_zero2" else 3
        if not uses_deepspeed:
            raise ValueError(f"trainer.strategy={cfg.strategy} but this run was not launched with DeepSpeed; start it "
                             f"with `{fix}`")
        if zero_stage != want:
            raise ValueError(f"trainer.strategy={cfg.strategy} but the DeepSpeed config has ZeRO stage {zero_stage}; "
                             f"start it with `{fix}`")
    elif uses_deepspeed:
        raise ValueError(f"this run was launched with DeepSpeed (ZeRO stage {zero_stage}) but trainer.strategy="
                         f"{cfg.strategy}; add trainer=deepspeed_zero{zero_stage}")
    elif cfg.strategy == "single" and num_processes > 1:
        raise ValueError(f"trainer.strategy=single but {num_processes} processes were launched; add trainer=ddp")
    cfg.accumulation_steps(num_processes)


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


def causal_lm_loss_sum(student_logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor,
                       model: torch.nn.Module | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy. student_logits (B,T,V), input_ids (B,T), mask (B,T) -> scalar.

    Position t predicts token t+1; the last position has no label and is dropped. ``model`` with a trimmed draft
    vocabulary (:mod:`data.draft_vocab`): ``student_logits`` are its ``(B, T, N)`` kept logits, labels are mapped to
    them and labels outside the kept set are not counted.
    """
    from data.draft_vocab import draft_labels

    logits = student_logits[:, :-1].float()  # (B, T-1, V)
    labels = input_ids[:, 1:].masked_fill(~mask[:, 1:].bool(), -100)  # (B, T-1)
    if model is not None:
        labels = draft_labels(model, labels)
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
        generated: BoolTensor (B,): ``True`` for rows the draft generated (on-policy; no cached teacher entry, the
            block_index entry of such a row is the block its prompt came from); ``None``: no generated row.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    block_index: torch.Tensor | None = None
    generated: torch.Tensor | None = None

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, block_index: torch.Tensor | None = None) -> "MicroBatch":
        """Every position of packed blocks (B, T) is real and counts."""
        return cls(blocks, torch.ones_like(blocks), torch.ones(blocks.shape, dtype=torch.bool, device=blocks.device),
                   block_index)

    def counted(self) -> torch.Tensor:
        """BoolTensor (B, T): positions whose prediction counts (loss mask on real tokens)."""
        return self.loss_mask.bool() & self.attention_mask.bool()


# A step loss: (student, teacher or None, micro-batch) -> (summed loss over counted tokens, token count). The count
# must equal count_tokens(step_loss, batch): ``batch.counted().sum()`` unless the function carries a
# ``count_tokens(batch) -> int`` attribute.
StepLoss = Callable[[torch.nn.Module, Any, MicroBatch], "tuple[torch.Tensor, int]"]
# A batch hook: (micro-batch, optimizer step, micro-batch index within the step over all processes, unwrapped
# student) -> the micro-batch to train on. Must be a deterministic function of its arguments (and the seed it
# closed over) so resumed runs replay it exactly.
BatchHook = Callable[[MicroBatch, int, int, torch.nn.Module], MicroBatch]
# An evaluation: unwrapped student (eval mode, no grad) -> metrics, e.g. {"mean_accepted_length": 2.1, ...}.
EvalFn = Callable[[torch.nn.Module], dict]


def cross_entropy_step(student, teacher, batch: MicroBatch):
    """Summed next-token cross-entropy over positions t with ``counted()[t]`` and a real label at t+1 (a trimmed
    draft vocabulary: labels outside the kept set add nothing, :func:`data.draft_vocab.draft_labels`)."""
    from data.draft_vocab import draft_labels

    out = student(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    logits = out.logits[:, :-1].float()  # (B, T-1, V)
    keep = batch.counted()[:, :-1] & batch.attention_mask[:, 1:].bool()  # (B, T-1)
    labels = draft_labels(student, batch.input_ids[:, 1:].masked_fill(~keep, -100))  # (B, T-1); trimmed: kept ids
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="sum")
    return loss, int(keep.sum())


def _count_next_token_labels(batch: MicroBatch) -> int:
    return int((batch.counted()[:, :-1] & batch.attention_mask[:, 1:].bool()).sum())


cross_entropy_step.count_tokens = _count_next_token_labels


def count_tokens(step_loss: StepLoss, batch: MicroBatch) -> int:
    """Tokens ``step_loss`` counts on ``batch`` (its ``count_tokens`` attribute; default: ``batch.counted()``),
    known before the forward so the step's global token count can scale every micro-batch's backward."""
    fn = getattr(step_loss, "count_tokens", None)
    return int(fn(batch)) if fn is not None else int(batch.counted().sum())


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



def optimizer_parameters(optimizer) -> list[torch.nn.Parameter]:
    """The model parameters ``optimizer`` updates, looking through accelerate's and DeepSpeed's wrappers (ZeRO keeps
    the model's own parameters in ``bit16_groups`` (stages 1-2) or ``fp16_groups`` (stage 3) and flat fp32 copies in
    ``param_groups``)."""
    opt = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer / DeepSpeedOptimizerWrapper
    for attr in ("bit16_groups", "fp16_groups"):
        if hasattr(opt, attr):
            return [p for group in getattr(opt, attr) for p in group]
    return [p for group in opt.param_groups for p in group["params"]]


def _teacher_ds_config(cfg: TrainerConfig, accum: int) -> dict:
    """DeepSpeed config of the frozen teacher's own inference engine (ZeRO-3, no optimizer), as in accelerate's
    guide to several models with DeepSpeed (knowledge distillation: student ZeRO-2/3, teacher ZeRO-3).
    ``gradient_accumulation_steps`` equals the student's: preparing an engine sets the accelerator's."""
    return {"train_micro_batch_size_per_gpu": cfg.micro_batch_size, "gradient_accumulation_steps": accum,
            "bf16": {"enabled": cfg.mixed_precision == "bf16"}, "fp16": {"enabled": cfg.mixed_precision == "fp16"},
            "zero_optimization": {"stage": 3, "overlap_comm": False, "stage3_param_persistence_threshold": "auto",
                                  "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto"},
            "steps_per_print": 10**9}


@dataclass
class _Run:
    """The prepared training objects of one :func:`train` call."""

    accelerator: Any
    engine: Any  # what the loop calls: the module, its DDP wrapper or its DeepSpeed engine
    raw_student: torch.nn.Module  # the trained module (parameters partitioned under ZeRO-3)
    replica: torch.nn.Module | None  # ZeRO-3: the caller's full module; receives the gathered weights at the end
    teacher: Any
    optimizer: Any
    scheduler: Any
    accum: int  # micro-batches per process per optimizer step

    @property
    def keeps_best(self) -> bool:
        """Whether this process holds the selected weights (under ZeRO-3 only the main process gathers them)."""
        return self.replica is None or self.accelerator.is_main_process

    def main_value(self, obj):
        """The main process's ``obj`` on every process (so every process takes the same decision)."""
        if self.accelerator.num_processes == 1:
            return obj
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([obj], from_process=0)[0]

    def weights_copy(self) -> dict[str, torch.Tensor] | None:
        """CPU copy of the student's full state dict; under ZeRO-3 gathered (collective: call on every process)
        and returned on the main process only (None elsewhere)."""
        if self.replica is None:
            return _state_dict_copy(self.raw_student)
        sd = self.accelerator.get_state_dict(self.engine)  # ZeRO-3: all-gathers the partitions onto the main process
        if not self.accelerator.is_main_process:
            return None
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}

    def eval_model(self) -> torch.nn.Module | None:
        """The student to evaluate with full weights: the trained module itself, or under ZeRO-3 the caller's
        replica loaded with the gathered weights on the main process (None on the others; collective)."""
        if self.replica is None:
            return self.raw_student
        weights = self.weights_copy()
        if weights is None:
            return None
        self.replica.load_state_dict(weights)
        return self.replica

    def finish(self, has_best: bool, best_weights: dict[str, torch.Tensor] | None,
               gradient_checkpointing: bool) -> None:
        """Leave the caller's student holding the selected (else the last) weights, in eval mode. Under ZeRO-3 the
        caller's module is the unpartitioned replica, updated on the main process (which saves it)."""
        if self.replica is not None:
            final = best_weights if has_best else self.weights_copy()  # same branch on every process
            module = self.replica
            if final is not None:
                module.load_state_dict(final)
        else:
            module = self.raw_student
            if best_weights is not None:
                module.load_state_dict(best_weights)
        if gradient_checkpointing:
            module.gradient_checkpointing_disable()
        module.eval()


def _prepare_run(student: torch.nn.Module, teacher: Any, cfg: TrainerConfig,
                 lr_lambda: Callable[[int], float] | None = None) -> _Run:
    """Accelerator, optimizer (the student's parameters, exactly), schedule (``lr_lambda``: LR multiplier per
    optimizer step; default the cosine over ``cfg.max_steps``) and teacher placement for ``cfg``.

    Raises:
        ValueError: the launch does not match ``trainer.strategy`` or the global batch (see :func:`check_launch`);
            a DeepSpeed config that brings its own optimizer or scheduler; gradient checkpointing on a model
            without it.
        RuntimeError: the optimizer would hold anything but the student's parameters.
    """
    import copy

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, DistributedType

    state = distributed_state()
    accum = cfg.accumulation_steps(state.num_processes)
    uses_ds = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    plugins = None
    teacher_zero3 = uses_ds and cfg.teacher_placement == "zero3" and isinstance(teacher, torch.nn.Module)
    if teacher_zero3:
        plugins = {"student": DeepSpeedPlugin(), "teacher": DeepSpeedPlugin(hf_ds_config=_teacher_ds_config(cfg, accum))}
    kw = _launch_kwargs()
    # Each train() call is its own accelerate run (stages may differ in precision or DeepSpeed engines): start a
    # fresh AcceleratorState, keeping the process group (PartialState).
    AcceleratorState._reset_state(reset_partial_state=False)
    accelerator = Accelerator(gradient_accumulation_steps=accum, mixed_precision=cfg.mixed_precision,
                              step_scheduler_with_optimizer=False,  # our schedule counts optimizer steps, not samples
                              deepspeed_plugins=plugins, **kw)
    ds = accelerator.distributed_type == DistributedType.DEEPSPEED
    plugin = accelerator.state.deepspeed_plugin if ds else None
    check_launch(cfg, accelerator.num_processes, ds, plugin.zero_stage if ds else None)
    replica = None
    if ds:
        conf = plugin.deepspeed_config
        if "optimizer" in conf or "scheduler" in conf:
            raise ValueError("the DeepSpeed config names an optimizer or scheduler; the trainer builds AdamW and its "
                             "cosine schedule from the trainer section: remove them from the DeepSpeed JSON")
        conf.update(train_micro_batch_size_per_gpu=cfg.micro_batch_size, gradient_accumulation_steps=accum,
                    gradient_clipping=cfg.max_grad_norm)
        if plugin.zero_stage == 3:
            conf.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True
            # ZeRO-3 partitions parameters in place: train a copy, so the caller's module stays a full one that
            # holds the gathered weights for evaluation (the fast decoder reads weights directly) and saving.
            replica, student = student, copy.deepcopy(student)
    if cfg.gradient_checkpointing:
        if not getattr(student, "supports_gradient_checkpointing", False):
            raise ValueError(f"trainer.gradient_checkpointing=true but {type(student).__name__} does not support it")
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    teacher_params = set()
    if isinstance(teacher, torch.nn.Module):
        teacher.eval().requires_grad_(False)
        teacher_params = {id(p) for p in teacher.parameters()}
        if teacher_zero3:
            teacher = copy.deepcopy(teacher)  # partitioned in place; the caller's full copy serves the evaluations
            teacher_params |= {id(p) for p in teacher.parameters()}
        else:
            teacher.to(accelerator.device)  # replicated on every process
    student.train()
    trainable = [p for p in student.parameters() if p.requires_grad]  # e.g. only the LoRA adapters of a PeftModel
    if not trainable:
        raise ValueError("the student has no parameter that requires grad; nothing to train")
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    if lr_lambda is None:
        lr_lambda = lambda s: cosine_with_warmup(s, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    engine, optimizer, scheduler = accelerator.prepare(student, optimizer, scheduler)
    raw_student = accelerator.unwrap_model(engine)
    held = {id(p) for p in optimizer_parameters(optimizer)}
    if held != {id(p) for p in raw_student.parameters() if p.requires_grad} or held & teacher_params:
        raise RuntimeError("the optimizer must hold exactly the student's trainable parameters (and none of the "
                           "teacher's)")
    if teacher_zero3:
        # The teacher's own ZeRO-3 inference engine (no optimizer); the student's engine stays the one that
        # accelerator.backward steps. It is frozen, so it is left out of the resumable state.
        accelerator.state.select_deepspeed_plugin("teacher")
        teacher = accelerator.prepare(teacher)
        teacher.eval()
        accelerator._models.remove(teacher)
        accelerator.state.select_deepspeed_plugin("student")
        if accelerator.gradient_accumulation_steps != accum:
            raise RuntimeError(f"preparing the teacher changed the accumulation steps to "
                               f"{accelerator.gradient_accumulation_steps} (expected {accum})")
    return _Run(accelerator, engine, raw_student, replica, teacher, optimizer, scheduler, accum)


def _check_resumable(saved: dict, now: dict, ckpt: Path) -> None:
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
    deepspeed = was.startswith("deepspeed") or strategy.startswith("deepspeed")
    if deepspeed and (was != strategy or saved.get("num_processes", 1) != now["num_processes"]):
        raise ValueError(f"{ckpt} holds a {was} checkpoint of {saved.get('num_processes', 1)} process(es); resuming it "
                         f"as {strategy} on {now['num_processes']} is not supported (DeepSpeed partitions the optimizer "
                         f"state per process). Resume with trainer={was} on {saved.get('num_processes', 1)} "
                         f"process(es), or start a new run directory.")


def _score(value) -> float:
    """A selection score; NaN or None (e.g. no verify step) ranks below every number."""
    return -math.inf if value is None or value != value else float(value)


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


class BudgetClock:
    """The ``trainer.max_time_s`` clock: training-loop seconds, continued across resumed parts, paused during
    selection evaluations; every process follows the main process's reading (same stop step, same LR)."""

    def __init__(self, cfg: TrainerConfig, run: "_Run", elapsed_s: float = 0.0):
        self.cfg, self.run = cfg, run
        self.t0 = time.perf_counter() - elapsed_s
        self.shared_s = elapsed_s  # the last reading shared by all processes

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


def _resume(run: "_Run", cfg: TrainerConfig, ckpt: Path, state: TrainState, desc: str) -> dict | None:
    """Load ``ckpt`` into the prepared objects and ``state`` (with ``cfg.resume``); returns the selected weights
    saved with it (None when there are none or this process does not keep them).

    Raises:
        ValueError: a damaged checkpoint, or one that cannot resume under this launch (:func:`_check_resumable`).
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
    _check_resumable(saved, asdict(state), ckpt)
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


class CheckpointSelector:
    """Scores the student with ``evaluate`` and keeps a CPU copy of the best weights by ``select_key`` (higher is
    better; ties keep the earlier step). Evaluation time pauses the budget clock."""

    def __init__(self, run: "_Run", state: TrainState, clock: BudgetClock, evaluate: EvalFn, select_key: str,
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
            self.best_weights = _state_dict_copy(model) if model is not None else None
        self.state.last_eval_step = done
        eval_s = time.perf_counter() - t_eval
        self.clock.pause(eval_s)  # selection evaluations are not training: they don't spend the budget
        self.state.selection_eval_s += eval_s
        rec = {"kind": "eval", "step": done, "loss": last_loss, **metrics, "eval_time_s": eval_s,
               "best_step": self.state.best["step"]}
        self.write_log(rec)
        if self.on_eval is not None:
            self.on_eval(done, rec)


def _micro_batches(run: "_Run", cfg: TrainerConfig, blocks: torch.Tensor, step: int, seed: int,
                   batch_hook: BatchHook | None) -> list[MicroBatch]:
    """This process's micro-batches of optimizer step ``step`` (each of ``cfg.micro_batch_size`` blocks)."""
    acc, accum = run.accelerator, run.accum
    global_batch = cfg.micro_batch_size * accum * acc.num_processes
    idx = _batch_indices(blocks.size(0), step, global_batch, seed)  # (global_batch,)
    # This process's share, then split into micro-batches: (world*accum*mb) -> accum x (mb,)
    mine = idx.view(acc.num_processes, -1)[acc.process_index].view(accum, cfg.micro_batch_size)
    micro = []
    for j, m in enumerate(mine):
        batch = MicroBatch.from_blocks(blocks[m].to(acc.device), m)
        if batch_hook is not None:
            batch = batch_hook(batch, step, acc.process_index * accum + j, run.raw_student)
        micro.append(batch)
    return micro


def _precision_context(run: "_Run", cfg: TrainerConfig):
    """The teacher runs in the run's precision under every strategy: accelerate autocasts on one process / DDP;
    under DeepSpeed it does not (the student's engine holds bf16 weights, the teacher would run in fp32), so the
    step runs in torch.autocast there."""
    from accelerate.utils import DistributedType

    from data.devices import run_precision

    acc = run.accelerator
    if acc.distributed_type != DistributedType.DEEPSPEED or cfg.mixed_precision == "no":
        return acc.autocast()
    return run_precision(cfg.mixed_precision, acc.device)


def _optimizer_step(run: "_Run", cfg: TrainerConfig, clock: BudgetClock, micro: list[MicroBatch],
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
            with _precision_context(run, cfg):
                loss_sum, n_tok = step_loss(run.engine, run.teacher, batch)
            if n_tok != expected:
                raise RuntimeError(f"{desc}: the step loss counted {n_tok} tokens, count_tokens {expected}")
            if not torch.isfinite(loss_sum.detach()):
                raise FloatingPointError(_diverged(desc, f"loss is {loss_sum.item()}", step + 1, ckpt))
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
        student: the model to train (its parameters that require grad, and only them, go into the optimizer: all of a plain
            model, the adapters of a peft LoRA model). Under ZeRO-3 a
            copy is trained and ``student`` stays unpartitioned; it ends with the gathered weights on the main
            process (the one that saves).
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
            (:func:`_check_resumable`), a student without a parameter that requires grad.
    """
    from accelerate.utils import set_seed

    if eval_every < 0:
        raise ValueError(f"eval_every must be >= 0 (0 disables evaluation), got {eval_every}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    clock: BudgetClock | None = None  # set once the run is prepared; the schedule reads it from the first step
    run = _prepare_run(student, teacher, cfg, lambda s: cosine_with_warmup(
        s, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio, clock.progress() if clock else 0.0))
    acc = run.accelerator
    set_seed(seed)
    global_batch = cfg.micro_batch_size * run.accum * acc.num_processes  # sequences per optimizer step
    ckpt = out_dir / "checkpoint-last"
    state = TrainState(global_batch_sequences=global_batch, num_processes=acc.num_processes, strategy=cfg.strategy)
    best_weights = _resume(run, cfg, ckpt, state, desc)
    start_step = step = state.step
    clock = BudgetClock(cfg, run, state.elapsed_s)  # the budget counts every resumed part
    write_log = TrainLog(out_dir / "train_log.jsonl", start_step, acc.is_main_process)
    select = CheckpointSelector(run, state, clock, evaluate, select_key, desc, write_log, on_eval, best_weights) \
        if evaluate is not None else None
    window, last_loss = _LossWindow(), None
    # A budgeted run says so: its step total is only a cap, the budget usually ends it first.
    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=not acc.is_main_process, dynamic_ncols=True,
               desc=f"{desc} (stops at {cfg.max_time_s:.0f} s of training)" if cfg.max_time_s else desc)
    while step < cfg.max_steps:
        if clock.exhausted():
            state.stopped_early = "max_time_s"
            log.info("%s: wall-clock budget trainer.max_time_s=%.0f s reached after %d steps", desc, cfg.max_time_s,
                     step)
            break
        micro = _micro_batches(run, cfg, blocks, step, seed, batch_hook)
        loss_sum, n_tokens = _optimizer_step(run, cfg, clock, micro, step_loss, step, desc, ckpt)
        last_loss = loss_sum / max(1, n_tokens)
        window.add(loss_sum, n_tokens)
        state.tokens_seen += n_tokens
        step = state.step = step + 1
        state.elapsed_s = clock.elapsed()
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            state.final_loss = window.take()
            _log_step(run, state, step, on_step, bar, write_log)
        if select is not None and eval_every and step % eval_every == 0:
            select(step, last_loss)
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
            _check_finite_params(run.raw_student, desc, step, ckpt)  # never checkpoint diverged weights
            save_checkpoint(acc, ckpt, asdict(state), select.best_weights if select else best_weights)
    bar.close()
    if select is not None and state.last_eval_step not in (None, step):
        select(step, last_loss)  # once selection is on, the last weights compete too
    best_weights = select.best_weights if select else best_weights
    state.elapsed_s = clock.elapsed()
    acc.wait_for_everyone()
    _check_finite_params(run.raw_student, desc, step, ckpt)
    save_checkpoint(acc, ckpt, asdict(state), best_weights)
    run.finish(state.best is not None, best_weights, cfg.gradient_checkpointing)
    return _summary(run, cfg, state, start_step)


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


def _log_step(run: "_Run", state: TrainState, step: int, on_step, bar, write_log: "TrainLog") -> None:
    """One ``train`` log record (window loss, learning rate, tokens, elapsed seconds): to ``on_step`` (which may add
    keys), the progress bar and ``train_log.jsonl``."""
    record = {"kind": "train", "step": step, "loss": state.final_loss, "lr": run.scheduler.get_last_lr()[0],
              "tokens_seen": state.tokens_seen, "elapsed_s": state.elapsed_s}
    if on_step is not None:
        on_step(step, record)
    bar.set_postfix(loss=f"{record['loss']:.3f}")
    write_log(record)


def _summary(run: "_Run", cfg: TrainerConfig, state: TrainState, start_step: int) -> dict:
    """What :func:`train` returns (see its docstring)."""
    acc = run.accelerator
    return {"final_loss": state.final_loss, "steps": state.step, "max_steps": cfg.max_steps,
            "train_time_s": state.elapsed_s, "selection_eval_s": state.selection_eval_s,
            "tokens_seen": state.tokens_seen, "global_batch_sequences": state.global_batch_sequences,
            "num_processes": acc.num_processes, "grad_accum_steps": run.accum,
            "optimizer_parameters": sum(getattr(p, "ds_numel", p.numel()) for p in optimizer_parameters(run.optimizer)),
            "resumed_from_step": start_step, "stopped_early": state.stopped_early, "best": state.best,
            "config": asdict(cfg)}


def _diverged(desc: str, what: str, step: int, ckpt: Path) -> str:
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


def _check_finite_params(model: torch.nn.Module, desc: str, step: int, ckpt: Path) -> None:
    """Raise FloatingPointError when a parameter holds NaN/inf (an optimizer step overflowed): such weights are
    never saved over the last good checkpoint."""
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise FloatingPointError(_diverged(desc, f"weights became non-finite ({', '.join(bad[:3])})", step, ckpt))


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


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats per token) of ``model`` over ``blocks`` (N, T). A draft with a trimmed
    vocabulary (:mod:`data.draft_vocab`) is scored over the labels inside its kept set only (it gives the others
    probability 0)."""
    from data.draft_vocab import draft_labels, trimmed_logits

    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    with trimmed_logits(model):
        for i in range(0, blocks.size(0), batch_size):
            x = blocks[i : i + batch_size].to(device)
            m = torch.ones_like(x)
            total += causal_lm_loss_sum(model(input_ids=x, attention_mask=m).logits, x, m, model).item()
            count += int((draft_labels(model, x[:, 1:]) >= 0).sum())
    return total / max(1, count)
