"""The decision of a domain as a value: which draft and draft length to deploy, or the target alone, and on what
basis. No wording here: :mod:`eval.report` renders a :class:`Decision`. This is the one place the rule lives; the
property tests check it against an independent oracle (tests/eval/decision_oracle.py).

Decision rule of a domain (:func:`decide`), over every measured setting (draft x gamma, draft x draft-length policy):

1. ``best`` = the setting with the highest measured speedup (point estimate).
2. If ``best``'s measured speedup is below 1, no setting was measured faster than the target alone here: the
   decision is **the target alone** (``routing.json`` routes the domain to no draft), whether its whole interval
   lies below 1 or the interval still reaches 1 (nothing measured says speculation is faster, and the target alone
   needs no draft). Recommending a setting measured at 0.89x because its interval reached 1.07 was recommending the
   slower path.
3. The settings whose interval overlaps ``best``'s (upper end >= ``best``'s lower end) are *tied* with it: the
   measurement cannot order them. Without ties ``best`` is chosen on the measured speedup (basis ``measured``).
   With ties (basis ``tie``) the choice among ``best`` and the tied settings measured at least 1x (only those whose
   interval lies wholly above 1, when there are any, unless settings beat that choice on both the measured and the
   expected speedup, then among those: :func:`tie_scope`) is the highest expected speedup of the measured cost
   model ``tau / (mean(k c + v_k) + o)`` (:func:`decode.stats.expected_speedup_from_costs`: measured tau, cost ratio
   c, verify cost ratio v_k of a k-token block, the loop's own work per step o, in one-position target forwards).
   Without measured verify cost ratios (an older ``metrics.json``) the model is Leviathan et al. 2023, Thm 3.8,
   ``(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1))`` (v = 1) for every setting. The verify forward's cost
   decides between gammas on a CPU: with v = 1 the model preferred gamma 3 (measured 1.22x) to gamma 4 (1.47x) in a
   ``distill_med`` run whose 4-position verify forward cost 1.97 one-token forwards and the 5-position one 1.46.
4. The model is not exact: its error in the domain is the median of ``|ln(measured / expected)|`` over the domain's
   settings (:func:`model_error`). Settings whose expected speedup is within that error of the highest are ones the
   model cannot order (:func:`model_near_top`); among them the highest measured speedup is chosen (then the higher
   tau). A ``distill_med`` run: medical gamma 3 expected 1.46x and gamma 4 1.44x where the model missed the five
   gammas' measurements by 4 % (median); measured, gamma 4 gave 1.48x and gamma 3 1.38x.
5. The measurement overrules a tie-break it contradicts: a tied setting whose whole interval lies above the pick's
   measured speedup replaces the pick (:func:`surer_than`). A model that expects a wide-interval gamma 6 at 1.55x
   cannot make it (1.20x [1.02, 1.50]) the choice over gamma 2 at 1.40x [1.35, 1.45].

The interval filter of rule 3 gives way because prompt-to-prompt spread widens a long draft's interval more than a
short one's: on the AVX-512 Xeon a ``distill_med`` re-evaluation measured gamma 1 1.20x [1.02, 1.50] and gamma 4
1.32x [0.89, 1.90] (expected 1.30x and 1.56x); the filter alone recommended gamma 1, which both the measurement and
the model call slower.

Before the rule runs, settings that cannot pay for themselves are set aside (:func:`paying_settings`): a mean
accepted length tau below ``eval.min_mean_accepted_length`` (1.5 by default: each verify step costs at least one
target forward plus gamma draft forwards; a loaded SmolLM2 run recommended drafts at tau 1.00 and 1.04 on measured
1.10x and 1.84x; ``break_even`` instead keeps a setting from the tau its own measured c and v need, :func:`tau_floor`,
so a lookup draft that costs almost nothing per drafted token is kept from a lower tau), and a measured speedup above ``1.1 tau / min(1, v)`` (:func:`speedup_bound`: a verify step emits
tau tokens for one verify forward of cost v, so more than that is disturbed timing, to be re-measured). When no
setting is left the domain goes to the target alone (basis ``low_tau``).

So no decision recommends a setting measured slower than the target alone, below the tau floor, or faster than its
own tau allows.

The deployment projection: the speedup Leviathan et al. 2023 (Thm 3.8) expects with the measured per-token
acceptance and the deployment's cost ratio c (``eval.deployment``), per setting, and its report section. Projected,
never measured: the report says so beside every projected number.

Writing the draft routing table (``routing.json``) from an evaluation's metrics; the decoder reads it with
:func:`decode.config.load_routing` (``decode.draft_routing=PATH``).

Route of a domain = the evaluation's decision ``recommendation.<domain>`` (:mod:`eval.decision`): the draft and
setting with the highest **measured speedup** where the intervals separate, else the cost model's pick among the
tied settings; a domain where even the fastest setting measured below 1x (its interval wholly below 1 or not) is
routed to no draft (``"target_only": true``: decode it with the target alone). Beside it the table keeps the numbers
behind the choice: for every candidate draft its measured speedup (with interval), mean accepted length, acceptance
rate and expected speedup at its best gamma.
``default`` (the fallback for a domain without a route, :func:`default_route`) is the (draft, fixed gamma) with the
highest geometric mean of measured speedup over every evaluated domain, among the pairs that pay for themselves in
each (tau floor, tau bound, at least 1x, as the decisions require) and whose draft some domain routes to; the target
alone when no pair qualifies.
"""
from __future__ import annotations

