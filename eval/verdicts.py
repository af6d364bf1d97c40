"""The verdicts of an evaluation in words: the decisions of :mod:`eval.decision` (one :class:`Decision` per domain),
their caveats (noisy timing, low acceptance, a failed lossless check) and their rendering.

``report.md`` opens with :func:`verdicts_section`: a table, one row per domain (what to deploy, measured speedup
[interval], tau, flags), then one short line per domain; ``python -m eval`` / ``python -m train`` print the same
section, so the two cannot disagree. The reasoning behind each decision (ties, the cost model, the settings set
aside) goes to :func:`reasoning_section`, "How each verdict was reached", further down.

A measurement is marked **noisy** (:func:`noisy_reasons`) when the chosen setting's interval is wider than
``eval.noisy_relative_width`` times its point estimate, its measured speedup exceeds tau / min(1, v) by more than
10 % (:func:`eval.decision.speedup_bound`), or other processes kept more than a quarter of a core busy while the
domain was timed (``eval.timing.load_record``).
"""
from __future__ import annotations

import logging
import math
from typing import Any

from .decision import (COMPONENTS_FORMULA, FORMULA, IMPLAUSIBLE_OVER_TAU, MIN_MEAN_ACCEPTED_LENGTH, SPECULATE,
                       TARGET_ONLY, Decision, candidates, decide_domain, interval, label, num, setting_entry,
                       speedup_bound)
from .decision_check import check_consistent

log = logging.getLogger(__name__)


def _fmt(v: Any, digits: int = 2) -> str:
    x = num(v)
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


def _named(c) -> str:
    """A setting as text: its draft in backticks, then :func:`eval.decision.label`."""
    draft = c["draft"] if isinstance(c, dict) else c.draft
    return f"`{draft}` with {label(c)}"


def _speedup(c) -> str:
    """``1.26x [1.09, 1.42]`` of a setting (dict or :class:`Decision`)."""
    s = c.get("measured_speedup") if isinstance(c, dict) else c.measured_speedup
    ci = c.get("measured_speedup_ci") if isinstance(c, dict) else c.measured_speedup_ci
    lo, hi = interval({"measured_speedup": s, "measured_speedup_ci": ci})
    return f"{_fmt(s)}x" + (f" [{_fmt(lo)}, {_fmt(hi)}]" if ci else "")


# ------------------------------------------------------------------------------------------------ reasoning
def _tie_words(r: Decision) -> str:
    """Why a tie went where it did (rules 3-5 of :mod:`eval.decision`)."""
    best = r.best_measured
    how = (f"{COMPONENTS_FORMULA} from the measured tau, cost ratio c, verify cost ratio v_k of each k-token block "
           f"and loop overhead per step o" if r.model == "expected_speedup_components"
           else f"{FORMULA} from the measured acceptance and cost ratio c (the measured step costs, v_k and o, are "
                f"incomplete for these settings)")
    pool = {"above_one": " among those whose interval lies above 1",
            "at_least_one": " among those measured at least as fast as the target alone", "all": "",
            "displaced": (f" among the settings that both the measurement and the model rate faster than "
                          f"{_named(r.displaced)} ({_fmt(r.displaced['measured_speedup'])}x, expected "
                          f"{_fmt(r.displaced.get(r.model))}x), the pick among those whose interval lies above 1"
                          if r.displaced else "")}[r.tie_pool or "all"]
    chosen_model = getattr(r, r.model) if r.model else None
    if len(r.model_near) == 1:
        pick = f": the highest expected speedup {how} ({_fmt(chosen_model)}x)"
    else:
        err = 100 * (r.model_error or 0.0)
        pick = (f", the highest expected speedup {how}, {_fmt(r.model_top)}x at best, within whose own error (it "
                f"misses the measured speedups by {err:.0f}% here, median) {len(r.model_near)} settings lie "
                f"({', '.join(_named(c) for c in r.model_near)}): among them the highest measured speedup "
                f"({_fmt(r.measured_speedup)}x, expected {_fmt(chosen_model)}x)")
    if r.model_pick:
        pick += (f"; but {_named(r)}, measured {_speedup(r)}, lies wholly above that pick's "
                 f"{_fmt(r.model_pick['measured_speedup'])}x, so the measurement overrules the model")
    return (f"tie: the measured speedup intervals of {len(r.tied_with) + 1} settings overlap (fastest measured: "
            f"{_named(best)}, {_speedup(best)}), so the measurement cannot order them; chosen by the cost model"
            + pool + pick)


