"""Where speculative decoding's time goes, per draft and domain: the ``time_breakdown`` of ``metrics.json`` and its
report section.

The same quantities as the decoder benchmark prints (:mod:`eval.bench`, ``scripts/bench_decode.py``; the phase
split is :func:`phase_split` for both), from the per-prompt rows at the primary gamma (fixed policy) and the
measured forward times:

- ``prefill_s``, ``draft_s``, ``verify_s``: summed decoder phase times (``AcceptanceStats.prefill_time_s`` /
  ``draft_time_s`` / ``verify_time_s``), ``wall_s`` the summed speculative decode time (``speculative_time_s``, the
  time the measured speedup uses) and ``other_s = wall_s - prefill_s - draft_s - verify_s`` (the loop's own work);
- ``loop_efficiency = (prefill_s + draft_s + verify_s) / wall_s`` (time in model forwards / wall time);
- ``cost_ratio`` c (one-position draft forward / one-position target forward, medians: ``cost_ratio.<draft>``)
  and ``cost_ratio_in_loop = (draft_s / drafted_tokens) / target_forward_s``;
- ``verify_cost_ratio`` v ((gamma + 1)-position target forward / one-position target forward, medians, measured
  once per gamma: ``verify_cost_ratio.<gamma>``, :func:`decode.block_forward_times_s`) and
  ``verify_cost_ratio_in_loop = (verify_s / verify_steps) / target_forward_s``;
- ``expected_speedup_components``: the cell's measured tau over its steps' mean cost ``k c + v_k``
  (:func:`decode.stats.expected_speedup_from_costs`, the value the verdicts break ties with), beside
  ``expected_speedup_leviathan`` (``(1 - a^(g+1)) / ((1 - a)(g c + 1))``, v = 1, Leviathan et al. 2023, Thm 3.8)
  and the ``measured_speedup``.

A value that cannot be computed (rows written before ``prefill_time_s`` was recorded, nothing drafted, no verify
measurement) is ``None``.
"""
from __future__ import annotations

import math

from decode.stats import expected_speedup

__all__ = ["phase_split", "time_breakdown", "time_breakdown_section"]


def _div(a, b):
    return a / b if a is not None and b not in (None, 0) and math.isfinite(b) else None


def phase_split(wall_s: float, prefill_s: float | None, draft_s: float, verify_s: float, missing=None) -> dict:
    """Speculative decoding's wall seconds split by phase: ``{"wall_s", "prefill_s", "draft_s", "verify_s",
    "other_s", "loop_efficiency"}`` with ``other_s = wall_s - prefill_s - draft_s - verify_s`` (the loop's own work)
    and ``loop_efficiency = (prefill_s + draft_s + verify_s) / wall_s`` (time in model forwards / wall). Seconds
    summed over the decodes (``AcceptanceStats.prefill_time_s`` / ``draft_time_s`` / ``verify_time_s``); what cannot
    be computed (``prefill_s`` None, a zero wall time) is ``missing``."""
    forwards = None if prefill_s is None else prefill_s + draft_s + verify_s
    efficiency = _div(forwards, wall_s)
    return {"wall_s": wall_s, "prefill_s": prefill_s, "draft_s": draft_s, "verify_s": verify_s,
            "other_s": missing if forwards is None else wall_s - forwards,
            "loop_efficiency": missing if efficiency is None else efficiency}


