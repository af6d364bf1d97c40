"""Acceptance statistics of speculative decoding, defined once for the whole project (docs/architecture.md, "Terms").

Definitions (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"):

- acceptance rate ``alpha`` = accepted draft tokens / drafted tokens, *pooled* over all verify steps.
- mean accepted length ``tau`` = emitted tokens / verify steps, **including the bonus (or correction) token**, so
  ``1 <= tau <= gamma + 1``. Pooled: sum of emitted / sum of verify steps, never a mean of per-prompt means.
- expected speedup (Thm 3.8): ``(1 - alpha^(gamma+1)) / ((1 - alpha) (gamma c + 1))`` with cost ratio ``c``;
  from measured parts (:func:`expected_speedup_from_costs`): ``tau / mean(k c + v_k)`` over the verify steps.

In a batch every active row counts as its own verify step (a "row-step"), so batched and unbatched runs of the same
prompts give the same statistics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Iterable

__all__ = ['AcceptanceStats', 'expected_speedup', 'expected_speedup_mixture', 'expected_speedup_from_costs']


def _add_lists(a: list, b: list) -> list:
    """Element-wise sum of two count lists, the shorter one padded with zeros."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


@dataclass
class AcceptanceStats:
    """Counts and timings of one or more speculative (or autoregressive) decoding runs.

    All fields are *sums* (or concatenations), so pooling is exact: ``a + b`` / :meth:`pool` add counts.

    Attributes:
        verify_steps: number of target forward passes, counted per active row (row-steps).
        drafted_tokens: draft tokens proposed to the target (sum over row-steps of the draft length).
        accepted_tokens: drafted tokens the target accepted (by the greedy match or the rejection-sampling rule;
            tokens accepted after an in-block EOS are counted, as the verification accepted them).
        emitted_tokens: tokens written to the output (accepted + bonus/correction, cut at EOS / max_new_tokens).
        draft_time_s: seconds spent in the draft phase (draft forwards and draws), ``time.perf_counter``; the
            prompt prefill is not included (``prefill_time_s``).
        verify_time_s: seconds spent in target forward passes (verification, or decoding for the baseline), the
            prompt prefill excluded.
        prefill_time_s: seconds spent prefilling the prompt into the caches (target and draft).
        wall_time_s: seconds of the whole decoding call; ``wall - prefill - draft - verify`` is the loop's own
            bookkeeping (acceptance, emission, cache edits).
        per_position_drafted: ``[i]`` = how often a i-th (0-based) draft token was proposed with all previous
            draft tokens of its block accepted.
        per_position_accepted: ``[i]`` = how often the i-th draft token was accepted (all previous accepted).
        accepted_length_histogram: ``[n]`` = number of row-steps that accepted exactly ``n`` draft tokens.
        draft_lengths: the draft length used at every row-step, in order.
        nodes_verified: draft tokens the target scored, summed over row-steps: the draft length for a chain, every
            node of the tree for a token tree (:mod:`decode.tree`, where ``draft_lengths`` holds the tree's depth
            and ``accepted_tokens`` the accepted path lengths).
        lookup_drafted_tokens: drafted tokens a hybrid draft (:mod:`decode.hybrid`) took from its lookup rather
            than its model (0 for every other draft).
    """

    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    prefill_time_s: float = 0.0
    wall_time_s: float = 0.0
    per_position_drafted: list[int] = field(default_factory=list)
    per_position_accepted: list[int] = field(default_factory=list)
    accepted_length_histogram: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    nodes_verified: int = 0
    lookup_drafted_tokens: int = 0

    # ------------------------------------------------------------------ derived metrics
    @property
    def acceptance_rate(self) -> float:
        """alpha = accepted_tokens / drafted_tokens (pooled; Leviathan et al. 2023, Sec. 3.1). NaN if nothing drafted."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else float("nan")

    @property
    def per_token_acceptance(self) -> float:
        """Per-token acceptance probability: accepted / *tested* draft tokens, a draft token being tested when
        every earlier token of its block was accepted (``sum(per_position_accepted) / sum(per_position_drafted)``).
        This is the maximum-likelihood alpha of Leviathan et al. 2023's i.i.d. model (Sec. 3.1, each token accepted
        with probability alpha until the first rejection), the alpha their Thm 3.8 expects; accepted / drafted
        (:attr:`acceptance_rate`) also counts the untested tokens after a rejection, so it underestimates alpha.
        NaN if nothing was tested."""
        tested = sum(self.per_position_drafted)
        return sum(self.per_position_accepted) / tested if tested else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """tau = emitted_tokens / verify_steps, bonus token included (1 <= tau <= gamma+1). NaN if no step."""
        return self.emitted_tokens / self.verify_steps if self.verify_steps else float("nan")

    @property
    def mean_nodes_verified(self) -> float:
        """Draft tokens scored per target forward (``nodes_verified / verify_steps``; gamma for a chain). NaN if no
        step."""
        return self.nodes_verified / self.verify_steps if self.verify_steps else float("nan")

    @property
    def per_position_acceptance(self) -> list[float]:
        """``[i]`` = P(i-th draft token accepted | all previous accepted) = accepted[i] / drafted[i] (NaN if 0)."""
        acc = self.per_position_accepted
        return [
            (acc[i] if i < len(acc) else 0) / d if d else float("nan") for i, d in enumerate(self.per_position_drafted)
        ]

    @property
    def tokens_per_s(self) -> float:
        """emitted_tokens / (draft_time_s + verify_time_s); NaN when no time was recorded."""
        t = self.draft_time_s + self.verify_time_s
        return self.emitted_tokens / t if t > 0 else float("nan")

    # ------------------------------------------------------------------ pooling
    def __add__(self, other: "AcceptanceStats") -> "AcceptanceStats":
        """Pool two stats by summing every count (lists padded with zeros; ``draft_lengths`` concatenated)."""
        if not isinstance(other, AcceptanceStats):
            return NotImplemented
        return AcceptanceStats(
            verify_steps=self.verify_steps + other.verify_steps,
            drafted_tokens=self.drafted_tokens + other.drafted_tokens,
            accepted_tokens=self.accepted_tokens + other.accepted_tokens,
            emitted_tokens=self.emitted_tokens + other.emitted_tokens,
            draft_time_s=self.draft_time_s + other.draft_time_s,
            verify_time_s=self.verify_time_s + other.verify_time_s,
            prefill_time_s=self.prefill_time_s + other.prefill_time_s,
            wall_time_s=self.wall_time_s + other.wall_time_s,
            per_position_drafted=_add_lists(self.per_position_drafted, other.per_position_drafted),
            per_position_accepted=_add_lists(self.per_position_accepted, other.per_position_accepted),
            accepted_length_histogram=_add_lists(self.accepted_length_histogram, other.accepted_length_histogram),
            draft_lengths=list(self.draft_lengths) + list(other.draft_lengths),
            nodes_verified=self.nodes_verified + other.nodes_verified,
            lookup_drafted_tokens=self.lookup_drafted_tokens + other.lookup_drafted_tokens,
        )

    def __radd__(self, other):  # lets sum([...]) start from 0
        if other == 0:
            return self + AcceptanceStats()
        return NotImplemented

    @classmethod
    def pool(cls, stats: Iterable["AcceptanceStats"]) -> "AcceptanceStats":
        """Pool many stats by summing counts (never a mean of means); an empty iterable gives empty stats."""
        out = cls()
        for s in stats:
            out = out + s
        return out

    # ------------------------------------------------------------------ recording
    def record_step(self, draft_length: int, num_accepted: int, num_emitted: int, nodes_verified: int | None = None
                    ) -> None:
        """Add one row-step: ``draft_length`` proposed, ``num_accepted`` accepted, ``num_emitted`` written;
        ``nodes_verified`` draft tokens scored by the target (default ``draft_length``: a chain)."""
        self.verify_steps += 1
        self.nodes_verified += draft_length if nodes_verified is None else nodes_verified
        self.drafted_tokens += draft_length
        self.accepted_tokens += num_accepted
        self.emitted_tokens += num_emitted
        self.draft_lengths.append(draft_length)
        reached = min(num_accepted + 1, draft_length)  # positions proposed with all previous accepted
        for lst, n in ((self.per_position_drafted, reached), (self.per_position_accepted, num_accepted)):
            if len(lst) < n:
                lst.extend([0] * (n - len(lst)))
            for i in range(n):
                lst[i] += 1
        hist = self.accepted_length_histogram
        if len(hist) <= num_accepted:
            hist.extend([0] * (num_accepted + 1 - len(hist)))
        hist[num_accepted] += 1

    def to_dict(self) -> dict:
        """JSON-serialisable dict of all fields plus the derived metrics (NaN written as ``None``)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d = {k: (list(v) if isinstance(v, list) else v) for k, v in d.items()}

        def clean(x):
            return None if isinstance(x, float) and math.isnan(x) else x

        d["acceptance_rate"] = clean(self.acceptance_rate)
        d["mean_accepted_length"] = clean(self.mean_accepted_length)
        d["per_token_acceptance"] = clean(self.per_token_acceptance)
        d["mean_nodes_verified"] = clean(self.mean_nodes_verified)
        d["per_position_acceptance"] = [clean(x) for x in self.per_position_acceptance]
        return d


