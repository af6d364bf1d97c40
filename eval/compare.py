"""Combine the runs of a Hydra multirun sweep into one comparison report.

    python -m train -m +experiment=distill_med_losses      # five losses; writes the comparison when the sweep ends
    python scripts/compare_runs.py outputs/multirun/distill_med_losses/<timestamp>   # (re)write it for any sweep

Every multirun of ``python -m train`` writes it at the end (``train.callbacks.CompareSweep``, in conf/config.yaml).

Every job folder under SWEEP_DIR that holds a ``metrics.json`` is one run; its label is the distillation loss
(``resolved_config.json``: ``distill.loss``), followed by the data source when two jobs share a loss, else by the
job's override folder name.
Writes, atomically, into SWEEP_DIR:

* ``comparison.json``: ``{"sweep_dir", "domains", "num_draft_tokens", "runs": [{"label", "job", "loss",
  "data_source", "teacher_signal", "off_policy_data", "selected_step", "cost": {"steps", "train_s", "one_off_s",
  "on_policy_generation_s", "on_policy_target_scoring_s"}, "mean_accepted_length": {domain: tau}, "mean_accepted_length_ci": {domain: [lo, hi]}, "acceptance_rate":
  {domain: alpha}, "vs_baseline": {domain: tau / tau_baseline}}], "baseline": {"mean_accepted_length": {domain: tau},
  "jobs": n, "spread": {domain: max - min over jobs}}, "skipped": [{"job", "reason"}]}``
* ``comparison.md``: the same as a loss x domain table of mean accepted length (distilled draft, its interval; in parentheses the
  ratio to the cross-entropy baseline), with the baseline as the last row; then what each draft cost (steps,
  training-loop seconds, one-off teacher passes, on-policy generation and target scoring).

The baseline row is the mean over the jobs' baseline drafts (every job of a loss sweep trains the same baseline;
``spread`` shows whether they differ). Exit status 2 (with a message) when SWEEP_DIR holds no finished run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from data.checkpoints import read_specdraft_meta
from data.io import write_json_atomic, write_text_atomic

DRAFT, BASELINE = "distilled", "baseline"


def collect_runs(sweep_dir: Path) -> tuple[list[dict], list[dict]]:
    """(runs, skipped): one dict per job folder with a ``metrics.json`` (sorted by folder name)."""
    runs, skipped = [], []
    for metrics_path in sorted(sweep_dir.rglob("metrics.json")):
        if any(part.startswith(".") for part in metrics_path.relative_to(sweep_dir).parts):
            continue  # a stored report version (.report/<version>/) or Hydra's folders: the job's link is enough
        job = metrics_path.parent
        try:
            metrics = json.loads(metrics_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            skipped.append({"job": str(job.relative_to(sweep_dir)), "reason": f"unreadable metrics.json: {e}"})
            continue
        cfg_path = job / "resolved_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        meta = read_specdraft_meta(job / "drafts" / DRAFT)
        if DRAFT not in metrics.get("drafts", {}):
            skipped.append({"job": str(job.relative_to(sweep_dir)), "reason": f"no {DRAFT!r} draft in metrics.json"})
            continue
        distill = cfg.get("distill", {})
        runs.append({"job": str(job.relative_to(sweep_dir)) or ".", "metrics": metrics,
                     "loss": distill.get("loss", meta.loss or "?"),
                     "data_source": distill.get("data_source", meta.data_source),
                     "teacher_signal": distill.get("teacher_signal", meta.teacher_signal),
                     "off_policy_data": meta.off_policy_data,
                     "selected_step": meta.selected_step, "cost": _cost(meta)})
    return runs, skipped


def _cost(meta) -> dict:
    """What the distilled draft cost (its ``specdraft.json``, :class:`data.specdraft_meta.SpecdraftMeta`): optimizer
    steps, training-loop seconds (on-policy generation and target scoring included), one-off teacher passes (teacher
    data, top-k cache) in seconds, and the on-policy part of the loop (draft generation, target scoring of the draft
    rows)."""
    train, op = meta.train or {}, meta.on_policy or {}
    return {"steps": train.get("steps"), "train_s": train.get("train_time_s"),
            "one_off_s": meta.one_off_pass_seconds if meta else None,
            "on_policy_generation_s": op.get("generation_s"), "on_policy_target_scoring_s": op.get("target_scoring_s")}


def _field(metrics: dict, draft: str, domain: str, name: str):
    return metrics.get("drafts", {}).get(draft, {}).get(domain, {}).get(name)


def _label(r: dict, runs: list[dict], losses: list[str]) -> str:
    """The loss; with the data source when that tells jobs of one loss apart; else with the job folder."""
    if losses.count(r["loss"]) == 1:
        return r["loss"]
    key = (r["loss"], r["data_source"])
    if sum((o["loss"], o["data_source"]) == key for o in runs) == 1:
        return f"{r['loss']} / {r['data_source']}"
    return f"{r['loss']} ({r['job']})"


def compare(runs: list[dict], sweep_dir: str = "") -> dict:
    """The comparison document (see the module docstring) from :func:`collect_runs`' runs."""
    domains: list[str] = []
    for r in runs:
        for d in r["metrics"]["drafts"][DRAFT]:
            if d not in domains:
                domains.append(d)
    base_values = {d: [v for r in runs if (v := _field(r["metrics"], BASELINE, d, "mean_accepted_length")) is not None]
                   for d in domains}
    baseline = {
        "mean_accepted_length": {d: (sum(v) / len(v) if v else None) for d, v in base_values.items()},
        "jobs": sum(1 for r in runs if BASELINE in r["metrics"].get("drafts", {})),
        "spread": {d: (max(v) - min(v) if v else None) for d, v in base_values.items()},
    }
    losses = [r["loss"] for r in runs]
    out_runs = []
    for r in runs:
        tau = {d: _field(r["metrics"], DRAFT, d, "mean_accepted_length") for d in domains}
        base = baseline["mean_accepted_length"]
        out_runs.append({
            "label": _label(r, runs, losses),
            "job": r["job"], "loss": r["loss"], "data_source": r["data_source"],
            "teacher_signal": r["teacher_signal"], "off_policy_data": r.get("off_policy_data"),
            "selected_step": r["selected_step"], "cost": r.get("cost", {}),
            "mean_accepted_length": tau,
            "mean_accepted_length_ci": {d: _field(r["metrics"], DRAFT, d, "mean_accepted_length_ci") for d in domains},
            "acceptance_rate": {d: _field(r["metrics"], DRAFT, d, "acceptance_rate") for d in domains},
            "vs_baseline": {d: (tau[d] / base[d] if tau[d] is not None and base[d] else None) for d in domains},
        })
    gammas = sorted({r["metrics"].get("num_draft_tokens") for r in runs} - {None})
    return {"sweep_dir": sweep_dir, "domains": domains, "num_draft_tokens": gammas[0] if len(gammas) == 1 else gammas,
            "runs": out_runs, "baseline": baseline}


