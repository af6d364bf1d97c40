"""The ``draft`` and ``distill`` config sections (typed, range-checked).

The ``trainer`` config section (:class:`TrainerConfig`): optimisation, checkpoint interval, wall-clock budget and
scale-out strategy of every training run (reference target, distilled / baseline drafts, LoRA adapters), and the
learning-rate schedule those settings describe (:func:`cosine_with_warmup`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from distill.drafts import LayerChoice, LlamaArch

DRAFT_INITS = ("config", "layer_pruned", "pretrained", "eagle3")


MAX_TTT_STEPS = 16  # training-time test steps: time and activation memory grow linearly with them


@dataclass
class Eagle3Options:
    """``draft.eagle3``: an EAGLE-3 head (draft.init=eagle3; models/eagle3.py, distill/eagle3.py)."""

    # three hidden_states indices (layer inputs); null: (2, N // 2, N - 3)
    target_layers: list[int] | None = field(default=None, metadata={
        "example": "[2, 15, 27]", "example_note": "three layers in [1, N - 1] of an N-layer target; these for 30"})
    ttt_steps: int = 3  # training-time test: draft steps unrolled per position (EAGLE-3 Sec. 3.1)
    step_weight: float = 0.8  # loss weight of step j: step_weight ** j
    init: str = "target"  # target (the layer, norm and head rows from the target's) | random
    feature_norm: str = "none"  # channel: fc trains on features scaled to unit RMS per channel (folded when saved)
    train_lm_head: bool = True  # false: the head's output rows stay as initialised (the target's rows under init=target)

    def __post_init__(self):
        if (isinstance(self.ttt_steps, bool) or not isinstance(self.ttt_steps, int)
                or not 1 <= self.ttt_steps <= MAX_TTT_STEPS):
            raise ValueError(f"draft.eagle3.ttt_steps must be an int in [1, {MAX_TTT_STEPS}] (each step is one more "
                             f"forward and backward of the head per position; SpecForge's ttt_length is 7), got "
                             f"{self.ttt_steps!r}")
        if not 0 < float(self.step_weight) <= 1:
            raise ValueError(f"draft.eagle3.step_weight must be in (0, 1], got {self.step_weight!r}")
        if self.init not in ("target", "random"):
            raise ValueError(f"draft.eagle3.init must be target or random, got {self.init!r}")
        if self.feature_norm not in ("none", "channel"):
            raise ValueError(f"draft.eagle3.feature_norm must be none or channel, got {self.feature_norm!r}")
        if not isinstance(self.train_lm_head, bool):
            raise ValueError(f"draft.eagle3.train_lm_head must be true or false, got {self.train_lm_head!r}")
        if self.target_layers is not None and (len(self.target_layers) != 3 or len(set(self.target_layers)) != 3):
            raise ValueError(f"draft.eagle3.target_layers must name three different layers or be null, got "
                             f"{self.target_layers!r}")


@dataclass
class DraftConfig:
    # Where the draft starts (distill/draft_init.py): config (a fresh Llama of `arch` sharing the target tokenizer),
    # layer_pruned (a self-draft of some of the target's own layers, `layers`), pretrained (`name_or_path`).
    init: str = "config"
    arch: LlamaArch = field(default_factory=LlamaArch)
    layers: LayerChoice = field(default_factory=LayerChoice)  # layer_pruned only
    name_or_path: str | None = None  # pretrained only: HF directory or hub id (tokenizer must match the target's)
    eagle3: Eagle3Options = field(default_factory=Eagle3Options)  # eagle3 only
    quantize: str = "none"  # none | int8: also save <draft>_int8, quantized at load time (decode/fast_settings.py)
    # train the input embeddings (and the output head tied to them) too; false keeps the target's: at a real
    # vocabulary (49,152 x 576 for SmolLM2) they are most of a self-draft's weights, and freezing them halves the
    # step time (2-layer self-draft of SmolLM2, 8 x 128 tokens: 1.4 s vs 2.5 s per step on 2 cores)
    train_embeddings: bool = True
    # train a trimmed output head's rows (draft.draft_vocab_size set): null follows train_embeddings; true trains
    # only those N x E rows while the full embedding stays frozen (a trimmed head is its own copy, not tied)
    train_head: bool | None = None
    # a trimmed output head over the N ids the target emits most often in the training answers (null: the full
    # vocabulary); saved as a full-vocabulary export with the id map in specdraft.json (models/vocab.py)
    draft_vocab_size: int | None = None

    def __post_init__(self):
        from decode.fast_settings import QUANTIZE_MODES

        if self.draft_vocab_size is not None and (isinstance(self.draft_vocab_size, bool)
                                                  or not isinstance(self.draft_vocab_size, int)
                                                  or self.draft_vocab_size < 1):
            raise ValueError(f"draft.draft_vocab_size must be a positive number of kept token ids or null (the "
                             f"full vocabulary), got {self.draft_vocab_size!r}")

        if self.train_head is not None and self.draft_vocab_size is None:
            raise ValueError("draft.train_head applies to a trimmed head only: set draft.draft_vocab_size=N, or set "
                             "draft.train_head=null (+experiment=distill_med and selfdraft_med set it to true; a full "
                             "head is tied to the embeddings: draft.train_embeddings)")

        if self.init not in DRAFT_INITS:
            raise ValueError(f"draft.init must be one of {', '.join(DRAFT_INITS)}, got {self.init!r}")
        if self.init == "pretrained" and not self.name_or_path:
            raise ValueError("draft.init=pretrained needs draft.name_or_path=<HF model dir or hub id> (a causal LM "
                             "that uses the target's tokenizer)")
        if self.init != "pretrained" and self.name_or_path:
            raise ValueError(f"draft.name_or_path is only read with draft.init=pretrained (draft.init={self.init}); "
                             f"set draft=pretrained or drop draft.name_or_path")
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"draft.quantize must be one of {', '.join(QUANTIZE_MODES)}, got {self.quantize!r}")


@dataclass
class GenerationConfig:
    """Sampling settings for generated training data (``distill.generation``): the target's sequences
    (``data_source=teacher``) and the draft's on-policy sequences (``data_source=on_policy``)."""

    max_new_tokens: int = 64  # tokens generated per prompt / per on-policy sequence
    temperature: float = 1.0  # 0: greedy; else sampling (transformers order: temperature, top-k, top-p)
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # in (0, 1]; 1 disables
    max_prompts: int = 512  # teacher data: training prompts used (the first ones in hash order)
    max_prompt_tokens: int = 128  # teacher data: longer prompts keep their last tokens
    batch_size: int = 32  # teacher data: prompts generated together (left padded); also prompts per stored shard
    engine: str = "ours"  # teacher data: ours (our decoder, float32 target) | llama_cpp (llama-server, parallel slots)
    engine_slots: int = 8  # llama_cpp: requests decoded at once (llama-server -np)
    engine_target_format: str = "q8_0"  # llama_cpp: q8_0 | f16 | f32 export of the target, or source (its own GGUF file)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"distill.generation.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"distill.generation.temperature must be a finite number >= 0 (0 = greedy), got "
                             f"{self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"distill.generation.top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"distill.generation.top_p must be in (0, 1], got {self.top_p}")
        if self.engine not in ("ours", "llama_cpp"):
            raise ValueError(f"distill.generation.engine must be ours or llama_cpp, got {self.engine!r}")
        if self.engine_slots < 1:
            raise ValueError(f"distill.generation.engine_slots must be >= 1, got {self.engine_slots}")
        if self.engine_target_format not in ("source", "f32", "f16", "q8_0"):
            raise ValueError(f"distill.generation.engine_target_format must be source, f32, f16 or q8_0, got "
                             f"{self.engine_target_format!r}")
        if self.max_prompts < 1 or self.max_prompt_tokens < 2 or self.batch_size < 1:
            raise ValueError("distill.generation.max_prompts and batch_size must be >= 1, max_prompt_tokens >= 2")

    def sampling_kwargs(self) -> dict:
        """Keyword arguments for :func:`decode.autoregressive_generate` (greedy when ``temperature == 0``)."""
        if self.temperature == 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


