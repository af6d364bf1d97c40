"""Report files: ``metrics.json`` (machine-readable), ``report.md`` (verdicts, tables, plots), ``per_prompt.csv``.

``metrics.json`` is built by :func:`eval.metrics.aggregate` from exactly the rows written to ``per_prompt.csv``.
Every file is written atomically (temp name in the same folder, then rename).

The verdicts of an evaluation in words: the decisions of :mod:`eval.decision` (one :class:`Decision` per domain),
their caveats (noisy timing, low acceptance, a failed lossless check) and their rendering.

``report.md`` opens with :func:`verdicts_section`: a table, one row per domain (what to deploy, measured speedup
[interval], tau, flags), then one short line per domain; ``python -m eval`` / ``python -m train`` print the same
section, so the two cannot disagree. The reasoning behind each decision (ties, the cost model, the settings set
aside) goes to :func:`reasoning_section`, "How each verdict was reached", further down.

A measurement is marked **noisy** (:func:`noisy_reasons`) when the chosen setting's interval is wider than
``eval.noisy_relative_width`` times its point estimate, its measured speedup exceeds tau / min(1, v) by more than
10 % (:func:`eval.decision.speedup_bound`), or other processes kept more than a quarter of a core busy while the
domain was timed (``eval.evaluate.load_record``).
"""
from __future__ import annotations

import csv
import io
import logging
import math
from pathlib import Path
from typing import Any

from core.runtime import describe_runtime
from core.io import fmt, fmt_interval, write_json_atomic, write_text_atomic
from eval.decision import (
    COMPONENTS_FORMULA,
    FORMULA,
    BREAK_EVEN,
    IMPLAUSIBLE_OVER_TAU,
    MIN_MEAN_ACCEPTED_LENGTH,
    SPECULATE,
    TARGET_ONLY,
    Decision,
    candidates,
    check_tau_floor,
    decide_domain,
    interval,
    label,
    num,
    setting_entry,
    speedup_bound,
)
from eval.evaluate import time_breakdown, time_breakdown_section
from eval.metrics import PER_PROMPT_COLUMNS, aggregate, domains_of, json_clean, row_to_csv

log = logging.getLogger(__name__)




def _named(c) -> str:
    """A setting as text: its draft in backticks, then :func:`eval.decision.label`."""
    draft = c["draft"] if isinstance(c, dict) else c.draft
    return f"`{draft}` with {label(c)}"


def _speedup(c) -> str:
    """``1.26x [1.09, 1.42]`` of a setting (dict or :class:`Decision`)."""
    s = c.get("measured_speedup") if isinstance(c, dict) else c.measured_speedup
    ci = c.get("measured_speedup_ci") if isinstance(c, dict) else c.measured_speedup_ci
    lo, hi = interval({"measured_speedup": s, "measured_speedup_ci": ci})
    return f"{fmt(s, '.2f')}x" + (f" [{fmt(lo, '.2f')}, {fmt(hi, '.2f')}]" if ci else "")


# ------------------------------------------------------------------------------------------------ reasoning
def _tie_words_doc(r: Decision) -> str:
    """Why a tie went where it did (rules 3-5 of :mod:`eval.decision`)."""
    best = r.best_measured
    how = (f"{COMPONENTS_FORMULA} from the measured tau, cost ratio c, verify cost ratio v_k of each k-token block "
           f"and loop overhead per step o" if r.model == "expected_speedup_components"
           else f"{FORMULA} from the measured acceptance and cost ratio c (the measured step costs, v_k and o, are "
                f"incomplete for these settings)")
    pool = {"above_one": " among those whose interval lies above 1",
            "at_least_one": " among those measured at least as fast as the target alone", "all": "",
            "displaced": (f" among the settings that both the measurement and the model rate faster than "
                          f"{_named(r.displaced)} ({fmt(r.displaced['measured_speedup'], '.2f')}x, expected "
                          f"{fmt(r.displaced.get(r.model), '.2f')}x), the pick among those whose interval lies above 1"
                          if r.displaced else "")}[r.tie_pool or "all"]
    chosen_model = getattr(r, r.model) if r.model else None
    if len(r.model_near) == 1:
        pick = f": the highest expected speedup {how} ({fmt(chosen_model, '.2f')}x)"
    else:
        err = 100 * (r.model_error or 0.0)
        pick = (f", the highest expected speedup {how}, {fmt(r.model_top, '.2f')}x at best, within whose own error (it "
                f"misses the measured speedups by {err:.0f}% here, median) {len(r.model_near)} settings lie "
                f"({', '.join(_named(c) for c in r.model_near)}): among them the highest measured speedup "
                f"({fmt(r.measured_speedup, '.2f')}x, expected {fmt(chosen_model, '.2f')}x)")
    if r.model_pick:
        pick += (f"; but {_named(r)}, measured {_speedup(r)}, lies wholly above that pick's "
                 f"{fmt(r.model_pick['measured_speedup'], '.2f')}x, so the measurement overrules the model")
    return (f"tie: the measured speedup intervals of {len(r.tied_with) + 1} settings overlap (fastest measured: "
            f"{_named(best)}, {_speedup(best)}), so the measurement cannot order them; chosen by the cost model"
            + pool + pick)