def _cell(v, ratio=None, ci=None) -> str:
    if v is None:
        return "-"
    return (f"{v:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
            + (f" ({ratio:.2f}x)" if ratio is not None else ""))


def render_markdown(doc: dict) -> str:
    """``comparison.md``: loss x domain mean accepted length, the baseline last."""
    domains = doc["domains"]
    lines = [f"# Sweep comparison: {doc['sweep_dir']}", "",
             f"Mean accepted length tau (tokens per verify step, bonus included; gamma = {doc['num_draft_tokens']}) "
             f"of the distilled draft per domain with its bootstrap interval over prompts; in parentheses tau / tau "
             f"of the cross-entropy baseline (when jobs trained one).", "",
             "| loss | " + " | ".join(domains) + " | selected step |",
             "|---|" + "---|" * (len(domains) + 1)]
    for r in doc["runs"]:
        cis = r.get("mean_accepted_length_ci", {})
        cells = [_cell(r["mean_accepted_length"][d], r["vs_baseline"][d], cis.get(d)) for d in domains]
        step = r["selected_step"] if r["selected_step"] is not None else "-"
        lines.append(f"| {r['label']} | " + " | ".join(cells) + f" | {step} |")
    b = doc["baseline"]
    if b["jobs"]:
        lines.append("| baseline (cross-entropy) | "
                     + " | ".join(_cell(b["mean_accepted_length"][d]) for d in domains) + " | - |")
        spread = [s for s in b["spread"].values() if s]
        lines += ["", f"Baseline: mean over {b['jobs']} job(s)" + (f"; max spread between jobs {max(spread):.3f}."
                                                                   if spread else ".")]
    else:
        lines += ["", "No job trained a cross-entropy baseline (stage `baseline`), so there are no ratios."]
    costs = [r for r in doc["runs"] if r.get("cost", {}).get("steps") is not None]
    if costs:
        def sec(v):
            return f"{v:.0f}" if v is not None else "-"

        lines += ["", "What each distilled draft cost (training-loop seconds include on-policy generation and the "
                      "target's scoring of the draft rows; one-off passes: teacher data and top-k cache):", "",
                  "| loss | data | steps | training s | one-off s | on-policy generation s | target scoring s |",
                  "|---|---|---|---|---|---|---|"]
        for r in costs:
            c = r["cost"]
            data = r.get("data_source") or "?"
            if data == "on_policy" and r.get("off_policy_data"):
                data += f" (+ {r['off_policy_data']})"
            lines.append(f"| {r['label']} | {data} | {c['steps']} | {sec(c['train_s'])} | {sec(c['one_off_s'])} | "
                         f"{sec(c.get('on_policy_generation_s'))} | {sec(c.get('on_policy_target_scoring_s'))} |")
    if doc.get("skipped"):
        lines += ["", "Skipped jobs: " + "; ".join(f"{s['job']} ({s['reason']})" for s in doc["skipped"])]
    return "\n".join(lines) + "\n"


def write_comparison(sweep: Path) -> dict:
    """Collect the finished jobs under ``sweep`` and write ``comparison.json`` + ``comparison.md`` there (atomic).

    Returns the comparison document.

    Raises:
        FileNotFoundError: ``sweep`` is not a directory.
        ValueError: no job folder under ``sweep`` holds a finished run (the message lists the skipped ones).
    """
    sweep = Path(sweep)
    if not sweep.is_dir():
        raise FileNotFoundError(f"{sweep} is not a directory (give the multirun folder, hydra.sweep.dir)")
    runs, skipped = collect_runs(sweep)
    if not runs:
        raise ValueError(f"no finished run (a job folder with metrics.json and a {DRAFT!r} draft) under {sweep}"
                         + (f"; skipped: {skipped}" if skipped else ""))
    doc = {**compare(runs, str(sweep)), "skipped": skipped}
    write_json_atomic(sweep / "comparison.json", doc)
    write_text_atomic(sweep / "comparison.md", render_markdown(doc))
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir", type=Path, help="the multirun folder (hydra.sweep.dir)")
    args = ap.parse_args(argv)
    try:
        doc = write_comparison(args.sweep_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render_markdown(doc))
    print(f"wrote {args.sweep_dir / 'comparison.md'} and {args.sweep_dir / 'comparison.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
