"""The ``eval`` config section and the typed root of ``python -m eval``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from data.config import DataConfig, PathsConfig, TargetConfig, validate_structured
from decode.config import DecodeConfig


@dataclass
class EvalConfig:
    domains: list[str] = field(default_factory=lambda: ["medical", "code", "chat", "math"])
    drafts: dict[str, str] | None = None  # name -> HF dir; null: the run directory's drafts/
    max_prompts: int = 16  # prompts per domain
    max_new_tokens: int = 64  # tokens generated per prompt
    max_prompt_tokens: int = 192  # longer prompts are truncated from the left (with a warning)
    check_lossless: bool = True  # compare speculative greedy output with target-only greedy output
    cost_ratio_trials: int = 20  # forwards timed per model to measure the cost ratio c

    def __post_init__(self):
        if self.max_prompts < 1 or self.max_new_tokens < 1 or self.max_prompt_tokens < 2:
            raise ValueError("eval.max_prompts and eval.max_new_tokens must be >= 1, eval.max_prompt_tokens >= 2")
        if self.cost_ratio_trials < 1:
            raise ValueError(f"eval.cost_ratio_trials must be >= 1, got {self.cost_ratio_trials}")
        if not self.domains:
            raise ValueError("eval.domains must list at least one domain")
        from data.registry import get_domain

        for d in self.domains:
            get_domain(d)


@dataclass
class LoggerConfig:
    name: str = "none"  # none | wandb

    def __post_init__(self):
        if self.name not in ("none", "wandb"):
            raise ValueError(f"logger.name must be none or wandb, got {self.name!r}")


@dataclass
class EvalRootConfig:
    """The sections ``python -m eval`` reads (the rest of the tree is ignored there)."""

    seed: int = 0
    experiment_name: str = "eval"
    paths: PathsConfig = field(default_factory=PathsConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


def validate_eval(cfg: Any) -> EvalRootConfig:
    return validate_structured(EvalRootConfig, cfg, keys=[f.name for f in EvalRootConfig.__dataclass_fields__.values()])