def explain(r: Decision) -> str:
    """The reasoning behind a decision, in one paragraph (the old ``reason``; ``metrics.json`` keeps it)."""
    if r.action == "none":
        return "no finite measured speedup"
    if r.basis == "low_tau":
        shown = "; ".join(r.set_aside[:4]) + (f"; and {len(r.set_aside) - 4} more" if len(r.set_aside) > 4 else "")
        return (f"no setting can pay for itself; each needs tau of at least eval.min_mean_accepted_length (or its "
                f"break-even) and a "
                f"measured speedup that tau can explain (at most {IMPLAUSIBLE_OVER_TAU:g} tau / min(1, v)), and every "
                f"one failed: {shown}")
    if r.basis == "below_one":
        best = r.best_measured
        lo, hi = interval(best)
        why = ("its whole interval lies below 1" if hi < 1.0 else
               "slower than the target alone on the measurement (its interval reaches 1, so not clearly slower, "
               "but no setting was measured faster and the target alone needs no draft)")
        return f"the fastest setting ({_named(best)}) measured {fmt(best['measured_speedup'], '.2f')}x " \
               f"[{fmt(lo, '.2f')}, {fmt(hi, '.2f')}]: {why}"
    text = ("chosen on measured speedup: its measured speedup interval lies above every other setting's"
            if r.basis == "measured" else _tie_words_doc(r))
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
        out.append(f"speedup interval [{fmt(lo, '.2f')}, {fmt(hi, '.2f')}] is wider than {max_relative_width:g} x the "
                   f"estimate (eval.noisy_relative_width)")
    tau = num(decision.get("mean_accepted_length"))
    bound = speedup_bound(decision, doc.get("verify_cost_ratio"))
    if not math.isnan(s) and tau > 0 and s > IMPLAUSIBLE_OVER_TAU * bound:
        out.append(f"measured speedup {fmt(s, '.2f')}x exceeds the mean accepted length {fmt(tau, '.2f')}"
                   + (f" over the verify cost ratio ({fmt(bound, '.2f')})" if bound != tau else "")
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
    its ``reason`` (:func:`explain`); ``doc["noisy"]`` = domains marked noisy. The rule lives in
    :func:`eval.decision.decide_domain` alone; the property tests check it against an independent oracle."""
    from eval.metrics import domains_of

    rec = {}
    min_tau = (doc.get("context") or {}).get("min_mean_accepted_length")
    min_tau = check_tau_floor(MIN_MEAN_ACCEPTED_LENGTH if min_tau is None else min_tau)  # 0: let every draft in
    doc["min_mean_accepted_length"] = min_tau
    for d in domains_of(doc):
        r, _ = decide_domain(candidates(doc, d), min_tau, doc.get("verify_cost_ratio"))
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
    below ``eval.alert_mean_accepted_length``), ``LOSSLESS CHECK FAILED``."""
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
    return out


def _why_target_alone(doc: dict, r: dict) -> str:
    """Why a domain goes to the target alone, in a few words, naming the actual reasons."""
    if r["basis"] == "below_one":
        return "no setting measured faster than the target alone"
    if r["basis"] != "low_tau":
        return r["basis"]
    floor = doc.get("min_mean_accepted_length", MIN_MEAN_ACCEPTED_LENGTH)
    n = r.get("set_aside_reasons") or {}
    floor = "its break-even" if floor == BREAK_EVEN else f"{float(floor):g}"
    parts = ([f"best tau {fmt(r.get('highest_tau'), '.2f')} < {floor}"] if n.get("low_tau") or n.get("no_tau") else []) \
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
        line = (f"use {_named(r)}: measured speedup {_speedup(e)}, tau {fmt(e.get('mean_accepted_length'), '.2f')}; "
                + ("intervals separated." if r["basis"] == "measured" else "tie, broken by the cost model."))
    marks = [f for f in flags(doc, domain) if f != "tie"]
    return line + (" " + ", ".join(f"**{f}**" for f in marks) + "." if marks else "")


# ------------------------------------------------------------------------------------------------ sections
def verdicts_table(doc: dict) -> list[str]:
    """Markdown rows: per domain what to deploy, the measured speedup [interval], tau (for the target alone after
    every setting was set aside: the best tau measured; when no draft measured faster: the fastest setting's) and
    the flags."""
    level = int(round(100 * doc.get("confidence", 0.95)))
    lines = [f"| domain | deploy | measured speedup [{level}% CI] | tau | flags |", "|---|---|---|---|---|"]
    for d, r in doc["recommendation"].items():
        if r["action"] == SPECULATE:
            e = setting_entry(doc, d, r) or r
            what, speed, tau = _named(r), _speedup(e), fmt(e.get("mean_accepted_length"), '.2f')
        else:
            best = r.get("best_measured") or {}
            what = "target alone" if r["action"] == TARGET_ONLY else "no measurement"
            speed = "-" if not best else ("1.00x (no draft setting pays for itself)" if r["basis"] == "low_tau" else
                                          f"1.00x (fastest draft setting {_speedup(best)})")
            tau = fmt(r.get("highest_tau") if r["basis"] == "low_tau" else best.get("mean_accepted_length"), '.2f') \
                if best or r["basis"] == "low_tau" else "-"
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
                     f"{fmt(x.get('tokens_per_s'), '.1f')} tokens/s.")
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
        text += (f" Leviathan's formula expects {fmt(e.get('expected_speedup'), '.2f')}x"
                 + (f", the measured parts {fmt(e['expected_speedup_components'], '.2f')}x"
                    if e.get("expected_speedup_components") is not None else "") + ".")
        if r.get("draft_length_policy", "fixed") != "fixed":
            text += f" Mean draft length {fmt(e.get('mean_draft_length'), '.2f')}."
        if e.get("projected_speedup") is not None:
            text += f" Projected on the deployment: {fmt(e['projected_speedup'], '.2f')}x."
        for n, by_domain in doc["drafts"].items():
            o = setting_entry(doc, d, {**r, "draft": n}) if n != r["draft"] and d in by_domain else None
            if o is not None:
                text += f" `{n}` at the same setting: tau {fmt(o['mean_accepted_length'], '.2f')}, " \
                        f"{fmt(o['measured_speedup'], '.2f')}x."
    else:
        text += f" routing.json routes {d} to no draft."
    taus, low = _low_tau_drafts(doc, d)
    alert = doc["alert_mean_accepted_length"]
    if taus and len(low) == len(taus):
        text += (f" ALERT: mean accepted length below {alert:g} (eval.alert_mean_accepted_length) for every draft "
                 f"at every setting (best {fmt(max(taus.values()), '.2f')}): adapt a draft to this domain.")
    elif low:
        text += f" Below the alert threshold (tau < {alert:g}): " + ", ".join(f"`{n}` ({fmt(taus[n], '.2f')})"
                                                                             for n in low) + "."
    if r.get("noisy"):
        text += " NOISY timing: " + "; ".join(r["noisy_reasons"]) + "."
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


