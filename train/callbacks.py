"""Hydra callbacks of ``python -m train`` (registered in conf/config.yaml under ``hydra.callbacks``)."""
from __future__ import annotations

import logging
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger("specdraft")


class CompareSweep(Callback):
    """When a multirun (``python -m train -m ...``) ends, write ``comparison.md`` / ``comparison.json`` into the
    sweep folder: one table of every job's distilled draft per domain (see :mod:`eval.compare`)."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from eval.compare import render_markdown, write_comparison

        sweep = Path(str(config.hydra.sweep.dir))
        try:
            doc = write_comparison(sweep)
        except (FileNotFoundError, ValueError) as e:
            log.warning("no sweep comparison written: %s", e)
            return
        print(render_markdown(doc))
        print(f"sweep comparison: {sweep / 'comparison.md'}")