def explain(r: Decision) -> str:
    """The reasoning behind a decision, in one paragraph (the old ``reason``; ``metrics.json`` keeps it)."""
    if r.action == "none":
        return "no finite measured speedup"
    if r.basis == "low_tau":
        shown = "; ".join(r.set_aside[:4]) + (f"; and {len(r.set_aside) - 4} more" if len(r.set_aside) > 4 else "")
        return (f"no setting can pay for itself; each needs tau of at least eval.min_mean_accepted_length and a "
                f"measured speedup that tau can explain (at most {IMPLAUSIBLE_OVER_TAU:g} tau / min(1, v)), and every "
                f"one failed: {shown}")
    if r.basis == "below_one":
        best = r.best_measured
        lo, hi = interval(best)
        why = ("its whole interval lies below 1" if hi < 1.0 else
               "slower than the target alone on the measurement (its interval reaches 1, so not clearly slower, "
               "but no setting was measured faster and the target alone needs no draft)")
        return f"the fastest setting ({_named(best)}) measured {_fmt(best['measured_speedup'])}x " \
               f"[{_fmt(lo)}, {_fmt(hi)}]: {why}"
    text = ("chosen on measured speedup: its measured speedup interval lies above every other setting's"
            if r.basis == "measured" else _tie_words(r))
    if r.set_aside:
        text += "; set aside first: " + "; ".join(r.set_aside[:4]) + (
            f"; and {len(r.set_aside) - 4} more" if len(r.set_aside) > 4 else "")
    return text


def noisy_reasons(doc: dict, domain: str, decision: dict, max_relative_width: float) -> list[str]:
    """Why the timing of ``domain`` is not to be trusted (empty: it is not marked noisy); ``decision``: the
    chosen (or, for the target alone, the fastest) setting's numbers as a dict."""
    out = []
    lo, hi = interval(decision) if decision.get("measured_speedup") is not None else (math.nan, math.nan)
    s = num(decision.get("measured_speedup"))
    if not math.isnan(s) and s > 0 and (hi - lo) / s > max_relative_width:
        out.append(f"speedup interval [{_fmt(lo)}, {_fmt(hi)}] is wider than {max_relative_width:g} x the "
                   f"estimate (eval.noisy_relative_width)")
    tau = num(decision.get("mean_accepted_length"))
    bound = speedup_bound(decision, doc.get("verify_cost_ratio"))
    if not math.isnan(s) and tau > 0 and s > IMPLAUSIBLE_OVER_TAU * bound:
        out.append(f"measured speedup {_fmt(s)}x exceeds the mean accepted length {_fmt(tau)}"
                   + (f" over the verify cost ratio ({_fmt(bound)})" if bound != tau else "")
                   + ": a verify step emits tau tokens on average for one verify forward, so the speedup cannot be "
                     "much above that")
    load = (doc.get("timing") or {}).get("machine_load", {}).get(domain)
    if load and load.get("overloaded"):
        peak = max(load["loadavg_before"][0], load["loadavg_after"][0])
        if load.get("other_load") is None:
            out.append(f"load average {peak:.2f} above the {load['cores']} cores while timing")
        else:
            out.append(f"other processes kept {load['other_load']:.2f} cores busy while timing (load average "
                       f"{peak:.2f}, this evaluation {load['own_cores']:.2f} of {load['cores']} cores)")
    return out


