"""Pooled metrics, bootstrap confidence intervals and the draft-length recommendation, computed from per-prompt rows.

Everything in ``metrics.json`` is a pure function of the rows written to ``per_prompt.csv`` (plus the measured cost
ratio), so the two files cannot disagree: :func:`aggregate` is what the report calls, and what a reader can call on
the CSV (:func:`read_per_prompt_csv`) to recompute every number.

Pooling follows docs/architecture.md ("Terms"): ratios are ratios of sums over prompts (never means of per-prompt means). Bootstrap:
resample the prompts of a (draft, domain, gamma) cell with replacement ``bootstrap_samples`` times (fixed seed),
recompute the pooled ratio on each resample, report the percentile interval.
"""
from __future__ import annotations

import csv
import hashlib
import math
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from decode.stats import expected_speedup, expected_speedup_from_costs, expected_speedup_mixture

# per_prompt.csv columns, in order. List-valued columns are space-separated integers.
PER_PROMPT_COLUMNS = (
    "draft", "domain", "prompt_id", "num_draft_tokens", "prompt_tokens", "truncated", "new_tokens", "verify_steps",
    "drafted_tokens", "accepted_tokens", "emitted_tokens", "draft_time_s", "verify_time_s", "speculative_time_s",
    "target_new_tokens", "target_time_s", "greedy_equal", "per_position_drafted", "per_position_accepted",
    "accepted_length_histogram", "draft_length_policy", "draft_lengths", "speculative_trial_times_s",
    "target_trial_times_s", "prefill_time_s", "nodes_verified", "numerical_tie_gap", "lookup_drafted_tokens",
)
LIST_COLUMNS = ("per_position_drafted", "per_position_accepted", "accepted_length_histogram", "draft_lengths")
# columns added after the first files were written: their value in an older per_prompt.csv / row
COLUMN_DEFAULTS = {"draft_length_policy": "fixed", "draft_lengths": [], "speculative_trial_times_s": [],
                   "target_trial_times_s": [], "prefill_time_s": None, "nodes_verified": None,
                   "numerical_tie_gap": None, "lookup_drafted_tokens": None}
# per-trial wall times (seconds, one per timing trial; space-separated in the CSV)
FLOAT_LIST_COLUMNS = ("speculative_trial_times_s", "target_trial_times_s")
# numerical_tie_gap: where greedy_equal is false because the target's top logits tie at the first differing
# position (eval.evaluate.divergence), the gap there in logit units; empty otherwise
OPTIONAL_FLOAT_COLUMNS = ("prefill_time_s", "numerical_tie_gap")  # None when unknown (an older file)
OPTIONAL_INT_COLUMNS = ("nodes_verified", "lookup_drafted_tokens")
FIXED = "fixed"
INT_COLUMNS = ("num_draft_tokens", "prompt_tokens", "new_tokens", "verify_steps", "drafted_tokens", "accepted_tokens",
               "emitted_tokens", "target_new_tokens")
FLOAT_COLUMNS = ("draft_time_s", "verify_time_s", "speculative_time_s", "target_time_s")
BOOL_COLUMNS = ("truncated", "greedy_equal")


def _nan_to_none(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _ratio(num: float, den: float) -> float:
    return num / den if den else float("nan")


def _add(a: list[int], b: Iterable[int]) -> list[int]:
    b = list(b)
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def percentiles(values: Iterable[float], qs=(50, 95, 99)) -> dict[str, float | None]:
    """``{"p50": ..., "p95": ..., "p99": ...}`` of ``values`` (linear interpolation); None when empty."""
    v = np.asarray(list(values), dtype=float)
    return {f"p{q}": (float(np.percentile(v, q)) if v.size else None) for q in qs}


def bootstrap_ratio_ci(num: np.ndarray, den: np.ndarray, *, samples: int, confidence: float, seed: int,
                       num2: np.ndarray | None = None, den2: np.ndarray | None = None) -> list[float] | None:
    """Percentile bootstrap interval of a pooled ratio over prompts.

    Each resample draws ``n`` prompt indices with replacement and recomputes ``sum(num[idx]) / sum(den[idx])``
    (or, with ``num2``/``den2``, the ratio of two pooled ratios ``(sum num / sum den) / (sum num2 / sum den2)``,
    which is how a speedup of tokens/s over tokens/s is pooled). Returns ``[low, high]`` or None when
    ``samples == 0`` or there are no prompts. Resamples whose ratio is undefined (zero denominator) are dropped.
    """
    n = len(num)
    if samples <= 0 or n == 0:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(samples, n))  # (samples, n) prompt indices
    with np.errstate(divide="ignore", invalid="ignore"):
        stat = num[idx].sum(1) / den[idx].sum(1)  # (samples,)
        if num2 is not None:
            stat = stat / (num2[idx].sum(1) / den2[idx].sum(1))
    return _percentile_interval(stat, confidence)


