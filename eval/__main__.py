"""``python -m eval target.name_or_path=DIR eval.drafts='{name: DIR}' eval.domains='[medical,code]'``:
evaluate drafts against a target without training (the same implementation as the pipeline's eval stage)."""
from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from data.paths import PROJECT_ROOT

OmegaConf.register_new_resolver("specdraft_root", lambda: str(PROJECT_ROOT), replace=True)
log = logging.getLogger("specdraft")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    from eval.config import validate_eval
    from eval.pipeline import evaluate_run

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        rc = validate_eval(cfg)
        if not rc.eval.drafts and not (run_dir / "drafts").is_dir():
            raise ValueError("python -m eval needs eval.drafts='{name: /path/to/draft_dir, ...}' "
                             "(or hydra.run.dir pointing at a training run directory with drafts/)")
        evaluate_run(rc, rc.data.options(), run_dir)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"run directory: {run_dir}")


if __name__ == "__main__":
    main()
