"""The ``decode`` config section (typed, range-checked)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DecodeConfig:
    num_draft_tokens: int = 4  # gamma: tokens the draft proposes per verify step
    do_sample: bool = False  # greedy when false
    temperature: float = 1.0  # sampling only; > 0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # in (0, 1]; 1 disables
    # Routing table (routing.json written by an evaluation): each domain is decoded with its routed draft.
    draft_routing: str | None = None

    def __post_init__(self):
        if self.num_draft_tokens < 1:
            raise ValueError(f"decode.num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.temperature < 0 or (self.do_sample and self.temperature == 0):
            raise ValueError(f"decode.temperature must be > 0 when sampling (>= 0 otherwise), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"decode.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"decode.top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.draft_routing is not None and not str(self.draft_routing).strip():
            raise ValueError("decode.draft_routing must be null or the path of a routing.json")

    def sampling_kwargs(self) -> dict:
        """Keyword arguments for ``speculative_generate`` / ``autoregressive_generate``."""
        if not self.do_sample:
            return {}
        return {"do_sample": True, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}