SCHEMA_VERSION = 2
METRIC_FIELDS = ("acceptance_rate", "mean_accepted_length", "target_tokens_per_s", "speculative_tokens_per_s",
                 "measured_speedup", "expected_speedup", "cost_ratio", "num_prompts", "lossless")




def _ci(v: Any, ci: list | None, digits: int = 2, suffix: str = "") -> str:
    options = dict(exact_ints=True, text=True, booleans=("yes", "**NO**"))
    return fmt(v, f".{digits}f", suffix=suffix, **options) + fmt_interval(ci, f".{digits}f", **options)


def metrics_document(results: dict, context: dict, *, primary_num_draft_tokens: int | None = None,
                     bootstrap_samples: int = 1000, confidence: float = 0.95, seed: int = 0,
                     check_lossless: bool = True, alert_mean_accepted_length: float = 2.0,
                     noisy_relative_width: float = 0.5, deployment: dict | None = None) -> dict:
    """The ``metrics.json`` document (schema in docs/reports.md, "Report fields").

    ``recommendation.<domain>`` is the decision of :mod:`eval.decision` (a draft and setting, or the target alone),
    ``best_measured.<domain>`` the setting with the highest measured speedup; ``deployment``: the result of
    :func:`eval.decision.deployment_cost_ratios` (adds ``projected_speedup`` to every entry), or None.

    ``drafts.<draft>.<domain>`` holds the metrics at the primary gamma (``decode.num_draft_tokens``, or the swept
    value closest to it) plus ``sweep.<gamma>``; ``verdicts.<domain>`` the report's one-line verdict;
    ``timing``: ``timing_trials`` and the machine load per domain while timing.
    """
    gammas = list(results["num_draft_tokens"])
    primary = primary_num_draft_tokens if primary_num_draft_tokens is not None else gammas[0]
    primary = min(gammas, key=lambda x: (abs(x - primary), x))
    cost = {n: c["cost_ratio"] for n, c in results["cost_ratio"].items()}
    agg = aggregate(results["rows"], cost, primary_num_draft_tokens=primary, bootstrap_samples=bootstrap_samples,
                    confidence=confidence, seed=seed, check_lossless=check_lossless,
                    verify_cost_ratio=results.get("verify_cost_ratio"),
                    target_forward_s={n: c.get("target_forward_s") for n, c in results["cost_ratio"].items()})
    all_lossless = [e["lossless"] for by_domain in agg["drafts"].values() for entry in by_domain.values()
                    for e in [*entry["sweep"].values(), *entry.get("policies", {}).values()]
                    if e["lossless"] is not None]
    sampling = results.get("sampling") or {}
    doc = {
        "schema_version": SCHEMA_VERSION,
        "context": context,
        "num_draft_tokens": primary,
        "num_draft_tokens_swept": gammas,
        "draft_length_policies": results.get("draft_length_policy_settings")
        or {n: {"draft_length_policy": n} for n in results.get("draft_length_policies", [])},
        "max_new_tokens": results["max_new_tokens"],
        "sampling": sampling,
        "decoding": "sampling" if sampling.get("do_sample") else "greedy",
        "domain_sampling": results.get("domain_sampling") or {},
        "bootstrap_samples": bootstrap_samples,
        "confidence": confidence,
        "alert_mean_accepted_length": alert_mean_accepted_length,
        "truncated_prompts": results.get("truncated_prompts", 0),
        "cost_ratio": results["cost_ratio"],
        "lossless_all": all(all_lossless) if all_lossless else None,
        "drafts": agg["drafts"],
        "best_measured": agg["recommendation"],
        "vs_baseline": agg["vs_baseline"],
        "timing": {"timing_trials": results.get("timing_trials", 1), "machine_load": results.get("machine_load", {})},
        "verify_cost_ratio": results.get("verify_cost_ratio"),
        # where decoding time goes per draft and domain (eval/evaluate.py)
        "time_breakdown": time_breakdown(results["rows"], results["cost_ratio"], results.get("verify_cost_ratio"),
                                         agg["drafts"], primary),
    }
    from eval.decision import add_projection

    add_projection(doc, deployment)
    add_decisions(doc, noisy_relative_width)
    doc["verdicts"] = {d: verdict(doc, d) for d in domains_of(doc)}
    return json_clean(doc)


