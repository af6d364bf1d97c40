"""The typed source of truth for the config tree (``conf/``): one dataclass per group, with units and ranges.

Hydra composes the YAML files; :func:`validate` merges the result onto these dataclasses, which type-checks every
key and runs the range checks in ``__post_init__`` before any model is loaded. An unknown key is an error.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from distill.models import LlamaArch
from distill.reference import ReferenceConfig
from distill.trainer import TrainerConfig

KNOWN_STAGES = ("reference_target", "distill", "baseline", "eval")


@dataclass
class PathsConfig:
    project_root: str = "."
    output_root: str = "outputs"
    reference_target: str = "reference_target"


@dataclass
class TargetConfig:
    name_or_path: str = "reference_target"  # HF directory or hub id of the model whose outputs must not change


@dataclass
class DraftConfig:
    init: str = "config"  # config: a fresh Llama of `arch` sharing the target tokenizer
    arch: LlamaArch = field(default_factory=LlamaArch)

    def __post_init__(self):
        if self.init not in ("config",):
            raise ValueError(f"draft.init must be 'config', got {self.init!r}")


@dataclass
class DataConfig:
    root: str | None = None  # data root; null: $SPECDRAFT_DATA_ROOT, else ../shared/data beside the repo
    source: str = "root"  # root | hub | auto
    domain: str = "medical"  # training domain of the draft
    validation_fraction: float = 0.05
    test_fraction: float = 0.1
    block_size: int = 128  # tokens per training block
    max_train_blocks: int | None = None  # cap on training blocks (null: all)

    def __post_init__(self):
        if self.source not in ("root", "hub", "auto"):
            raise ValueError(f"data.source must be root, hub or auto, got {self.source!r}")
        if self.block_size < 2:
            raise ValueError(f"data.block_size must be >= 2 tokens, got {self.block_size}")
        if not (0 <= self.validation_fraction < 1 and 0 <= self.test_fraction < 1):
            raise ValueError("data.validation_fraction and data.test_fraction must be in [0, 1)")


@dataclass
class DistillConfig:
    loss: str = "forward_kl"  # forward_kl | reverse_kl | generalized_jsd | total_variation | skew_kl
    temperature: float = 1.0  # divides both logits; the loss is scaled by T^2
    beta: float = 0.5  # generalized_jsd only: 0 = forward KL, 1 = reverse KL
    skew: float = 0.1  # skew_kl only: lambda in KL(p || lambda p + (1 - lambda) q)

    def __post_init__(self):
        from distill.losses import LOSSES

        if self.loss not in LOSSES:
            raise ValueError(f"unknown distill.loss {self.loss!r}; choose one of {', '.join(LOSSES)}")
        if not self.temperature > 0:
            raise ValueError(f"distill.temperature must be > 0, got {self.temperature}")
        if not 0 <= self.beta <= 1 or not 0 <= self.skew <= 1:
            raise ValueError("distill.beta and distill.skew must be in [0, 1]")


@dataclass
class DecodeConfig:
    num_draft_tokens: int = 4  # gamma: tokens the draft proposes per verify step
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.num_draft_tokens < 1:
            raise ValueError(f"decode.num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.temperature < 0 or (self.do_sample and self.temperature == 0):
            raise ValueError(f"decode.temperature must be > 0 when sampling (>= 0 otherwise), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"decode.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"decode.top_k must be >= 0 (0 disables it), got {self.top_k}")


@dataclass
class EvalConfig:
    domains: list[str] = field(default_factory=lambda: ["medical", "code", "chat", "math"])
    max_prompts: int = 16  # prompts per domain
    max_new_tokens: int = 64  # tokens generated per prompt
    max_prompt_tokens: int = 192  # longer prompts are truncated from the left (with a warning)
    check_lossless: bool = True  # compare speculative greedy output with target-only greedy output
    cost_ratio_trials: int = 20  # forwards timed per model to measure the cost ratio c

    def __post_init__(self):
        if self.max_prompts < 1 or self.max_new_tokens < 1 or self.max_prompt_tokens < 1:
            raise ValueError("eval.max_prompts, eval.max_new_tokens and eval.max_prompt_tokens must be >= 1")
        if not self.domains:
            raise ValueError("eval.domains must list at least one domain")


@dataclass
class LoggerConfig:
    name: str = "none"  # none | wandb


@dataclass
class RootConfig:
    seed: int = 0
    experiment_name: str = "default"
    stages: list[str] = field(default_factory=lambda: ["distill", "baseline", "eval"])
    paths: PathsConfig = field(default_factory=PathsConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)

    def __post_init__(self):
        bad = [s for s in self.stages if s not in KNOWN_STAGES]
        if bad:
            raise ValueError(f"unknown stage(s) {bad}; stages are {', '.join(KNOWN_STAGES)}")
        from data.registry import get_domain

        for d in [self.data.domain, *self.eval.domains]:
            get_domain(d)


def validate(cfg: DictConfig | dict[str, Any]) -> RootConfig:
    """Merge a composed config onto :class:`RootConfig` and return the typed, range-checked object.

    Raises:
        ValueError: an unknown key, a value of the wrong type, or a value out of range (the message says which).
    """
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RootConfig), cfg)
        return OmegaConf.to_object(merged)
    except Exception as e:  # OmegaConf wraps our __post_init__ errors; surface one clear line
        msg = str(e).split("\n")[0]
        raise ValueError(f"invalid config: {msg}") from None