def expected_speedup(acceptance_rate: float, num_draft_tokens: int, cost_ratio: float,
                     verify_cost_ratio: float = 1.0) -> float:
    """Expected walltime improvement of speculative decoding (Leviathan et al. 2023, Theorem 3.8).

    ``(1 - a^(g+1)) / ((1 - a) (g c + v))`` with ``a`` = per-token acceptance alpha in [0, 1]
    (:attr:`AcceptanceStats.per_token_acceptance`), ``g`` = num_draft_tokens (gamma) >= 0, ``c`` = cost ratio
    (one-position draft forward / one-position target forward) >= 0 and ``v`` = verify cost ratio (the target's
    (g+1)-position verify forward / its one-position forward) > 0. The theorem assumes ``v = 1`` (the default);
    passing the measured ``v`` gives the expectation from measured components. At ``a = 1`` the limit
    ``(g + 1) / (g c + v)`` is used.

    Raises:
        ValueError: ``a`` outside [0, 1], ``g < 0``, ``c < 0`` or ``v <= 0``.
    """
    a, g, c = float(acceptance_rate), int(num_draft_tokens), float(cost_ratio)
    v = float(verify_cost_ratio)
    if not (v > 0.0):
        raise ValueError(f"verify_cost_ratio must be > 0 (got {verify_cost_ratio!r}).")
    if not (0.0 <= a <= 1.0):
        raise ValueError(f"acceptance_rate must be in [0, 1] (got {acceptance_rate!r}).")
    if g < 0:
        raise ValueError(f"num_draft_tokens must be >= 0 (got {num_draft_tokens!r}).")
    if not (c >= 0.0):
        raise ValueError(f"cost_ratio must be >= 0 (got {cost_ratio!r}).")
    denom_cost = g * c + v
    if a == 1.0:
        return (g + 1) / denom_cost
    return (1.0 - a ** (g + 1)) / ((1.0 - a) * denom_cost)


