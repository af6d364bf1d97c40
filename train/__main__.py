"""``python -m train +experiment=NAME``: compose the Hydra config and run the configured stages."""
from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from data.paths import PROJECT_ROOT

OmegaConf.register_new_resolver("specdraft_root", lambda: str(PROJECT_ROOT), replace=True)
log = logging.getLogger("specdraft")
for noisy in ("accelerate", "datasets", "httpx", "deepspeed"):
    logging.getLogger(noisy).setLevel(logging.WARNING)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from train.run import run

    run_dir = HydraConfig.get().runtime.output_dir
    try:
        run(cfg, run_dir)
    except (ValueError, FileNotFoundError, FloatingPointError, OSError) as e:
        log.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"interrupted: rerun with hydra.run.dir={run_dir} trainer.resume=true to continue from the last "
              f"checkpoint", file=sys.stderr)
        sys.exit(130)
    print(f"run directory: {run_dir}")


if __name__ == "__main__":
    main()