def add_decisions(doc: dict, noisy_relative_width: float = 0.5) -> None:
    """Decide every domain of ``doc``: ``doc["recommendation"][domain]`` = the :class:`Decision`'s JSON form plus
    its ``reason`` (:func:`explain`); ``doc["noisy"]`` = domains marked noisy. Each decision is checked by the
    oracle :func:`eval.decision_check.check_consistent` (a failure is logged and recorded as
    ``consistency_error``)."""
    from .metrics import domains_of

    rec = {}
    min_tau = (doc.get("context") or {}).get("min_mean_accepted_length")
    min_tau = float(MIN_MEAN_ACCEPTED_LENGTH if min_tau is None else min_tau)  # 0 is a setting (let every draft in)
    doc["min_mean_accepted_length"] = min_tau
    for d in domains_of(doc):
        r, ruled = decide_domain(candidates(doc, d), min_tau, doc.get("verify_cost_ratio"))
        try:
            if r.basis != "low_tau":  # low_tau: no setting left to check the rule against
                check_consistent(r, ruled)
        except AssertionError as e:  # a bug in the rule: say so in the report rather than lose the evaluation
            log.error("the decision for %s does not follow from its numbers: %s", d, e)
            r = r.with_(consistency_error=str(e))
        timed = r.as_dict() if r.action == SPECULATE else {**r.as_dict(), **(r.best_measured or {})}
        r = r.with_(noisy_reasons=noisy_reasons(doc, d, timed, noisy_relative_width))
        rec[d] = {**r.as_dict(), "reason": explain(r)}
    doc["recommendation"] = rec
    doc["noisy"] = [d for d, r in rec.items() if r["noisy"]]
    doc["noisy_relative_width"] = noisy_relative_width


# ------------------------------------------------------------------------------------------------ flags
def _low_tau_drafts(doc: dict, domain: str) -> tuple[dict[str, float], list[str]]:
    """``({draft: its highest tau over every gamma and policy measured}, drafts below
    eval.alert_mean_accepted_length)``."""
    taus = {}
    for n, by_domain in doc["drafts"].items():
        e = by_domain.get(domain)
        if e is not None:
            vals = [num(x.get("mean_accepted_length")) for x in
                    [e, *e.get("sweep", {}).values(), *e.get("policies", {}).values()]]
            taus[n] = max((v for v in vals if not math.isnan(v)), default=math.nan)
    return taus, [n for n, t in taus.items() if not t >= doc["alert_mean_accepted_length"]]


def flags(doc: dict, domain: str) -> list[str]:
    """Short flags of a domain's verdict: ``tie``, ``not clearly > 1``, ``NOISY``, ``RE-MEASURE`` (a setting measured
    faster than its tau allows was set aside: disturbed timing), ``ALERT`` (every draft's tau
    below ``eval.alert_mean_accepted_length``), ``LOSSLESS CHECK FAILED``, ``INCONSISTENT`` (the oracle disagreed)."""
    r = doc["recommendation"].get(domain) or {}
    out = []
    if r.get("basis") == "tie":
        out.append("tie")
    if r.get("action") == SPECULATE and interval(r)[0] < 1.0:
        out.append("not clearly > 1")
    if r.get("noisy"):
        out.append("NOISY")
    if any("disturbed timing" in x for x in r.get("set_aside") or []):
        out.append("RE-MEASURE")  # a setting measured faster than its tau allows was set aside
    taus, low = _low_tau_drafts(doc, domain)
    if taus and len(low) == len(taus):
        out.append("ALERT")
    lossless = [x["lossless"] for by_domain in doc["drafts"].values() if domain in by_domain
                for x in [*by_domain[domain]["sweep"].values(), *by_domain[domain].get("policies", {}).values()]]
    if False in lossless:
        out.append("LOSSLESS CHECK FAILED")
    if r.get("consistency_error"):
        out.append("INCONSISTENT")
    return out