@dataclass
class OnPolicySchedule:
    """When the draft's own samples mix in (``distill.on_policy_schedule``, ``data_source=on_policy`` only): a warm
    start. The first ``warmup_steps`` optimizer steps are off-policy only (``distill.off_policy_data``: dataset text
    or target generations), then the on-policy fraction rises linearly over ``ramp_steps`` steps to
    ``distill.on_policy_fraction`` and stays there. GKD (Agarwal et al. 2024) and DistillSpec (Zhou et al. 2024)
    sample from a student that already models the data; a draft trained from random weights on its own samples
    first learns from noise."""

    warmup_steps: int = 0  # steps with no on-policy rows
    ramp_steps: int = 0  # steps over which the fraction rises linearly to on_policy_fraction (0: at once)

    def __post_init__(self):
        if self.warmup_steps < 0 or self.ramp_steps < 0:
            raise ValueError(f"distill.on_policy_schedule.warmup_steps and ramp_steps must be >= 0, got "
                             f"{self.warmup_steps} and {self.ramp_steps}")

    def fraction(self, step: int, final: float) -> float:
        """The on-policy fraction lambda_s of optimizer step ``step`` (0-based) for the target fraction ``final``:
        0 for ``step < warmup_steps``, then ``final * min(1, (step - warmup_steps + 1) / ramp_steps)``."""
        if step < self.warmup_steps:
            return 0.0
        if self.ramp_steps == 0:
            return float(final)
        return float(final) * min(1.0, (step - self.warmup_steps + 1) / self.ramp_steps)