import math
import numbers
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from core.io import fmt, write_json_atomic
from decode.config import DEFAULT_KEY, SCHEMA
from decode.stats import expected_speedup, expected_speedup_mixture

TARGET_ONLY = "target_only"
SPECULATE = "speculate"
FORMULA = "(1 - alpha^(gamma+1)) / ((1 - alpha) (gamma c + 1))"  # Leviathan et al. 2023, Thm 3.8 (eq. 1)
COMPONENTS_FORMULA = "tau / (mean(k c + v_k) + o)"  # decode.stats.expected_speedup_from_costs
# speedup <= tau t_1 / t_verify: a verify step yields tau tokens for one verify forward of cost v t_1 (v = the
# measured verify cost ratio of the setting's block; where the one-token forward is the slower path, as on SmolLM2
# on the 2-core EPYC: v(2 positions) = 0.65, the bound is tau / v); 10 % above that allows timing noise
IMPLAUSIBLE_OVER_TAU = 1.1
MIN_MEAN_ACCEPTED_LENGTH = 1.5  # eval.min_mean_accepted_length's default
BREAK_EVEN = "break_even"  # eval.min_mean_accepted_length=break_even: each setting's own measured break-even tau
_SETTING_NUMBERS = ("measured_speedup", "measured_speedup_ci", "expected_speedup", "expected_speedup_components",
                    "mean_accepted_length", "mean_accepted_length_ci", "mean_draft_length", "projected_speedup")


@dataclass(frozen=True)
class Decision:
    """What to deploy on one domain and why, as data (rendered by :func:`eval.report.explain`).

    Attributes:
        action: ``"speculate"``, ``"target_only"`` or ``"none"`` (nothing measured).
        basis: ``"measured"`` (intervals separated), ``"tie"`` (chosen by the cost model among overlapping
            intervals), ``"below_one"`` (the fastest setting measured below 1x), ``"low_tau"`` (no setting pays for
            itself) or ``"none"``.
        draft, draft_length_policy, num_draft_tokens: the chosen setting (None for the target alone).
        measured_speedup, measured_speedup_ci, ...: the chosen setting's numbers; for the target alone those of
            the fastest setting measured, which it refuses.
        best_measured: the fastest measured setting (draft, policy, gamma, speedup, interval).
        tied_with: ``"draft:label"`` of the settings whose interval overlaps the fastest one's.
        set_aside: one phrase per setting set aside before the rule (:func:`paying_settings`);
            set_aside_reasons: how many for each reason (``low_tau``, ``no_tau``, ``disturbed``);
            highest_tau: (``low_tau`` decisions) the highest tau any setting of the domain measured.
        tie_pool: the settings a tie was decided among: ``"above_one"`` (intervals above 1), ``"at_least_one"``
            (measured at least 1x), ``"all"`` (every tied setting was), ``"displaced"`` (the interval filter gave
            way, see ``displaced``).
        model: the cost model field a tie was broken with (``expected_speedup_components`` or
            ``expected_speedup``); model_error: its median ``|ln(measured / model)|`` in the domain;
            model_top: its highest value in the pool; model_near: the settings it could not tell from that.
        model_pick: the cost model's pick, when the measurement overruled it (rule 5).
        displaced: the pick among intervals above 1 that gave way, with its expected speedup.
        noisy_reasons: why the timing is not to be trusted (empty: it is).
    """
    action: str
    basis: str
    draft: str | None = None
    draft_length_policy: str | None = None
    num_draft_tokens: int | None = None
    measured_speedup: float | None = None
    measured_speedup_ci: list | None = None
    expected_speedup: float | None = None
    expected_speedup_components: float | None = None
    mean_accepted_length: float | None = None
    mean_accepted_length_ci: list | None = None
    mean_draft_length: float | None = None
    projected_speedup: float | None = None
    best_measured: dict | None = None
    tied_with: list[str] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)
    set_aside_reasons: dict[str, int] = field(default_factory=dict)
    highest_tau: float | None = None
    tie_pool: str | None = None
    model: str | None = None
    model_error: float | None = None
    model_top: float | None = None
    model_near: list[dict] = field(default_factory=list)
    model_pick: dict | None = None
    displaced: dict | None = None
    noisy_reasons: list[str] = field(default_factory=list)

    @property
    def noisy(self) -> bool:
        return bool(self.noisy_reasons)

    def with_(self, **changes) -> "Decision":
        """A copy with ``changes`` (a decision is immutable)."""
        return replace(self, **changes)

    def as_dict(self) -> dict:
        """The JSON form ``metrics.json`` stores under ``recommendation.<domain>`` (plus ``noisy``)."""
        return {**asdict(self), "noisy": self.noisy}