def setting_label(r: dict) -> str:
    """``num_draft_tokens=G`` for a fixed gamma, ``draft_length_policy=NAME`` for a policy (a recommendation or
    an entry)."""
    policy = r.get("draft_length_policy", "fixed")
    return f"num_draft_tokens={r['num_draft_tokens']}" if policy == "fixed" else f"draft_length_policy={policy}"


def verdict(doc: dict, domain: str) -> str:
    """One line: the decision of ``domain`` (see :func:`eval.report.verdict_line`)."""

    return verdict_line(doc, domain)


def histogram_text(hist: list[int]) -> str:
    """``"1:3 2:10 4:40"``: draft length : verify steps, lengths never used left out."""
    return " ".join(f"{k}:{h}" for k, h in enumerate(hist or []) if h) or "-"


def policy_label(name: str, settings: dict | None) -> str:
    """A policy and its parameters in words, e.g. ``adaptive (start 4, [1, 8], window 4, step 1)``."""
    s = settings or {}
    if name == "adaptive" and "min_draft_tokens" in s:
        return (f"adaptive (start {s['num_draft_tokens']}, [{s['min_draft_tokens']}, {s['max_draft_tokens']}], "
                f"window {s['adaptive_window']}, step {s['adaptive_step']})")
    if name == "confidence" and "confidence_threshold" in s:
        return f"confidence (threshold {s['confidence_threshold']:g}, at most {s['max_draft_tokens']})"
    return name


