"""Tracking: the run's local JSONL event log and, with ``logger=wandb``, a Weights & Biases run.

The wandb run defaults to ``mode=offline`` (nothing leaves the machine; ``wandb sync <dir>`` uploads later) and
writes its folder under the run directory (``<run_dir>/wandb/offline-run-*``). It receives the same numbers as
``metrics.json`` (flattened ``<draft>/<domain>/<field>`` into the run summary and one history step), the plots as
``wandb.Image``, a ``metrics`` table (one row per draft x domain x num_draft_tokens), optionally the per-prompt
table, and copies of ``metrics.json`` / ``report.md`` (``specdraft_metrics.json`` / ``specdraft_report.md``)
in the run's files.
"""
from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SUMMARY_FIELDS = ("acceptance_rate", "token_acceptance_rate", "mean_accepted_length", "expected_mean_accepted_length",
                  "measured_speedup", "expected_speedup", "target_tokens_per_s", "speculative_tokens_per_s",
                  "cost_ratio", "draft_time_s", "verify_time_s", "num_prompts", "best_num_draft_tokens")
TABLE_COLUMNS = ("draft", "domain", "num_draft_tokens", "acceptance_rate", "acceptance_rate_ci_low",
                 "acceptance_rate_ci_high", "mean_accepted_length", "mean_accepted_length_ci_low",
                 "mean_accepted_length_ci_high", "measured_speedup", "measured_speedup_ci_low",
                 "measured_speedup_ci_high", "expected_speedup", "target_tokens_per_s", "speculative_tokens_per_s",
                 "speculative_latency_p50_s", "speculative_latency_p95_s", "speculative_latency_p99_s",
                 "num_prompts", "lossless")


def _num(x) -> Any:
    return x if x is None or not isinstance(x, float) or math.isfinite(x) else None


def flat_metrics(doc: dict) -> dict[str, Any]:
    """``{"<draft>/<domain>/<field>": value}`` for the primary gamma, plus ``.../gamma<g>/<field>`` per swept gamma,
    ``.../<policy>/<field>`` per draft-length policy, ``recommendation/<domain>/...`` and ``lossless_all``."""
    out: dict[str, Any] = {"lossless_all": doc.get("lossless_all")}
    for draft, by_domain in doc["drafts"].items():
        for domain, e in by_domain.items():
            for f in SUMMARY_FIELDS:
                out[f"{draft}/{domain}/{f}"] = _num(e.get(f))
            for f in ("mean_accepted_length_ci", "measured_speedup_ci", "acceptance_rate_ci"):
                if e.get(f):
                    out[f"{draft}/{domain}/{f}_low"], out[f"{draft}/{domain}/{f}_high"] = e[f]
            for g, s in e.get("sweep", {}).items():
                for f in ("mean_accepted_length", "measured_speedup", "expected_speedup", "acceptance_rate"):
                    out[f"{draft}/{domain}/gamma{g}/{f}"] = _num(s.get(f))
            for p, s in e.get("policies", {}).items():
                for f in ("mean_accepted_length", "measured_speedup", "expected_speedup", "acceptance_rate",
                          "mean_draft_length"):
                    out[f"{draft}/{domain}/{p}/{f}"] = _num(s.get(f))
    for domain, r in doc.get("recommendation", {}).items():
        out[f"recommendation/{domain}/draft"] = r["draft"]
        out[f"recommendation/{domain}/num_draft_tokens"] = r["num_draft_tokens"]
        out[f"recommendation/{domain}/draft_length_policy"] = r.get("draft_length_policy", "fixed")
        out[f"recommendation/{domain}/measured_speedup"] = _num(r["measured_speedup"])
    return out


def metrics_rows(doc: dict) -> list[list]:
    """One row per draft x domain x num_draft_tokens, columns :data:`TABLE_COLUMNS`."""
    rows = []
    for draft, by_domain in doc["drafts"].items():
        for domain, entry in by_domain.items():
            for g, e in entry["sweep"].items():
                def ci(f, i):
                    return e[f"{f}_ci"][i] if e.get(f"{f}_ci") else None

                lat = e["speculative_latency_s"]
                rows.append([draft, domain, int(g), e["acceptance_rate"], ci("acceptance_rate", 0),
                             ci("acceptance_rate", 1), e["mean_accepted_length"], ci("mean_accepted_length", 0),
                             ci("mean_accepted_length", 1), e["measured_speedup"], ci("measured_speedup", 0),
                             ci("measured_speedup", 1), e["expected_speedup"], e["target_tokens_per_s"],
                             e["speculative_tokens_per_s"], lat["p50"], lat["p95"], lat["p99"], e["num_prompts"],
                             e["lossless"]])
    return rows


def log_to_wandb(logger_cfg, run_dir: str | Path, doc: dict, *, config: dict | None = None,
                 name: str | None = None, per_prompt_rows: list[dict] | None = None,
                 events_path: str | Path | None = None) -> str | None:
    """Log one evaluation to a wandb run (offline unless ``logger.mode=online``); returns the run's local folder.

    Training events found in ``events_path`` (``train_step`` / ``train_eval``) are replayed as history so the same
    run shows the training curves of a pipeline run.
    """
    import wandb

    run_dir = Path(run_dir)
    wdir = Path(logger_cfg.dir).expanduser() if logger_cfg.dir else run_dir
    wdir.mkdir(parents=True, exist_ok=True)
    run = wandb.init(project=logger_cfg.project, entity=logger_cfg.entity, mode=logger_cfg.mode, dir=str(wdir),
                     name=name, config=config or {}, tags=list(logger_cfg.tags) or None, job_type="eval",
                     settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
    try:
        if events_path and Path(events_path).exists():
            _replay_training_events(run, Path(events_path))
        flat = flat_metrics(doc)
        images = {f"plots/{k}": wandb.Image(str(run_dir / rel), caption=k) for k, rel in doc.get("plots", {}).items()}
        table = wandb.Table(columns=list(TABLE_COLUMNS), data=metrics_rows(doc))
        payload = {**{f"eval/{k}": v for k, v in flat.items() if isinstance(v, (int, float)) or v is None},
                   **images, "eval/metrics_table": table}
        if logger_cfg.log_per_prompt and per_prompt_rows:
            from .metrics import PER_PROMPT_COLUMNS, row_to_csv

            payload["eval/per_prompt"] = wandb.Table(
                columns=list(PER_PROMPT_COLUMNS), data=[list(row_to_csv(r).values()) for r in per_prompt_rows])
        run.log(payload)
        for k, v in flat.items():
            run.summary[f"eval/{k}"] = v
        # copies in the run's files (uploaded by `wandb sync`); renamed so tools that glob for metrics.json in a
        # sweep folder (scripts/compare_runs.py) do not count the copy as a second run
        for src, dst in (("metrics.json", "specdraft_metrics.json"), ("report.md", "specdraft_report.md")):
            if (run_dir / src).exists() and run.dir:
                shutil.copyfile(run_dir / src, Path(run.dir) / dst)
        local = str(Path(run.dir).parent) if run.dir else None
    finally:
        run.finish()
    return local


def _replay_training_events(run, path: Path) -> None:
    for line in path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if ev.get("event") not in ("train_step", "train_eval"):
            continue
        stage = ev.get("stage", "train")
        nums = {f"train/{stage}/{k}": v for k, v in ev.items()
                if k not in ("time", "event", "stage") and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if nums:
            run.log(nums)
