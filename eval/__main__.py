"""``python -m eval target.name_or_path=DIR eval.drafts='{name: DIR}' eval.domains='[medical,code]'``:
evaluate drafts against a target without training (the same implementation as the pipeline's eval stage).

Writes into the run directory (``hydra.run.dir``; a training run's directory re-evaluates its ``drafts/``):
``report.md``, ``metrics.json``, ``per_prompt.csv``, ``plots/*.png``, ``events.jsonl`` and, with ``logger=wandb``,
an offline wandb run under ``wandb/``.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from data.paths import PROJECT_ROOT

OmegaConf.register_new_resolver("specdraft_root", lambda: str(PROJECT_ROOT), replace=True)
log = logging.getLogger("specdraft")


def run(cfg: DictConfig | dict, run_dir: str | os.PathLike) -> dict:
    """Validate the eval sections of ``cfg`` and evaluate in ``run_dir``; returns the eval summary.

    Raises:
        ValueError: bad config (before any model loads), no drafts, unreadable checkpoints, unknown domains.
    """
    from eval.config import validate_eval
    from eval.pipeline import evaluate_run
    from eval.tracking import EventLog

    run_dir = Path(run_dir)
    rc = validate_eval(cfg)
    if not rc.eval.drafts and not (run_dir / "drafts").is_dir():
        raise ValueError("python -m eval needs eval.drafts='{name: /path/to/draft_dir, ...}' "
                         "(or hydra.run.dir pointing at a training run directory with drafts/)")
    events = EventLog(run_dir / "events.jsonl")
    events("stage_start", stage="eval", entry="python -m eval")
    t0 = time.perf_counter()
    try:
        out = evaluate_run(rc, rc.data.options(), run_dir, events=events)
    except BaseException as e:
        events("stage_failed", stage="eval", error=f"{type(e).__name__}: {e}")
        raise
    events("stage_end", stage="eval", seconds=time.perf_counter() - t0)
    return out


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        out = run(cfg, run_dir)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for domain, (draft, g) in out["recommendation"].items():
        print(f"{domain}: use {draft} with num_draft_tokens={g}")
    print(f"report: {out['report']}")
    print(f"run directory: {run_dir}")


if __name__ == "__main__":
    main()