def policies_section(doc: dict) -> list[str]:
    """Markdown lines: per domain, every draft-length policy beside the fixed-gamma sweep (empty without
    policies)."""
    if not any(e.get("policies") for by_domain in doc["drafts"].values() for e in by_domain.values()):
        return []
    level = int(round(100 * doc["confidence"]))
    settings = doc.get("draft_length_policies") or {}
    lines = ["", f"## Draft-length policies ([{level}% CI])", "",
             "Each policy decodes the same prompts as the fixed-gamma sweep (parameters: `decode.*`). Expected "
             "speedup: Leviathan et al.'s Thm 3.8 with the token acceptance rate, pooled over the draft lengths "
             "actually used for a policy; expected from measured costs: tau / (mean(k c + v_k) + o), what ties are "
             "broken with (see Verdicts). Draft lengths used: `length:verify steps` (the last step of a prompt drafts "
             "fewer when fewer tokens remain).", "",
             "| domain | draft | setting | tau | acceptance rate | measured speedup | expected speedup | "
             "expected from measured costs | mean draft length | draft lengths used | lossless |", "|" + "---|" * 11]
    for d in domains_of(doc):
        rec = doc["recommendation"].get(d, {})
        for n, by_domain in doc["drafts"].items():
            entry = by_domain.get(d)
            if entry is None:
                continue
            rows = [(f"fixed gamma={g}", "fixed", e) for g, e in entry["sweep"].items()]
            rows += [(policy_label(p, settings.get(p)), p, e) for p, e in entry.get("policies", {}).items()]
            for label, policy, e in rows:
                best = rec.get("draft") == n and rec.get("draft_length_policy", "fixed") == policy and (
                    policy != "fixed" or rec.get("num_draft_tokens") == e["num_draft_tokens"])
                lines.append(f"| {d} | {n} | {'**' + label + '**' if best else label} | "
                             f"{_ci(e['mean_accepted_length'], e.get('mean_accepted_length_ci'))} | "
                             f"{fmt(e['acceptance_rate'], '.3f', exact_ints=True, text=True, booleans=('yes', '**NO**'))} | "
                             f"{_ci(e['measured_speedup'], e.get('measured_speedup_ci'), 2, 'x')} | "
                             f"{fmt(e['expected_speedup'], '.2f', exact_ints=True, text=True, booleans=('yes', '**NO**'))}x | "
                             f"{fmt(e.get('expected_speedup_components'), '.2f', exact_ints=True, text=True, booleans=('yes', '**NO**'))}"
                             f"{'x' if e.get('expected_speedup_components') is not None else ''} | "
                             f"{fmt(e.get('mean_draft_length'), '.2f', exact_ints=True, text=True, booleans=('yes', '**NO**'))} | "
                             f"{histogram_text(e.get('draft_length_histogram'))} | {fmt(e['lossless'], '.3f', exact_ints=True, text=True, booleans=('yes', '**NO**'))} |")
    lines += ["", "Bold: the recommended setting of the domain (see Verdicts: measured speedup where the intervals "
              "separate, else the cost model; none when decoding with the target alone)."]
    return lines


def _num(x) -> float:
    return float(x) if isinstance(x, (int, float)) and x is not None else float("nan")


def render_markdown(doc: dict, extra_sections: list[str] | None = None, plots: dict[str, str] | None = None,
                    sources: dict[str, list[tuple[str, str]]] | None = None) -> str:
    """``report.md`` of a metrics document: the title, the verdicts (a table, one row per domain, then a short
    line each), the run (target, drafts, decoding, costs), how each verdict was reached, the deployment
    projection, the comparison with the baseline, the summary table, policies, time breakdown, plots, per-domain
    tables, data sources and ``extra_sections`` (Markdown strings), in that order."""
    from eval.decision import deployment_section

    title, *run = _header_lines(doc)
    lines = [title, "", verdicts_section(doc), "", "## The run", *run[1:]]
    lines += reasoning_section(doc) + deployment_section(doc)
    lines += _baseline_lines(doc) + _summary_lines(doc) + policies_section(doc) + time_breakdown_section(doc)
    lines += _plot_lines(plots)
    lines += ["## Per domain", ""]
    for d in domains_of(doc):
        lines += _domain_lines(doc, d)
    if sources:
        lines += ["## Data sources", "", "| domain | sources (license) |", "|---|---|"]
        lines += [f"| {d} | " + ", ".join(f"{s} ({lic})" for s, lic in sources[d]) + " |"
                  for d in domains_of(doc) if d in sources] + [""]
    for s in extra_sections or []:
        lines += [s, ""]
    lines += ["Field meanings: see docs/reports.md in the specdraft repository, \"Report fields\". Every number here "
              "is recomputable from per_prompt.csv (eval.metrics.aggregate).", ""]
    return "\n".join(lines)