def _percentile_interval(stat: np.ndarray, confidence: float) -> list[float] | None:
    """``[low, high]`` percentile interval of the finite bootstrap statistics ``stat`` (samples,); None if none."""
    stat = stat[np.isfinite(stat)]
    if not stat.size:
        return None
    a = (1 - confidence) / 2
    lo, hi = np.quantile(stat, [a, 1 - a])
    return [float(lo), float(hi)]


def trial_times(rows: list[dict], key: str) -> np.ndarray:
    """(n, T) per-trial wall times of ``rows`` from ``<key>_trial_times_s`` (T = the fewest trials of a row); rows
    without per-trial times (older files) give their ``<key>_time_s`` as one trial."""
    lists = [list(r.get(f"{key}_trial_times_s") or []) or [float(r[f"{key}_time_s"])] for r in rows]
    t = min((len(x) for x in lists), default=1)
    return np.asarray([x[:t] for x in lists], dtype=float).reshape(len(rows), t)


def bootstrap_speedup_ci(new: np.ndarray, spec_t: np.ndarray, tnew: np.ndarray, tgt_t: np.ndarray, *,
                         samples: int, confidence: float, seed: int) -> list[float] | None:
    """Percentile bootstrap interval of the pooled speedup over prompts **and** timing trials, pairs kept.

    ``new``/``tnew`` (n,): tokens of the speculative / target-only decode of each prompt; ``spec_t``/``tgt_t``
    (n, T): their wall times (seconds) in each of T timing trials, the two of a trial measured side by side. Each
    resample draws n prompts with replacement and, for each drawn prompt, one of its T trials (the speculative and
    target-only time of that same trial: a paired draw), then recomputes
    ``(sum new / sum spec_t) / (sum tnew / sum tgt_t)``. Returns ``[low, high]``, or None when ``samples == 0`` or
    there are no prompts."""
    n = len(new)
    if samples <= 0 or n == 0:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(samples, n))  # (samples, n) prompt indices
    tr = rng.integers(0, spec_t.shape[1], size=(samples, n))  # (samples, n) trial of each drawn prompt
    with np.errstate(divide="ignore", invalid="ignore"):
        stat = (new[idx].sum(1) / spec_t[idx, tr].sum(1)) / (tnew[idx].sum(1) / tgt_t[idx, tr].sum(1))
    return _percentile_interval(stat, confidence)


def _cell_seed(seed: int, *key: Any) -> int:
    """A fixed, per-cell seed so each interval is reproducible on its own (independent of cell order)."""
    h = hashlib.sha256(("/".join(map(str, (seed, *key)))).encode()).digest()
    return int.from_bytes(h[:4], "big")


def policy_of(row: dict) -> str:
    """The draft-length policy of a per-prompt row (``fixed`` for rows written before the column existed)."""
    return row.get("draft_length_policy") or FIXED


def draft_length_histogram(rows: Iterable[dict]) -> list[int]:
    """``[k]`` = verify steps (row-steps) that drafted ``k`` tokens, pooled over the rows' ``draft_lengths``."""
    hist: list[int] = []
    for r in rows:
        for k in r.get("draft_lengths") or []:
            if len(hist) <= k:
                hist.extend([0] * (k + 1 - len(hist)))
            hist[k] += 1
    return hist


