"""The typed root of the config tree (``conf/``): each section's dataclass lives in the package that owns it.

Hydra composes the YAML files; :func:`validate` merges the result onto :class:`RootConfig`, which type-checks every
key and runs the range checks in each section's ``__post_init__`` before any model is loaded. Unknown keys are
errors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from data.config import validate_structured
from distill.config import DistillConfig, DraftConfig
from distill.lora import LoraSectionConfig
from distill.reference import ReferenceConfig
from distill.trainer_config import TrainerConfig
from eval.config import EvalRootConfig

from .adapt import AdaptConfig
from .stages import KNOWN_STAGES



@dataclass
class RootConfig(EvalRootConfig):
    """The whole tree: the sections ``python -m eval`` reads (:class:`eval.config.EvalRootConfig`) plus training."""

    experiment_name: str = "default"
    overwrite: bool = False  # replace the artifacts of a run already in hydra.run.dir (else: refuse, or resume)
    stages: list[str] = field(default_factory=lambda: ["distill", "baseline", "eval"])
    draft: DraftConfig = field(default_factory=DraftConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    lora: LoraSectionConfig = field(default_factory=LoraSectionConfig)
    adapt: AdaptConfig = field(default_factory=AdaptConfig)

    def __post_init__(self):
        super().__post_init__()
        bad = [s for s in self.stages if s not in KNOWN_STAGES]
        if bad:
            raise ValueError(f"stages: unknown stage(s) {bad}; stages are {', '.join(KNOWN_STAGES)}")
        if not self.stages:
            raise ValueError("stages is empty; list at least one of " + ", ".join(KNOWN_STAGES))
        from data.domains import get_domain

        get_domain(self.data.domain)
        if "draft_init" in self.stages and self.draft.init == "config":
            raise ValueError("stage draft_init needs draft.init=layer_pruned or pretrained (set draft=layer_pruned or "
                             "draft=pretrained), or remove draft_init from stages")
        uses_lora = [s for s in self.stages if s in ("lora", "finetune", "adapt")]
        if uses_lora and not self.lora.enabled:
            raise ValueError(f"stages {uses_lora} LoRA-adapt drafts but lora=none: add `lora=default` to the command "
                             f"(conf/lora/default.yaml holds rank, alpha, dropout, target modules and steps)")
        if "lora" in self.stages or "finetune" in self.stages:
            dom = self.lora.domain or self.data.domain
            from .adapt import trainable_domain

            if not trainable_domain(dom):
                raise ValueError(f"lora.domain {dom!r} has no training split (a test-only benchmark); adapt to a "
                                 f"domain with training text (medical, code, chat, math, ...)")
        if uses_lora and self.lora.teacher_signal == "cached" and (
                self.distill.loss == "reverse_kl" or (self.distill.loss == "generalized_jsd" and self.distill.beta == 1)):
            raise ValueError("lora.teacher_signal=cached: reverse KL is infinite against a cached top-k teacher; set "
                             "lora.teacher_signal=online, or a distill.loss that stays finite (forward_kl, ...)")
        if uses_lora:
            self.lora.trainer_config(self.trainer)  # the adapter's optimiser settings are valid before any model loads


def validate(cfg: Any) -> RootConfig:
    """Typed, range-checked config; raises ValueError naming the bad key (see :func:`validate_structured`)."""
    return validate_structured(RootConfig, cfg)
