"""Report files: ``metrics.json`` (machine-readable), ``report.md`` (tables + verdicts), ``per_prompt.csv``."""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

from data.io import write_json_atomic, write_text_atomic

METRIC_FIELDS = ("acceptance_rate", "mean_accepted_length", "target_tokens_per_s", "speculative_tokens_per_s",
                 "measured_speedup", "expected_speedup", "cost_ratio", "num_prompts", "lossless")


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "**NO**"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.{digits}f}"
    return str(v)


def metrics_document(results: dict, context: dict) -> dict:
    """The ``metrics.json`` document: ``{"context": ..., "drafts": {draft: {domain: entry}}, "cost_ratio": ...}``.

    Entries are keyed by draft name then domain (the report's field names; see README "Report fields").
    """
    drafts: dict = {}
    for domain, by_draft in results["domains"].items():
        for name, entry in by_draft.items():
            drafts.setdefault(name, {})[domain] = entry
    all_lossless = [e["lossless"] for d in drafts.values() for e in d.values() if e["lossless"] is not None]
    return {
        "context": context,
        "num_draft_tokens": results["num_draft_tokens"],
        "max_new_tokens": results["max_new_tokens"],
        "sampling": results["sampling"],
        "cost_ratio": results["cost_ratio"],
        "lossless_all": all(all_lossless) if all_lossless else None,
        "drafts": drafts,
    }


def render_markdown(doc: dict, extra_sections: list[str] | None = None) -> str:
    ctx = doc["context"]
    lines = [f"# specdraft acceptance report: {ctx.get('experiment_name', '')}", ""]
    lines += [f"- target: `{ctx.get('target')}`", f"- drafts: " + ", ".join(f"`{k}`" for k in doc["drafts"]),
              f"- num_draft_tokens (gamma): {doc['num_draft_tokens']}, max_new_tokens: {doc['max_new_tokens']}, "
              f"decoding: {'sampling ' + str(doc['sampling']) if doc['sampling'].get('do_sample') else 'greedy'}",
              f"- speculative greedy output equals target-only greedy output on every prompt: "
              f"{_fmt(doc['lossless_all'])}", ""]
    for name, c in doc["cost_ratio"].items():
        lines.append(f"- cost ratio c of `{name}`: {c['cost_ratio']:.3f} (draft forward {c['draft_forward_s']*1e3:.2f} ms, "
                     f"target forward {c['target_forward_s']*1e3:.2f} ms)")
    lines.append("")
    domains = list(next(iter(doc["drafts"].values())).keys()) if doc["drafts"] else []
    header = ("| draft | acceptance rate | mean accepted length | target-only tok/s | speculative tok/s | "
              "measured speedup | expected speedup (Leviathan) | prompts | lossless |")
    for domain in domains:
        lines += [f"## {domain}", "", header, "|" + "---|" * 9]
        best = max(doc["drafts"], key=lambda n: doc["drafts"][n][domain]["mean_accepted_length"])
        for name, by_domain in doc["drafts"].items():
            e = by_domain[domain]
            lines.append(f"| {name} | {_fmt(e['acceptance_rate'])} | {_fmt(e['mean_accepted_length'])} | "
                         f"{_fmt(e['target_tokens_per_s'], 1)} | {_fmt(e['speculative_tokens_per_s'], 1)} | "
                         f"{_fmt(e['measured_speedup'], 2)}x | {_fmt(e['expected_speedup'], 2)}x | {e['num_prompts']} | "
                         f"{_fmt(e['lossless'])} |")
        e = doc["drafts"][best][domain]
        lines += ["", f"Verdict: `{best}` has the highest mean accepted length on {domain} "
                      f"({e['mean_accepted_length']:.2f} tokens per verify step, measured speedup "
                      f"{e['measured_speedup']:.2f}x).", ""]
    for s in extra_sections or []:
        lines += [s, ""]
    lines += ["Field meanings: see README.md, section \"Report fields\".", ""]
    return "\n".join(lines)


def write_per_prompt_csv(path: Path, rows: list[dict]) -> None:
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    write_text_atomic(path, buf.getvalue())


def write_report(out_dir: str | Path, results: dict, context: dict, extra_sections: list[str] | None = None) -> dict:
    """Write ``metrics.json``, ``report.md`` and ``per_prompt.csv`` into ``out_dir`` (each atomically)."""
    out_dir = Path(out_dir)
    doc = metrics_document(results, context)
    write_json_atomic(out_dir / "metrics.json", doc)
    write_per_prompt_csv(out_dir / "per_prompt.csv", results["per_prompt"])
    write_text_atomic(out_dir / "report.md", render_markdown(doc, extra_sections))
    return doc
