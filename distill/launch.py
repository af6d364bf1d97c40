"""How a training run is launched and prepared: one process, DDP, or DeepSpeed ZeRO-2/3 under ``accelerate launch``.

:func:`uses_deepspeed` is the one answer to "does this run train under DeepSpeed" (the launch check, the process
group, the teacher's placement, the precision context all ask it). :func:`check_launch` compares the launch with
``trainer.strategy`` before any model loads; :func:`prepare_run` builds the accelerator, the optimizer over exactly
the student's trainable parameters, the schedule and the teacher's placement for one :func:`distill.trainer.train`
call (:class:`Run`).
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from distill.config import TrainerConfig, cosine_with_warmup, zero_stage


def uses_deepspeed(accelerator: Any = None) -> bool:
    """Whether this run trains under DeepSpeed: ``accelerator``'s distributed type once one exists, else the launch
    environment (``ACCELERATE_USE_DEEPSPEED=true``, what ``accelerate launch`` with a DeepSpeed config sets and
    what accelerate itself reads to choose DeepSpeed)."""
    if accelerator is not None:
        from accelerate.utils import DistributedType

        return accelerator.distributed_type == DistributedType.DEEPSPEED
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def launch_zero_stage() -> int | None:
    """The ZeRO stage of the DeepSpeed config this process was launched with (None outside DeepSpeed)."""
    if not uses_deepspeed():
        return None
    from accelerate.utils import DeepSpeedPlugin

    return DeepSpeedPlugin().zero_stage


def launch_kwargs() -> dict:
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
    if uses_deepspeed():
        from accelerate.utils import InitProcessGroupKwargs

        return {"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}
    return {"cpu": True}


def distributed_state():
    """The process's :class:`accelerate.PartialState` (initialises the process group under ``accelerate launch``)."""
    from accelerate import PartialState

    kw = launch_kwargs()
    return PartialState(cpu=kw.get("cpu", False),
                        **({"backend": "gloo"} if "kwargs_handlers" in kw else {}))


def check_launch(cfg: TrainerConfig, num_processes: int, deepspeed: bool, launched_stage: int | None) -> None:
    """``trainer.strategy`` must match how the run was launched (checked before any model loads): ``deepspeed``
    (:func:`uses_deepspeed`) with ZeRO stage ``launched_stage``, ``num_processes`` processes.

    Raises:
        ValueError: naming the strategy, the launch and the ``accelerate launch --config_file`` that fits.
    """
    fix = f"accelerate launch --config_file conf/accelerate/{cfg.strategy}.yaml -m train ... trainer={cfg.strategy}"
    want = zero_stage(cfg.strategy)
    if want is not None:
        if not deepspeed:
            raise ValueError(f"trainer.strategy={cfg.strategy} but this run was not launched with DeepSpeed; start it "
                             f"with `{fix}`")
        if launched_stage != want:
            raise ValueError(f"trainer.strategy={cfg.strategy} but the DeepSpeed config has ZeRO stage "
                             f"{launched_stage}; start it with `{fix}`")
    elif deepspeed:
        raise ValueError(f"this run was launched with DeepSpeed (ZeRO stage {launched_stage}) but trainer.strategy="
                         f"{cfg.strategy}; add trainer=deepspeed_zero{launched_stage}")
    elif cfg.strategy == "single" and num_processes > 1:
        raise ValueError(f"trainer.strategy=single but {num_processes} processes were launched; add trainer=ddp")
    cfg.accumulation_steps(num_processes)


def state_dict_copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
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


def teacher_ds_config(cfg: TrainerConfig, accum: int) -> dict:
    """DeepSpeed config of the frozen teacher's own inference engine (ZeRO-3, no optimizer), as in accelerate's
    guide to several models with DeepSpeed (knowledge distillation: student ZeRO-2/3, teacher ZeRO-3).
    ``gradient_accumulation_steps`` equals the student's: preparing an engine sets the accelerator's."""
    return {"train_micro_batch_size_per_gpu": cfg.micro_batch_size, "gradient_accumulation_steps": accum,
            "bf16": {"enabled": cfg.mixed_precision == "bf16"}, "fp16": {"enabled": cfg.mixed_precision == "fp16"},
            "zero_optimization": {"stage": 3, "overlap_comm": False, "stage3_param_persistence_threshold": "auto",
                                  "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto"},
            "steps_per_print": 10**9}


@dataclass
class Run:
    """The prepared training objects of one :func:`distill.trainer.train` call."""

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
            return state_dict_copy(self.raw_student)
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

    def precision(self, mixed_precision: str):
        """The teacher runs in the run's precision under every strategy: accelerate autocasts on one process / DDP;
        under DeepSpeed it does not (the student's engine holds bf16 weights, the teacher would run in fp32), so the
        step runs in torch.autocast there."""
        from core.runtime import run_precision

        if not uses_deepspeed(self.accelerator) or mixed_precision == "no":
            return self.accelerator.autocast()
        return run_precision(mixed_precision, self.accelerator.device)