def expected_speedup_mixture(acceptance_rate: float, draft_length_histogram: list[int], cost_ratio: float) -> float:
    """Expected walltime improvement when the draft length varies from step to step (a draft-length policy).

    Leviathan et al. 2023, Theorem 3.8 per step, pooled over steps: with ``h[k]`` steps of draft length ``k``,
    ``sum_k h[k] (1 - a^(k+1)) / (1 - a)  /  sum_k h[k] (k c + 1)`` (expected emitted tokens over the cost of the
    steps in target-forward units, i.i.d. acceptance ``a``). A histogram with a single length ``g`` gives
    :func:`expected_speedup` ``(a, g, c)``. NaN when the histogram is empty.

    Raises:
        ValueError: ``a`` outside [0, 1], ``c < 0``, or a negative count.
    """
    a, c = float(acceptance_rate), float(cost_ratio)
    if not (0.0 <= a <= 1.0):
        raise ValueError(f"acceptance_rate must be in [0, 1] (got {acceptance_rate!r}).")
    if not (c >= 0.0):
        raise ValueError(f"cost_ratio must be >= 0 (got {cost_ratio!r}).")
    if any(h < 0 for h in draft_length_histogram):
        raise ValueError(f"draft_length_histogram counts must be >= 0 (got {draft_length_histogram!r}).")
    tokens = sum(h * ((k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a))
                 for k, h in enumerate(draft_length_histogram))
    cost = sum(h * (k * c + 1.0) for k, h in enumerate(draft_length_histogram))
    return tokens / cost if cost else float("nan")


