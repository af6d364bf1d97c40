"""``python -m train +experiment=NAME``: compose the Hydra config and run the configured stages.

The command is checked (config, target path, run-directory policy, write access) before Hydra creates or writes
anything in the run directory (:func:`core.cli.preflight`); errors end in one ``error: ...`` line on stderr and an
exit code: 2 bad input, 3 an artifact could not be written, 4 the training loss diverged, 130 interrupted.
"""
from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from core.cli import exit_on_error, interrupted, preflight, quiet_libraries, replace_mapping_overrides
from core.io import PROJECT_ROOT

OmegaConf.register_new_resolver("specdraft_root", lambda: str(PROJECT_ROOT), replace=True)
quiet_libraries()
log = logging.getLogger("specdraft")
for noisy in ("accelerate", "datasets", "httpx", "deepspeed"):
    logging.getLogger(noisy).setLevel(logging.WARNING)


def _check(cfg, run_dir) -> None:
    from train.run import check_before_run

    check_before_run(cfg, run_dir)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from train.run import run

    run_dir = HydraConfig.get().runtime.output_dir
    try:
        results = run(cfg, run_dir)
    except KeyboardInterrupt:
        from pathlib import Path

        from train.run import run_command

        interrupted(f"continue from the last checkpoint with: "
                    f"{run_command(Path(run_dir), 'train', ('trainer.resume=true',))}")
    except Exception as e:
        exit_on_error(e)
        raise
    summary = (results or {}).get("eval", {}).get("summary") if isinstance((results or {}).get("eval"), dict) else None
    if summary:  # the verdict section of report.md, as it is there (eval.report.verdicts_section)
        print(summary)
        print()
    print(f"run directory: {run_dir}")


def main() -> None:
    from train.run import RootConfig

    typed = sys.argv[1:]
    sys.argv[1:] = replace_mapping_overrides(typed, RootConfig)
    preflight(sys.argv[1:], PROJECT_ROOT / "conf", _check, RootConfig, typed=typed)
    hydra_main()


if __name__ == "__main__":
    main()