def prepare_run(student: torch.nn.Module, teacher: Any, cfg: TrainerConfig,
                lr_lambda: Callable[[int], float] | None = None) -> Run:
    """Accelerator, optimizer (the student's parameters, exactly), schedule (``lr_lambda``: LR multiplier per
    optimizer step; default the cosine over ``cfg.max_steps``) and teacher placement for ``cfg``.

    Raises:
        ValueError: the launch does not match ``trainer.strategy`` or the global batch (see :func:`check_launch`);
            a DeepSpeed config that brings its own optimizer or scheduler; gradient checkpointing on a model
            without it; a student without a parameter that requires grad.
        RuntimeError: the optimizer would hold anything but the student's parameters.
    """
    accum = cfg.accumulation_steps(distributed_state().num_processes)
    teacher_zero3 = uses_deepspeed() and cfg.teacher_placement == "zero3" and isinstance(teacher, torch.nn.Module)
    accelerator = _accelerator(cfg, accum, teacher_zero3)
    student, replica = _deepspeed_student(accelerator, cfg, accum, student)
    if cfg.gradient_checkpointing:
        if not getattr(student, "supports_gradient_checkpointing", False):
            raise ValueError(f"trainer.gradient_checkpointing=true but {type(student).__name__} does not support it")
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    teacher, teacher_params = _frozen_teacher(teacher, accelerator, teacher_zero3)
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
        teacher = _teacher_engine(accelerator, teacher, accum)
    return Run(accelerator, engine, raw_student, replica, teacher, optimizer, scheduler, accum)


def _accelerator(cfg: TrainerConfig, accum: int, teacher_zero3: bool):
    """A fresh ``Accelerator`` for one train() call, checked against ``trainer.strategy`` (:func:`check_launch`)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    plugins = None
    if teacher_zero3:
        plugins = {"student": DeepSpeedPlugin(), "teacher": DeepSpeedPlugin(hf_ds_config=teacher_ds_config(cfg, accum))}
    # Each train() call is its own accelerate run (stages may differ in precision or DeepSpeed engines): start a
    # fresh AcceleratorState, keeping the process group (PartialState).
    AcceleratorState._reset_state(reset_partial_state=False)
    accelerator = Accelerator(gradient_accumulation_steps=accum, mixed_precision=cfg.mixed_precision,
                              step_scheduler_with_optimizer=False,  # our schedule counts optimizer steps, not samples
                              deepspeed_plugins=plugins, **launch_kwargs())
    ds = uses_deepspeed(accelerator)
    check_launch(cfg, accelerator.num_processes, ds, accelerator.state.deepspeed_plugin.zero_stage if ds else None)
    return accelerator


def _deepspeed_student(accelerator, cfg: TrainerConfig, accum: int, student: torch.nn.Module):
    """``(module to train, replica)``: under DeepSpeed the engine's config takes the trainer's batch and clipping;
    under ZeRO-3 a copy is trained and the caller's ``student`` is the replica (else None).

    Raises:
        ValueError: the DeepSpeed config brings its own optimizer or scheduler.
    """
    if not uses_deepspeed(accelerator):
        return student, None
    plugin = accelerator.state.deepspeed_plugin
    conf = plugin.deepspeed_config
    if "optimizer" in conf or "scheduler" in conf:
        raise ValueError("the DeepSpeed config names an optimizer or scheduler; the trainer builds AdamW and its "
                         "cosine schedule from the trainer section: remove them from the DeepSpeed JSON")
    conf.update(train_micro_batch_size_per_gpu=cfg.micro_batch_size, gradient_accumulation_steps=accum,
                gradient_clipping=cfg.max_grad_norm)
    if plugin.zero_stage != 3:
        return student, None
    conf.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True
    # ZeRO-3 partitions parameters in place: train a copy, so the caller's module stays a full one that holds the
    # gathered weights for evaluation (the fast decoder reads weights directly) and saving.
    return copy.deepcopy(student), student


def _frozen_teacher(teacher: Any, accelerator, teacher_zero3: bool) -> tuple[Any, set[int]]:
    """An ``nn.Module`` teacher in eval mode without grads, replicated on this process's device (or, for its own
    ZeRO-3 engine, a copy left to partition); returns it and the ids of its parameters (never in the optimizer).
    Anything else (a teacher cache, None) passes through."""
    if not isinstance(teacher, torch.nn.Module):
        return teacher, set()
    teacher.eval().requires_grad_(False)
    params = {id(p) for p in teacher.parameters()}
    if teacher_zero3:
        teacher = copy.deepcopy(teacher)  # partitioned in place; the caller's full copy serves the evaluations
        params |= {id(p) for p in teacher.parameters()}
    else:
        teacher.to(accelerator.device)  # replicated on every process
    return teacher, params


def _teacher_engine(accelerator, teacher: torch.nn.Module, accum: int):
    """The teacher's own ZeRO-3 inference engine (no optimizer); the student's engine stays the one that
    ``accelerator.backward`` steps. It is frozen, so it is left out of the resumable state.

    Raises:
        RuntimeError: preparing it changed the accumulation steps.
    """
    accelerator.state.select_deepspeed_plugin("teacher")
    teacher = accelerator.prepare(teacher)
    teacher.eval()
    accelerator._models.remove(teacher)
    accelerator.state.select_deepspeed_plugin("student")
    if accelerator.gradient_accumulation_steps != accum:
        raise RuntimeError(f"preparing the teacher changed the accumulation steps to "
                           f"{accelerator.gradient_accumulation_steps} (expected {accum})")
    return teacher
