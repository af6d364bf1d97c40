"""The deployment projection: the speedup Leviathan et al. 2023 (Thm 3.8) expects with the measured per-token
acceptance and the deployment's cost ratio c (``eval.deployment``), per setting, and its report section. Projected,
never measured: the report says so beside every projected number."""
from __future__ import annotations

import math

from decode.stats import expected_speedup, expected_speedup_mixture

from .decision import FORMULA, SPECULATE, candidates, label, setting_entry
from .decision import num as _num


def _fmt(v, digits: int = 2) -> str:
    x = _num(v)
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


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
            e = setting_entry(doc, d, r) or {}
            ci = e.get("measured_speedup_ci")
            meas = f"{_fmt(e.get('measured_speedup'))}x" + (f" [{_fmt(ci[0])}, {_fmt(ci[1])}]" if ci else "")
            lines.append(f"| {d} | `{r['draft']}` with {label(r)} | {meas} | "
                         f"{_fmt(e.get('projected_speedup'))}x | {best_txt} |")
        else:
            fastest = _fmt(r.get("measured_speedup"))
            lines.append(f"| {d} | target alone | {fastest}{'' if fastest == 'n/a' else 'x'} (fastest setting) | - | "
                         f"{best_txt} |")
    return lines
