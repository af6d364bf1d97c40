"""The learning curve of a draft: held-out acceptance against the unique teacher tokens it trained on.

    python scripts/learning_curve.py RUN_OR_SWEEP_DIR [...] [--domain medical] [--draft distilled] [--target 0.6]
        [--gpu-tokens-per-s 200000] [--recorded learning_curve.json ...] [--out DIR]

Reads each finished run (``metrics.json`` with the held-out section, eval/heldout.py, and the distilled draft's
``specdraft.json``), e.g. the folders of ``python -m train +experiment=learning_curve -m``. Prints and writes
(``learning_curve.md``, ``learning_curve.json``, ``learning_curve.png`` in ``--out``, default the first folder):

* per run: unique teacher tokens, the most reads of any token, held-out first-position acceptance ``alpha_1`` and
  ``tau`` at gamma 3 with their intervals on ``--domain``, the same on training prompts, and the one-off teacher
  passes' compute seconds on this machine;
* the least-squares fit ``alpha_1 = a + b log10(tokens)`` (a straight line on the log axis), the tokens it needs for
  ``--target``, and, marked as a projection, what scoring that many tokens costs: CPU-hours at the throughput the
  runs measured here and GPU-hours at ``--gpu-tokens-per-s`` (a stated assumption, not a measurement).

Points are grouped by draft kind (``specdraft.json``'s ``init``: ``layer_pruned``, ``eagle3``, ...): each kind gets
its own fit, table and series in the plot (held-out alpha_1 and tau at gamma 3 against tokens, log axis, each point
labelled with its training seconds). ``--recorded`` adds the points of an earlier ``learning_curve.json`` (e.g. a
kind measured at another commit), shown as they were recorded.

Exit status 2 with a message when fewer than two points of one kind are found.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def _runs(paths: list[Path]) -> list[Path]:
    found = []
    for p in paths:
        found += sorted({m.parent for m in p.rglob("metrics.json")}) if p.is_dir() else []
    return found


def run_point(run: Path, domain: str, draft: str = "distilled") -> dict | None:
    """One curve point from a finished run folder, or None when it lacks the held-out section or the draft."""
    doc = json.loads((run / "metrics.json").read_text())
    ho = (doc.get("heldout") or {}).get("drafts", {})
    name = draft if draft in ho else next((n for n in ho if n.startswith(draft)), None)  # else e.g. <draft>_int8
    meta_path = run / "drafts" / draft / "specdraft.json"
    if name is None or domain not in ho[name] or not meta_path.exists():
        return None
    meta = json.loads(meta_path.read_text())
    tr = meta.get("train", {})
    cost = sum(float((meta.get(k) or {}).get("cost_s") or (meta.get(k) or {}).get("time_s") or 0)
               for k in ("teacher_cache", "teacher_data"))
    cache = meta.get("teacher_cache") or {}
    # the tokens the teacher passes' seconds scored: shards an earlier size wrote are reused, not rescored
    computed = cache.get("computed_tokens", None if cache.get("reused_shards") else "unique")
    s, t = ho[name][domain], ho[name].get(f"train:{domain}")
    unique = tr.get("unique_tokens") or (meta.get("teacher_cache") or {}).get("scored_tokens")  # cached: the same
    reads = tr.get("max_reads_per_token") or (-(-int(tr["tokens_seen"]) // unique) if unique and "tokens_seen" in tr
                                              else None)
    return {"run": str(run), "kind": meta.get("init") or "draft", "unique_tokens": unique, "max_reads": reads,
            "steps": tr.get("steps"), "train_s": tr.get("train_time_s"), "teacher_cost_s": cost,
            "teacher_scored_tokens": unique if computed == "unique" else computed,
            "alpha_1": s["alpha"][0], "alpha_1_ci": s["alpha_ci"][0], "tau_3": s["tau"].get("3", s["tau"].get(3)),
            "tau_3_ci": s["tau_ci"].get("3", s["tau_ci"].get(3)), "prompts": s["prompts"],
            "train_alpha_1": t["alpha"][0] if t else None,
            "others": {d: v["alpha"][0] for d, v in ho[name].items() if d != domain and not d.startswith("train:")}}


def fit_log_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b log10(x)``; returns ``(a, b)``."""
    lx = [math.log10(x) for x in xs]
    mx, my = sum(lx) / len(lx), sum(ys) / len(ys)
    sxx = sum((v - mx) ** 2 for v in lx)
    b = sum((v - mx) * (y - my) for v, y in zip(lx, ys)) / sxx
    return my - b * mx, b