def cell_metrics(rows: list[dict], cost_ratio: float, *, num_draft_tokens: int, bootstrap_samples: int = 1000,
                 confidence: float = 0.95, seed: int = 0, check_lossless: bool = True,
                 draft_length_policy: str = FIXED, verify_cost_ratio: dict | None = None,
                 step_overhead: float | None = None) -> dict:
    """All metrics of one (draft, domain, num_draft_tokens) cell, or of one (draft, domain, policy) cell, from its
    per-prompt rows (see docs/reports.md, "Report fields").

    The draft lengths the decoder used are ``draft_length_histogram`` (pooled from the rows' ``draft_lengths``) and
    ``mean_draft_length`` = drafted tokens / verify steps. A fixed gamma's expected speedup is Leviathan et al.'s
    Thm 3.8 at that gamma; a policy's is the same formula pooled over the draft lengths it used
    (:func:`decode.stats.expected_speedup_mixture`). ``expected_speedup_components`` is the expectation from the
    measured parts instead: the cell's tau over its steps' mean cost ``k c + v_k`` in one-position target forwards
    (:func:`decode.stats.expected_speedup_from_costs`; ``verify_cost_ratio``: ``{str(k): {"verify_cost_ratio"}}``
    as :func:`eval.evaluate.measure_verify_cost_ratio` returns it; ``step_overhead``: the loop's own work per step
    in one-position target forwards, :func:`loop_overhead_per_step`; None without ``verify_cost_ratio``, ``step_overhead``
    or a needed ``v_k``)."""
    g = int(num_draft_tokens)
    key = (rows[0]["draft"], rows[0]["domain"], g) if rows else ("", "", g)
    if draft_length_policy != FIXED:
        key = (*key, draft_length_policy)
    boot = dict(samples=bootstrap_samples, confidence=confidence)
    col = _columns(rows)
    acc = _acceptance_fields(rows, col, g, float(cost_ratio), draft_length_policy, boot, seed, key)
    timing = _timing_fields(rows, col, boot, seed, key)
    v = {k: x["verify_cost_ratio"] for k, x in (verify_cost_ratio or {}).items()}
    nodes = [r.get("nodes_verified") for r in rows]
    tree = str(draft_length_policy).startswith("tree:")
    known = bool(v) and step_overhead is not None and not (tree and None in nodes)  # an older file: unknown, never
    components = expected_speedup_from_costs(  # a tree priced as a chain
        acc["mean_accepted_length"], acc["draft_length_histogram"], float(cost_ratio), v,
        _ratio(sum(nodes), col["verify_steps"].sum()) if tree else None, step_overhead) \
        if known and rows else float("nan")
    expected, stats = acc.pop("_expected_speedup"), _stats(col, acc)  # _stats takes the private per-position lists
    return {**acc, **timing, "expected_speedup": expected, "expected_speedup_components": _nan_to_none(components),
            "loop_overhead_per_step": step_overhead, "cost_ratio": float(cost_ratio), "num_prompts": len(rows),
            **_lossless_fields(rows, check_lossless), "stats": stats}


_COLUMNS = ("verify_steps", "emitted_tokens", "drafted_tokens", "accepted_tokens", "new_tokens",
            "speculative_time_s", "target_new_tokens", "target_time_s", "draft_time_s", "verify_time_s")


def _columns(rows: list[dict]) -> dict[str, np.ndarray]:
    """The per-prompt columns a cell's metrics pool: ``{name: (n,) float array}``."""
    return {k: np.asarray([r[k] for r in rows], dtype=float) for k in _COLUMNS}


def _acceptance_fields(rows: list[dict], col: dict, g: int, c: float, policy: str, boot: dict, seed: int,
                       key: tuple) -> dict:
    """Acceptance rate, per-token acceptance, tau and their intervals, per-position acceptance, histograms and
    Leviathan's expectations (``_expected_speedup``, popped by the caller)."""
    dl_hist = draft_length_histogram(rows)
    ppd, ppa, hist = [], [], []
    for r in rows:
        ppd, ppa, hist = _add(ppd, r["per_position_drafted"]), _add(ppa, r["per_position_accepted"]), \
            _add(hist, r["accepted_length_histogram"])
    steps, emitted, drafted, accepted = (col[k] for k in ("verify_steps", "emitted_tokens", "drafted_tokens",
                                                          "accepted_tokens"))
    # the per-token acceptance probability of Leviathan et al.'s i.i.d. model: accepted / positions reached.
    token_alpha = _ratio(sum(ppa), sum(ppd))
    exp_speedup, exp_tau = _expected(token_alpha, g, c, dl_hist, policy)
    return {
        "num_draft_tokens": g, "draft_length_policy": policy, "mean_draft_length": _ratio(drafted.sum(), steps.sum()),
        "draft_length_histogram": dl_hist, "acceptance_rate": _ratio(accepted.sum(), drafted.sum()),
        "acceptance_rate_ci": bootstrap_ratio_ci(accepted, drafted, seed=_cell_seed(seed, "alpha", *key), **boot),
        "token_acceptance_rate": token_alpha, "mean_accepted_length": _ratio(emitted.sum(), steps.sum()),
        "mean_accepted_length_ci": bootstrap_ratio_ci(emitted, steps, seed=_cell_seed(seed, "tau", *key), **boot),
        "expected_mean_accepted_length": exp_tau,
        "per_position_acceptance": [_ratio(a, d) for a, d in zip(ppa + [0] * (len(ppd) - len(ppa)), ppd)],
        "accepted_length_histogram": hist, "_per_position": (ppd, ppa), "_expected_speedup": exp_speedup}