def _header_lines(doc: dict) -> list[str]:
    ctx, drafts, swept = doc["context"], list(doc["drafts"]), doc["num_draft_tokens_swept"]
    level = int(round(100 * doc["confidence"]))
    lines = [f"# specdraft acceptance report: {ctx.get('experiment_name', '')}", ""]
    lines += [f"- target: `{ctx.get('target')}`" + _target_words(ctx.get("target_model"), ctx.get("prompt_formats")),
              "- drafts: " + ", ".join(f"`{k}` (`{ctx.get('drafts', {}).get(k, '')}`)" for k in drafts),
              f"- decoding: {doc['decoding']}" + (f" {doc['sampling']}" if doc["decoding"] == "sampling" else "")
              + "".join(f"; {d}: " + (f"sampling {kw}" if kw else "greedy")
                        for d, kw in (doc.get("domain_sampling") or {}).items()) + f"; max_new_tokens {doc['max_new_tokens']}; num_draft_tokens (gamma) "
              + (f"swept over {swept}, tables at gamma = {doc['num_draft_tokens']}" if len(swept) > 1
                 else str(doc["num_draft_tokens"])),
              *([f"- runtime: {describe_runtime(ctx['runtime'])}"] if ctx.get("runtime") else []),
              f"- intervals: {level}% percentile bootstrap over prompts ({doc['bootstrap_samples']} resamples, "
              f"pooled ratio recomputed per resample, seed {ctx.get('seed')})",
              f"- lossless (speculative greedy output equals target-only greedy output on every prompt): "
              f"{fmt(doc['lossless_all'], '.3f', exact_ints=True, text=True, booleans=('yes', '**NO**'))}" + (" (not checked when sampling)" if doc["lossless_all"] is None else " (greedy domains)" if any((doc.get("domain_sampling") or {}).values()) else "")
              + _tie_words(doc)]
    if doc.get("truncated_prompts"):
        lines.append(f"- {doc['truncated_prompts']} prompt(s) were truncated from the left to eval.max_prompt_tokens")
    for name, v in ctx.get("draft_vocab", {}).items():
        lines.append(f"- draft vocabulary of `{name}`: {v['size']:,} of the target's {v['target_vocab_size']:,} ids "
                     f"(the most frequent in its {_COUNTED_ON.get(v.get('counted_on'), 'training text')}, which they "
                     f"cover {100 * v.get('counted_share_kept', float('nan')):.1f} %); other ids only come from the "
                     f"target's correction or bonus token")
    for name, c in doc["cost_ratio"].items():
        lines.append(f"- cost ratio c of `{name}`: {c['cost_ratio']:.3f} (draft forward "
                     f"{c['draft_forward_s'] * 1e3:.2f} ms, target forward {c['target_forward_s'] * 1e3:.2f} ms)")
    return lines


_COUNTED_ON = {"target_answers": "target's generated training answers", "training_blocks": "training text"}


def _tie_words(doc: dict) -> str:
    """`` (N decodes parted from target-only at a numerical tie ...)`` or ``""``."""
    entries = [e for by_domain in doc["drafts"].values() for d in by_domain.values()
               for e in [*d["sweep"].values(), *d.get("policies", {}).values()]]
    n = sum(int(e.get("numerical_ties") or 0) for e in entries)
    if not n:
        return ""
    gap = max(e["numerical_tie_max_gap"] for e in entries if e.get("numerical_tie_max_gap") is not None)
    return (f"; {n} decode(s) parted from target-only at a numerical tie: at the first differing position the "
            f"emitted token's logit is within {gap:.1e} of the target's top logit in an independent full forward, "
            f"a rounding difference between a verify block and a one-token forward, not a decoder fault "
            f"(per_prompt.csv numerical_tie_gap)")


def _target_words(m: dict | None, formats: dict | None = None) -> str:
    """`` (<gguf file> from the package ...; llama, 30 layers, ...; chat template used)``: the target's shape from
    ``context.target_model`` (:func:`target_description`)."""
    if not m:
        return ""
    src = m.get("converted_from") or {}
    name = (f"{src['gguf_file']} from the package {src.get('package')} {src.get('package_version') or ''}".strip()
            + "; ") if src.get("gguf_file") else ""
    vocab = m.get("vocab_size")
    vocab = f"{vocab:,}" if isinstance(vocab, int) else str(vocab)
    used = any(str(f).startswith("chat_template") for fs in (formats or {}).values() for f in fs) \
        if formats else m.get("chat_template")
    chat = ("chat template used" if used else "chat template not used: see Prompt format") if m.get("chat_template") \
        else "no chat template"
    return (f" ({name}{m.get('model_type')}, {m.get('num_layers')} layers, hidden {m.get('hidden_size')}, "
            f"{m.get('num_heads')} query / {m.get('num_kv_heads')} key-value heads, vocabulary {vocab}, "
            f"{(m.get('parameters') or 0) / 1e6:.1f}M parameters, context {m.get('max_position_embeddings')}; {chat})")


