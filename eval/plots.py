"""The report's figures (matplotlib, Agg backend; written atomically as PNG).

- ``acceptance_by_domain.png``: acceptance rate and mean accepted length per domain, one bar per draft, 95% bootstrap
  intervals as error bars, the value printed on each bar, the alert threshold as a dashed line.
- ``accepted_length_histograms.png``: per domain, the share of verify steps that accepted 0..gamma draft tokens.
- ``speedup_vs_num_draft_tokens.png``: per domain, measured speedup (points with intervals) and the Leviathan et al.
  expected speedup curve, per draft; the recommended gamma is ringed.
- ``per_position_acceptance.png``: per domain, P(draft token i accepted | tokens before it accepted).
"""
from __future__ import annotations

import io
import math
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt  # noqa: E402

from core.io import write_bytes_atomic

matplotlib.use("Agg")

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def _save(fig, path: Path) -> Path:
    """PNG bytes written atomically (temp name, then rename)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue())
    return path


def _v(x) -> float:
    return float(x) if isinstance(x, (int, float)) and x is not None and math.isfinite(x) else float("nan")


def _grid(n: int, max_cols: int = 4):
    cols = min(n, max_cols)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.9 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.axis("off")
    return fig, flat[:n]


def _domains(doc: dict) -> list[str]:
    seen: dict[str, None] = {}
    for by_domain in doc["drafts"].values():
        for d in by_domain:
            seen.setdefault(d, None)
    return list(seen)


def acceptance_by_domain(doc: dict, path: Path, alert: float | None = None) -> Path:
    drafts, domains = list(doc["drafts"]), _domains(doc)
    width = 0.8 / max(1, len(drafts))
    fig, axes = plt.subplots(2, 1, figsize=(min(16.0, max(7.0, 0.55 * len(domains) * max(1, len(drafts)) + 3)), 7.5))
    for ax, field, label in ((axes[0], "acceptance_rate", "acceptance rate $\\alpha$"),
                             (axes[1], "mean_accepted_length", "mean accepted length $\\tau$ (tokens / verify step)")):
        for j, draft in enumerate(drafts):
            xs, ys, err_lo, err_hi = [], [], [], []
            for i, dom in enumerate(domains):
                e = doc["drafts"][draft].get(dom)
                if e is None:
                    continue
                y = _v(e[field])
                ci = e.get(f"{field}_ci") or [y, y]
                xs.append(i + (j - (len(drafts) - 1) / 2) * width)
                ys.append(y)
                err_lo.append(max(0.0, y - _v(ci[0])) if not math.isnan(y) else 0.0)
                err_hi.append(max(0.0, _v(ci[1]) - y) if not math.isnan(y) else 0.0)
            bars = ax.bar(xs, ys, width * 0.95, yerr=[err_lo, err_hi], capsize=3, label=draft,
                          color=COLORS[j % len(COLORS)], error_kw={"elinewidth": 1})
            for b, y, up in zip(bars, ys, err_hi):
                if not math.isnan(y):
                    ax.annotate(f"{y:.2f}", (b.get_x() + b.get_width() / 2, y + up), xytext=(0, 2),
                                textcoords="offset points", ha="center", va="bottom", fontsize=7)
        if field == "mean_accepted_length" and alert:
            ax.axhline(alert, color="red", ls="--", lw=1, label=f"alert: $\\tau$ < {alert:g}")
        if field == "acceptance_rate":
            ax.set_ylim(0, 1.15)
        else:
            top = max([_v(doc["drafts"][n][d][f"{field}_ci"][1]) if doc["drafts"][n].get(d, {}).get(f"{field}_ci")
                       else _v(doc["drafts"][n].get(d, {}).get(field)) for n in drafts for d in domains] + [alert or 0])
            ax.set_ylim(0, (top if math.isfinite(top) else 1.0) * 1.15 + 0.1)
        ax.set_ylabel(label, fontsize=9)
        ax.set_xticks(range(len(domains)))
        ax.set_xticklabels(domains, rotation=25, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0)
    g = doc.get("num_draft_tokens_primary", doc.get("num_draft_tokens"))
    axes[0].set_title(f"Acceptance by domain (gamma = {g}; error bars: {int(100 * doc.get('confidence', 0.95))}% "
                      f"bootstrap over prompts)")
    fig.tight_layout()
    return _save(fig, path)


def accepted_length_histograms(doc: dict, path: Path) -> Path:
    drafts, domains = list(doc["drafts"]), _domains(doc)
    fig, axes = _grid(len(domains))
    width = 0.8 / max(1, len(drafts))
    for ax, dom in zip(axes, domains):
        for j, draft in enumerate(drafts):
            e = doc["drafts"][draft].get(dom)
            if e is None:
                continue
            hist = e["accepted_length_histogram"]
            total = sum(hist) or 1
            ax.bar([k + (j - (len(drafts) - 1) / 2) * width for k in range(len(hist))], [h / total for h in hist],
                   width * 0.95, color=COLORS[j % len(COLORS)], label=f"{draft} ($\\tau$={_v(e['mean_accepted_length']):.2f})")
        ax.set_title(f"{dom} (gamma = {doc['num_draft_tokens']})", fontsize=9)  # e may be None (routed eval)
        ax.set_xlabel("draft tokens accepted in a verify step", fontsize=8)
        ax.set_ylabel("share of verify steps", fontsize=8)
        ax.set_xticks(range(0, max(len(doc["drafts"][d].get(dom, {}).get("accepted_length_histogram", [0]))
                                   for d in drafts)))
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Accepted-length histograms", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


POLICY_MARKERS = ("^", "s", "D", "v")


def speedup_vs_num_draft_tokens(doc: dict, path: Path) -> Path:
    drafts, domains = list(doc["drafts"]), _domains(doc)
    fig, axes = _grid(len(domains))
    rec = doc.get("recommendation", {})
    handles: dict[str, object] = {}
    top_g = 1
    for ax, dom in zip(axes, domains):
        for j, draft in enumerate(drafts):
            e = doc["drafts"][draft].get(dom)
            if e is None:
                continue
            color = COLORS[j % len(COLORS)]
            curve = e["leviathan_curve"]
            top_g = max(top_g, max(curve["num_draft_tokens"]))
            (h1,) = ax.plot(curve["num_draft_tokens"], [_v(y) for y in curve["expected_speedup"]], "--", color=color,
                            lw=1)
            handles.setdefault(f"{draft}: Leviathan expected", h1)
            gs = sorted(int(g) for g in e["sweep"])
            ys = [_v(e["sweep"][str(g)]["measured_speedup"]) for g in gs]
            lo, hi = [], []
            for g, y in zip(gs, ys):
                ci = e["sweep"][str(g)].get("measured_speedup_ci") or [y, y]
                lo.append(max(0.0, y - _v(ci[0])) if not math.isnan(y) else 0.0)
                hi.append(max(0.0, _v(ci[1]) - y) if not math.isnan(y) else 0.0)
            h2 = ax.errorbar(gs, ys, yerr=[lo, hi], fmt="o-", color=color, ms=4, capsize=3, lw=1.2)
            handles.setdefault(f"{draft}: measured ({int(100 * doc.get('confidence', 0.95))}% CI)", h2)
            for g, y in zip(gs, ys):
                if not math.isnan(y):
                    ax.annotate(f"{y:.2f}", (g, y), xytext=(4, -9), textcoords="offset points", fontsize=6,
                                color=color)
            # draft-length policies: one marker each at the mean draft length they used
            for k, (name, pe) in enumerate(e.get("policies", {}).items()):
                x, y = _v(pe.get("mean_draft_length")), _v(pe["measured_speedup"])
                if not (math.isnan(x) or math.isnan(y)):
                    (hp,) = ax.plot([x], [y], POLICY_MARKERS[k % len(POLICY_MARKERS)], color=color, ms=7)
                    handles.setdefault(f"{draft}: {name} policy (at its mean draft length)", hp)
        r = rec.get(dom)
        title = dom
        if r and r.get("draft") and not math.isnan(_v(r["measured_speedup"])):
            policy = r.get("draft_length_policy", "fixed")
            x = r["num_draft_tokens"] if policy == "fixed" else _v(r.get("mean_draft_length"))
            (h3,) = ax.plot([x], [r["measured_speedup"]], "o", ms=11, mfc="none", mec="black")
            handles.setdefault("recommended", h3)
            how = f"gamma={r['num_draft_tokens']}" if policy == "fixed" else policy
            title += f"\nrecommended: {r['draft']}, {how} ({_v(r['measured_speedup']):.2f}x)"
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("num_draft_tokens (gamma)", fontsize=8)
        ax.set_ylabel("speedup over target-only", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes:
        ax.set_xticks(range(1, top_g + 1))
        ax.tick_params(labelsize=7)
    fig.suptitle("Speedup vs num_draft_tokens: measured (points) and Leviathan et al. expected (dashed)", fontsize=11)
    ncol = min(3, max(1, len(handles)))
    legend_in = 0.22 * math.ceil(len(handles) / ncol) + 0.05  # inches of legend below the axes
    fig.tight_layout(rect=(0, legend_in / fig.get_figheight(), 1, 1))
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    return _save(fig, path)


def per_position_acceptance(doc: dict, path: Path) -> Path:
    drafts, domains = list(doc["drafts"]), _domains(doc)
    fig, axes = _grid(len(domains))
    for ax, dom in zip(axes, domains):
        for j, draft in enumerate(drafts):
            e = doc["drafts"][draft].get(dom)
            if e is None:
                continue
            ys = [_v(y) for y in e["per_position_acceptance"]]
            ax.plot(range(1, len(ys) + 1), ys, "o-", color=COLORS[j % len(COLORS)], ms=4, label=draft)
        ax.set_ylim(0, 1.05)
        ax.set_title(dom, fontsize=9)
        ax.set_xlabel("draft position", fontsize=8)
        ax.set_ylabel("P(accepted | earlier accepted)", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Per-position acceptance", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


def write_plots(doc: dict, out_dir: str | Path, alert: float | None = None) -> dict[str, Path]:
    """Write every figure into ``<out_dir>/plots/``; returns name -> path (``{}`` when no draft was decoded, as under
    a routing table that sends every domain to the target alone)."""
    plots = Path(out_dir) / "plots"
    if not _domains(doc):
        return {}
    return {
        "acceptance_by_domain": acceptance_by_domain(doc, plots / "acceptance_by_domain.png", alert),
        "accepted_length_histograms": accepted_length_histograms(doc, plots / "accepted_length_histograms.png"),
        "speedup_vs_num_draft_tokens": speedup_vs_num_draft_tokens(doc, plots / "speedup_vs_num_draft_tokens.png"),
        "per_position_acceptance": per_position_acceptance(doc, plots / "per_position_acceptance.png"),
    }