def _timing_fields(rows: list[dict], col: dict, boot: dict, seed: int, key: tuple) -> dict:
    """Throughputs, latencies, the measured speedup (pooled tokens / time, both decoders) with its paired bootstrap
    interval over prompts and trials, and the paired per-prompt median."""
    new, spec_t, tnew, tgt_t = col["new_tokens"], col["speculative_time_s"], col["target_new_tokens"], \
        col["target_time_s"]
    target_tps, spec_tps = _ratio(tnew.sum(), tgt_t.sum()), _ratio(new.sum(), spec_t.sum())
    spec_trials, tgt_trials = trial_times(rows, "speculative"), trial_times(rows, "target")  # (n, T) each
    t_common = min(spec_trials.shape[1], tgt_trials.shape[1])
    spec_trials, tgt_trials = spec_trials[:, :t_common], tgt_trials[:, :t_common]
    with np.errstate(divide="ignore", invalid="ignore"):  # per prompt and trial: (new / spec_t) / (tnew / tgt_t)
        pairs = (new[:, None] / spec_trials) / (tnew[:, None] / tgt_trials)
    pairs = pairs[np.isfinite(pairs)]
    return {
        "draft_time_s": float(col["draft_time_s"].sum()), "verify_time_s": float(col["verify_time_s"].sum()),
        "target_tokens_per_s": target_tps, "speculative_tokens_per_s": spec_tps,
        "target_latency_s": percentiles(tgt_t), "speculative_latency_s": percentiles(spec_t),
        "measured_speedup": _ratio(spec_tps, target_tps) if math.isfinite(target_tps) else float("nan"),
        "measured_speedup_ci": bootstrap_speedup_ci(new, spec_trials, tnew, tgt_trials,
                                                    seed=_cell_seed(seed, "speedup", *key), **boot),
        "timing_trials": int(spec_trials.shape[1]),
        "paired_speedup_median": float(np.median(pairs)) if pairs.size else float("nan")}


def _lossless_fields(rows: list[dict], check_lossless: bool) -> dict:
    """``lossless`` (None when not checked), and the numerical ties counted apart: a tie of the target's own logits
    is not a decoder fault."""
    equal = [r["greedy_equal"] or r.get("numerical_tie_gap") is not None for r in rows
             if r["greedy_equal"] is not None]
    ties = [r["numerical_tie_gap"] for r in rows if r.get("numerical_tie_gap") is not None]
    return {"lossless": (all(equal) if equal else None) if check_lossless else None,
            "numerical_ties": len(ties), "numerical_tie_max_gap": max(ties) if ties else None}


def _stats(col: dict, acc: dict) -> dict:
    """The pooled counts behind a cell (``stats``), from which its ratios are recomputed."""
    ppd, ppa = acc.pop("_per_position")
    ints = ("verify_steps", "drafted_tokens", "accepted_tokens", "emitted_tokens", "new_tokens", "target_new_tokens")
    out = {k: int(col[k].sum()) for k in ints}
    out.update({k: float(col[k].sum()) for k in ("speculative_time_s", "target_time_s", "draft_time_s",
                                                  "verify_time_s")})
    return {**out, "per_position_drafted": ppd, "per_position_accepted": ppa,
            "accepted_length_histogram": acc["accepted_length_histogram"],
            "draft_length_histogram": acc["draft_length_histogram"]}


def _expected(token_alpha: float, g: int, c: float, dl_hist: dict, draft_length_policy: str) -> tuple[float, float]:
    """(expected speedup, expected tau) of Leviathan et al.'s i.i.d. model (Thm 3.8; tau = (1 - a^(g+1)) / (1 - a),
    the speedup at c = 0): at the fixed gamma ``g``, or pooled over the draft lengths a policy used."""
    if not math.isfinite(token_alpha) or (draft_length_policy != FIXED and not dl_hist):
        return float("nan"), float("nan")
    if draft_length_policy != FIXED:
        return expected_speedup_mixture(token_alpha, dl_hist, c), expected_speedup_mixture(token_alpha, dl_hist, 0.0)
    return expected_speedup(token_alpha, g, c), expected_speedup(token_alpha, g, 0.0)


