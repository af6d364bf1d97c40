"""Per-domain decisions (which draft and draft length to deploy, or none), their caveats, and the projected speedup
on the deployment, from an evaluation's metrics document.

One function renders the verdicts (:func:`verdicts_section`): ``report.md`` embeds it and ``python -m eval`` /
``python -m train`` print it, so the two cannot disagree.

Decision rule of a domain (:func:`decide`), over every measured setting (draft x gamma, draft x draft-length policy):

1. ``best`` = the setting with the highest measured speedup (point estimate).
2. If ``best``'s measured speedup is below 1, no setting was measured faster than the target alone here: the
   verdict is **decode with the target alone** (``routing.json`` routes the domain to no draft), whether its whole
   interval lies below 1 or the interval still reaches 1 (then speculation is not clearly slower, but nothing
   measured says it is faster, and the target alone needs no draft). Recommending a setting measured at 0.89x
   because its interval reached 1.07 was recommending the slower path.
3. The settings whose interval overlaps ``best``'s (upper end >= ``best``'s lower end) are *tied* with it: the
   measurement cannot order them. Without ties ``best`` is chosen on the measured speedup. With ties the choice
   among ``best`` and the tied settings measured at least 1x (only those whose interval lies wholly above 1, when
   there are any: measured clearly faster than the target alone; unless settings beat that choice on both the
   measured and the expected speedup, then among those: :func:`tie_scope`) is the highest expected speedup of the
   measured cost model, ``tau / (mean(k c + v_k) + o)`` over the setting's verify steps
   (:func:`decode.stats.expected_speedup_from_costs`: its measured mean accepted length tau, the measured cost
   ratio c, the measured verify cost ratio v_k of a k-token block and the loop's measured own work per step o, in
   one-position target forwards); the verdict says "tie" and why. Without measured verify cost ratios (an older
   ``metrics.json``) the model is Leviathan et al. 2023, Thm 3.8, ``(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c +
   1))`` (v = 1, per-token acceptance alpha) for every setting. The verify forward's cost decides between gammas on
   a CPU: with v = 1 the model preferred gamma 3 (measured 1.22x) to gamma 4 (1.47x) in a ``distill_med`` run whose
   4-position verify forward cost 1.97 one-token forwards and the 5-position one 1.46.
4. The model is not exact either: its error in the domain is the median of ``|ln(measured / expected)|`` over the
   domain's settings (:func:`model_error`). Settings whose expected speedup is within that error of the highest
   are ones the model cannot order (:func:`model_near_top`); among them the highest measured speedup is chosen
   (then the higher tau). A later ``distill_med`` run: medical gamma 3 expected 1.46x and gamma 4 1.44x, a 1.4 %
   margin, where the model missed the five gammas' measurements by 4 % (median); measured, gamma 4 gave 1.48x and
   gamma 3 1.38x.

The interval filter gives way because prompt-to-prompt spread widens a long draft's interval more than a short
one's: on the AVX-512 Xeon a ``distill_med`` re-evaluation (medical, 5 prompts) measured gamma 1 1.20x [1.02,
1.50] and gamma 4 1.32x [0.89, 1.90] (expected 1.30x and 1.56x); the filter alone recommended gamma 1, the setting
both the measurement and the model call slower.

5. The measurement overrules a tie-break it contradicts: a tied setting whose whole interval lies above the pick's
   measured speedup replaces the pick (:func:`surer_than`; the highest measured such one). A model that expects a
   wide-interval gamma 6 at 1.55x cannot make it (1.20x [1.02, 1.50]) the choice over gamma 2 at 1.40x [1.35, 1.45].

So no decision recommends a setting measured slower than the target alone (speedup below 1).

Before the rule runs, settings that cannot pay for themselves are set aside (:func:`paying_settings`): a mean
accepted length tau below ``eval.min_mean_accepted_length`` (1.5 by default: each verify step costs at least one
target forward plus gamma draft forwards, so a draft that adds half a token per step is slower than the target
alone wherever the evaluation measured it; a loaded SmolLM2 run recommended drafts at tau 1.00 and 1.04 on measured
1.10x and 1.84x), and a measured speedup above ``1.1 tau / min(1, v)`` (physically out of reach, see below: the
timing was disturbed; v is the setting's measured verify cost ratio, :func:`speedup_bound`). When no setting is left the domain goes to the target alone, and the verdict says why.

A measurement is marked **noisy** when the chosen setting's interval is wider than ``eval.noisy_relative_width``
times its point estimate, its measured speedup exceeds its mean accepted length tau (over the verify cost ratio v
where v < 1) by more than 10 % (physically out of reach: each verify step costs one verify forward and yields tau
tokens), or other processes
kept more than a quarter of a core busy while the domain was timed (the machine's busy CPU time minus the
evaluation's own; ``eval.evaluate.load_record``).
"""
from __future__ import annotations

