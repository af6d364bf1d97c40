"""An oracle for :func:`eval.decision.decide` used by the property tests: properties any decision must have, checked
from the numbers with helpers of its own (none of the rule's), so a bug in a shared helper cannot hide itself."""
from __future__ import annotations

import math
import statistics


def _f(x) -> float:
    if isinstance(x, (bool, str, bytes)) or x is None:
        return math.nan
    try:
        v = float(x)
    except (TypeError, ValueError):
        return math.nan
    return v if math.isfinite(v) else math.nan


def _bounds(c: dict) -> tuple[float, float]:
    """A setting's interval, holding its point estimate."""
    s, ci = _f(c.get("measured_speedup")), c.get("measured_speedup_ci")
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(not math.isnan(_f(v)) for v in ci):
        lo, hi = min(map(_f, ci)), max(map(_f, ci))
        return (lo, hi) if math.isnan(s) else (min(lo, s), max(hi, s))
    return s, s


def _order(c: dict) -> tuple:
    """The order settings are picked in: measured speedup, then tau, then the upper end, smaller gamma, name."""
    tau = _f(c.get("mean_accepted_length"))
    return (_f(c["measured_speedup"]), -math.inf if math.isnan(tau) else tau, _bounds(c)[1],
            -(c["num_draft_tokens"] or 0), c["draft"])


def _same(c: dict, d: dict) -> bool:
    return all(c.get(k) == d.get(k) for k in ("draft", "draft_length_policy", "num_draft_tokens"))


def _model(pool: list[dict]) -> str:
    has = all(not math.isnan(_f(c.get("expected_speedup_components"))) for c in pool)
    return "expected_speedup_components" if pool and has else "expected_speedup"


def _error(valid: list[dict], fld: str) -> float:
    logs = [abs(math.log(_f(c["measured_speedup"]) / _f(c.get(fld)))) for c in valid
            if _f(c["measured_speedup"]) > 0 and _f(c.get(fld)) > 0]
    return statistics.median(logs) if logs else 0.0


def check_consistent(decision, cands: list[dict]) -> None:
    """Raise AssertionError when ``decision`` (a :class:`eval.decision.Decision` or its ``as_dict()``) breaks a
    property the rule guarantees over ``cands``: the target alone only when no setting was measured at least 1x; a
    draft only at a measured setting of at least 1x; ``measured`` only when its interval lies above every other
    one; a ``tie`` pick overlapping the fastest setting, never below a tied interval, above 1 when any tied interval
    is (unless it beats such a setting on both measured and modelled speedup), and never beaten on both numbers
    (beyond the model's own error) by a tied setting; an overruled model pick only for a surely faster setting."""
    d = decision if isinstance(decision, dict) else decision.as_dict()
    valid = [c for c in cands if not math.isnan(_f(c.get("measured_speedup")))]
    if not valid:
        assert d["action"] == "none", "a decision without any finite measured speedup"
        return
    top = max(_f(c["measured_speedup"]) for c in valid)
    if d["action"] == "target_only":
        assert top < 1.0, "target alone although a setting was measured at least as fast as the target alone"
        return
    assert d["action"] == "speculate", f"unknown action {d['action']!r}"
    chosen = next((c for c in valid if _same(c, d)), None)
    assert chosen is not None, "the decision names a setting that was not measured"
    s = _f(chosen["measured_speedup"])
    assert s >= 1.0, "recommends a setting measured slower than the target alone"
    lo, _ = _bounds(chosen)
    if d["basis"] == "measured":
        assert s == top and all(_bounds(o)[1] < lo for o in valid if o is not chosen), \
            "chosen on measured speedup although intervals overlap"
        return
    assert d["basis"] == "tie", f"unknown basis {d['basis']!r}"
    # the fastest setting: highest measured speedup, then the higher upper end, the smaller gamma, the draft name
    best = max(valid, key=lambda c: (_f(c["measured_speedup"]), _bounds(c)[1], -(c["num_draft_tokens"] or 0),
                                     c["draft"]))
    assert chosen is best or _bounds(chosen)[1] >= _bounds(best)[0], "tie pick does not overlap the fastest setting"
    pool = [o for o in valid if o is best or (_f(o["measured_speedup"]) >= 1.0 and
                                             _bounds(o)[1] >= _bounds(best)[0])]
    assert not any(_bounds(o)[0] > s for o in pool if o is not chosen), \
        "a tied setting's whole interval lies above the pick's speedup"
    fld = _model(pool)
    above = [o for o in pool if _bounds(o)[0] >= 1.0]
    if above and lo < 1.0:
        assert any(s > _f(a["measured_speedup"]) and _f(chosen.get(fld)) > _f(a.get(fld)) for a in above), \
            "tie pick below 1 although tied settings lie above 1 and it beats none of them on both numbers"
    err = _error(valid, fld)
    scope = _scope(pool, above, fld, err)
    near = _near(scope, fld, err)
    model_pick = max(near, key=_order)
    if d.get("model_pick"):  # overruled: only by a tied setting whose interval lies above the model's pick
        assert _same(model_pick, d["model_pick"]) or \
            _f(model_pick["measured_speedup"]) == _f(d["model_pick"]["measured_speedup"]), "a wrong model pick"
        assert lo > _f(model_pick["measured_speedup"]), "tie not broken by the cost model"
        return
    assert any(o is chosen for o in near), "tie pick outside the settings the cost model rates highest"
    assert s == _f(model_pick["measured_speedup"]), \
        "among the settings the cost model cannot tell apart, not the highest measured speedup"


def _near(pool: list[dict], fld: str, err: float) -> list[dict]:
    """The settings whose modelled speedup lies within the model's error of the highest (all without values)."""
    vals = [(o, _f(o.get(fld))) for o in pool]
    top = max((v for _, v in vals if v > 0), default=None)
    if top is None:
        return list(pool)
    return [o for o, v in vals if v > 0 and math.log(top / v) <= err + 1e-12]


def _scope(pool: list[dict], above: list[dict], fld: str, err: float) -> list[dict]:
    """Which tied settings the cost model chooses among: all of them measured at least 1x; those whose interval
    lies above 1 when there are any; unless some beat that choice on both numbers, then those."""
    if not above:
        return pool
    pick = max(_near(above, fld, err), key=_order)
    faster = [o for o in pool if _f(o["measured_speedup"]) > _f(pick["measured_speedup"])
              and _f(o.get(fld)) > _f(pick.get(fld)) > 0]
    return faster or above
