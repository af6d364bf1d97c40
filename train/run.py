"""The pipeline: ``run(cfg) -> dict`` runs the configured stages in order inside one run directory."""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from data.io import write_json_atomic

from .schema import RootConfig, validate

log = logging.getLogger("specdraft")


class EventLog:
    """Append-only JSONL event log of every stage (``events.jsonl`` in the run directory)."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self, event: str, **fields) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"time": time.time(), "event": event, **fields}, default=str) + "\n")


def run(cfg: DictConfig | dict, run_dir: str | os.PathLike) -> dict:
    """Validate ``cfg`` and run its stages in ``run_dir``; returns each stage's summary keyed by stage name.

    Raises:
        ValueError: invalid config (before any model is loaded), bad data or checkpoints (clear messages).
    """
    rc = validate(cfg)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    events = EventLog(run_dir / "events.jsonl")
    write_json_atomic(run_dir / "resolved_config.json", asdict(rc))
    results: dict = {}
    opts = rc.data.options()
    for stage in rc.stages:
        t0 = time.perf_counter()
        events("stage_start", stage=stage)
        log.info("stage %s", stage)
        try:
            results[stage] = _run_stage(stage, rc, opts, run_dir, events)
        except BaseException as e:
            events("stage_failed", stage=stage, error=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
            if isinstance(e, KeyboardInterrupt):
                log.error("interrupted; rerun with hydra.run.dir=%s trainer.resume=true to continue", run_dir)
            raise
        events("stage_end", stage=stage, seconds=time.perf_counter() - t0)
    return results


def _run_stage(stage: str, rc: RootConfig, opts, run_dir: Path, events: EventLog) -> dict:
    if stage == "reference_target":
        from distill.reference import build_reference_target

        rc.reference.trainer.resume = rc.reference.trainer.resume or rc.trainer.resume
        return build_reference_target(rc.reference, opts, run_dir / "reference_train", seed=rc.seed)
    if stage in ("distill", "baseline"):
        from distill.pipeline import train_draft

        return train_draft(rc, opts, run_dir, kind="distilled" if stage == "distill" else "baseline", events=events)
    from eval.pipeline import evaluate_run

    return evaluate_run(rc, opts, run_dir, events=events)