import logging
import math
import statistics
from typing import Any

from decode.stats import expected_speedup, expected_speedup_mixture

log = logging.getLogger(__name__)

TARGET_ONLY = "target_only"
SPECULATE = "speculate"
FORMULA = "(1 - alpha^(gamma+1)) / ((1 - alpha) (gamma c + 1))"  # Leviathan et al. 2023, Thm 3.8 (eq. 1)
COMPONENTS_FORMULA = "tau / (mean(k c + v_k) + o)"  # decode.stats.expected_speedup_from_costs
# speedup <= tau t_1 / t_verify: a verify step yields tau tokens for one verify forward of cost v t_1 (v = the
# measured verify cost ratio of the setting's block; at least 1 on most machines, but where the decoder's one-token
# forward is the slower path, as on SmolLM2 on the 2-core EPYC: v(2 positions) = 0.65, the bound is tau / v); 10 %
# above that allows timing noise
IMPLAUSIBLE_OVER_TAU = 1.1


def speedup_bound(c: dict, verify_cost_ratio: dict | None) -> float:
    """The most a setting with mean accepted length tau can measure: ``tau / min(1, v)``, v the measured verify
    cost ratio of its block (``num_draft_tokens + 1`` positions; for a draft-length policy the smallest measured);
    NaN when tau is unknown."""
    tau = _num(c.get("mean_accepted_length"))
    vs = {str(k): _num((x or {}).get("verify_cost_ratio")) for k, x in (verify_cost_ratio or {}).items()}
    if (c.get("draft_length_policy") or "fixed") == "fixed":
        v = vs.get(str(c.get("num_draft_tokens")), math.nan)
    else:
        v = min((x for x in vs.values() if not math.isnan(x)), default=math.nan)
    return tau / min(1.0, v) if not math.isnan(v) and v > 0 else tau


def _num(x) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else math.nan


def _fmt(v: Any, digits: int = 2) -> str:
    x = _num(v)
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


def _key(x) -> float:
    """A sort key of a number: NaN / missing last."""
    v = _num(x)
    return -math.inf if math.isnan(v) else v


def interval(c: dict) -> tuple[float, float]:
    """(low, high) of a candidate's measured speedup interval; its point estimate twice without an interval."""
    ci = c.get("measured_speedup_ci")
    s = _num(c.get("measured_speedup"))
    if ci and len(ci) == 2 and not any(math.isnan(_num(v)) for v in ci):
        return min(_num(ci[0]), _num(ci[1])), max(_num(ci[0]), _num(ci[1]))
    return s, s


def _fastest_order(c: dict) -> tuple:
    """Sort key of "the fastest measured setting": the measured speedup, then (equal estimates) the higher upper
    bound of its interval, the smaller gamma, the draft name."""
    return _num(c["measured_speedup"]), interval(c)[1], -(c["num_draft_tokens"] or 0), c["draft"]


def label(c: dict) -> str:
    """``num_draft_tokens=G`` or ``draft_length_policy=NAME`` of a candidate."""
    p = c.get("draft_length_policy") or "fixed"
    return f"num_draft_tokens={c['num_draft_tokens']}" if p == "fixed" else f"draft_length_policy={p}"


def _named(c: dict) -> str:
    """A candidate as text: its draft in backticks, then :func:`label`."""
    return f"`{c['draft']}` with {label(c)}"


def candidates(doc: dict, domain: str) -> list[dict]:
    """Every measured setting of ``domain``: ``{"draft", "draft_length_policy", "num_draft_tokens",
    "measured_speedup", "measured_speedup_ci", "expected_speedup", "mean_accepted_length", ...}``."""
    out = []
    for draft, by_domain in doc["drafts"].items():
        entry = by_domain.get(domain)
        if entry is None:
            continue
        items = [("fixed", e) for e in entry["sweep"].values()] + list(entry.get("policies", {}).items())
        for policy, e in items:
            out.append({"draft": draft, "draft_length_policy": policy, "num_draft_tokens": e["num_draft_tokens"],
                        "measured_speedup": e["measured_speedup"], "measured_speedup_ci": e.get("measured_speedup_ci"),
                        "expected_speedup": e.get("expected_speedup"),
                        "expected_speedup_components": e.get("expected_speedup_components"),
                        "mean_accepted_length": e.get("mean_accepted_length"),
                        "mean_accepted_length_ci": e.get("mean_accepted_length_ci"),
                        "mean_draft_length": e.get("mean_draft_length"),
                        "projected_speedup": e.get("projected_speedup")})
    return out