REFERENCE_DRAFT = "baseline"  # the draft other drafts are compared with in ``vs_baseline``


def ratios_vs_reference(rows: list[dict], *, num_draft_tokens: int, reference: str = REFERENCE_DRAFT,
                        bootstrap_samples: int = 1000, confidence: float = 0.95, seed: int = 0) -> dict:
    """Mean accepted length of each draft divided by the ``reference`` draft's, per domain, paired over prompts.

    tau_draft / tau_reference = (sum emitted_d / sum verify_steps_d) / (sum emitted_r / sum verify_steps_r) over the
    prompts both drafts decoded at ``num_draft_tokens``; the interval resamples those prompts (the same indices for
    both drafts: a paired percentile bootstrap, see :func:`bootstrap_ratio_ci`).

    Returns ``{draft: {domain: {"mean_accepted_length_ratio", "ci", "num_prompts"}}}``; empty without the reference.
    """
    cells: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        if int(r["num_draft_tokens"]) == num_draft_tokens and policy_of(r) == FIXED:
            cells.setdefault((r["draft"], r["domain"]), {})[r["prompt_id"]] = r
    out: dict[str, dict] = {}
    for (draft, domain), by_prompt in sorted(cells.items()):
        ref = cells.get((reference, domain))
        if draft == reference or ref is None:
            continue
        ids = sorted(set(by_prompt) & set(ref))
        if not ids:
            continue
        col = lambda src, k: np.array([float(src[i][k]) for i in ids])  # noqa: E731
        num, den = col(by_prompt, "emitted_tokens"), col(by_prompt, "verify_steps")
        num2, den2 = col(ref, "emitted_tokens"), col(ref, "verify_steps")
        ratio = _ratio(num.sum(), den.sum()) / _ratio(num2.sum(), den2.sum())
        ci = bootstrap_ratio_ci(num, den, num2=num2, den2=den2, samples=bootstrap_samples, confidence=confidence,
                                seed=_cell_seed(seed, "vs", draft, reference, domain, num_draft_tokens))
        out.setdefault(draft, {})[domain] = {"mean_accepted_length_ratio": ratio, "ci": ci, "num_prompts": len(ids)}
    return out


def loop_overhead_per_step(rows: list[dict], target_forward_s: float | None) -> float | None:
    """The loop's own work per verify step, in one-position target forwards: ``sum(speculative_time_s -
    prefill_time_s - draft_time_s - verify_time_s) / sum(verify_steps) / target_forward_s`` over ``rows`` (one draft
    and domain, every setting pooled: the bookkeeping per step hardly depends on gamma), clipped at 0. None without
    ``prefill_time_s`` (an older file), a target forward time or steps."""
    if not target_forward_s or not rows or any(r.get("prefill_time_s") is None for r in rows):
        return None
    steps = sum(r["verify_steps"] for r in rows)
    other = sum(r["speculative_time_s"] - r["prefill_time_s"] - r["draft_time_s"] - r["verify_time_s"] for r in rows)
    return max(0.0, other / steps / target_forward_s) if steps else None