def num(x) -> float:
    """``x`` as a float (numpy scalars too); NaN for None, booleans, strings, other non-numbers and infinities."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return math.nan
    return float(x) if math.isfinite(float(x)) else math.nan




def _key(x) -> float:
    """A sort key of a number: NaN / missing last."""
    v = num(x)
    return -math.inf if math.isnan(v) else v


def interval(c) -> tuple[float, float]:
    """(low, high) of a setting's measured speedup interval (a candidate dict or a :class:`Decision`), widened to
    hold its point estimate (a percentile bootstrap of very few resamples can miss it); the point estimate twice
    without an interval."""
    get = c.get if isinstance(c, dict) else lambda k: getattr(c, k, None)
    ci, s = get("measured_speedup_ci"), num(get("measured_speedup"))
    if ci and len(ci) == 2 and not any(math.isnan(num(v)) for v in ci):
        lo, hi = min(num(ci[0]), num(ci[1])), max(num(ci[0]), num(ci[1]))
        return (lo, hi) if math.isnan(s) else (min(lo, s), max(hi, s))
    return s, s


def _fastest_order(c: dict) -> tuple:
    """Sort key of "the fastest measured setting": the measured speedup, then (equal estimates) the higher upper
    bound of its interval, the smaller gamma, the draft name."""
    return num(c["measured_speedup"]), interval(c)[1], -(c["num_draft_tokens"] or 0), c["draft"]


def _tie_pick_order(c: dict) -> tuple:
    """Among settings the cost model cannot tell apart: the highest measured speedup, then tau, then
    :func:`_fastest_order`."""
    return num(c["measured_speedup"]), _key(c.get("mean_accepted_length")), _fastest_order(c)


def label(c) -> str:
    """``num_draft_tokens=G`` or ``draft_length_policy=NAME`` of a candidate dict or a :class:`Decision`."""
    get = c.get if isinstance(c, dict) else lambda k: getattr(c, k, None)
    p = get("draft_length_policy") or "fixed"
    return f"num_draft_tokens={get('num_draft_tokens')}" if p == "fixed" else f"draft_length_policy={p}"


def view(c: dict, *extra: str) -> dict:
    """A setting as a decision names it: draft, policy, gamma, measured speedup and interval (and ``extra`` keys)."""
    keys = ("draft", "draft_length_policy", "num_draft_tokens", "measured_speedup", "measured_speedup_ci", *extra)
    return {k: c.get(k) for k in keys}


def setting_entry(doc: dict, domain: str, r: dict) -> dict | None:
    """The sweep / policy entry of draft ``r["draft"]`` at ``r``'s setting on ``domain`` (None: not measured)."""
    entry = doc["drafts"].get(r["draft"], {}).get(domain)
    if entry is None:
        return None
    policy = r.get("draft_length_policy") or "fixed"
    if policy != "fixed":
        return entry.get("policies", {}).get(policy)
    return entry["sweep"].get(str(r["num_draft_tokens"]))


def candidates(doc: dict, domain: str) -> list[dict]:
    """Every measured setting of ``domain`` in a metrics document: ``{"draft", "draft_length_policy",
    "num_draft_tokens", "measured_speedup", "measured_speedup_ci", "expected_speedup", "mean_accepted_length",
    ...}``."""
    out = []
    for draft, by_domain in doc["drafts"].items():
        entry = by_domain.get(domain)
        if entry is None:
            continue
        items = [("fixed", e) for e in entry["sweep"].values()] + list(entry.get("policies", {}).items())
        out += [{"draft": draft, "draft_length_policy": policy, "num_draft_tokens": e["num_draft_tokens"],
                 **{k: e.get(k) for k in _SETTING_NUMBERS}} for policy, e in items]
    return out


def speedup_bound(c: dict, verify_cost_ratio: dict | None) -> float:
    """The most a setting with mean accepted length tau can measure: ``tau / min(1, v)``, v the measured verify
    cost ratio of its block (``num_draft_tokens + 1`` positions; for a draft-length policy the smallest measured);
    NaN when tau is unknown."""
    tau = num(c.get("mean_accepted_length"))
    vs = {str(k): num((x or {}).get("verify_cost_ratio")) for k, x in (verify_cost_ratio or {}).items()}
    if (c.get("draft_length_policy") or "fixed") == "fixed":
        v = vs.get(str(c.get("num_draft_tokens")), math.nan)
    else:
        v = min((x for x in vs.values() if not math.isnan(x)), default=math.nan)
    return tau / min(1.0, v) if not math.isnan(v) and v > 0 else tau


def model_field(pool: list[dict]) -> str:
    """The cost model a tie is broken with: ``expected_speedup_components`` (measured tau, c and v_k) when every
    setting of ``pool`` has it, else Leviathan's ``expected_speedup`` (v = 1) for all of them."""
    if pool and all(not math.isnan(num(c.get("expected_speedup_components"))) for c in pool):
        return "expected_speedup_components"
    return "expected_speedup"


