"""The pipeline: ``run(cfg) -> dict`` runs the configured stages in order inside one run directory.

Hydra callbacks of ``python -m train`` (registered in conf/config.yaml under ``hydra.callbacks``).

The typed root of the config tree (``conf/``): each section's dataclass lives in the package that owns it.

Hydra composes the YAML files; :func:`validate` merges the result onto :class:`RootConfig`, which type-checks every
key and runs the range checks in each section's ``__post_init__`` before any model is loaded. Unknown keys are
errors.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from core.cli import run_command  # noqa: F401 (re-exported: train.__main__ and tests import it from here)
from core.errors import RunDirInUseError, closest_names, did_you_mean
from core.io import EventLog, write_json_atomic
from core.cli import validate_structured
from distill.config import DistillConfig, DraftConfig, TrainerConfig
from distill.draft_init import ReferenceConfig
from distill.lora import LoraSectionConfig
from eval.config import EvalRootConfig
from train.stages import KNOWN_STAGES, STAGES, AdaptConfig, lora_draft_name

log = logging.getLogger("specdraft")


class CompareSweep(Callback):
    """When a multirun (``python -m train -m ...``) ends, write ``comparison.md`` / ``comparison.json`` into the
    sweep folder: one table of every job's distilled draft per domain (see :mod:`eval.sections`)."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from eval.sections import render_markdown, write_comparison

        sweep = Path(str(config.hydra.sweep.dir))
        try:
            doc = write_comparison(sweep)
        except (FileNotFoundError, ValueError) as e:
            log.warning("no sweep comparison written: %s", e)
            return
        print(render_markdown(doc))
        print(f"sweep comparison: {sweep / 'comparison.md'}")