def model_field(pool: list[dict]) -> str:
    """The cost model a tie is broken with: ``expected_speedup_components`` (measured tau, c and v_k) when every
    setting of ``pool`` has it, else Leviathan's ``expected_speedup`` (v = 1) for all of them (one model for the
    whole comparison)."""
    if pool and all(not math.isnan(_num(c.get("expected_speedup_components"))) for c in pool):
        return "expected_speedup_components"
    return "expected_speedup"


def model_error(cands: list[dict], field: str) -> float:
    """How far the cost model ``field`` is from the measurement in these settings: the median over ``cands`` of
    ``|ln(measured_speedup / model)|`` (0.05: about 5 %); NaN when no setting has both numbers."""
    ratios = [_num(c.get("measured_speedup")) / _num(c.get(field)) for c in cands
              if _num(c.get("measured_speedup")) > 0 and _num(c.get(field)) > 0]
    errs = [abs(math.log(r)) for r in ratios if 0 < r < math.inf]
    return float(statistics.median(errs)) if errs else math.nan


def model_near_top(pool: list[dict], cands: list[dict], field: str) -> tuple[list[dict], float]:
    """The settings of ``pool`` the cost model ``field`` cannot tell from its best one: those whose expected speedup
    is within the model's own error (:func:`model_error` over all of the domain's settings ``cands``) of the
    highest, ``ln(top / model) <= error``; just the highest when the error is unknown; the whole pool when no
    setting has a model value. Returns ``(settings, error)``."""
    vals = [_num(c.get(field)) for c in pool]
    finite = [v for v in vals if v > 0]
    err = model_error(cands, field)
    if not finite:
        return list(pool), err
    top = max(finite)
    tol = err if not math.isnan(err) else 0.0
    return [c for c, v in zip(pool, vals) if v > 0 and math.log(top / v) <= tol + 1e-12], err


def _tie_pick_order(c: dict) -> tuple:
    """Among settings the cost model cannot tell apart: the highest measured speedup, then tau, then
    :func:`_fastest_order`."""
    return _num(c["measured_speedup"]), _key(c.get("mean_accepted_length")), _fastest_order(c)


def tie_scope(valid: list[dict], best: dict, tied: list[dict]) -> tuple[list[dict], str, list[dict], dict | None]:
    """The settings a tie is decided among (rule 3 of the module docstring), the cost model's field, the tied
    settings whose interval lies wholly above 1 and the setting those alone would give when others displace it.

    ``pool`` = ``best`` and the ``tied`` settings measured at least 1x. When some of them are measured clearly
    faster than the target alone (interval above 1: ``above``), the tie is decided among those, unless settings of
    the pool beat that pick (the model's choice among ``above``) on both the measured speedup and the expected one:
    then among those settings (the narrower interval of a short draft is no reason to deploy what both the
    measurement and the model call slower). Returns ``(scope, field, above, displaced or None)``."""
    pool = [best] + [c for c in tied if _num(c["measured_speedup"]) >= 1.0]  # never one measured below 1
    above = [c for c in pool if interval(c)[0] >= 1.0]  # measured clearly faster than the target alone
    field = model_field(pool)
    if not above:
        return pool, field, above, None
    pick = max(model_near_top(above, valid, field)[0], key=_tie_pick_order)
    faster = [c for c in pool if _num(c["measured_speedup"]) > _num(pick["measured_speedup"])
              and _num(c.get(field)) > _num(pick.get(field)) > 0]
    return (faster, field, above, pick) if faster else (above, field, above, None)


def surer_than(pick: dict, pool: list[dict]) -> dict:
    """``pick``, unless settings of ``pool`` measured at least 1x have their whole interval above ``pick``'s measured
    speedup (the measurement says they are faster more surely than a tie-break can overturn): then the highest
    measured of those (whose own interval then lies above every other such one's estimate, so one step suffices)."""
    surer = [c for c in pool if _num(c["measured_speedup"]) >= 1.0
             and interval(c)[0] > _num(pick["measured_speedup"])]
    return max(surer, key=_tie_pick_order) if surer else pick


