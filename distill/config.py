"""The ``draft`` and ``distill`` config sections (typed, range-checked)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .models import LlamaArch
from .selfdraft import LayerChoice


DRAFT_INITS = ("config", "layer_pruned", "pretrained")


@dataclass
class DraftConfig:
    # Where the draft starts (distill/draft_init.py): config (a fresh Llama of `arch` sharing the target tokenizer),
    # layer_pruned (a self-draft of some of the target's own layers, `layers`), pretrained (`name_or_path`).
    init: str = "config"
    arch: LlamaArch = field(default_factory=LlamaArch)
    layers: LayerChoice = field(default_factory=LayerChoice)  # layer_pruned only
    name_or_path: str | None = None  # pretrained only: HF directory or hub id (tokenizer must match the target's)
    quantize: str = "none"  # none | int8: also save <draft>_int8, quantized at load time (decode/quantize.py)

    def __post_init__(self):
        from decode.quantize import QUANTIZE_MODES

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

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"distill.generation.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"distill.generation.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"distill.generation.top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"distill.generation.top_p must be in (0, 1], got {self.top_p}")
        if self.max_prompts < 1 or self.max_prompt_tokens < 2 or self.batch_size < 1:
            raise ValueError("distill.generation.max_prompts and batch_size must be >= 1, max_prompt_tokens >= 2")

    def sampling_kwargs(self) -> dict:
        """Keyword arguments for :func:`decode.autoregressive_generate` (greedy when ``temperature == 0``)."""
        if self.temperature == 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


DATA_SOURCES = ("dataset", "teacher", "on_policy")
TEACHER_SIGNALS = ("online", "cached")
BASELINE_BUDGETS = ("steps", "wall_clock")


@dataclass
class DistillConfig:
    loss: str = "forward_kl"  # forward_kl | reverse_kl | generalized_jsd | total_variation | skew_kl
    temperature: float = 1.0  # divides both logits; the loss is scaled by T^2
    beta: float = 0.5  # generalized_jsd only: 0 = forward KL, 1 = reverse KL
    skew: float = 0.1  # skew_kl only: lambda in KL(p || lambda p + (1 - lambda) q)
    # Training data of the distilled draft: dataset (fixed text, off-policy), teacher (sequences the target
    # generates from the domain's training prompts, stored once), on_policy (GKD: with probability
    # on_policy_fraction a micro-batch is the draft's own continuations of dataset prefixes, scored by the target).
    data_source: str = "dataset"
    on_policy_fraction: float = 0.5  # GKD's lambda, on_policy only
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    # Teacher signal: online (teacher forward in the loop) or cached (top-k logits stored on disk once).
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
        from .losses import LOSSES

        if self.loss not in LOSSES:
            raise ValueError(f"unknown distill.loss {self.loss!r}; choose one of {', '.join(LOSSES)}")
        if not self.temperature > 0:
            raise ValueError(f"distill.temperature must be > 0, got {self.temperature}")
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
        if self.teacher_signal == "cached":
            if self.data_source == "on_policy":
                raise ValueError("distill.teacher_signal=cached needs fixed training sequences; on-policy "
                                 "sequences are new every step. Use teacher_signal=online with data_source=on_policy.")
            if self.loss == "reverse_kl" or (self.loss == "generalized_jsd" and self.beta == 1):
                raise ValueError("reverse KL is infinite against a cached top-k teacher (the draft puts mass outside "
                                 "the stored top-k); use teacher_signal=online, or a loss that stays finite "
                                 "(forward_kl, generalized_jsd with beta < 1, total_variation, skew_kl).")

    def loss_kwargs(self) -> dict:
        return {"beta": self.beta} if self.loss == "generalized_jsd" else \
            {"skew": self.skew} if self.loss == "skew_kl" else {}