@dataclass
class RootConfig(EvalRootConfig):
    """The whole tree: the sections ``python -m eval`` reads (:class:`eval.config.EvalRootConfig`) plus training."""

    experiment_name: str = "default"
    overwrite: bool = False  # replace the artifacts of a run already in hydra.run.dir (else: refuse, or resume)
    stages: list[str] = field(default_factory=lambda: ["distill", "baseline", "eval"])
    draft: DraftConfig = field(default_factory=DraftConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    lora: LoraSectionConfig = field(default_factory=LoraSectionConfig)
    adapt: AdaptConfig = field(default_factory=AdaptConfig)

    def __post_init__(self):
        super().__post_init__()
        bad = [s for s in self.stages if s not in KNOWN_STAGES]
        if bad:
            close = {b: closest_names(b, KNOWN_STAGES, 1) for b in bad}
            hint = (f" (did you mean stages='[{', '.join(close[s][0] if s in close else s for s in self.stages)}]'?)"
                    if all(close.values()) else "")
            raise ValueError(f"stages: unknown stage(s) {bad}{hint}; stages are {', '.join(KNOWN_STAGES)}")
        if not self.stages:
            raise ValueError("stages is empty; list at least one of " + ", ".join(KNOWN_STAGES))
        from data.loading import get_domain

        get_domain(self.data.domain)
        if "draft_init" in self.stages and self.draft.init in ("config", "eagle3"):
            raise ValueError(f"stage draft_init needs draft.init=layer_pruned or pretrained (set draft=layer_pruned or "
                             f"draft=pretrained), or remove draft_init from stages (draft.init={self.draft.init} "
                             f"starts in the distill stage)")
        uses_lora = [s for s in self.stages if s in ("lora", "finetune", "adapt")]
        if uses_lora and not self.lora.enabled:
            raise ValueError(f"stages {uses_lora} LoRA-adapt drafts but lora=none: add `lora=default` to the command "
                             f"(conf/lora/default.yaml holds rank, alpha, dropout, target modules and steps)")
        if "lora" in self.stages or "finetune" in self.stages:
            dom = self.lora.domain or self.data.domain
            from train.stages import trainable_domain

            if not trainable_domain(dom):
                raise ValueError(f"lora.domain {dom!r} has no training split (a test-only benchmark); adapt to a "
                                 f"domain with training text (medical, code, chat, math, ...)")
        if uses_lora and self.lora.teacher_signal == "cached" and (
                self.distill.loss == "reverse_kl" or (self.distill.loss == "generalized_jsd" and self.distill.beta == 1)):
            raise ValueError("lora.teacher_signal=cached: reverse KL is infinite against a cached top-k teacher; set "
                             "lora.teacher_signal=online, or a distill.loss that stays finite (forward_kl, ...)")
        if uses_lora:
            self.lora.trainer_config(self.trainer)  # the adapter's optimiser settings are valid before any model loads


def validate(cfg: Any) -> RootConfig:
    """Typed, range-checked config; raises ValueError naming the bad key (see :func:`validate_structured`)."""
    return validate_structured(RootConfig, cfg)


# Keys that may change between an interrupted run and its resumption (they don't change the trained weights beyond
# the summation order: the thread count, the strategy). trainer.strategy may change (e.g. ddp -> single); the
# trainer refuses DeepSpeed checkpoints on another setup.
RESUME_FREE_KEYS = {"trainer.resume", "overwrite", "trainer.max_time_s", "trainer.log_every", "trainer.num_threads",
                    "trainer.follow_free_cores", "trainer.strategy", "trainer.save_every", "stages", "experiment_name",
                    "paths", "logger", "eval", "decode"}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def check_resume_consistent(rc: RootConfig, run_dir: Path) -> None:
    """With ``trainer.resume=true``, refuse to continue a run whose training settings differ from the stored ones
    (a mixed run would record one config and contain weights trained with another).

    Raises:
        ValueError: listing each differing key with the stored and the new value.
    """
    stored_path = run_dir / "resolved_config.json"
    if not rc.trainer.resume or not stored_path.exists():
        return
    stored = _flatten(json.loads(stored_path.read_text()))
    new = _flatten(json.loads(json.dumps(asdict(rc), default=str)))

    def free(key: str) -> bool:
        return any(key == f or key.startswith(f + ".") for f in RESUME_FREE_KEYS)

    diff = [k for k in sorted(set(stored) | set(new)) if not free(k) and stored.get(k) != new.get(k)]
    if diff:
        shown = "; ".join(f"{k}: {stored.get(k)!r} -> {new.get(k)!r}" for k in diff[:8])
        raise ValueError(f"trainer.resume=true in {run_dir}, but the training settings differ from the interrupted "
                         f"run ({shown}{'; ...' if len(diff) > 8 else ''}). Resume with the same settings, or start a "
                         f"new run directory.")


def check_run_dir_free(rc: RootConfig, run_dir: Path) -> None:
    """A run never replaces another run's artifacts unless told to: a run directory that already holds a run
    (its ``resolved_config.json`` and a draft, report, checkpoint or reference-training folder) needs
    ``trainer.resume=true`` (continue it) or ``overwrite=true`` (replace it). A directory whose earlier command
    stopped on bad input before writing any of those (only Hydra's record, ``events.jsonl`` and the resolved
    config) is free: the corrected command runs there.

    Raises:
        RunDirInUseError: naming the directory, what is in it, and the three ways on.
    """
    if rc.trainer.resume or rc.overwrite or not (run_dir / "resolved_config.json").exists():
        return
    held = [n for n in ("drafts", "report.md", "train", "reference_train") if (run_dir / n).exists()]
    if not held:  # an earlier attempt that stopped on bad input before producing anything: nothing to lose
        return
    from eval.config import EVAL_SECTIONS

    eval_cmd = run_command(run_dir, "eval", experiment_name=rc.experiment_name, sections=EVAL_SECTIONS)
    resume_cmd = run_command(run_dir, "train", ("trainer.resume=true",), experiment_name=rc.experiment_name)
    raise RunDirInUseError(
        f"run directory {run_dir} already holds a run (resolved_config.json, {', '.join(held)}); "
        f"nothing was changed. Continue it with its own settings ({resume_cmd}), replace its artifacts with "
        f"overwrite=true, or "
        f"choose a new hydra.run.dir (or leave it unset for a fresh timestamped one). To re-evaluate its drafts "
        f"with the run's own settings: {eval_cmd}"
    )


def check_stage_inputs(rc: RootConfig, run_dir: Path) -> None:
    """Before any model loads: the draft a ``lora`` / ``adapt`` stage starts from exists, or an earlier stage of
    this run writes it (``drafts/distilled``, ``drafts/baseline``, a ``lora`` stage's output), and a routing table
    given with an ``eval`` stage loads.

    Raises:
        ValueError: naming the missing draft / table and how to supply it.
    """
    from distill.lora import check_base_available, check_modules_before_loading

    produced: set[str] = set()
    training = [s for s in rc.stages if STAGES[s].draft is not None or s == "adapt"]
    if rc.decode.draft_routing and "eval" in rc.stages and training:
        raise ValueError(f"decode.draft_routing evaluates the drafts its table names, not the ones stages {training} "
                         f"train in this run: drop decode.draft_routing here, or evaluate with the table afterwards "
                         f"(python -m eval decode.draft_routing=... hydra.run.dir=<run dir>)")
    fixed_names = {STAGES[s].draft(rc) for s in ("distill", "baseline", "distill_small")} | {"layer_pruned", "pretrained"}
    for stage in rc.stages:
        if stage == "lora":
            check_base_available(rc.lora.base, run_dir, produced)
            name = lora_draft_name(rc)
            if name in fixed_names | produced | {STAGES[s].draft(rc) for s in rc.stages if s == "finetune"} \
                    or name.endswith("_int8"):
                raise ValueError(f"lora.name={name!r} would replace another draft of this run (drafts/{name}); "
                                 f"choose another lora.name (default lora_<domain>)")
            check_modules_before_loading(rc.lora.base, run_dir, rc.lora)  # target_modules / modules_to_save
            produced.add(name)
        elif stage == "finetune":
            check_base_available(rc.lora.base, run_dir, produced)
            produced.add(STAGES[stage].draft(rc))
        elif stage == "adapt":
            check_base_available(rc.adapt.draft, run_dir, produced, key="adapt.draft")
            check_modules_before_loading(rc.adapt.draft, run_dir, rc.lora)
        elif stage == "baseline" and rc.distill.baseline_budget == "wall_clock" and "distilled" not in produced \
                and not (run_dir / "drafts" / "distilled" / "specdraft.json").exists():
            raise ValueError("distill.baseline_budget=wall_clock matches the baseline's time to the distilled "
                             "draft's, but no distill stage runs before the baseline (and this run has no "
                             "drafts/distilled): put distill before baseline in stages, or set "
                             "distill.baseline_budget=steps")
        if STAGES[stage].draft is not None:
            produced.add(STAGES[stage].draft(rc))
        if stage == "eval" and rc.decode.draft_routing:
            from decode.config import load_routing

            load_routing(rc.decode.draft_routing)


def check_drafts_written_before_eval(rc: RootConfig, run_dir: Path) -> None:
    """Every ``eval.drafts`` entry of this run's own ``drafts/`` that does not exist yet, and every trained draft of
    this run behind a hybrid entry (``ngram:<kind>+drafts/<name>``), is written by a stage before ``eval``
    (``<name>_int8`` too under ``draft.quantize=int8``); not checked when an ``adapt`` stage runs
    (it names its drafts per domain as it goes).

    Raises:
        ValueError: naming the entry, the drafts the stages write, the closest one, and the fixes."""
    from eval.config import hybrid_head_error, hybrid_paths, hybrid_specs, lookup_specs
    from eval.pipeline import later_drafts, planned_drafts

    if "eval" not in rc.stages or "adapt" in rc.stages:
        return
    if rc.eval.drafts is not None and not rc.eval.drafts and not rc.decode.draft_routing \
            and not lookup_specs(rc) and not hybrid_specs(rc):
        raise ValueError("nothing to evaluate: eval.drafts names no draft (it is {} or every entry is null) and "
                         "eval.lookup_drafts is []: name a draft (eval.drafts.distilled=drafts/distilled), set "
                         "eval.drafts=null to evaluate every draft the run writes, or drop eval from stages")
    before = rc.stages[:rc.stages.index("eval")]
    produced = {STAGES[s].draft(rc) for s in before if STAGES[s].draft is not None}
    written = produced | ({f"{n}_int8" for n in produced} if rc.draft.quantize == "int8" else set())
    behind = {} if rc.decode.draft_routing else hybrid_paths(rc, run_dir)
    run_drafts = (Path(run_dir) / "drafts").resolve()
    for name, path in behind.items():  # under draft=eagle3 the stages write heads, which no lookup can front
        if rc.draft.init == "eagle3" and path.name in produced and path.resolve().parent == run_drafts:
            raise hybrid_head_error(name, hybrid_specs(rc)[name][0], f"drafts/{path.name} (draft=eagle3)")
    hybrids = later_drafts(behind, run_dir)
    for name, path in {**planned_drafts(rc, run_dir), **hybrids}.items():
        if path.name in written and path.parent.name == "drafts":
            continue
        rel = os.path.relpath(path, Path(run_dir).resolve())
        kind = hybrid_specs(rc)[name][0] if name in hybrids else None
        prefix = f"ngram:{kind}+" if kind else ""  # a hybrid's fix keeps its lookup
        hint = did_you_mean(path.name, sorted(written), lambda c: f"eval.drafts.{name}={prefix}drafts/{c}")
        writes = (f"the stages before eval write {', '.join(f'drafts/{w}' for w in sorted(written))}" if written
                  else "no stage before eval writes a draft")
        what = f"ngram:{kind}+{rel}, whose trained draft {rel}" if kind else f"{rel}, which"
        raise ValueError(f"eval.drafts.{name} is {what} does not exist in {run_dir} and no stage of this run "
                         f"writes ({writes}): point it at a draft this run writes or at an existing draft folder, "
                         f"leave it out (eval.drafts.{name}=null), or add the stage that trains it to stages"
                         f"{f'; {hint}' if hint else ''}")


def check_draft_source(rc: RootConfig) -> None:
    """Draft-source settings that only need config files: a self-draft's layer choice against the target's layer
    count (its ``config.json``), a pretrained draft's folder and tokenizer files.

    Raises:
        ValueError: naming the bad key and the fix.
    """
    if "draft_init" not in rc.stages and rc.draft.init == "config":
        return
    from models.checkpoints import read_model_config

    if rc.draft.init == "layer_pruned" and rc.draft.layers.method != "search":
        from distill.drafts import resolve_layers

        try:
            n = int((read_model_config(rc.target.name_or_path) or {}).get("num_hidden_layers", 0))
        except (ValueError, TypeError):
            n = 0  # an odd config is reported by the checkpoint check with its own message
        if n:
            resolve_layers(rc.draft.layers, n)
    elif rc.draft.init == "layer_pruned" and rc.draft.layers.k < 1:
        raise ValueError(f"draft.layers.k must be >= 1, got {rc.draft.layers.k}")
    if rc.draft.init == "eagle3":
        _check_eagle3_fits_target(rc)
    if rc.draft.init == "pretrained" and rc.draft.name_or_path:
        from models.checkpoints import check_checkpoint_dir

        check_checkpoint_dir(rc.draft.name_or_path, role="pretrained draft (draft.name_or_path)")


def _check_eagle3_fits_target(rc: RootConfig) -> None:
    """An EAGLE-3 head's shape against the target's ``config.json``: ``draft.eagle3.target_layers`` inside its
    depth, ``draft.draft_vocab_size`` inside its vocabulary, a Llama-family target of >= 4 layers.

    Raises:
        ValueError: :meth:`models.eagle3.Eagle3Config.from_target`'s messages, naming the key and the fix.
    """
    from types import SimpleNamespace

    from models.checkpoints import read_model_config
    from models.eagle3 import Eagle3Config

    doc = read_model_config(rc.target.name_or_path)
    try:
        target = SimpleNamespace(**doc)
        vocab = int(target.vocab_size)
    except (TypeError, ValueError, AttributeError):
        return  # no readable config: the checkpoint check reports it in its own words
    size = rc.draft.draft_vocab_size or vocab
    if not 0 < size <= vocab:
        raise ValueError(f"draft.draft_vocab_size={size} is outside [1, {vocab}], the target's vocabulary: give a "
                         f"size in that range, or null for the whole vocabulary")
    try:
        Eagle3Config.from_target(target, size, list(rc.draft.eagle3.target_layers or []) or None)
    except (AttributeError, KeyError, TypeError):
        return  # a config without Llama's keys: the draft builder reports the target kind


def _check_engine(rc: RootConfig) -> None:
    """llama.cpp must be installed where the config asks for it outright: teacher data through it
    (``distill.generation.engine=llama_cpp``) or ``eval.engine.enabled=true`` (``auto`` skips when absent).

    Raises:
        decode.llamacpp.EngineNotInstalled: a ``ValueError`` naming the install command.
    """
    from decode.llamacpp import find_engine

    dc = rc.distill
    teacher_data = dc.data_source == "teacher" or (dc.data_source == "on_policy" and dc.off_policy_data == "teacher")
    teacher = any(s in rc.stages for s in ("distill", "distill_small")) and teacher_data \
        and dc.generation.engine == "llama_cpp"
    if teacher or ("eval" in rc.stages and rc.eval.engine.enabled == "true"):
        find_engine()


def _check_data_files(rc: RootConfig) -> None:
    """The files of the domains the run reads (``data.domain`` or ``data.mixture`` for its training stages,
    ``eval.domains`` for an ``eval`` stage) exist, or may come from the hub: before any model loads or converts, and
    before stage ``draft_init`` builds a draft.

    Local files are also parsed whole (a few MB, about a second per domain): a damaged file of a training domain would
    otherwise be found after Hydra has written the run folder, one of an evaluation domain after the drafts have
    trained.

    Raises:
        DataSourceError: naming the file and both ways to supply it.
        DataFormatError: a file that cannot be parsed, naming the file and line."""
    from data.loading import UnknownDomainError, check_domain_files, get_domain

    trains = any(s != "eval" for s in rc.stages)
    names = list(rc.data.training_domains()) if trains else []
    later = [d for d in (rc.eval.domains if "eval" in rc.stages else []) if d not in names]
    for name in names + later:
        try:
            domain = get_domain(name)
        except UnknownDomainError:
            continue  # an eval.extra_domains file: the eval inputs check reads it
        check_domain_files(domain, rc.data.options(), parse=True)
    _check_training_prompts(rc, names)


def _check_training_prompts(rc: RootConfig, names: list[str]) -> None:
    """The training domains hold the prompts the distillation stages ask for: train-split prompts for teacher or
    on-policy data (``distill.data_source``), validation-split prompts for checkpoint selection
    (``distill.eval_every > 0``); with a mixture, one domain that has them is enough (as the stages read it).

    Raises:
        ValueError: no training domain has them (a plain-text corpus), naming the key and the fix."""
    from data.loading import has_prompts

    dc = rc.distill
    if not names or not any(s in rc.stages for s in ("distill", "baseline", "distill_small")):
        return
    need = {}
    if "distill" in rc.stages and dc.data_source in ("teacher", "on_policy"):
        need["train"] = (f"distill.data_source={dc.data_source} generates answers to them: use "
                         f"distill.data_source=dataset")
    if dc.eval_every:
        need["validation"] = "distill.eval_every > 0 selects checkpoints on them: set distill.eval_every=0"
    for split, fix in need.items():
        found = [has_prompts(n, split, rc.data.options()) for n in names]
        if not any(f is None or f for f in found):
            key = "data.mixture" if rc.data.mixture else "data.domain"
            raise ValueError(f"{key} {', '.join(names)}: its {split} split has no prompts (plain text only), but "
                             f"{fix}, or train on a domain with prompts")


def check_before_run(cfg: DictConfig | dict, run_dir: str | os.PathLike) -> RootConfig:
    """Every check that needs no model weights, in the order a user would fix them: the typed config, cross-section
    settings, the target path, the run-directory policy and resume consistency, and (with an eval stage) the eval
    inputs (``eval.drafts`` checkpoints and tokenizers, user domain files). ``python -m train`` runs it before
    Hydra touches the run directory, :func:`run` again before any work.

    Raises:
        ValueError: the first problem found, with a message naming it and the fix.
    """
    from distill.pipeline import check_draft_config
    from models.checkpoints import check_checkpoint_dir
    from models.target import resolve_target

    rc = validate(cfg)
    run_dir = Path(run_dir)
    _check_launch_env(rc)
    check_draft_config(rc)
    _check_engine(rc)
    _check_data_files(rc)
    if "eval" in rc.stages:
        from eval.pipeline import check_planned_drafts

        check_planned_drafts(rc, run_dir)  # before the target is converted: a config mistake costs no minute
        check_drafts_written_before_eval(rc, run_dir)
    builds_target = "reference_target" in rc.stages
    if not builds_target:
        resolve_target(rc)  # a GGUF target (target=smollm2) is converted once into its cached folder
        check_checkpoint_dir(rc.target.name_or_path, role="target")
        check_draft_source(rc)
    check_run_dir_free(rc, run_dir)
    check_resume_consistent(rc, run_dir)
    check_stage_inputs(rc, run_dir)
    if "eval" in rc.stages and not builds_target:
        from eval.pipeline import check_eval_inputs

        check_eval_inputs(rc, run_dir, need_drafts=False)
    return rc


def run(cfg: DictConfig | dict, run_dir: str | os.PathLike) -> dict:
    """Validate ``cfg`` and run its stages in ``run_dir``; returns each stage's summary keyed by stage name.

    Raises:
        ValueError: invalid config, missing target, a run directory holding another run (see
            :func:`check_run_dir_free`), all before any model is loaded; bad data or checkpoints (clear messages).
        FloatingPointError: the training loss became NaN/inf (the last good checkpoint is kept).
        ArtifactWriteError: an artifact could not be written (full disk, read-only folder).
    """
    rc = validate(cfg)
    from decode.fast_settings import set_block_threads

    set_block_threads(rc.decode.block_threads)  # decode.block_threads: teacher generation, selection, evaluation
    dist = _check_launch(rc)
    if not dist.is_main_process:  # one copy of the progress log: the main process's
        for name in ("specdraft", "distill", "data", "eval", "decode"):
            logging.getLogger(name).setLevel(logging.WARNING)
    if dist.num_processes > 1:  # every process uses the main process's run directory (Hydra's name has a clock)
        from accelerate.utils import broadcast_object_list

        run_dir = broadcast_object_list([str(run_dir)], from_process=0)[0]
    run_dir = Path(run_dir)
    rc = check_before_run(cfg, run_dir)  # run-dir policy, resume consistency, paths (every process)
    run_dir.mkdir(parents=True, exist_ok=True)
    events = EventLog(run_dir / "events.jsonl") if dist.is_main_process else (lambda *a, **k: None)
    dist.wait_for_everyone()  # every process checked the stored config before the main process rewrites it
    if dist.is_main_process:
        write_json_atomic(run_dir / "resolved_config.json", asdict(rc))
    results: dict = {}
    opts = rc.data.options()
    for stage in rc.stages:
        if stage == "eval" and not dist.is_main_process:
            continue  # evaluation runs on the main process; training stages run on every process
        t0 = time.perf_counter()
        events("stage_start", stage=stage)
        log.info("stage %s", stage)
        try:
            results[stage] = STAGES[stage].run(rc, opts, run_dir, events)
        except BaseException as e:
            events("stage_failed", stage=stage, error=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
            if isinstance(e, KeyboardInterrupt):
                log.error("interrupted; rerun with hydra.run.dir=%s trainer.resume=true to continue", run_dir)
            raise
        events("stage_end", stage=stage, seconds=time.perf_counter() - t0)
    return results


def _check_launch_env(rc: RootConfig) -> None:
    """:func:`distill.launch.check_launch` from the launch environment alone (``WORLD_SIZE``,
    ``ACCELERATE_USE_DEEPSPEED`` and the DeepSpeed config that ``accelerate launch`` exports), so that a strategy that
    does not fit the launch is refused before Hydra creates the run directory and before any process group starts;
    :func:`_check_launch` checks the same against the initialised distributed state."""
    from distill.launch import launch_zero_stage, uses_deepspeed

    _check_strategies(rc, int(os.environ.get("WORLD_SIZE", "1") or 1), uses_deepspeed(), launch_zero_stage())


def _check_strategies(rc: RootConfig, processes: int, deepspeed: bool, stage: int | None) -> None:
    """:func:`distill.launch.check_launch` for every trainer the run's stages use (the reference target's too)."""
    from distill.launch import check_launch

    check_launch(rc.trainer, processes, deepspeed, stage)
    if "reference_target" in rc.stages:
        check_launch(rc.reference.trainer, processes, deepspeed, stage)


def _check_launch(rc: RootConfig):
    """The distributed state, after checking that ``trainer.strategy`` and the global batch fit the launch (before
    any model loads)."""
    from distill.launch import distributed_state, launch_zero_stage, uses_deepspeed

    dist = distributed_state()
    _check_strategies(rc, dist.num_processes, uses_deepspeed(), launch_zero_stage())
    lora_stages = [s for s in rc.stages if s in ("lora", "finetune", "adapt")]
    if lora_stages and dist.num_processes > 1:
        raise ValueError(f"stages {lora_stages} run in one process (LoRA drafts are small); launched with "
                         f"{dist.num_processes} processes. Run them with plain `python -m train`, e.g. "
                         f"stages='{lora_stages}' in the same run directory after the multi-process stages.")
    return dist