def decide(cands: list[dict]) -> dict:
    """The decision for one domain from its measured settings (rule in the module docstring).

    Args:
        cands: candidates as :func:`candidates` builds them (at least ``draft``, ``draft_length_policy``,
            ``num_draft_tokens``, ``measured_speedup``, ``measured_speedup_ci`` ([low, high] or None),
            ``expected_speedup``, ``mean_accepted_length``; ``expected_speedup_components`` when measured).

    Returns:
        ``{"action": "speculate" | "target_only" | "none", "basis": "measured" | "tie" | "below_one" | "none",
        "draft", "draft_length_policy", "num_draft_tokens" (None for target_only / none), the chosen candidate's
        numbers, "best_measured": the highest measured setting, "tied_with": [labels], "reason": str}``.
    """
    valid = [c for c in cands if not math.isnan(_num(c.get("measured_speedup")))]
    if not valid:
        return {"action": "none", "basis": "none", "draft": None, "draft_length_policy": None,
                "num_draft_tokens": None, "tied_with": [], "best_measured": None,
                "reason": "no finite measured speedup"}
    best = max(valid, key=_fastest_order)
    lo, hi = interval(best)
    best_view = _view(best)
    if _num(best["measured_speedup"]) < 1.0:
        why = ("its whole interval lies below 1" if hi < 1.0 else
               "slower than the target alone on the measurement (its interval reaches 1, so not clearly slower, but "
               "no setting was measured faster and the target alone needs no draft)")
        return _target_only(best, "below_one", f"the fastest setting (`{best['draft']}` with {label(best)}) measured "
                                               f"{_fmt(best['measured_speedup'])}x [{_fmt(lo)}, {_fmt(hi)}]: {why}")
    tied = [c for c in valid if c is not best and interval(c)[1] >= lo]
    if not tied:
        chosen, basis = best, "measured"
        reason = "its measured speedup interval lies above every other setting's"
    else:
        scope, field, above, displaced = tie_scope(valid, best, tied)
        near, err = model_near_top(scope, valid, field)
        chosen = max(near, key=_tie_pick_order)
        model_pick, chosen = chosen, surer_than(chosen, [best] + tied)
        basis = "tie"
        how = (f"{COMPONENTS_FORMULA} from the measured tau, cost ratio c, verify cost ratio v_k of each "
               f"k-token block and loop overhead per step o" if field == "expected_speedup_components"
               else f"{FORMULA} from the measured acceptance and cost ratio c (the measured step costs, v_k and o, "
                    f"are incomplete for these settings)")
        top = max((_num(c.get(field)) for c in near), default=math.nan)
        pick = (f": the highest expected speedup {how} ({_fmt(chosen.get(field))}x)" if len(near) == 1 else
                f", the highest expected speedup {how}, {_fmt(top)}x at best, within whose own error (it misses "
                f"the measured speedups by {100 * err:.0f}% here, median) {len(near)} settings lie "
                f"({', '.join(_named(c) for c in near)}): among them the highest measured speedup "
                f"({_fmt(chosen['measured_speedup'])}x, expected {_fmt(chosen.get(field))}x)")
        if chosen is not model_pick:
            pick += (f"; but {_named(chosen)}, measured {_fmt(chosen['measured_speedup'])}x "
                     f"[{_fmt(interval(chosen)[0])}, {_fmt(interval(chosen)[1])}], lies wholly above that pick's "
                     f"{_fmt(model_pick['measured_speedup'])}x, so the measurement overrules the model")
        reason = (f"tie: the measured speedup intervals of {len(tied) + 1} settings overlap (fastest measured: "
                  f"`{best['draft']}` with {label(best)}, {_fmt(best['measured_speedup'])}x [{_fmt(lo)}, "
                  f"{_fmt(hi)}]), so the measurement cannot order them; chosen by the cost model"
                  + (f" among the settings that both the measurement and the model rate faster than "
                     f"{_named(displaced)} ({_fmt(displaced['measured_speedup'])}x, expected "
                     f"{_fmt(displaced.get(field))}x), the pick among those whose interval lies above 1"
                     if displaced is not None else
                     " among those whose interval lies above 1" if above else
                     " among those measured at least as fast as the target alone"
                     if any(_num(c["measured_speedup"]) < 1.0 for c in tied) else "") + pick)
    return {"action": SPECULATE, "basis": basis, **chosen, "best_measured": best_view,
            "tied_with": [f"{c['draft']}:{label(c)}" for c in tied], "reason": reason}