def _baseline_lines(doc: dict) -> list[str]:
    if not doc.get("vs_baseline"):
        return []
    domains, level = domains_of(doc), int(round(100 * doc["confidence"]))
    lines = ["", f"## Against the cross-entropy baseline (gamma = {doc['num_draft_tokens']})", "",
             f"Mean accepted length of each draft / that of `baseline` on the same prompts ([{level}% CI], "
             f"paired bootstrap over prompts).", "",
             "| draft | " + " | ".join(domains) + " |", "|---|" + "---|" * len(domains)]
    for n, by_domain in doc["vs_baseline"].items():
        cells = [("-" if (v := by_domain.get(d)) is None else
                  _ci(v["mean_accepted_length_ratio"], v["ci"], 2, "x")) for d in domains]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def _summary_lines(doc: dict) -> list[str]:
    level = int(round(100 * doc["confidence"]))
    lines = ["", f"## Summary (gamma = {doc['num_draft_tokens']}; [{level}% CI])", "",
             "| domain | draft | acceptance rate | mean accepted length | measured speedup | expected speedup | "
             "target tok/s | speculative tok/s | best gamma | lossless |", "|" + "---|" * 10]
    for d in domains_of(doc):
        for n in doc["drafts"]:
            e = doc["drafts"][n].get(d)
            if e is None:
                continue
            lines.append(f"| {d} | {n} | {_ci(e['acceptance_rate'], e['acceptance_rate_ci'])} | "
                         f"{_ci(e['mean_accepted_length'], e['mean_accepted_length_ci'])} | "
                         f"{_ci(e['measured_speedup'], e['measured_speedup_ci'], 2, 'x')} | "
                         f"{fmt(e['expected_speedup'], '.2f', exact_ints=True, text=True, booleans=('yes', '**NO**'))}x | {fmt(e['target_tokens_per_s'], '.1f', exact_ints=True, text=True, booleans=('yes', '**NO**'))} | "
                         f"{fmt(e['speculative_tokens_per_s'], '.1f', exact_ints=True, text=True, booleans=('yes', '**NO**'))} | {e['best_num_draft_tokens']} | "
                         f"{fmt(e['lossless'], '.3f', exact_ints=True, text=True, booleans=('yes', '**NO**'))} |")
    return lines


def _plot_lines(plots: dict[str, str] | None) -> list[str]:
    if not plots:
        return []
    titles = {"acceptance_by_domain": "Acceptance by domain", "accepted_length_histograms": "Accepted-length histograms",
              "speedup_vs_num_draft_tokens": "Speedup vs num_draft_tokens (measured and Leviathan)",
              "per_position_acceptance": "Per-position acceptance"}
    lines = ["", "## Plots", ""]
    for k, rel in plots.items():
        lines += [f"### {titles.get(k, k)}", "", f"![{titles.get(k, k)}]({rel})", ""]
    return lines


def _domain_lines(doc: dict, d: str) -> list[str]:
    drafts, swept = list(doc["drafts"]), doc["num_draft_tokens_swept"]
    lines = [f"### {d}", "", "| draft | gamma | alpha | token alpha | tau (expected) | draft time s | "
             "verify time s | target latency P50/P95/P99 s | speculative latency P50/P95/P99 s | prompts |",
             "|" + "---|" * 10]
    for n in drafts:
        e = doc["drafts"][n].get(d)
        if e is None:
            continue
        tl, sl = e["target_latency_s"], e["speculative_latency_s"]
        lines.append(
            f"| {n} | {e['num_draft_tokens']} | {fmt(e['acceptance_rate'], '.3f', exact_ints=True, text=True, booleans=('yes', '**NO**'))} | "
            f"{fmt(e['token_acceptance_rate'], '.3f', exact_ints=True, text=True, booleans=('yes', '**NO**'))} | {fmt(e['mean_accepted_length'], '.2f', exact_ints=True, text=True, booleans=('yes', '**NO**'))} "
            f"({fmt(e['expected_mean_accepted_length'], '.2f', exact_ints=True, text=True, booleans=('yes', '**NO**'))}) | {fmt(e['draft_time_s'], '.3f', exact_ints=True, text=True, booleans=('yes', '**NO**'))} | "
            f"{fmt(e['verify_time_s'], '.3f', exact_ints=True, text=True, booleans=('yes', '**NO**'))} | {fmt(tl['p50'], '.3f', exact_ints=True, text=True, booleans=('yes', '**NO**'))}/{fmt(tl['p95'], '.3f', exact_ints=True, text=True, booleans=('yes', '**NO**'))}/{fmt(tl['p99'], '.3f', exact_ints=True, text=True, booleans=('yes', '**NO**'))} | "
            f"{fmt(sl['p50'], '.3f', exact_ints=True, text=True, booleans=('yes', '**NO**'))}/{fmt(sl['p95'], '.3f', exact_ints=True, text=True, booleans=('yes', '**NO**'))}/{fmt(sl['p99'], '.3f', exact_ints=True, text=True, booleans=('yes', '**NO**'))} | {e['num_prompts']} |")
    lines += ["", "Per-position acceptance (P(token i accepted | earlier accepted)): " + "; ".join(
        f"`{n}` " + ", ".join(fmt(x, '.2f', exact_ints=True, text=True, booleans=('yes', '**NO**')) for x in doc["drafts"][n][d]["per_position_acceptance"])
        for n in drafts if d in doc["drafts"][n]), ""]
    if len(swept) <= 1:
        return lines
    lines += ["| gamma | " + " | ".join(f"{n}: tau / measured / expected speedup" for n in drafts) + " |",
              "|" + "---|" * (1 + len(drafts))]
    for g in swept:
        cells = []
        for n in drafts:
            e = doc["drafts"][n].get(d, {}).get("sweep", {}).get(str(g))
            cells.append("n/a" if e is None else
                         f"{fmt(e['mean_accepted_length'], '.2f', exact_ints=True, text=True, booleans=('yes', '**NO**'))} / "
                         f"{_ci(e['measured_speedup'], e['measured_speedup_ci'], 2, 'x')} / "
                         f"{fmt(e['expected_speedup'], '.2f', exact_ints=True, text=True, booleans=('yes', '**NO**'))}x")
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    r = doc["recommendation"].get(d)
    if r and r.get("draft"):
        lines += ["", f"Recommended for {d}: `{r['draft']}` with {setting_label(r)}."]
    elif r:
        lines += ["", f"Recommended for {d}: decode with the target alone."]
    return lines + [""]