def aggregate(rows: list[dict], cost_ratio: dict[str, float], *, primary_num_draft_tokens: int,
              bootstrap_samples: int = 1000, confidence: float = 0.95, seed: int = 0,
              check_lossless: bool = True, verify_cost_ratio: dict | None = None,
              target_forward_s: dict[str, float] | None = None) -> dict:
    """Per-prompt rows -> ``{"drafts": {draft: {domain: entry}}, "recommendation": {domain: ...}}``.

    ``entry`` holds the metrics at the primary gamma (``primary_num_draft_tokens`` if it was measured, else the
    measured value closest to it), ``sweep`` = ``{gamma: entry}`` for every measured gamma, ``best_num_draft_tokens``
    (highest measured speedup) and ``leviathan_curve`` (expected speedup for gamma = 1..max, from the token
    acceptance rate pooled over the sweep). ``recommendation[domain]`` = the (draft, gamma) with the highest measured
    speedup. ``vs_baseline`` = :func:`ratios_vs_reference` at the primary gamma when a draft is named
    ``baseline``. ``cost_ratio`` maps draft -> c. ``verify_cost_ratio`` (``metrics.json``'s) and
    ``target_forward_s`` (draft -> the target's one-position forward in seconds, measured with its c; the one
    measured with the verify cost ratios is used instead when they carry it) give every cell's
    ``expected_speedup_components`` (:func:`cell_metrics`, with :func:`loop_overhead_per_step` per draft and domain).

    Rows of a draft-length policy other than ``fixed`` (column ``draft_length_policy``) are pooled per (draft,
    domain, policy) into ``policies.<name>`` of the entry; they compete with the sweep for ``recommendation``
    (whose ``draft_length_policy`` then names the policy; ``num_draft_tokens`` is its cap).
    """
    cells: dict[tuple[str, str, int], list[dict]] = {}
    policy_cells: dict[tuple[str, str, str], list[dict]] = {}
    by_pair: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by_pair.setdefault((r["draft"], r["domain"]), []).append(r)
        if policy_of(r) == FIXED:
            cells.setdefault((r["draft"], r["domain"], int(r["num_draft_tokens"])), []).append(r)
        else:
            policy_cells.setdefault((r["draft"], r["domain"], policy_of(r)), []).append(r)
    # o in the unit the v_k it is added to share: the target forward measured with them (else the one measured with c)
    unit = next((x.get("target_forward_s") for x in (verify_cost_ratio or {}).values() if x.get("target_forward_s")),
                None)
    overhead = {pair: loop_overhead_per_step(rs, unit or (target_forward_s or {}).get(pair[0]))
                for pair, rs in by_pair.items()}
    kw = dict(bootstrap_samples=bootstrap_samples, confidence=confidence, seed=seed, check_lossless=check_lossless,
              verify_cost_ratio=verify_cost_ratio)
    policies: dict[tuple[str, str], dict[str, dict]] = {}
    for (draft, domain, name), cell in policy_cells.items():
        policies.setdefault((draft, domain), {})[name] = cell_metrics(
            cell, cell_cost_ratio(cell, cost_ratio[draft]), num_draft_tokens=max(int(r["num_draft_tokens"]) for r in cell),
            draft_length_policy=name, step_overhead=overhead[(draft, domain)], **kw)
    drafts: dict[str, dict[str, dict]] = {}
    for (draft, domain, g), cell in cells.items():
        drafts.setdefault(draft, {}).setdefault(domain, {})[g] = cell_metrics(
            cell, cell_cost_ratio(cell, cost_ratio[draft]), num_draft_tokens=g, step_overhead=overhead[(draft, domain)], **kw)
    out: dict[str, dict[str, dict]] = {}
    best_measured: dict[str, dict] = {}
    for draft, by_domain in drafts.items():
        for domain, sweep in by_domain.items():
            entry = _domain_entry(sweep, cost_ratio[draft], primary_num_draft_tokens, policies.get((draft, domain)))
            out.setdefault(draft, {})[domain] = entry
            best = sweep[entry["best_num_draft_tokens"]]
            for name, e in [(FIXED, best)] + list(entry.get("policies", {}).items()):
                cur = best_measured.get(domain)
                if cur is None or _finite(e["measured_speedup"]) > _finite(cur["measured_speedup"]):
                    best_measured[domain] = {"draft": draft, "draft_length_policy": name, **{
                        k: e[k] for k in ("num_draft_tokens", "measured_speedup", "measured_speedup_ci",
                                          "mean_accepted_length", "mean_accepted_length_ci", "expected_speedup",
                                          "expected_speedup_components", "mean_draft_length")}}
    vs = ratios_vs_reference(rows, num_draft_tokens=primary_num_draft_tokens, bootstrap_samples=bootstrap_samples,
                             confidence=confidence, seed=seed) if any(r["draft"] == REFERENCE_DRAFT for r in rows) else {}
    return {"drafts": out, "recommendation": best_measured, "vs_baseline": vs}