def check_consistent(decision: dict, cands: list[dict]) -> None:
    """Raise AssertionError when ``decision`` does not follow from ``cands`` by the rule above (used by the tests
    and on every report)."""
    valid = [c for c in cands if not math.isnan(_num(c.get("measured_speedup")))]
    if not valid:
        assert decision["action"] == "none"
        return
    top = max(_num(c["measured_speedup"]) for c in valid)
    best = [c for c in valid if _num(c["measured_speedup"]) == top]
    if decision["action"] == TARGET_ONLY:
        assert top < 1.0, "target alone although a setting was measured at least as fast as the target alone"
        return
    assert decision["action"] == SPECULATE
    chosen = [c for c in valid if c["draft"] == decision["draft"] and c["draft_length_policy"] ==
              decision["draft_length_policy"] and c["num_draft_tokens"] == decision["num_draft_tokens"]]
    assert chosen, "the decision names a setting that was not measured"
    c = chosen[0]
    assert _num(c["measured_speedup"]) >= 1.0, "recommends a setting measured slower than the target alone"
    b = max(valid, key=_fastest_order)
    if decision["basis"] == "measured":
        assert c is b and all(interval(o)[1] < interval(c)[0] for o in valid if o is not c), \
            "chosen on measured speedup although intervals overlap"
    else:
        assert decision["basis"] == "tie"
        assert interval(c)[1] >= interval(b)[0], "tie pick does not overlap the fastest setting"
        pool = [o for o in valid
                if o is b or (interval(o)[1] >= interval(b)[0] and _num(o["measured_speedup"]) >= 1.0)]
        assert any(o is c for o in pool), "tie pick not among the tied settings measured at least 1x"
        scope, field, above, displaced = tie_scope(valid, b, [o for o in pool if o is not b])
        if above and displaced is None:
            assert interval(c)[0] >= 1.0, "tie pick not among the tied settings measured above 1"
        if displaced is not None:  # the interval filter gave way: the pick beats its pick on both numbers
            assert _num(c["measured_speedup"]) > _num(displaced["measured_speedup"]) and \
                (_num(c.get(field)) > _num(displaced.get(field)) or
                 interval(c)[0] > _num(displaced["measured_speedup"])), \
                "the interval filter gave way to a setting no faster"
        near, _ = model_near_top(scope, valid, field)
        assert not any(interval(o)[0] > _num(c["measured_speedup"]) for o in pool), \
            "a tied setting's whole interval lies above the pick's measured speedup"
        model_pick = max(near, key=_tie_pick_order)
        if c is not model_pick:  # only a setting surely faster than the model's pick may replace it
            assert interval(c)[0] > _num(model_pick["measured_speedup"]), \
                "tie not broken by the cost model (nor by a setting measured surely faster than its pick)"
        else:
            assert _num(c["measured_speedup"]) == max(_num(o["measured_speedup"]) for o in near), \
                "among the settings the cost model cannot tell apart, not the highest measured speedup"


def adapter_decision(base_tau, base_ci, adapted_tau, adapted_ci) -> dict:
    """Keep a domain's adapter only where it measurably lifts acceptance: the adapted draft's tau interval lies
    wholly above the base draft's (``adapted_ci[0] > base_ci[1]``: the two 95% bootstrap intervals over prompts,
    :func:`eval.metrics.bootstrap_ratio_ci`, are separated). Overlapping intervals, an adapted interval below the
    base's, or a missing interval (``eval.bootstrap_samples=0``, no prompts) refuse the adapter: the measurement
    does not show that it helps.

    Args:
        base_tau, adapted_tau: pooled mean accepted lengths (tokens per verify step) on the domain's test prompts.
        base_ci, adapted_ci: their ``[low, high]`` intervals, or None.

    Returns:
        ``{"keep": bool, "basis": "separated" | "overlap" | "worse" | "no_interval", "reason": str}``.
    """
    def ci(c):
        return (_num(c[0]), _num(c[1])) if c and len(c) == 2 and not any(math.isnan(_num(v)) for v in c) else None

    b, a = ci(base_ci), ci(adapted_ci)
    nums = f"tau {_fmt(adapted_tau)} [{_fmt(a[0]) if a else 'n/a'}, {_fmt(a[1]) if a else 'n/a'}] adapted vs " \
           f"{_fmt(base_tau)} [{_fmt(b[0]) if b else 'n/a'}, {_fmt(b[1]) if b else 'n/a'}] base"
    if a is None or b is None:
        return {"keep": False, "basis": "no_interval",
                "reason": f"no interval to separate ({nums}; set eval.bootstrap_samples > 0): adapter not kept"}
    if a[0] > b[1]:
        return {"keep": True, "basis": "separated", "reason": f"intervals separated: {nums}"}
    if a[1] < b[0]:
        return {"keep": False, "basis": "worse", "reason": f"the adapted draft is worse, intervals separated: {nums}"}
    return {"keep": False, "basis": "overlap",
            "reason": f"intervals overlap ({nums}): the measurement does not show a lift"}