def expected_speedup_from_costs(mean_accepted_length: float, draft_length_histogram: Iterable[int],
                                cost_ratio: float, verify_cost_ratio, nodes_per_step: float | None = None,
                                step_overhead: float = 0.0) -> float:
    """Expected walltime improvement from the measured parts of a step: tokens per step over the step's cost.

    ``tau / (sum_k h[k] (k c + v_k) / sum_k h[k] + o)``: ``tau`` = the measured mean accepted length (emitted tokens
    per verify step, bonus included), ``h[k]`` = steps that drafted ``k`` tokens, ``c`` = cost ratio (one-position
    draft forward / one-position target forward) and ``v_k`` = verify cost ratio of a step with ``k`` draft tokens
    (the target's (k + 1)-position forward / its one-position forward; ``v_0 = 1``). This is Leviathan et al. 2023,
    Sec. 3.3 / Thm 3.8 with the i.i.d. acceptance term replaced by the measured tau and the verify forward costing
    its measured ``v_k`` instead of 1: on a CPU (and for wide blocks anywhere) ``v_k`` grows with ``k`` and is not
    even monotone (a 4-position forward measured slower than a 5-position one on the development machine, MKL's
    small-M kernels). A token tree (``nodes_per_step`` given): a step drafts one level per draft forward, its depth
    ``k`` from the histogram, and verifies ``n`` = ``round(nodes_per_step)`` nodes, so its cost is ``k c + v_n``
    (each level counted as one one-position draft forward: a lower bound of the tree's drafting cost). ``o`` =
    ``step_overhead``: the loop's own work per verify step outside the forwards (acceptance, bookkeeping, cache
    edits), in one-position target forwards; it weighs on short steps most (gamma 1 pays it every 1-2 tokens).

    Args:
        mean_accepted_length: tau >= 0 (tokens per verify step).
        draft_length_histogram: ``[k]`` = verify steps that drafted ``k`` tokens (tree: of depth ``k``).
        cost_ratio: c >= 0.
        verify_cost_ratio: mapping ``k -> v_k`` (int keys, or their strings as in ``metrics.json``); a ``v``
            that is needed and missing makes the result NaN.
        nodes_per_step: nodes a token tree verifies per step (None: a chain).
        step_overhead: o >= 0, in one-position target forwards (0: forwards only).

    Returns:
        The expected speedup (a ratio); NaN for an empty histogram, a non-finite tau or a missing ``v_k``.

    Raises:
        ValueError: ``c < 0``, ``o < 0``, a negative count or a ``v_k <= 0``.
    """
    c, o = float(cost_ratio), float(step_overhead)
    if not (c >= 0.0):
        raise ValueError(f"cost_ratio must be >= 0 (got {cost_ratio!r}).")
    if not (o >= 0.0):
        raise ValueError(f"step_overhead must be >= 0 (got {step_overhead!r}).")
    hist = list(draft_length_histogram)
    if any(h < 0 for h in hist):
        raise ValueError(f"draft_length_histogram counts must be >= 0 (got {hist!r}).")
    v = {int(k): float(x) for k, x in dict(verify_cost_ratio or {}).items()}
    if any(not (x > 0.0) for x in v.values()):
        raise ValueError(f"verify cost ratios must be > 0 (got {verify_cost_ratio!r}).")
    v.setdefault(0, 1.0)
    tau = float(mean_accepted_length)
    steps = sum(hist)
    if not steps or not math.isfinite(tau):
        return float("nan")
    if nodes_per_step is not None:
        n = int(round(float(nodes_per_step)))
        if n not in v:
            return float("nan")
        depth = sum(k * h for k, h in enumerate(hist)) / steps
        return tau / (depth * c + v[n] + o)
    if any(h and k not in v for k, h in enumerate(hist)):
        return float("nan")
    cost = sum(h * (k * c + v[k]) for k, h in enumerate(hist) if h) / steps
    return tau / (cost + o)
