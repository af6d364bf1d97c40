"""``python -m eval target.name_or_path=DIR eval.drafts='{name: DIR}' eval.domains='[medical,code]'``:
evaluate drafts against a target without training (the same implementation as the pipeline's eval stage).

Writes into the run directory (``hydra.run.dir``; a training run's directory re-evaluates its ``drafts/``):
``report.md``, ``metrics.json``, ``per_prompt.csv``, ``plots/*.png``, ``events.jsonl`` and, with ``logger=wandb``,
an offline wandb run under ``wandb/``. The report files are replaced as one set (a killed evaluation leaves the
previous complete set; rerunning the command gives the same numbers). Hydra's record of the command goes to
``.hydra-eval-last/`` (so a training run's ``.hydra/`` is kept) and, once the report set is written, is published
with it as ``.hydra-eval/``: that folder always describes the command behind the current report, and a failed
evaluation leaves it as it was.

The command is checked (config, draft and target checkpoints, tokenizers, write access) before Hydra touches the
run directory; errors end in one ``error: ...`` line on stderr and exit code 2 (bad input) or 3 (an artifact
could not be written).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from core.cli import exit_on_error, ignored_overrides, interrupted, preflight, quiet_libraries
from core.cli import replace_mapping_overrides
from core.io import PROJECT_ROOT

OmegaConf.register_new_resolver("specdraft_root", lambda: str(PROJECT_ROOT), replace=True)
quiet_libraries()
log = logging.getLogger("specdraft")

ATTEMPT_RECORD = ".hydra-eval-last"  # Hydra's record of the latest python -m eval command, failed or not
COMMAND_RECORD = ".hydra-eval"  # the record of the command behind the current report (part of the report set)


def check_before_eval(cfg: DictConfig | dict, run_dir: str | os.PathLike):
    """The typed eval config, then the inputs (drafts, checkpoints, tokenizers, user files), without loading any
    model. Raises ValueError with a message naming the problem and the fix."""
    from eval.config import validate_eval
    from eval.pipeline import check_eval_inputs

    rc = validate_eval(cfg)
    run_dir = Path(run_dir)
    lookups_only = rc.eval.drafts is not None and not rc.eval.drafts and rc.eval.lookup_drafts  # eval.drafts={}
    if not rc.eval.drafts and not rc.decode.draft_routing and not (run_dir / "drafts").is_dir() and not lookups_only:
        raise ValueError("python -m eval needs eval.drafts='{name: /path/to/draft_dir, ...}' or "
                         "decode.draft_routing=/path/to/routing.json "
                         "(or hydra.run.dir pointing at a training run directory with drafts/; "
                         f"{run_dir} {'has no drafts/ folder' if run_dir.is_dir() else 'does not exist'}), or "
                         "eval.drafts={} to decode only the lookup drafts of eval.lookup_drafts")
    _check_same_experiment(rc, run_dir)
    check_eval_inputs(rc, run_dir)
    _check_domain_files(rc)
    return rc


def _check_domain_files(rc) -> None:
    """The built-in ``eval.domains`` files exist and parse (a few MB, about a second each), before Hydra writes the
    run folder: a damaged one would otherwise be found after the models load.

    Raises:
        DataSourceError, DataFormatError: naming the file (and line) and the fix."""
    from data.loading import check_domain_files

    extra = {e.name for e in rc.eval.extra_domains}  # user files: checked by check_eval_inputs
    for name in rc.eval.domains:
        if name not in extra:
            check_domain_files(name, rc.data.options(), parse=True)


def _check_same_experiment(rc, run_dir: Path) -> None:
    """Re-evaluating a training run in place (its report is replaced) takes that run's settings: a run made by
    ``+experiment=X`` evaluated without it, or with another experiment, would silently use other prompts, gammas
    and drafts. Raises ValueError naming the run's own command (``core.cli.run_command``) and the way to evaluate
    its drafts with other settings (a new folder)."""
    import json

    from core.cli import run_command
    from eval.config import EVAL_SECTIONS

    try:
        stored = json.loads((run_dir / "resolved_config.json").read_text()).get("experiment_name")
    except (OSError, ValueError, AttributeError):
        return  # not a training run's folder (or an eval-only one)
    if stored and stored != rc.experiment_name:
        raise ValueError(
            f"{run_dir} holds a {stored!r} run, but this evaluation has the settings of {rc.experiment_name!r} "
            f"(other prompts, gammas or drafts; its report would replace the run's). Re-evaluate it with its own "
            f"settings: {run_command(run_dir, 'eval', experiment_name=stored, sections=EVAL_SECTIONS)} ; or "
            f"evaluate its drafts with these settings into a new folder: python -m eval <this command's overrides> "
            f"eval.drafts='{{name: {run_dir}/drafts/<name>}}' hydra.run.dir=<new dir>")


def run(cfg: DictConfig | dict, run_dir: str | os.PathLike) -> dict:
    """Validate the eval sections of ``cfg`` and evaluate in ``run_dir``; returns the eval summary.

    Raises:
        ValueError: bad config (before any model loads), no drafts, unreadable checkpoints, unknown domains.
    """
    from core.io import EventLog
    from eval.pipeline import evaluate_run

    run_dir = Path(run_dir)
    rc = check_before_eval(cfg, run_dir)
    events = EventLog(run_dir / "events.jsonl")
    events("stage_start", stage="eval", entry="python -m eval")
    t0 = time.perf_counter()
    try:
        record = run_dir / ATTEMPT_RECORD
        out = evaluate_run(rc, rc.data.options(), run_dir, events=events,
                           command_record=(record, COMMAND_RECORD) if record.is_dir() else None)
    except BaseException as e:
        events("stage_failed", stage="eval", error=f"{type(e).__name__}: {e}")
        raise
    events("stage_end", stage="eval", seconds=time.perf_counter() - t0)
    return out


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        out = run(cfg, run_dir)
    except KeyboardInterrupt:
        interrupted("the previous report set (if any) is intact; rerun the same command to evaluate again")
    except Exception as e:
        exit_on_error(e)
        raise
    print(out["summary"])  # the verdict section of report.md, as it is there (eval.report.verdicts_section)
    print()
    print(f"report: {out['report']}")
    print(f"run directory: {run_dir}")


def main() -> None:
    from eval.config import EVAL_SECTIONS, EvalRootConfig

    typed = sys.argv[1:]
    sys.argv[1:] = argv = replace_mapping_overrides(typed, EvalRootConfig)
    preflight(argv, PROJECT_ROOT / "conf", check_before_eval, EvalRootConfig, typed=typed)
    ignored = ignored_overrides(argv, EVAL_SECTIONS)
    if ignored:
        print(f"warning: python -m eval reads only {', '.join(EVAL_SECTIONS)}; ignored: {' '.join(ignored)} (the "
              "drafts it evaluates are eval.drafts' checkpoints, each with its own config.json; python -m train "
              "reads these)", file=sys.stderr)
    if not any(a.lstrip("+").startswith("hydra.output_subdir=") for a in argv):
        # Hydra writes its record before the evaluation starts; writing it to .hydra-eval directly would let a
        # failed evaluation replace the record of the command behind the current report. evaluate_run publishes
        # the attempt's record as .hydra-eval together with the report set it produced, in the same rename.
        # first, not last: after a flag such as --cfg job Hydra's parser would take it for a stray argument
        sys.argv.insert(1, f"hydra.output_subdir={ATTEMPT_RECORD}")  # a training run's .hydra/ is kept as it was
    hydra_main()


if __name__ == "__main__":
    main()