def _domain_entry(sweep: dict[int, dict], c: float, primary_num_draft_tokens: int, by_policy: dict | None) -> dict:
    """One (draft, domain) entry: the metrics at the primary gamma (the measured one closest to
    ``primary_num_draft_tokens``), ``best_num_draft_tokens``, Leviathan's curve from the acceptance pooled over the
    sweep, ``sweep`` and ``policies``."""
    gammas = sorted(sweep)
    primary = min(gammas, key=lambda x: (abs(x - primary_num_draft_tokens), x))
    best = max(gammas, key=lambda x: (_finite(sweep[x]["measured_speedup"]), -x))
    ppa = sum(sum(sweep[x]["stats"]["per_position_accepted"]) for x in gammas)
    ppd = sum(sum(sweep[x]["stats"]["per_position_drafted"]) for x in gammas)
    alpha = _ratio(ppa, ppd)
    top = max(max(gammas), 8)
    curve = [expected_speedup(alpha, x, c) if math.isfinite(alpha) else float("nan") for x in range(1, top + 1)]
    entry = dict(sweep[primary])
    entry.update(best_num_draft_tokens=best, token_acceptance_rate_pooled_over_sweep=alpha,
                 leviathan_curve={"num_draft_tokens": list(range(1, top + 1)), "expected_speedup": curve},
                 sweep={str(x): sweep[x] for x in gammas})
    if by_policy:
        entry["policies"] = by_policy
    return entry


def _finite(x) -> float:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else -math.inf


def json_clean(obj):
    """Replace NaN/inf with None (strict JSON) recursively."""
    if isinstance(obj, dict):
        return {k: json_clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_clean(v) for v in obj]
    return _nan_to_none(obj)


# ------------------------------------------------------------------------------------------------- CSV round trip
def row_to_csv(row: dict) -> dict:
    out = {}
    for k in PER_PROMPT_COLUMNS:
        v = row[k] if k not in COLUMN_DEFAULTS else row.get(k, COLUMN_DEFAULTS[k])
        if k in LIST_COLUMNS:
            v = " ".join(str(int(x)) for x in v)
        elif k in FLOAT_LIST_COLUMNS:
            v = " ".join(repr(float(x)) for x in v)
        elif v is None:
            v = ""
        out[k] = v
    return out


def row_from_csv(rec: dict[str, str]) -> dict:
    rec = {**{k: (" ".join(map(str, v)) if isinstance(v, list) else v) for k, v in COLUMN_DEFAULTS.items()
              if rec.get(k) is None}, **{k: v for k, v in rec.items() if v is not None}}
    out: dict[str, Any] = dict(rec)
    for k in INT_COLUMNS:
        out[k] = int(rec[k])
    for k in FLOAT_COLUMNS:
        out[k] = float(rec[k])
    for k in OPTIONAL_FLOAT_COLUMNS:
        out[k] = None if rec.get(k) in (None, "") else float(rec[k])
    for k in OPTIONAL_INT_COLUMNS:
        out[k] = None if rec.get(k) in (None, "") else int(rec[k])
    for k in BOOL_COLUMNS:
        out[k] = None if rec[k] == "" else rec[k] == "True"
    for k in LIST_COLUMNS:
        out[k] = [int(x) for x in rec[k].split()]
    for k in FLOAT_LIST_COLUMNS:
        out[k] = [float(x) for x in rec[k].split()]
    return out


def cell_cost_ratio(rows: list[dict], c: float) -> float:
    """The cost ratio of a cell's drafted tokens: ``c`` (the draft model's one-position forward over the target's),
    scaled for a hybrid draft (decode/hybrid.py) by the share of its drafted tokens its model proposed,
    ``c (1 - lookup_drafted / drafted)`` (a lookup costs next to nothing: decode/ngram.py); ``c`` for every other
    draft (rows without ``lookup_drafted_tokens``)."""
    looked = [r.get("lookup_drafted_tokens") for r in rows]
    if not rows or any(x is None for x in looked):
        return c
    drafted = sum(int(r["drafted_tokens"]) for r in rows)
    return c * (1.0 - sum(looked) / drafted) if drafted else c


def read_per_prompt_csv(path: str | Path) -> list[dict]:
    """Rows of a ``per_prompt.csv`` with their types restored (feed them to :func:`aggregate`)."""
    with open(path, newline="", encoding="utf-8") as f:
        return [row_from_csv(r) for r in csv.DictReader(f)]


def domains_of(doc: dict) -> list[str]:
    """The domains of a ``metrics.json`` document, in the order its drafts first list them."""
    seen: dict[str, None] = {}
    for by_domain in doc["drafts"].values():
        for d in by_domain:
            seen.setdefault(d, None)
    return list(seen)