def model_error(cands: list[dict], field_name: str) -> float:
    """The median over ``cands`` of ``|ln(measured_speedup / model)|`` for the cost model ``field_name`` (0.05:
    about 5 %); NaN when no setting has both numbers."""
    ratios = [num(c.get("measured_speedup")) / num(c.get(field_name)) for c in cands
              if num(c.get("measured_speedup")) > 0 and num(c.get(field_name)) > 0]
    errs = [abs(math.log(r)) for r in ratios if 0 < r < math.inf]
    return float(statistics.median(errs)) if errs else math.nan


def model_near_top(pool: list[dict], cands: list[dict], field_name: str) -> tuple[list[dict], float]:
    """The settings of ``pool`` the cost model cannot tell from its best one: expected speedup within the model's
    own error (:func:`model_error` over the domain's settings ``cands``) of the highest, ``ln(top / model) <=
    error``; just the highest when the error is unknown; the whole pool when no setting has a model value.
    Returns ``(settings, error)``."""
    vals = [num(c.get(field_name)) for c in pool]
    finite = [v for v in vals if v > 0]
    err = model_error(cands, field_name)
    if not finite:
        return list(pool), err
    top, tol = max(finite), (err if not math.isnan(err) else 0.0)
    return [c for c, v in zip(pool, vals) if v > 0 and math.log(top / v) <= tol + 1e-12], err


def tie_scope(valid: list[dict], best: dict, tied: list[dict]) -> tuple[list[dict], str, list[dict], dict | None]:
    """The settings a tie is decided among (rule 3), the cost model's field, the tied settings whose interval lies
    wholly above 1 and the pick those alone would give when others displace it.

    ``pool`` = ``best`` and the ``tied`` settings measured at least 1x. When some are measured clearly faster than
    the target alone (interval above 1: ``above``), the tie is decided among those, unless settings of the pool
    beat that pick on both the measured and the expected speedup: then among those. Returns ``(scope, field,
    above, displaced or None)``."""
    pool = [best] + [c for c in tied if num(c["measured_speedup"]) >= 1.0]
    above = [c for c in pool if interval(c)[0] >= 1.0]
    fld = model_field(pool)
    if not above:
        return pool, fld, above, None
    pick = max(model_near_top(above, valid, fld)[0], key=_tie_pick_order)
    faster = [c for c in pool if num(c["measured_speedup"]) > num(pick["measured_speedup"])
              and num(c.get(fld)) > num(pick.get(fld)) > 0]
    return (faster, fld, above, pick) if faster else (above, fld, above, None)


def surer_than(pick: dict, pool: list[dict]) -> dict:
    """``pick``, unless settings of ``pool`` measured at least 1x have their whole interval above ``pick``'s
    measured speedup: then the highest measured of those."""
    surer = [c for c in pool if c is not pick and num(c["measured_speedup"]) >= 1.0
             and interval(c)[0] > num(pick["measured_speedup"])]
    return max(surer, key=_tie_pick_order) if surer else pick


def _chosen(c: dict, basis: str, best: dict, **how) -> Decision:
    return Decision(action=SPECULATE, basis=basis, draft=c["draft"], draft_length_policy=c["draft_length_policy"],
                    num_draft_tokens=c["num_draft_tokens"], **{k: c.get(k) for k in _SETTING_NUMBERS},
                    best_measured=view(best), **how)


def target_alone(best: dict, basis: str, **how) -> Decision:
    """The target alone; ``best`` = the fastest setting measured (its numbers recorded, not deployed)."""
    return Decision(action=TARGET_ONLY, basis=basis, measured_speedup=best["measured_speedup"],
                    measured_speedup_ci=best.get("measured_speedup_ci"),
                    mean_accepted_length=best.get("mean_accepted_length"), best_measured=view(best), **how)


def decide(cands: list[dict]) -> Decision:
    """The decision for one domain from its measured settings (rule in the module docstring).

    Args:
        cands: settings as :func:`candidates` builds them (at least ``draft``, ``draft_length_policy``,
            ``num_draft_tokens``, ``measured_speedup``, ``measured_speedup_ci`` ([low, high] or None),
            ``expected_speedup``, ``mean_accepted_length``; ``expected_speedup_components`` when measured).

    Returns:
        a :class:`Decision`; ``action="none"`` when no setting has a finite measured speedup.
    """
    valid = [c for c in cands if not math.isnan(num(c.get("measured_speedup")))]
    if not valid:
        return Decision(action="none", basis="none")
    best = max(valid, key=_fastest_order)
    if num(best["measured_speedup"]) < 1.0:
        return target_alone(best, "below_one")
    tied = [c for c in valid if c is not best and interval(c)[1] >= interval(best)[0]]
    if not tied:
        return _chosen(best, "measured", best)
    scope, fld, above, displaced = tie_scope(valid, best, tied)
    near, err = model_near_top(scope, valid, fld)
    model_pick = max(near, key=_tie_pick_order)
    chosen = surer_than(model_pick, [best] + tied)
    pool = ("displaced" if displaced is not None else "above_one" if above else
            "at_least_one" if any(num(c["measured_speedup"]) < 1.0 for c in tied) else "all")
    return _chosen(chosen, "tie", best, tied_with=[f"{c['draft']}:{label(c)}" for c in tied], tie_pool=pool,
                   model=fld, model_error=None if math.isnan(err) else err,
                   model_top=max((num(c.get(fld)) for c in near), default=None),
                   model_near=[view(c, fld) for c in near],
                   model_pick=None if chosen is model_pick else view(model_pick, fld),
                   displaced=None if displaced is None else view(displaced, fld))