DATA_SOURCES = ("dataset", "teacher", "on_policy")
OFF_POLICY_DATA = ("dataset", "teacher")
TEACHER_SIGNALS = ("online", "cached")
BASELINE_BUDGETS = ("steps", "wall_clock")


@dataclass
class DistillConfig:
    loss: str = "forward_kl"  # forward_kl | reverse_kl | generalized_jsd | total_variation | skew_kl
    temperature: float = 1.0  # divides both logits; the loss is scaled by T^2
    beta: float = 0.5  # generalized_jsd only: 0 = forward KL, 1 = reverse KL
    skew: float = 0.1  # skew_kl only: lambda in KL(p || lambda p + (1 - lambda) q)
    # Training data of the distilled draft: dataset (fixed text, off-policy), teacher (sequences the target
    # generates from the domain's training prompts, stored once), on_policy (GKD: a share on_policy_fraction of each
    # micro-batch's rows are the draft's own continuations of the off-policy rows' prefixes, scored by the target;
    # with teacher_signal=cached the off-policy rows read the cache and only the draft's rows run the target).
    data_source: str = "dataset"
    on_policy_fraction: float = 0.5  # GKD's lambda, on_policy only: the share of each micro-batch's rows
    on_policy_schedule: OnPolicySchedule = field(default_factory=OnPolicySchedule)  # warm start, on_policy only
    # on_policy only: the rows that are not the draft's samples, and the prompts the draft continues: dataset text
    # or the target's generations (as data_source=teacher, with distill.generation)
    off_policy_data: str = "dataset"
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    # data_source=teacher: false counts only the positions whose next token the target generated (its answers), not
    # the prompts packed before them (torchtune's train_on_input, TRL's completion-only loss)
    train_on_prompts: bool = True
    # Sampling of the draft's on-policy continuations; null: distill.generation (set it when the teacher data of
    # off_policy_data=teacher needs other settings, e.g. greedy target data and sampled draft rows)
    on_policy_generation: GenerationConfig | None = None
    # Teacher signal: online (teacher forward in the loop) or cached (top-k logits stored on disk once; with
    # data_source=on_policy the draft's rows are still scored by the target's forward in the loop).
    teacher_signal: str = "online"
    cache_top_k: int = 32  # logits kept per position with teacher_signal=cached
    cache_shard_blocks: int = 256  # training blocks per cache shard
    cache_dir: str | None = None  # teacher cache + teacher data; null: <run dir>/teacher_cache
    # Closing the loop: acceptance on validation prompts selects the saved checkpoint.
    eval_every: int = 50  # optimizer steps between acceptance evaluations (0: off, the last weights are saved)
    eval_prompts: int = 8  # validation prompts of data.domain (hash order)
    eval_max_new_tokens: int = 32  # tokens generated per prompt (greedy, decode.num_draft_tokens)
    # The cross-entropy baseline's budget: steps (trainer.max_steps, like the distilled draft) or wall_clock (the
    # distilled draft's training time + its one-off teacher passes, with the LR schedule over that time and at most
    # baseline_max_steps steps; 0: 20 x trainer.max_steps).
    baseline_budget: str = "steps"
    baseline_max_steps: int = 0

    def __post_init__(self):
        from distill.losses import LOSSES

        if self.loss not in LOSSES:
            raise ValueError(f"unknown distill.loss {self.loss!r}; choose one of {', '.join(LOSSES)}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"distill.temperature must be a finite number > 0, got {self.temperature}")
        if not 0 <= self.beta <= 1 or not 0 <= self.skew <= 1:
            raise ValueError("distill.beta and distill.skew must be in [0, 1]")
        if self.data_source not in DATA_SOURCES:
            raise ValueError(f"distill.data_source must be one of {', '.join(DATA_SOURCES)}, got {self.data_source!r}")
        if self.teacher_signal not in TEACHER_SIGNALS:
            raise ValueError(f"distill.teacher_signal must be one of {', '.join(TEACHER_SIGNALS)}, "
                             f"got {self.teacher_signal!r}")
        if not 0 <= self.on_policy_fraction <= 1:
            raise ValueError(f"distill.on_policy_fraction must be in [0, 1], got {self.on_policy_fraction}")
        if self.cache_top_k < 1 or self.cache_shard_blocks < 1:
            raise ValueError("distill.cache_top_k and distill.cache_shard_blocks must be >= 1")
        if self.eval_every < 0 or self.eval_prompts < 1 or self.eval_max_new_tokens < 1:
            raise ValueError("distill.eval_every must be >= 0 (0 disables), distill.eval_prompts and "
                             "distill.eval_max_new_tokens >= 1")
        if self.baseline_budget not in BASELINE_BUDGETS:
            raise ValueError(f"distill.baseline_budget must be one of {', '.join(BASELINE_BUDGETS)}, "
                             f"got {self.baseline_budget!r}")
        if self.baseline_max_steps < 0:
            raise ValueError(f"distill.baseline_max_steps must be >= 0 (0: 20 x trainer.max_steps), "
                             f"got {self.baseline_max_steps}")
        if self.off_policy_data not in OFF_POLICY_DATA:
            raise ValueError(f"distill.off_policy_data must be one of {', '.join(OFF_POLICY_DATA)}, "
                             f"got {self.off_policy_data!r}")
        if not self.train_on_prompts and self.data_source != "teacher":
            raise ValueError(f"distill.train_on_prompts=false masks the prompts of the target's generated answers, "
                             f"so it needs distill.data_source=teacher (it is {self.data_source}); set "
                             f"distill.data_source=teacher or distill.train_on_prompts=true")
        if self.teacher_signal == "cached":
            if self.loss == "reverse_kl" or (self.loss == "generalized_jsd" and self.beta == 1):
                raise ValueError("reverse KL is infinite against a cached top-k teacher (the draft puts mass outside "
                                 "the stored top-k); use teacher_signal=online, or a loss that stays finite "
                                 "(forward_kl, generalized_jsd with beta < 1, total_variation, skew_kl).")

    @property
    def on_policy_gen(self) -> GenerationConfig:
        """Sampling settings of the draft's on-policy rows: ``on_policy_generation``, else ``generation``."""
        return self.on_policy_generation or self.generation

    @property
    def uses_teacher_data(self) -> bool:
        """Whether the training blocks are target generations (``data_source=teacher``, or ``on_policy`` with
        ``off_policy_data=teacher``)."""
        return self.data_source == "teacher" or (self.data_source == "on_policy" and self.off_policy_data == "teacher")

    def loss_kwargs(self) -> dict:
        return {"beta": self.beta} if self.loss == "generalized_jsd" else \
            {"skew": self.skew} if self.loss == "skew_kl" else {}


STRATEGIES = ("single", "ddp", "deepspeed_zero2", "deepspeed_zero3")


def zero_stage(strategy: str) -> int | None:
    """The DeepSpeed ZeRO stage a ``trainer.strategy`` runs under (2 or 3), None for ``single`` / ``ddp``."""
    return {"deepspeed_zero2": 2, "deepspeed_zero3": 3}.get(strategy)


@dataclass
class TrainerConfig:
    """Optimisation settings (the ``trainer`` config group). Steps count optimizer updates."""

    max_steps: int = 300
    # read only the first N training blocks of the epoch-0 order, as many times as max_steps needs (a data budget
    # of N blocks: the learning curve's sizes, several reads each); 0: every block
    unique_blocks: int = 0
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
    num_threads: int = 0  # torch CPU threads while training; 0: torch's count when the run starts (not the load)
    follow_free_cores: bool = False  # true: threads follow the free cores (faster on a shared machine; the
    # weights then depend on the load: the thread count changes the summation order)
    # Scale-out. strategy must match how the run was launched (conf/accelerate/<strategy>.yaml).
    strategy: str = "single"  # single | ddp | deepspeed_zero2 | deepspeed_zero3
    global_batch_size: int = 0  # sequences per optimizer step over all processes (0: micro x accum x processes)
    gradient_checkpointing: bool = False  # recompute the student's activations in backward (less memory)
    teacher_placement: str = "replicate"  # replicate | zero3 (own ZeRO-3 inference engine; deepspeed_zero3 only)

    def __post_init__(self):
        for name in ("max_steps", "micro_batch_size", "grad_accum_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.unique_blocks < 0:
            raise ValueError(f"trainer.unique_blocks must be >= 0 training blocks (0: every block), got "
                             f"{self.unique_blocks}")
        if not self.lr > 0:
            raise ValueError(f"trainer.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"trainer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.save_every < 0 or self.log_every < 1:
            raise ValueError("trainer.warmup_steps and trainer.save_every must be >= 0, trainer.log_every >= 1")
        if self.num_threads < 0:
            raise ValueError(f"trainer.num_threads must be >= 0 (0: torch's thread count when the run starts), got "
                             f"{self.num_threads}")
        if self.follow_free_cores and self.num_threads:
            raise ValueError(f"trainer.follow_free_cores=true takes the thread count from the free cores, but "
                             f"trainer.num_threads={self.num_threads} fixes it: set trainer.num_threads=0 to follow "
                             f"the free cores, or trainer.follow_free_cores=false to keep {self.num_threads} threads")
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