def _why_target_alone(doc: dict, r: dict) -> str:
    """Why a domain goes to the target alone, in a few words, naming the actual reasons."""
    if r["basis"] == "below_one":
        return "no setting measured faster than the target alone"
    if r["basis"] != "low_tau":
        return r["basis"]
    floor = doc.get("min_mean_accepted_length", MIN_MEAN_ACCEPTED_LENGTH)
    n = r.get("set_aside_reasons") or {}
    parts = ([f"best tau {_fmt(r.get('highest_tau'))} < {floor:g}"] if n.get("low_tau") or n.get("no_tau") else []) \
        + ([f"{n['disturbed']} setting(s) faster than tau allows (re-measure)"] if n.get("disturbed") else [])
    return "no setting pays for itself: " + "; ".join(parts or ["none measured"])


def verdict_line(doc: dict, domain: str) -> str:
    """One short line (at most about 40 words): what to deploy on ``domain``, its numbers, the basis and flags."""
    r = doc["recommendation"].get(domain)
    if r is None or r["action"] == "none":
        return f"{domain}: no measurement."
    if r["action"] == TARGET_ONLY:
        best = r.get("best_measured") or r
        line = f"decode with the target alone: {_why_target_alone(doc, r)}" + (
            f" (fastest {_named(best)}, {_speedup(best)})." if r["basis"] == "below_one" else ".")
    else:
        e = setting_entry(doc, domain, r) or r
        line = (f"use {_named(r)}: measured speedup {_speedup(e)}, tau {_fmt(e.get('mean_accepted_length'))}; "
                + ("intervals separated." if r["basis"] == "measured" else "tie, broken by the cost model."))
    marks = [f for f in flags(doc, domain) if f != "tie"]
    return line + (" " + ", ".join(f"**{f}**" for f in marks) + "." if marks else "")


# ------------------------------------------------------------------------------------------------ sections
def verdicts_table(doc: dict) -> list[str]:
    """Markdown rows: per domain what to deploy, the measured speedup [interval], tau (for the target alone after
    every setting was set aside: the best tau measured) and the flags."""
    level = int(round(100 * doc.get("confidence", 0.95)))
    lines = [f"| domain | deploy | measured speedup [{level}% CI] | tau | flags |", "|---|---|---|---|---|"]
    for d, r in doc["recommendation"].items():
        if r["action"] == SPECULATE:
            e = setting_entry(doc, d, r) or r
            what, speed, tau = _named(r), _speedup(e), _fmt(e.get("mean_accepted_length"))
        else:
            best = r.get("best_measured") or {}
            what = "target alone" if r["action"] == TARGET_ONLY else "no measurement"
            speed = "-" if not best else ("1.00x (no draft setting pays for itself)" if r["basis"] == "low_tau" else
                                          f"1.00x (fastest draft setting {_speedup(best)})")
            tau = _fmt(r.get("highest_tau")) if r["basis"] == "low_tau" else "-"
        lines.append(f"| {d} | {what} | {speed} | {tau} | {', '.join(flags(doc, d)) or '-'} |")
    return lines


def verdicts_section(doc: dict) -> str:
    """The ``## Verdicts`` section that opens ``report.md`` (printed as it is by ``python -m eval`` and ``python -m
    train``): the table, one short line per domain, then the caveats of the timing (trials, machine load, noisy
    domains) and of the deployment projection."""
    lines = ["## Verdicts", ""] + verdicts_table(doc) + [""]
    lines += [f"- **{d}**: {doc['verdicts'][d]}" for d in doc["verdicts"]]
    routing = (doc.get("context") or {}).get("draft_routing") or {}
    for d, x in (routing.get("target_only") or {}).items():
        lines.append(f"- **{d}**: decoded with the target alone (routed to no draft by `{routing.get('table')}`): "
                     f"{_fmt(x.get('tokens_per_s'), 1)} tokens/s.")
    notes = _timing_notes(doc)
    if doc.get("deployment"):
        notes.append(f"Projected speedups are not measured: {doc['deployment']['formula']}; c from "
                     f"{doc['deployment']['source']}.")
    return "\n".join(lines + ([""] + notes if notes else []))


