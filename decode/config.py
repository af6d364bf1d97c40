"""The ``decode`` config section (typed, range-checked)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DRAFT_LENGTH_POLICIES = ("fixed", "adaptive", "confidence")


@dataclass
class DecodeConfig:
    num_draft_tokens: int = 4  # gamma: tokens the draft proposes per verify step (adaptive: the starting length)
    do_sample: bool = False  # greedy when false
    temperature: float = 1.0  # sampling only; > 0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # in (0, 1]; 1 disables
    # Routing table (routing.json written by an evaluation): each domain is decoded with its routed draft.
    draft_routing: str | None = None
    # How many tokens the draft proposes per verify step (decode.policies): fixed (num_draft_tokens), adaptive
    # (starts at num_draft_tokens, +/- adaptive_step after every adaptive_window verify steps, within
    # [min_draft_tokens, max_draft_tokens]) or confidence (up to max_draft_tokens, a row stops drafting when the
    # draft's top probability falls below confidence_threshold).
    draft_length_policy: str = "fixed"
    min_draft_tokens: int = 1  # adaptive: lower bound
    max_draft_tokens: int = 8  # adaptive: upper bound; confidence: most tokens drafted per step
    adaptive_window: int = 4  # adaptive: verify steps (per row) behind each grow/shrink decision
    adaptive_step: int = 1  # adaptive: change of the draft length per decision
    confidence_threshold: float = 0.5  # confidence: keep drafting while the draft's top probability is >= this
    # torch.compile of the lean forward (decode/fast_llama.py): auto (on for CUDA, off on CPU, where it does not pay),
    # on, off. Lossless either way (the same computation).
    compile: str = "auto"
    # CPU threads for forwards over more than one token (the target's verify block, prefills, batches): auto (every
    # core the process may use), off (the caller's torch setting), or a number. One-token forwards keep the caller's
    # eval.num_threads / trainer.num_threads (decode/threads.py). Lossless either way.
    block_threads: Any = "auto"

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
        if self.min_draft_tokens < 1:
            raise ValueError(f"decode.min_draft_tokens must be >= 1, got {self.min_draft_tokens}")
        if self.max_draft_tokens < self.min_draft_tokens:
            raise ValueError(f"decode.max_draft_tokens must be >= decode.min_draft_tokens ({self.min_draft_tokens}), "
                             f"got {self.max_draft_tokens}")
        if self.adaptive_window < 1:
            raise ValueError(f"decode.adaptive_window must be >= 1 verify step, got {self.adaptive_window}")
        if self.adaptive_step < 1:
            raise ValueError(f"decode.adaptive_step must be >= 1 token, got {self.adaptive_step}")
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise ValueError(f"decode.confidence_threshold must be a probability in [0, 1], got "
                             f"{self.confidence_threshold}")
        self.check_policy(self.draft_length_policy)
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"decode.compile must be one of auto, on, off, got {self.compile!r}")
        from .threads import parse_block_threads

        self.block_threads = parse_block_threads(self.block_threads)

    def check_policy(self, name: str) -> None:
        """Raise ValueError (naming the keys to fix) unless policy ``name`` can be built from this section."""
        if name not in DRAFT_LENGTH_POLICIES:
            raise ValueError(f"decode.draft_length_policy must be one of {', '.join(DRAFT_LENGTH_POLICIES)}, "
                             f"got {name!r}")
        if name == "adaptive" and not self.min_draft_tokens <= self.num_draft_tokens <= self.max_draft_tokens:
            raise ValueError(f"decode.num_draft_tokens (the adaptive policy's starting draft length) must be in "
                             f"[decode.min_draft_tokens, decode.max_draft_tokens] = [{self.min_draft_tokens}, "
                             f"{self.max_draft_tokens}], got {self.num_draft_tokens}")

    def make_policy(self, name: str | None = None):
        """A fresh :class:`decode.policies.DraftLengthPolicy` (``name``, default ``draft_length_policy``) with this
        section's parameters. Policies are stateful: build one per independent decode.

        Raises:
            ValueError: unknown name, or parameters that do not fit it (see :meth:`check_policy`).
        """
        from .policies import AdaptiveDraftLength, ConfidenceDraftLength, FixedDraftLength

        name = name or self.draft_length_policy
        self.check_policy(name)
        if name == "fixed":
            return FixedDraftLength(self.num_draft_tokens)
        if name == "adaptive":
            return AdaptiveDraftLength(initial=self.num_draft_tokens, min_draft_tokens=self.min_draft_tokens,
                                       max_draft_tokens=self.max_draft_tokens, window=self.adaptive_window,
                                       step=self.adaptive_step)
        return ConfidenceDraftLength(max_draft_tokens=self.max_draft_tokens, threshold=self.confidence_threshold)

    def policy_settings(self, name: str | None = None) -> dict:
        """The keys that define policy ``name`` (default ``draft_length_policy``), for reports and metadata."""
        name = name or self.draft_length_policy
        if name == "fixed":
            return {"draft_length_policy": name, "num_draft_tokens": self.num_draft_tokens}
        if name == "adaptive":
            return {"draft_length_policy": name, "num_draft_tokens": self.num_draft_tokens,
                    "min_draft_tokens": self.min_draft_tokens, "max_draft_tokens": self.max_draft_tokens,
                    "adaptive_window": self.adaptive_window, "adaptive_step": self.adaptive_step}
        return {"draft_length_policy": name, "max_draft_tokens": self.max_draft_tokens,
                "confidence_threshold": self.confidence_threshold}

    def sampling_kwargs(self) -> dict:
        """Keyword arguments for ``speculative_generate`` / ``autoregressive_generate``."""
        if not self.do_sample:
            return {}
        return {"do_sample": True, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}