def paying_settings(cands: list[dict], min_mean_accepted_length: float | str,
                    verify_cost_ratio: dict | None = None) -> tuple[list[dict], list[str]]:
    """``(kept, why_dropped)``: the settings that can pay for themselves (tau >= :func:`tau_floor` and a
    measured speedup within ``IMPLAUSIBLE_OVER_TAU`` times :func:`speedup_bound`), and one phrase per setting set
    aside."""
    kept, dropped, _ = _sort_settings(cands, min_mean_accepted_length, verify_cost_ratio)
    return kept, dropped


def _sort_settings(cands: list[dict], min_mean_accepted_length: float | str,
                   verify_cost_ratio: dict | None) -> tuple[list[dict], list[str], dict[str, int]]:
    """One pass over ``cands``: the kept settings, one phrase per setting set aside, and how many per reason."""
    kept, dropped, reasons = [], [], {}
    for c in cands:
        why = set_aside_reason(c, min_mean_accepted_length, verify_cost_ratio)
        if why is None:
            kept.append(c)
            continue
        reasons[why] = reasons.get(why, 0) + 1
        tau, s, bound = num(c.get("mean_accepted_length")), num(c.get("measured_speedup")), \
            speedup_bound(c, verify_cost_ratio)
        name = f"`{c['draft']}` with {label(c)}"
        floor = tau_floor(c, min_mean_accepted_length)
        below = (f"tau {tau:.2f} < {floor:.2f}, its break-even at its measured c and v"
                 if min_mean_accepted_length == BREAK_EVEN and not math.isnan(num(c.get("expected_speedup_components")))
                 else f"tau {tau:.2f} < {floor:g}")
        also = ""  # a low tau measured faster than it allows: the timing is disturbed too (the flag RE-MEASURE)
        if why == "low_tau" and not math.isnan(bound) and not math.isnan(s) and s > IMPLAUSIBLE_OVER_TAU * bound:
            also = f"; measured {s:.2f}x, above the {bound:.2f}x it allows: disturbed timing, re-measure"
        dropped.append({"no_tau": f"{name} (no measured tau)",
                        "low_tau": f"{name} ({below}{also})",
                        "disturbed": f"{name} (measured {s:.2f}x above what its tau {tau:.2f} allows, {bound:.2f}x: "
                                     f"disturbed timing, re-measure)"}[why])
    return kept, dropped, reasons


def check_tau_floor(value) -> float | str:
    """``eval.min_mean_accepted_length`` as the decision reads it: a number >= 0 (tokens per verify step) or
    ``"break_even"``.

    Raises:
        ValueError: anything else, naming the two forms.
    """
    if isinstance(value, str) and value.strip() == BREAK_EVEN:
        return BREAK_EVEN
    try:
        floor = float(value)
    except (TypeError, ValueError):
        floor = math.nan
    if isinstance(value, bool) or not floor >= 0:
        raise ValueError(f"eval.min_mean_accepted_length must be a number >= 0 tokens per verify step (1 lets every "
                         f"draft through) or {BREAK_EVEN} (each setting's break-even tau at its measured costs), "
                         f"got {value!r}")
    return floor


def tau_floor(c: dict, min_mean_accepted_length: float | str) -> float:
    """The tau setting ``c`` must reach to be kept. A number: that number. ``"break_even"``: the tau at which the
    setting's own measured costs give 1x, ``tau / expected_speedup_components`` = ``mean(k c + v_k) + o`` (a verify
    step of cost ``k c + v_k`` target forwards emits tau tokens; Leviathan et al. 2023, Thm 3.8 with measured costs;
    :func:`decode.stats.expected_speedup_from_costs`), so a lookup draft (c near 0, v near 1) is kept from a lower tau
    than a draft that runs a model; :data:`MIN_MEAN_ACCEPTED_LENGTH` where the setting has no measured costs."""
    if min_mean_accepted_length != BREAK_EVEN:
        return float(min_mean_accepted_length)
    tau, e = num(c.get("mean_accepted_length")), num(c.get("expected_speedup_components"))
    return tau / e if e > 0 and not math.isnan(tau) else MIN_MEAN_ACCEPTED_LENGTH


def set_aside_reason(c: dict, min_mean_accepted_length: float | str,
                     verify_cost_ratio: dict | None = None) -> str | None:
    """Why setting ``c`` cannot pay for itself: ``"no_tau"`` (no measured tau), ``"low_tau"`` (tau below
    :func:`tau_floor`), ``"disturbed"`` (a measured speedup above ``IMPLAUSIBLE_OVER_TAU`` times
    :func:`speedup_bound`); None when it can."""
    tau, s = num(c.get("mean_accepted_length")), num(c.get("measured_speedup"))
    bound = speedup_bound(c, verify_cost_ratio)
    floor = tau_floor(c, min_mean_accepted_length)
    if math.isnan(tau) and floor > 0:  # no measured tau: nothing says it pays
        return "no_tau"
    if tau < floor:
        return "low_tau"
    if not math.isnan(bound) and not math.isnan(s) and s > IMPLAUSIBLE_OVER_TAU * bound:
        return "disturbed"
    return None


