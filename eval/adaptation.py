"""The report's "Adaptation" section: a domain's adapted drafts beside the alternatives, in one table.

For the domain a LoRA (kind ``lora``) or fully fine-tuned (kind ``finetune``) draft of the evaluation was adapted
to, one row per evaluated draft: how it was made, its trainable parameters, its training time (training loop +
one-off teacher passes, from its ``specdraft.json``), its tau on that domain with the 95% bootstrap interval over
prompts, tau relative to the base draft the adaptation started from, its measured speedup with interval, and
for a LoRA draft the adapter's size on disk and the time to merge it into the base weights.
"""
from __future__ import annotations

import math
from pathlib import Path

from data.specdraft_meta import SpecdraftMeta

ADAPTED_KINDS = ("lora", "finetune")


def _f(x, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def _ci(ci) -> str:
    return f" [{_f(ci[0])}, {_f(ci[1])}]" if ci else ""


def _how(m: SpecdraftMeta) -> str:
    """How a draft was made, in words, from its ``specdraft.json``."""
    data = f"({m.data_source} data, {m.teacher_signal} teacher)"
    if m.kind == "lora":
        full = (m.lora or {}).get("modules_to_save")
        return (f"LoRA r={(m.lora or {}).get('rank')} on the base"
                f"{' + ' + ', '.join(full) + ' trained in full' if full else ''} {data}")
    if m.kind == "finetune":
        return f"every weight of the base fine-tuned {data}"
    if m.distilled:
        return f"distilled from scratch {data}"
    return m.kind or "?"


def adaptation_rows(doc: dict, meta: dict[str, SpecdraftMeta], draft_paths: dict[str, str | Path]) -> list[dict]:
    """One dict per evaluated draft for the domain of the first adapted draft in ``meta`` (empty when none):
    ``draft, kind, trainable_parameters, train_time_s, one_off_s, total_time_s, passes_reused, tau, tau_ci,
    tau_vs_base, speedup, speedup_ci, adapter_bytes, merge_time_s, base``. ``doc``: the evaluation's metrics document (its ``drafts``
    section at the primary gamma); ``draft_paths``: name -> directory, to find which evaluated draft is the base."""
    adapted = [n for n, m in meta.items() if m.kind in ADAPTED_KINDS and n in doc.get("drafts", {})]
    if not adapted:
        return []
    domain = meta[adapted[0]].domain
    base_path = Path(meta[adapted[0]].base).resolve()
    base = next((n for n, p in draft_paths.items() if Path(p).resolve() == base_path), None)
    base_tau = doc["drafts"].get(base, {}).get(domain, {}).get("mean_accepted_length") if base else None
    rows = []
    for name, per_domain in doc["drafts"].items():
        e = per_domain.get(domain)
        if e is None:
            continue
        m = meta.get(name) or SpecdraftMeta()
        tr = m.train or {}
        train_s = tr.get("train_time_s")
        one_off = m.one_off_pass_seconds if m else None
        tau = e.get("mean_accepted_length")
        rows.append({
            "draft": name, "domain": domain, "base": name == base,
            "kind": "base: the draft adapted" if name == base else _how(m),
            "trainable_parameters": m.trainable_parameters if m.trainable_parameters is not None
            else m.draft_parameters,
            "steps": tr.get("steps"),
            "train_time_s": train_s, "one_off_s": one_off,
            "total_time_s": (train_s + one_off) if train_s is not None else None,
            # every one-off pass came from the cache (stored by another stage or an earlier run): not paid here
            "passes_reused": m.passes_reused,
            "tau": tau, "tau_ci": e.get("mean_accepted_length_ci"),
            "tau_vs_base": tau / base_tau if tau is not None and base_tau else None,
            "speedup": e.get("measured_speedup"), "speedup_ci": e.get("measured_speedup_ci"),
            "adapter_bytes": m.adapter_bytes, "merge_time_s": m.merge_time_s,
        })
    return rows


class AdaptationSection:
    """A report section (called with the metrics document, like the other callable sections)."""

    def __init__(self, meta: dict[str, SpecdraftMeta], draft_paths: dict[str, str | Path]):
        self.meta, self.draft_paths = meta, draft_paths
        self.rows: list[dict] = []

    def __call__(self, doc: dict) -> str:
        self.rows = rows = adaptation_rows(doc, self.meta, self.draft_paths)
        if not rows:
            return ""
        lines = [f"## Adaptation ({rows[0]['domain']})", "",
                 "| draft | how it was made | trainable parameters | steps | training time s (loop + one-off "
                 "passes) | tau [95% CI] | tau / base | measured speedup [95% CI] | adapter bytes | merge s |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            time_s = "-" if r["train_time_s"] is None or r["base"] else \
                f"{r['total_time_s']:.0f} ({r['train_time_s']:.0f} + {r['one_off_s']:.0f}" \
                f"{', passes reused' if r['passes_reused'] else ''})"
            params = f"{r['trainable_parameters']:,}" if r["trainable_parameters"] else "-"
            lines.append(
                f"| {r['draft']} | {r['kind']} | {params} | {r['steps'] if r['steps'] and not r['base'] else '-'} | "
                f"{time_s} | {_f(r['tau'])}{_ci(r['tau_ci'])} | {_f(r['tau_vs_base'])} | "
                f"{_f(r['speedup'])}x{_ci(r['speedup_ci'])} | "
                f"{r['adapter_bytes'] if r['adapter_bytes'] is not None else '-'} | "
                f"{_f(r['merge_time_s'], 3) if r['merge_time_s'] is not None else '-'} |")
        lines += ["", "Training time: the training loop's wall clock (checkpoint-selection evaluations excluded) "
                  "plus the one-off teacher passes the stage ran (target generations, top-k cache; a pass another "
                  "stage or an earlier run stored costs only its load time). tau: tokens per verify step on the "
                  "domain's test prompts at the primary gamma. The base row is the draft the adaptation started from.",
                  ""]
        return "\n".join(lines)