# ------------------------------------------------------------------------------------------------ deployment
def deployment_cost_ratios(deployment: dict | None, parameters: dict[str, int] | None,
                           target_parameters: int | None) -> dict | None:
    """The deployment's cost ratio c per draft from ``eval.deployment`` (None: no projection).

    ``cost_ratio`` given: that c for every draft. Else ``target_parameters`` and ``draft_parameters`` given: c =
    draft / target parameters (a memory-bound GPU at batch 1 reads every weight once per forward, so forward time
    is proportional to the parameter count). Else ``memory_bound: true``: the same with the evaluated models' own
    counts of the weights a forward reads (``parameters``: draft -> count, ``target_parameters``; the caller passes
    :func:`decode.timing.weights_read_per_token`: every parameter except an untied input embedding).

    Returns ``{"cost_ratio": {draft: c}, "source": str, "formula": str}`` or None."""
    d = dict(deployment or {})
    names = list(parameters or {})
    if d.get("cost_ratio") is not None:
        c = float(d["cost_ratio"])
        cr, source = {n: c for n in names}, f"eval.deployment.cost_ratio = {c:g}"
    elif d.get("target_parameters") and d.get("draft_parameters"):
        c = float(d["draft_parameters"]) / float(d["target_parameters"])
        cr = {n: c for n in names}
        source = (f"memory-bound at batch 1: c = draft / target parameters = {int(d['draft_parameters']):,} / "
                  f"{int(d['target_parameters']):,} = {c:.4f}")
    elif d.get("memory_bound") and target_parameters and parameters:
        cr = {n: p / target_parameters for n, p in parameters.items()}
        source = ("memory-bound at batch 1: c = each draft's / the target's weights read per token (the evaluated "
                  "models' parameters, an untied input embedding counted as the few rows a forward reads)")
    else:
        return None
    return {"cost_ratio": cr, "source": source, "formula": f"projected speedup = {FORMULA} (Leviathan et al. "
            f"2023, Thm 3.8) with the measured per-token acceptance alpha and the deployment's c"}


def add_projection(doc: dict, deployment: dict | None) -> None:
    """Add ``projected_speedup`` to every sweep / policy entry of ``doc`` and ``doc["deployment"]`` (None without
    a deployment), from ``deployment`` = :func:`deployment_cost_ratios`'s result."""
    doc["deployment"] = deployment
    if not deployment:
        return
    for draft, by_domain in doc["drafts"].items():
        c = deployment["cost_ratio"].get(draft)
        for entry in by_domain.values():
            items = [(None, e) for e in entry["sweep"].values()] + list(entry.get("policies", {}).items())
            for policy, e in items:
                a = _num(e.get("token_acceptance_rate"))
                if c is None or math.isnan(a):
                    e["projected_speedup"] = None
                elif policy is None:
                    e["projected_speedup"] = expected_speedup(a, int(e["num_draft_tokens"]), c)
                else:
                    hist = e.get("draft_length_histogram") or []
                    e["projected_speedup"] = expected_speedup_mixture(a, hist, c) if hist else None
            primary = entry["sweep"].get(str(entry["num_draft_tokens"]))
            entry["projected_speedup"] = primary.get("projected_speedup") if primary else None


# ------------------------------------------------------------------------------------------------ the document
def noisy_reasons(doc: dict, domain: str, decision: dict, max_relative_width: float) -> list[str]:
    """Why the timing of ``domain`` is not to be trusted (empty: it is not marked noisy)."""
    out = []
    lo, hi = interval(decision) if decision.get("measured_speedup") is not None else (math.nan, math.nan)
    s = _num(decision.get("measured_speedup"))
    if not math.isnan(s) and s > 0 and (hi - lo) / s > max_relative_width:
        out.append(f"speedup interval [{_fmt(lo)}, {_fmt(hi)}] is wider than {max_relative_width:g} x the "
                   f"estimate (eval.noisy_relative_width)")
    tau = _num(decision.get("mean_accepted_length"))
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


MIN_MEAN_ACCEPTED_LENGTH = 1.5  # eval.min_mean_accepted_length's default


def paying_settings(cands: list[dict], min_mean_accepted_length: float,
                    verify_cost_ratio: dict | None = None) -> tuple[list[dict], list[str]]:
    """``(kept, why_dropped)``: the settings that can pay for themselves (tau >= ``min_mean_accepted_length`` and a
    measured speedup within ``IMPLAUSIBLE_OVER_TAU`` times :func:`speedup_bound`), and one phrase per setting set
    aside."""
    kept, dropped = [], []
    for c in cands:
        tau, s = _num(c.get("mean_accepted_length")), _num(c.get("measured_speedup"))
        bound = speedup_bound(c, verify_cost_ratio)
        if math.isnan(tau) and min_mean_accepted_length > 0:  # no measured tau: nothing says it pays
            dropped.append(f"{_named(c)} (no measured tau)")
        elif tau < min_mean_accepted_length:
            dropped.append(f"{_named(c)} (tau {_fmt(tau)} < {min_mean_accepted_length:g})")
        elif not math.isnan(bound) and not math.isnan(s) and s > IMPLAUSIBLE_OVER_TAU * bound:
            dropped.append(f"{_named(c)} (measured {_fmt(s)}x above what its tau {_fmt(tau)} allows, "
                           f"{_fmt(bound)}x: disturbed timing)")
        else:
            kept.append(c)
    return kept, dropped


def _view(c: dict) -> dict:
    """A setting as a decision's ``best_measured`` names it."""
    return {k: c.get(k) for k in ("draft", "draft_length_policy", "num_draft_tokens", "measured_speedup",
                                  "measured_speedup_ci")}