def paying_fixed(doc: dict, draft: str, domain: str) -> list[dict]:
    """The fixed-gamma settings of ``draft`` on ``domain`` that can pay for themselves (:func:`set_aside_reason` with
    the document's ``min_mean_accepted_length`` and verify cost ratios) and measured at least 1x: what an engine with
    a fixed draft length may be given (``serving.json``, ``routing.json``'s default)."""
    floor = doc.get("min_mean_accepted_length")
    floor = MIN_MEAN_ACCEPTED_LENGTH if floor is None else check_tau_floor(floor)
    return [c for c in candidates(doc, domain) if c["draft"] == draft and c["draft_length_policy"] == "fixed"
            and set_aside_reason(c, floor, doc.get("verify_cost_ratio")) is None
            and num(c.get("measured_speedup")) >= 1.0]


def decide_domain(every: list[dict], min_mean_accepted_length: float | str,
                  verify_cost_ratio: dict | None = None) -> tuple[Decision, list[dict]]:
    """:func:`paying_settings`, then :func:`decide` over what is left (the target alone, basis ``low_tau``, when
    nothing is). Returns ``(decision, the settings the rule ran over)``."""
    cands, dropped, reasons = _sort_settings(every, min_mean_accepted_length, verify_cost_ratio)
    valid = [c for c in every if not math.isnan(num(c.get("measured_speedup")))]
    measured_kept = [c for c in cands if not math.isnan(num(c.get("measured_speedup")))]
    if measured_kept or not valid:
        return decide(cands).with_(set_aside=dropped, set_aside_reasons=reasons), cands
    # the numbers recorded beside "target alone": the fastest setting whose timing its tau can explain; a speedup
    # above what tau allows (a disturbed timing) is never shown as the domain's measured speedup
    plausible = [c for c in valid if set_aside_reason(c, 0.0, verify_cost_ratio) != "disturbed"]
    best = max(plausible, key=_fastest_order) if plausible else \
        {**max(valid, key=_fastest_order), "measured_speedup": math.nan, "measured_speedup_ci": None}
    return target_alone(best, "low_tau", set_aside=dropped, set_aside_reasons=reasons,
                        highest_tau=max((num(c.get("mean_accepted_length")) for c in every
                                       if not math.isnan(num(c.get("mean_accepted_length")))), default=None)), cands


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
        return (num(c[0]), num(c[1])) if c and len(c) == 2 and not any(math.isnan(num(v)) for v in c) else None

    b, a = ci(base_ci), ci(adapted_ci)
    nums = f"tau {fmt(adapted_tau, '.2f')} [{fmt(a[0], '.2f') if a else 'n/a'}, {fmt(a[1], '.2f') if a else 'n/a'}] adapted vs " \
           f"{fmt(base_tau, '.2f')} [{fmt(b[0], '.2f') if b else 'n/a'}, {fmt(b[1], '.2f') if b else 'n/a'}] base"
    if a is None or b is None:
        return {"keep": False, "basis": "no_interval",
                "reason": f"no interval to separate ({nums}; set eval.bootstrap_samples > 0): adapter not kept"}
    if a[0] > b[1]:
        return {"keep": True, "basis": "separated", "reason": f"intervals separated: {nums}"}
    if a[1] < b[0]:
        return {"keep": False, "basis": "worse", "reason": f"the adapted draft is worse, intervals separated: {nums}"}
    return {"keep": False, "basis": "overlap",
            "reason": f"intervals overlap ({nums}): the measurement does not show a lift"}




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
                a = num(e.get("token_acceptance_rate"))
                if c is None or math.isnan(a):
                    e["projected_speedup"] = None
                elif policy is None:
                    e["projected_speedup"] = expected_speedup(a, int(e["num_draft_tokens"]), c)
                else:
                    hist = e.get("draft_length_histogram") or []
                    e["projected_speedup"] = expected_speedup_mixture(a, hist, c) if hist else None
            primary = entry["sweep"].get(str(entry["num_draft_tokens"]))
            entry["projected_speedup"] = primary.get("projected_speedup") if primary else None


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
            p = num(c.get("projected_speedup"))
            if not math.isnan(p) and p > best_p:
                best, best_p = c, p
        best_txt = f"`{best['draft']}` with {label(best)}: {best_p:.2f}x" if best else "n/a"
        if r.get("action") == SPECULATE:
            e = setting_entry(doc, d, r) or {}
            ci = e.get("measured_speedup_ci")
            meas = f"{fmt(e.get('measured_speedup'), '.2f')}x" + (f" [{fmt(ci[0], '.2f')}, {fmt(ci[1], '.2f')}]" if ci else "")
            lines.append(f"| {d} | `{r['draft']}` with {label(r)} | {meas} | "
                         f"{fmt(e.get('projected_speedup'), '.2f')}x | {best_txt} |")
        else:
            fastest = fmt(r.get("measured_speedup"), '.2f')
            lines.append(f"| {d} | target alone | {fastest}{'' if fastest == 'n/a' else 'x'} (fastest setting) | - | "
                         f"{best_txt} |")
    return lines


