"""Writing the draft routing table (``routing.json``) from an evaluation's metrics; the decoder reads it with
:func:`decode.routing.load_routing` (``decode.draft_routing=PATH``).

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
from pathlib import Path

from data.io import write_json_atomic
from decode.routing import DEFAULT_KEY, SCHEMA

from .decision import paying_fixed


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


def routing_table(doc: dict, draft_paths: dict[str, str | Path]) -> dict:
    """The routing document for a ``metrics.json`` document ``doc`` and the drafts' directories.

    Returns:
        ``{"schema", "metric": "measured_speedup", "num_draft_tokens_swept", "target", "routes": {domain: {"draft",
        "path", "num_draft_tokens", "measured_speedup", ..., "candidates": {draft: numbers}}}, "default": {...}}``.

    Raises:
        ValueError: a recommended draft has no path in ``draft_paths``.
    """
    missing = [n for n in doc["drafts"] if n not in draft_paths]
    if missing:
        raise ValueError(f"routing table: no checkpoint path for draft(s) {missing}")
    routes = {}
    for domain, rec in doc["recommendation"].items():
        name = rec["draft"]
        cands = {n: _entry(doc, n, domain) for n in doc["drafts"] if domain in doc["drafts"][n]}
        if name is None:  # the target alone is fastest: route to no draft
            routes[domain] = {"draft": None, "path": None, "target_only": True, "num_draft_tokens": None,
                              "measured_speedup": rec.get("measured_speedup"),
                              "measured_speedup_ci": rec.get("measured_speedup_ci"),
                              "reason": rec.get("reason"), "candidates": cands}
            continue
        routes[domain] = {"draft": name, "path": str(Path(draft_paths[name]).resolve()),
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
    return {"draft": best[0], "path": str(Path(draft_paths[best[0]]).resolve()),
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
            lines.append(f"| {d} | none: the target alone | - | {fx(r['measured_speedup'])} (fastest draft) | - | "
                         f"{others} |")
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
