"""The ``draft`` and ``distill`` config sections (typed, range-checked)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .models import LlamaArch


@dataclass
class DraftConfig:
    init: str = "config"  # config: a fresh Llama of `arch` sharing the target tokenizer
    arch: LlamaArch = field(default_factory=LlamaArch)

    def __post_init__(self):
        if self.init not in ("config",):
            raise ValueError(f"draft.init must be 'config', got {self.init!r}")


@dataclass
class DistillConfig:
    loss: str = "forward_kl"  # forward_kl | reverse_kl | generalized_jsd | total_variation | skew_kl
    temperature: float = 1.0  # divides both logits; the loss is scaled by T^2
    beta: float = 0.5  # generalized_jsd only: 0 = forward KL, 1 = reverse KL
    skew: float = 0.1  # skew_kl only: lambda in KL(p || lambda p + (1 - lambda) q)

    def __post_init__(self):
        from .losses import LOSSES

        if self.loss not in LOSSES:
            raise ValueError(f"unknown distill.loss {self.loss!r}; choose one of {', '.join(LOSSES)}")
        if not self.temperature > 0:
            raise ValueError(f"distill.temperature must be > 0, got {self.temperature}")
        if not 0 <= self.beta <= 1 or not 0 <= self.skew <= 1:
            raise ValueError("distill.beta and distill.skew must be in [0, 1]")

    def loss_kwargs(self) -> dict:
        return {"beta": self.beta} if self.loss == "generalized_jsd" else \
            {"skew": self.skew} if self.loss == "skew_kl" else {}