def time_breakdown(rows: list[dict], cost_ratio: dict, verify_cost_ratio: dict | None, drafts: dict,
                   num_draft_tokens: int) -> dict:
    """``{draft: {domain: {...}}}`` (fields in the module docstring) at gamma ``num_draft_tokens``, fixed policy.

    ``rows``: per-prompt rows (:data:`eval.metrics.PER_PROMPT_COLUMNS`); ``cost_ratio``: ``{draft: {"cost_ratio",
    "target_forward_s", ...}}``; ``verify_cost_ratio``: ``{str(gamma): {"verify_cost_ratio", ...}}`` or None;
    ``drafts``: the metrics document's ``drafts`` (for the token acceptance rate, measured and expected speedup).
    """
    g = int(num_draft_tokens)
    v = ((verify_cost_ratio or {}).get(str(g)) or {}).get("verify_cost_ratio")
    out: dict[str, dict] = {}
    for name, by_domain in drafts.items():
        cost = cost_ratio.get(name) or {}
        c, t1 = cost.get("cost_ratio"), cost.get("target_forward_s")
        for domain, entry in by_domain.items():
            cell = [r for r in rows if r["draft"] == name and r["domain"] == domain and int(r["num_draft_tokens"]) == g
                    and r.get("draft_length_policy", "fixed") == "fixed"]
            if not cell:
                continue
            wall = sum(r["speculative_time_s"] for r in cell)
            draft_s = sum(r["draft_time_s"] for r in cell)
            verify_s = sum(r["verify_time_s"] for r in cell)
            pre = [r.get("prefill_time_s") for r in cell]
            prefill_s = None if any(p is None for p in pre) else sum(pre)
            steps = sum(r["verify_steps"] for r in cell)
            drafted = sum(r["drafted_tokens"] for r in cell)
            a = entry.get("token_acceptance_rate")
            finite = a is not None and math.isfinite(a) and c is not None
            out.setdefault(name, {})[domain] = {
                "num_draft_tokens": g,
                **phase_split(wall, prefill_s, draft_s, verify_s),
                "cost_ratio": c,
                "cost_ratio_in_loop": _div(_div(draft_s, drafted), t1),
                "verify_cost_ratio": v,
                "verify_cost_ratio_in_loop": _div(_div(verify_s, steps), t1),
                "measured_speedup": entry.get("measured_speedup"),
                "expected_speedup_leviathan": expected_speedup(a, g, c) if finite else None,
                "expected_speedup_components": entry.get("expected_speedup_components") if v else None,
            }
    return out


def _f(x, fmt: str, suffix: str = "") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt) + suffix


def _share(x, wall) -> str:
    return "n/a" if x is None or not wall else f"{x:.3f} ({x / wall:.0%})"


def time_breakdown_section(doc: dict) -> list[str]:
    """Markdown lines of the report's "Where decoding time goes" section (empty without ``time_breakdown``)."""
    tb = doc.get("time_breakdown") or {}
    if not tb:
        return []
    lines = ["", f"## Where decoding time goes (gamma = {doc['num_draft_tokens']})", "",
             "Seconds summed over the domain's prompts (share of the speculative wall time); c and v measured "
             "standalone (in the loop); expected speedup from the measured c and v beside Leviathan's (v = 1). "
             "Loop efficiency = time in model forwards / wall time.", "",
             "| domain | draft | wall s | prefill s | draft s | verify s | other s | loop efficiency | c (in loop) | "
             "v (in loop) | measured speedup | expected: measured c, v | expected: Leviathan |", "|" + "---|" * 13]
    for name, by_domain in tb.items():
        for domain, e in by_domain.items():
            wall = e["wall_s"]
            lines.append(
                f"| {domain} | {name} | {_f(wall, '.3f')} | {_share(e['prefill_s'], wall)} | "
                f"{_share(e['draft_s'], wall)} | {_share(e['verify_s'], wall)} | {_share(e['other_s'], wall)} | "
                f"{_f(e['loop_efficiency'], '.2f')} | {_f(e['cost_ratio'], '.3f')} "
                f"({_f(e['cost_ratio_in_loop'], '.3f')}) | {_f(e['verify_cost_ratio'], '.2f')} "
                f"({_f(e['verify_cost_ratio_in_loop'], '.2f')}) | {_f(e['measured_speedup'], '.2f', 'x')} | "
                f"{_f(e['expected_speedup_components'], '.2f', 'x')} | "
                f"{_f(e['expected_speedup_leviathan'], '.2f', 'x')} |")
    return lines