def curve(points: list[dict], target: float, gpu_tokens_per_s: float) -> dict:
    xs, ys = [p["unique_tokens"] for p in points], [p["alpha_1"] for p in points]
    a, b = fit_log_line(xs, ys)
    need = 10 ** ((target - a) / b) if b > 0 else None
    per_token_s = sum(p["teacher_cost_s"] or 0 for p in points) / max(1, sum(p["unique_tokens"] for p in points))
    cpu_rate = max((p["teacher_scored_tokens"] / p["teacher_cost_s"] for p in points
                    if p["teacher_cost_s"] and p.get("teacher_scored_tokens")), default=None)
    return {"fit": {"a": a, "b_per_decade": b}, "target_alpha_1": target, "tokens_for_target": need,
            "projection": None if need is None else {
                "cpu_hours_here": need / cpu_rate / 3600 if cpu_rate else None, "cpu_tokens_per_s": cpu_rate,
                "gpu_hours": need / gpu_tokens_per_s / 3600, "gpu_tokens_per_s_assumed": gpu_tokens_per_s},
            "teacher_s_per_token_here": per_token_s}


def _num(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def markdown(points: list[dict], c: dict, domain: str) -> str:
    ci = lambda v: f" [{v[0]:.2f}, {v[1]:.2f}]" if v else ""  # noqa: E731
    lines = [f"| unique teacher tokens | most reads | held-out {domain} alpha_1 | tau g=3 | training-prompt alpha_1 | "
             f"other domains alpha_1 | teacher passes s | training s |", "|---|---|---|---|---|---|---|---|"]
    for p in points:
        others = ", ".join(f"{d} {v:.2f}" for d, v in p["others"].items())
        tr = "-" if p["train_alpha_1"] is None else f"{p['train_alpha_1']:.2f}"
        lines.append(f"| {p['unique_tokens']:,} | {p['max_reads']} | {p['alpha_1']:.3f}{ci(p['alpha_1_ci'])} | "
                     f"{p['tau_3']:.2f}{ci(p['tau_3_ci'])} | {tr} | {others} | {_num(p['teacher_cost_s'])} | "
                     f"{_num(p['train_s'])} |")
    if c is None:
        return "\n".join(lines + ["", "One token count: no fit."])
    f = c["fit"]
    lines += ["", f"Fit: alpha_1 = {f['a']:.3f} + {f['b_per_decade']:.3f} x log10(tokens) "
                  f"({len(points)} points)."]
    if c["tokens_for_target"] is None:
        lines.append(f"The fit does not rise with tokens: no token count reaches alpha_1 {c['target_alpha_1']}.")
    else:
        pr = c["projection"]
        lines.append(f"Projection (extrapolated from the fit, not measured): alpha_1 {c['target_alpha_1']} at "
                     f"{c['tokens_for_target']:.3g} unique teacher tokens; scoring them takes "
                     + (f"{pr['cpu_hours_here']:.3g} CPU-hours here ({pr['cpu_tokens_per_s']:.0f} tokens/s measured) "
                        "and " if pr["cpu_hours_here"] else "")
                     + f"{pr['gpu_hours']:.3g} GPU-hours at an assumed {pr['gpu_tokens_per_s_assumed']:.3g} "
                       f"tokens/s.")
    return "\n".join(lines)


def plot(groups: dict[str, tuple[list[dict], dict]], path: Path, domain: str) -> None:
    """Held-out alpha_1 (with intervals and each kind's fit) and tau at gamma 3 against tokens, one series per kind,
    each point labelled with its training seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    for kind, (points, c) in groups.items():
        xs = [p["unique_tokens"] for p in points]
        err = ([[p["alpha_1"] - p["alpha_1_ci"][0] for p in points], [p["alpha_1_ci"][1] - p["alpha_1"] for p in points]]
               if all(p["alpha_1_ci"] for p in points) else None)
        line = ax[0].errorbar(xs, [p["alpha_1"] for p in points], yerr=err, fmt="o", capsize=3,
                              label=f"{kind}: held-out {domain}")
        color = line[0].get_color()
        if c is not None:
            f = c["fit"]
            grid = [min(xs) * (max(xs) / min(xs)) ** (k / 40) for k in range(41)]
            ax[0].plot(grid, [f["a"] + f["b_per_decade"] * math.log10(g) for g in grid], "--", color=color, lw=0.8)
        terr = ([[p["tau_3"] - p["tau_3_ci"][0] for p in points], [p["tau_3_ci"][1] - p["tau_3"] for p in points]]
                if all(p.get("tau_3_ci") for p in points) else None)
        ax[1].errorbar(xs, [p["tau_3"] for p in points], yerr=terr, fmt="o-", capsize=3, color=color, label=kind)
        for p in points:
            if p.get("train_s") is not None:
                ax[1].annotate(f"{p['train_s']:.0f} s", (p["unique_tokens"], p["tau_3"]), fontsize=6,
                               xytext=(3, 3), textcoords="offset points", color=color)
    ax[0].set(xscale="log", xlabel="unique teacher tokens", ylabel="alpha_1 (first draft position)")
    ax[1].set(xscale="log", xlabel="unique teacher tokens", ylabel="tau at gamma 3 (held-out; labels: training s)")
    ax[0].legend(fontsize=7)
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path, help="run folders or sweep folders holding them")
    ap.add_argument("--domain", default="medical")
    ap.add_argument("--target", type=float, default=0.6, help="the alpha_1 the projection solves for")
    ap.add_argument("--gpu-tokens-per-s", type=float, default=2e5,
                    help="assumed teacher-forced scoring throughput of one GPU for the projection")
    ap.add_argument("--draft", default="distilled", help="the draft read from each run (default distilled; its int8 "
                    "copy when only that was evaluated)")
    ap.add_argument("--recorded", type=Path, action="append", default=[],
                    help="an earlier run's learning_curve.json whose points are added as recorded")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    points = [p for p in (run_point(r, args.domain, args.draft) for r in _runs(args.paths)) if p and p["unique_tokens"]]
    for f in args.recorded:
        points += [{"kind": "draft", **p} for p in json.loads(f.read_text())["points"]]
    kinds: dict[str, list[dict]] = {}  # one series per draft kind, its points read once apart from those read more
    for p in sorted(points, key=lambda p: p["unique_tokens"]):
        kinds.setdefault(p["kind"] if (p.get("max_reads") or 1) <= 1 else f"{p['kind']}, several reads", []).append(p)
    if not any(len({p["unique_tokens"] for p in ps}) >= 2 for ps in kinds.values()):
        print(f"error: need at least two finished runs of one draft kind at different token counts with a held-out "
              f"section under {args.paths}; found {len(points)} point(s)", file=sys.stderr)
        return 2
    groups = {k: (ps, curve(ps, args.target, args.gpu_tokens_per_s) if len({p["unique_tokens"] for p in ps}) >= 2
                  else None) for k, ps in kinds.items()}
    out = args.out or (args.paths[0] if args.paths[0].is_dir() else Path("."))
    out.mkdir(parents=True, exist_ok=True)
    md = "\n\n".join(f"**{k}**\n\n" + markdown(ps, c, args.domain) for k, (ps, c) in groups.items())
    (out / "learning_curve.md").write_text(md + "\n")
    doc = {"points": [p for ps, _ in groups.values() for p in ps],
           **next(c for _, c in groups.values() if c is not None),
           "kinds": {k: c for k, (_, c) in groups.items()}}
    (out / "learning_curve.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(groups, out / "learning_curve.png", args.domain)
    print(md)
    print(f"\nwrote {out / 'learning_curve.md'}, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