def write_per_prompt_csv(path: Path, rows: list[dict]) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(PER_PROMPT_COLUMNS))
    w.writeheader()
    w.writerows(row_to_csv(r) for r in rows)
    write_text_atomic(path, buf.getvalue())


def write_report(out_dir: str | Path, results: dict, context: dict, extra_sections: list[str] | None = None, *,
                 primary_num_draft_tokens: int | None = None, bootstrap_samples: int = 1000,
                 confidence: float = 0.95, seed: int = 0, check_lossless: bool = True,
                 alert_mean_accepted_length: float = 2.0, plots: bool = True,
                 sources: dict[str, list[tuple[str, str]]] | None = None, noisy_relative_width: float = 0.5,
                 deployment: dict | None = None) -> dict:
    """Write ``per_prompt.csv``, ``metrics.json``, ``plots/*.png`` and ``report.md`` into ``out_dir`` (each
    atomically); returns the metrics document (with ``plots``: name -> path relative to ``out_dir``).

    ``extra_sections``: Markdown strings, or callables ``f(doc) -> str`` called on the metrics document before it
    is written (they may add keys to it, which then appear in ``metrics.json``)."""
    out_dir = Path(out_dir)
    doc = metrics_document(results, context, primary_num_draft_tokens=primary_num_draft_tokens,
                           bootstrap_samples=bootstrap_samples, confidence=confidence, seed=seed,
                           check_lossless=check_lossless, alert_mean_accepted_length=alert_mean_accepted_length,
                           noisy_relative_width=noisy_relative_width, deployment=deployment)
    extra_sections = [s(doc) if callable(s) else s for s in extra_sections or []]
    # The numbers first: a failure while drawing plots must never lose the measurements.
    write_per_prompt_csv(out_dir / "per_prompt.csv", results["rows"])
    doc["plots"] = {}
    write_json_atomic(out_dir / "metrics.json", doc)
    rel: dict[str, str] = {}
    if plots:
        from eval.plots import write_plots

        rel = {k: str(p.relative_to(out_dir)) for k, p in
               write_plots(doc, out_dir, alert=alert_mean_accepted_length).items()}
        doc["plots"] = rel
        write_json_atomic(out_dir / "metrics.json", doc)
    write_text_atomic(out_dir / "report.md", render_markdown(doc, extra_sections, rel, sources))
    return doc


def target_description(target, tokenizer) -> dict:
    """What the report says of the target: architecture, layers, hidden size, heads, vocabulary, parameters, context,
    whether its tokenizer has a chat template, and where a converted target came from (its ``specdraft.json``)."""
    from data.text import chat_template_of

    c = target.config
    out = {"model_type": getattr(c, "model_type", None), "num_layers": getattr(c, "num_hidden_layers", None),
           "hidden_size": getattr(c, "hidden_size", None), "num_heads": getattr(c, "num_attention_heads", None),
           "num_kv_heads": getattr(c, "num_key_value_heads", None), "vocab_size": getattr(c, "vocab_size", None),
           "parameters": sum(int(p.numel()) for p in target.parameters()),
           "max_position_embeddings": getattr(c, "max_position_embeddings", None),
           "chat_template": chat_template_of(tokenizer) is not None}
    from core.errors import CheckpointError
    from models.checkpoints import read_specdraft_meta

    path = getattr(c, "_name_or_path", None)
    try:
        src = read_specdraft_meta(path).extra.get("source") if path and Path(str(path)).is_dir() else None
    except CheckpointError:  # a damaged specdraft.json only loses this line of the report
        src = None
    if isinstance(src, dict):
        out["converted_from"] = src
    return out