def _timing_notes(doc: dict) -> list[str]:
    t = doc.get("timing") or {}
    loads = list((t.get("machine_load") or {}).values())
    notes = []
    if t:
        notes.append(f"Timing: {t.get('timing_trials', 1)} trial(s) per decode, speculative and target-only "
                     f"interleaved prompt by prompt; speedup intervals resample prompts and trials (paired).")
    if loads:
        peak = max(max(x["loadavg_before"][0], x["loadavg_after"][0]) for x in loads)
        other = [x["other_load"] for x in loads if x.get("other_load") is not None]
        notes.append(f"Machine load while timing: 1-minute load average up to {peak:.2f} on {loads[0]['cores']} "
                     f"core(s)" + (f", of which other processes up to {max(other):.2f}" if other else "")
                     + (" (other processes competed for the cores: timings include waiting for a core)."
                        if any(x["overloaded"] for x in loads) else "."))
    if doc.get("noisy"):
        notes.append(f"Noisy timing in {len(doc['noisy'])} domain(s) ({', '.join(doc['noisy'])}): re-measure on a "
                     f"quiet machine, or with more eval.timing_trials / eval.max_prompts, before relying on their "
                     f"speed numbers.")
    return notes


def _reasoning(doc: dict, d: str, r: dict) -> str:
    """The paragraph of one domain in "How each verdict was reached"."""
    text = r["reason"][0].upper() + r["reason"][1:] + "."
    if r["action"] == SPECULATE:
        e = setting_entry(doc, d, r) or {}
        text += (f" Leviathan's formula expects {_fmt(e.get('expected_speedup'))}x"
                 + (f", the measured parts {_fmt(e['expected_speedup_components'])}x"
                    if e.get("expected_speedup_components") is not None else "") + ".")
        if r.get("draft_length_policy", "fixed") != "fixed":
            text += f" Mean draft length {_fmt(e.get('mean_draft_length'))}."
        if e.get("projected_speedup") is not None:
            text += f" Projected on the deployment: {_fmt(e['projected_speedup'])}x."
        for n, by_domain in doc["drafts"].items():
            o = setting_entry(doc, d, {**r, "draft": n}) if n != r["draft"] and d in by_domain else None
            if o is not None:
                text += f" `{n}` at the same setting: tau {_fmt(o['mean_accepted_length'])}, " \
                        f"{_fmt(o['measured_speedup'])}x."
    else:
        text += f" routing.json routes {d} to no draft."
    taus, low = _low_tau_drafts(doc, d)
    alert = doc["alert_mean_accepted_length"]
    if taus and len(low) == len(taus):
        text += (f" ALERT: mean accepted length below {alert:g} (eval.alert_mean_accepted_length) for every draft "
                 f"at every setting (best {_fmt(max(taus.values()))}): adapt a draft to this domain.")
    elif low:
        text += f" Below the alert threshold (tau < {alert:g}): " + ", ".join(f"`{n}` ({_fmt(taus[n])})"
                                                                             for n in low) + "."
    if r.get("noisy"):
        text += " NOISY timing: " + "; ".join(r["noisy_reasons"]) + "."
    if r.get("consistency_error"):
        text += f" The decision fails its consistency check ({r['consistency_error']}): a bug, please report it."
    return text


def reasoning_section(doc: dict) -> list[str]:
    """``## How each verdict was reached``: per domain the rule's path (ties, cost model, settings set aside), the
    cost models' expectations, the other drafts at the same setting and the caveats behind each flag."""
    lines = ["", "## How each verdict was reached", "",
             "The rule (docs/configuration.md, \"Verdicts\"): the fastest measured setting when its interval lies above "
             "every other one; among overlapping intervals the cost model's pick; the target alone when nothing "
             "measured at least 1x or no setting reaches tau eval.min_mean_accepted_length.", ""]
    return lines + [f"- **{d}**: {_reasoning(doc, d, r)}" for d, r in doc["recommendation"].items()
                    if r["action"] != "none"]