def _entry(doc: dict, draft: str, domain: str, gamma: int | None = None, policy: str = "fixed") -> dict:
    e = doc["drafts"][draft][domain]
    g = gamma if gamma is not None else e.get("best_num_draft_tokens", e["num_draft_tokens"])
    s = e["policies"][policy] if policy != "fixed" else e["sweep"].get(str(g), e)
    return {"num_draft_tokens": int(s["num_draft_tokens"]), "draft_length_policy": policy,
            "measured_speedup": s["measured_speedup"],
            "measured_speedup_ci": s.get("measured_speedup_ci"), "mean_accepted_length": s["mean_accepted_length"],
            "mean_accepted_length_ci": s.get("mean_accepted_length_ci"), "acceptance_rate": s["acceptance_rate"],
            "expected_speedup": s["expected_speedup"], "num_prompts": s.get("num_prompts")}


def _finite(x) -> float:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else -math.inf


def route_path(path: str | Path) -> str:
    """A draft's path as routing.json and serving.json write it: absolute, or a lookup draft's ``ngram:<kind>``."""
    return str(path) if str(path).startswith("ngram:") else str(Path(path).resolve())


def routing_table(doc: dict, draft_paths: dict[str, str | Path]) -> dict:
    """The routing document for a ``metrics.json`` document ``doc`` and the drafts' directories.

    Returns:
        ``{"schema", "metric": "measured_speedup", "num_draft_tokens_swept", "decoding", "target", "routes": {domain:
        {"draft", "path", "num_draft_tokens", "measured_speedup", ..., "candidates": {draft: numbers}}}, "default":
        {...}}`` (a domain of ``eval.domain_sampling`` also says its own ``decoding`` and ``sampling``).

    Raises:
        ValueError: a recommended draft has no path in ``draft_paths``.
    """
    missing = [n for n in doc["drafts"] if n not in draft_paths]
    if missing:
        raise ValueError(f"routing table: no checkpoint path for draft(s) {missing}")
    routes = {}
    own = doc.get("domain_sampling") or {}  # eval.domain_sampling: a domain measured under its own sampling
    for domain, rec in doc["recommendation"].items():
        name = rec["draft"]
        cands = {n: _entry(doc, n, domain) for n in doc["drafts"] if domain in doc["drafts"][n]}
        how = {"decoding": ("sampling" if own[domain] else "greedy"), "sampling": own[domain]} if domain in own else {}
        if name is None:  # the target alone is fastest: route to no draft
            routes[domain] = {"draft": None, "path": None, "target_only": True, "num_draft_tokens": None, **how,
                              "measured_speedup": rec.get("measured_speedup"),
                              "measured_speedup_ci": rec.get("measured_speedup_ci"),
                              "reason": rec.get("reason"), "candidates": cands}
            continue
        routes[domain] = {"draft": name, "path": route_path(draft_paths[name]), **how,
                          **_entry(doc, name, domain, rec["num_draft_tokens"], rec.get("draft_length_policy", "fixed")),
                          "candidates": cands}
    default = default_route(doc, routes, draft_paths)
    return {"schema": SCHEMA, "metric": "measured_speedup", "num_draft_tokens_swept": doc["num_draft_tokens_swept"],
            "decoding": doc.get("decoding"), "target": doc.get("context", {}).get("target"),
            "routes": routes, DEFAULT_KEY: default}


def default_route(doc: dict, routes: dict, draft_paths: dict[str, str | Path]) -> dict | None:
    """The fallback for a domain without a route: the (draft, fixed gamma) with the highest geometric-mean measured
    speedup over every evaluated domain, among the pairs that pay for themselves in each of them
    (:func:`eval.decision.paying_fixed`: tau floor, tau bound, at least 1x) whose draft some domain routes to; the
    target alone (``target_only``) when no pair qualifies; None when no draft was measured on every domain."""
    domains = list(routes)
    full = [n for n in doc["drafts"] if domains and all(d in doc["drafts"][n] for d in domains)]
    if not full:
        return None
    routed = {r["draft"] for r in routes.values() if r["draft"]}
    best, best_log = None, -math.inf
    for n in (n for n in full if n in routed):
        per = [{c["num_draft_tokens"]: c["measured_speedup"] for c in paying_fixed(doc, n, d)} for d in domains]
        for g in sorted(set.intersection(*(set(p) for p in per))):
            mean_log = sum(math.log(p[g]) for p in per) / len(per)
            if mean_log > best_log:
                best, best_log = (n, g), mean_log
    if best is None:
        return {"draft": None, "path": None, "target_only": True, "geometric_mean_measured_speedup": None,
                "over_domains": domains}
    return {"draft": best[0], "path": route_path(draft_paths[best[0]]),
            "geometric_mean_measured_speedup": math.exp(best_log), "num_draft_tokens": int(best[1]),
            "over_domains": domains}