def _target_only(best: dict, basis: str, reason: str) -> dict:
    """A decision for the target alone (``best``: the fastest setting measured, which it refuses)."""
    return {"action": TARGET_ONLY, "basis": basis, "draft": None, "draft_length_policy": None,
            "num_draft_tokens": None, "measured_speedup": best["measured_speedup"],
            "measured_speedup_ci": best.get("measured_speedup_ci"), "tied_with": [], "best_measured": _view(best),
            "reason": reason}


def _none_pay(cands: list[dict], dropped: list[str], min_tau: float) -> dict:
    shown = "; ".join(dropped[:4]) + (f"; and {len(dropped) - 4} more" if len(dropped) > 4 else "")
    return _target_only(max(cands, key=_fastest_order), "low_tau",
                        f"no setting can pay for itself (tau at least {min_tau:g}, a measured speedup within "
                        f"{IMPLAUSIBLE_OVER_TAU:g} tau / min(1, v)): {shown}")


def add_decisions(doc: dict, noisy_relative_width: float = 0.5) -> None:
    """Decide every domain of ``doc``: ``doc["recommendation"][domain]`` = :func:`decide`'s decision plus
    ``noisy`` / ``noisy_reasons``; ``doc["noisy"]`` = domains marked noisy. Each decision is checked against its
    numbers (:func:`check_consistent`; a failure is logged and recorded as ``consistency_error``)."""
    from .metrics import domains_of

    rec = {}
    min_tau = (doc.get("context") or {}).get("min_mean_accepted_length")
    min_tau = float(MIN_MEAN_ACCEPTED_LENGTH if min_tau is None else min_tau)  # 0 is a setting (let every draft in)
    doc["min_mean_accepted_length"] = min_tau
    for d in domains_of(doc):
        every = candidates(doc, d)
        cands, dropped = paying_settings(every, min_tau, doc.get("verify_cost_ratio"))
        valid = [c for c in every if not math.isnan(_num(c.get("measured_speedup")))]
        r = decide(cands) if cands or not valid else _none_pay(valid, dropped, min_tau)
        if dropped and r["action"] == SPECULATE:
            r["reason"] += "; set aside first: " + "; ".join(dropped[:4]) + (
                f"; and {len(dropped) - 4} more" if len(dropped) > 4 else "")
        r["set_aside"] = dropped
        try:
            if r["basis"] != "low_tau":  # low_tau: no setting left to check the rule against
                check_consistent(r, cands)
        except AssertionError as e:  # a bug in the rule: say so in the report rather than lose the evaluation
            log.error("the decision for %s does not follow from its numbers: %s", d, e)
            r["consistency_error"] = str(e)
        reasons = noisy_reasons(doc, d, r if r["action"] == SPECULATE else {**r, **(r.get("best_measured") or {})},
                                noisy_relative_width)
        r.update(noisy=bool(reasons), noisy_reasons=reasons)
        rec[d] = r
    doc["recommendation"] = rec
    doc["noisy"] = [d for d, r in rec.items() if r["noisy"]]
    doc["noisy_relative_width"] = noisy_relative_width


def verdict_line(doc: dict, domain: str) -> str:
    """One line: the decision of ``domain``, its numbers, why it was made, its caveats."""
    r = doc["recommendation"].get(domain)
    if r is None or r["action"] == "none":
        return f"{domain}: no measurement."
    alert = doc["alert_mean_accepted_length"]
    if r["action"] == TARGET_ONLY:
        line = f"decode with the target alone: {r['reason']}; routing.json routes {domain} to no draft."
    else:
        e = _entry(doc, domain, r)
        line = (f"use `{r['draft']}` with {label(r)}: measured speedup {_fmt(e['measured_speedup'])}x"
                + (f" [{_fmt(e['measured_speedup_ci'][0])}, {_fmt(e['measured_speedup_ci'][1])}]"
                   if e.get("measured_speedup_ci") else "")
                + f" (Leviathan expects {_fmt(e['expected_speedup'])}x"
                + (f", the measured parts {_fmt(e['expected_speedup_components'])}x"
                   if e.get("expected_speedup_components") is not None else "")
                + f"), tau {_fmt(e['mean_accepted_length'])}"
                + (f" [{_fmt(e['mean_accepted_length_ci'][0])}, {_fmt(e['mean_accepted_length_ci'][1])}]"
                   if e.get("mean_accepted_length_ci") else ""))
        if r.get("draft_length_policy", "fixed") != "fixed":
            line += f", mean draft length {_fmt(e.get('mean_draft_length'))}"
        if e.get("projected_speedup") is not None:
            line += f", projected on the deployment {_fmt(e['projected_speedup'])}x"
        for n, by_domain in doc["drafts"].items():
            if n != r["draft"] and domain in by_domain:
                o = _entry(doc, domain, {**r, "draft": n})
                if o is not None:
                    line += (f"; `{n}` at the same setting: tau {_fmt(o['mean_accepted_length'])}, "
                             f"{_fmt(o['measured_speedup'])}x")
        line += "."
        line += (" Chosen on measured speedup: " + r["reason"] + "." if r["basis"] == "measured"
                 else " " + r["reason"][0].upper() + r["reason"][1:] + ".")
        lo, _ = interval(r)
        if lo < 1.0:
            line += " Not clearly faster than the target alone (the interval includes 1)."
    taus = {n: _num(by_domain[domain]["mean_accepted_length"]) for n, by_domain in doc["drafts"].items()
            if domain in by_domain}
    low = [n for n, t in taus.items() if not t >= alert]
    if taus and len(low) == len(taus):
        line += (f" **ALERT**: mean accepted length below {alert:g} (eval.alert_mean_accepted_length) for every "
                 f"draft (best {_fmt(max(taus.values()))}): adapt a draft to this domain.")
    elif low:
        line += f" Below the alert threshold (tau < {alert:g}): " + ", ".join(
            f"`{n}` ({_fmt(taus[n])})" for n in low) + "."
    if r.get("noisy"):
        line += " **NOISY** timing: " + "; ".join(r["noisy_reasons"]) + "."
    lossless = [x["lossless"] for by_domain in doc["drafts"].values() if domain in by_domain
                for x in [*by_domain[domain]["sweep"].values(), *by_domain[domain].get("policies", {}).values()]]
    if False in lossless:
        line += " **LOSSLESS CHECK FAILED** (speculative greedy output differs from target-only)."
    return line