def write_routing(path: str | Path, doc: dict, draft_paths: dict[str, str | Path]) -> dict:
    """Build :func:`routing_table` and write it to ``path`` atomically; returns it."""
    table = routing_table(doc, draft_paths)
    write_json_atomic(path, table)
    return table


def routing_section(table: dict, path: str) -> str:
    """Markdown section of the report: the route of each domain and the numbers of every candidate."""
    def f(x, d=2):
        return "n/a" if x is None or x != x else f"{x:.{d}f}"

    def fx(x):  # a speedup: "1.23x", or "n/a" without the x
        return "n/a" if x is None or x != x else f"{x:.2f}x"

    lines = ["## Routing", "", f"Routing table `{path}` (load it with `decode.draft_routing=PATH`): each domain goes "
             f"to the draft of its verdict (none: decoded with the target alone).", "",
             "| domain | routed draft | gamma | measured speedup | tau | other drafts (tau, speedup) |",
             "|---|---|---|---|---|---|"]
    for d, r in table["routes"].items():
        others = ", ".join(f"`{n}` {f(c['mean_accepted_length'])}, {fx(c['measured_speedup'])}"
                           for n, c in r["candidates"].items() if n != r["draft"]) or "-"
        if r.get("target_only"):
            lines.append(f"| {d} | none: the target alone | - | {fx(r['measured_speedup'])} (fastest draft setting "
                         f"whose tau explains its timing) | - | {others} |")
            continue
        policy = r.get("draft_length_policy", "fixed")
        setting = r["num_draft_tokens"] if policy == "fixed" else f"{policy} policy"
        lines.append(f"| {d} | `{r['draft']}` | {setting} | {fx(r['measured_speedup'])} | "
                     f"{f(r['mean_accepted_length'])} | {others} |")
    if table.get(DEFAULT_KEY):
        dflt = table[DEFAULT_KEY]
        who = f"`{dflt['draft']}`" if dflt.get("draft") else "the target alone"
        lines += ["", f"Fallback (`{DEFAULT_KEY}`) for other domains: {who} (geometric-mean measured "
                      f"speedup {fx(dflt['geometric_mean_measured_speedup'])} over {len(dflt['over_domains'])} "
                      f"domains)."]
    return "\n".join(lines)


def recommended_settings(doc: dict) -> dict[str, dict]:
    """domain -> ``{"draft", "num_draft_tokens", "measured_speedup", "note"}``: the draft and fixed gamma to serve
    each domain with, read from a ``metrics.json`` document's recommendation (the one place to re-point when the
    verdict logic moves). A domain served by the target alone has ``draft`` None, ``measured_speedup`` None (the
    target alone is the baseline) and ``fastest_refused_draft``: the fastest measured setting it turned down (its
    draft, policy, gamma and measured speedup with interval), or None."""
    out = {}
    for domain, r in (doc.get("recommendation") or {}).items():
        if r.get("action", "speculate") != "speculate" or r.get("draft") is None:  # the verdict: no draft pays
            # the target alone is the baseline (speedup 1 by definition): the refused draft's number is kept apart
            best = r.get("best_measured") or {}
            refused = {k: best.get(k) for k in ("draft", "draft_length_policy", "num_draft_tokens",
                                                "measured_speedup", "measured_speedup_ci")} if best else None
            out[domain] = {"draft": None, "num_draft_tokens": 0, "measured_speedup": None,
                           "fastest_refused_draft": refused,
                           "note": "serve with the target alone: " + (r.get("reason") or "no draft measured faster")}
            continue
        gamma, note, s = r["num_draft_tokens"], "", r.get("measured_speedup")
        policy = r.get("draft_length_policy", "fixed")
        if policy != "fixed":
            fixed = paying_fixed(doc, r["draft"], domain)
            if not fixed:  # no fixed gamma of this draft paid for itself here: an engine would be slower
                out[domain] = {"draft": None, "num_draft_tokens": 0, "measured_speedup": None,
                               "fastest_refused_draft": {"draft": r["draft"], "draft_length_policy": policy,
                                                         "num_draft_tokens": r.get("num_draft_tokens"),
                                                         "measured_speedup": s,
                                                         "measured_speedup_ci": r.get("measured_speedup_ci")},
                               "note": (
                    f"the recommendation is draft_length_policy={policy}, which engines with a fixed draft length "
                    f"cannot run, and no fixed gamma of `{r['draft']}` paid for itself here: serve with the target "
                    f"alone (or an engine with adaptive draft lengths)")}
                continue
            best = max(fixed, key=lambda c: c["measured_speedup"])
            gamma, s = best["num_draft_tokens"], best["measured_speedup"]
            note = (f"the recommendation is draft_length_policy={policy}; engines take a fixed count, so this is "
                    f"the draft's fastest fixed gamma among those that pay for themselves")
        if isinstance(s, (int, float)) and math.isfinite(s) and s < 1:
            note = (note + "; " if note else "") + (f"measured speedup {s:.2f}x < 1 here: speculative decoding was "
                                                    f"slower than the target alone on this machine")
        out[domain] = {"draft": r["draft"], "num_draft_tokens": int(gamma), "measured_speedup": s, "note": note}
    return out