def _entry(doc: dict, domain: str, r: dict) -> dict | None:
    """The sweep / policy entry of draft ``r["draft"]`` at ``r``'s setting on ``domain`` (None: not measured)."""
    entry = doc["drafts"].get(r["draft"], {}).get(domain)
    if entry is None:
        return None
    policy = r.get("draft_length_policy") or "fixed"
    if policy != "fixed":
        return entry.get("policies", {}).get(policy)
    return entry["sweep"].get(str(r["num_draft_tokens"]))


def verdicts_section(doc: dict) -> str:
    """The ``## Verdicts`` section of ``report.md``, printed as it is by ``python -m eval`` and ``python -m train``:
    one line per domain, then the caveats of the timing (trials, machine load, noisy domains) and the deployment
    projection's formula."""
    lines = ["## Verdicts", ""]
    lines += [f"- **{d}**: {doc['verdicts'][d]}" for d in doc["verdicts"]]
    routing = (doc.get("context") or {}).get("draft_routing") or {}
    for d, x in (routing.get("target_only") or {}).items():
        lines.append(f"- **{d}**: decoded with the target alone (routed to no draft by `{routing.get('table')}`): "
                     f"{_fmt(x.get('tokens_per_s'), 1)} tokens/s.")
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
    if doc.get("deployment"):
        notes.append(f"Projected speedups are not measured: {doc['deployment']['formula']}; c from "
                     f"{doc['deployment']['source']}.")
    if notes:
        lines += [""] + notes
    return "\n".join(lines)


def deployment_section(doc: dict) -> list[str]:
    """Markdown lines: per domain, the recommended setting's measured speedup (this machine) beside its projected
    speedup on the deployment, and the gamma with the highest projected speedup (empty without
    ``eval.deployment``)."""
    dep = doc.get("deployment")
    if not dep:
        return []
    lines = ["", "## Projected speedup on the deployment (not measured)", "",
             f"{dep['formula']}; c from {dep['source']}. The measured speedup is this machine's.", "",
             "| domain | recommended | measured speedup (this machine) | projected speedup (deployment) | "
             "best projected setting |", "|---|---|---|---|---|"]
    for d, r in doc["recommendation"].items():
        best, best_p = None, -math.inf
        for c in candidates(doc, d):
            p = _num(c.get("projected_speedup"))
            if not math.isnan(p) and p > best_p:
                best, best_p = c, p
        best_txt = f"`{best['draft']}` with {label(best)}: {best_p:.2f}x" if best else "n/a"
        if r.get("action") == SPECULATE:
            e = _entry(doc, d, r) or {}
            ci = e.get("measured_speedup_ci")
            meas = f"{_fmt(e.get('measured_speedup'))}x" + (f" [{_fmt(ci[0])}, {_fmt(ci[1])}]" if ci else "")
            lines.append(f"| {d} | `{r['draft']}` with {label(r)} | {meas} | "
                         f"{_fmt(e.get('projected_speedup'))}x | {best_txt} |")
        else:
            lines.append(f"| {d} | target alone | {_fmt(r.get('measured_speedup'))}x (fastest setting) | - | "
                         f"{best_txt} |")
    return lines
