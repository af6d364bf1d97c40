"""The stage registry: every stage ``python -m train`` can run, keyed by the name used in ``stages: [...]``.

A stage is a recipe ``(root config, data options, run_dir, events) -> summary dict`` (docs/architecture.md,
"The stage contract"); ``draft`` names the folder under ``<run_dir>/drafts`` it writes, where it writes one that
later stages of the run may start from. Adding a stage is adding an entry here.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from distill.pipeline import baseline_stage, distill_small_stage, distill_stage


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[..., dict]  # (rc, opts, run_dir, events) -> summary
    draft: Callable[[Any], str] | None = None  # rc -> the draft folder name it writes (drafts/<name>)


def _reference_target(rc, opts, run_dir: Path, events) -> dict:
    from distill.reference import build_reference_target

    rc.reference.trainer.resume = rc.reference.trainer.resume or rc.trainer.resume
    return build_reference_target(rc.reference, opts, run_dir / "reference_train", seed=rc.seed)


def _draft_init(rc, opts, run_dir: Path, events) -> dict:
    from distill.draft_init import run_draft_init

    return run_draft_init(rc, opts, run_dir, events=events)


def _lora(rc, opts, run_dir: Path, events) -> dict:
    from distill.adaptation import adapt_draft

    return adapt_draft(rc, opts, run_dir, events=events)


def _finetune(rc, opts, run_dir: Path, events) -> dict:
    from distill.adaptation import finetune_draft

    return finetune_draft(rc, opts, run_dir, events=events)


def _adapt(rc, opts, run_dir: Path, events) -> dict:
    from .adapt import adapt_domains

    return adapt_domains(rc, opts, run_dir, events=events)


def domain_tau_stage(rc, opts, run_dir: Path, events=None) -> dict:
    """Stage ``domain_tau`` (after ``eval``): write each evaluated draft's per-domain tau (mean accepted length,
    tokens per verify step, with its 95% bootstrap interval over prompts, at the evaluation's primary gamma) into
    that draft's ``specdraft.json`` as ``domain_mean_accepted_length: {domain: {mean_accepted_length,
    mean_accepted_length_ci, num_draft_tokens, num_prompts}}``, so a draft that is reused later (the committed
    general draft) carries the acceptance it was measured with.

    Raises:
        ValueError: no ``metrics.json`` in the run directory (the eval stage must run first).
    """
    import json

    from data.checkpoints import read_specdraft_meta
    from data.io import write_json_atomic

    metrics = Path(run_dir) / "metrics.json"
    if not metrics.is_file():
        raise ValueError(f"stage domain_tau reads {metrics}, which does not exist: put eval before domain_tau in "
                         f"stages")
    doc = json.loads(metrics.read_text())
    written = {}
    for name, per_domain in doc["drafts"].items():
        draft_dir = Path(run_dir) / "drafts" / name
        if not (draft_dir / "specdraft.json").is_file():
            continue  # a draft evaluated from outside the run: not ours to annotate
        meta = read_specdraft_meta(draft_dir)
        meta.domain_mean_accepted_length = {
            d: {"mean_accepted_length": e.get("mean_accepted_length"),
                "mean_accepted_length_ci": e.get("mean_accepted_length_ci"),
                "num_draft_tokens": e.get("num_draft_tokens", doc.get("num_draft_tokens")),
                "num_prompts": e.get("num_prompts")}
            for d, e in per_domain.items()}
        write_json_atomic(draft_dir / "specdraft.json", meta.to_dict())
        written[name] = {d: v["mean_accepted_length"] for d, v in meta.domain_mean_accepted_length.items()}
    return {"domain_mean_accepted_length": written}


def _eval(rc, opts, run_dir: Path, events) -> dict:
    from eval.pipeline import evaluate_run

    return evaluate_run(rc, opts, run_dir, events=events)


def lora_draft_name(rc) -> str:
    """The folder a ``lora`` stage writes: ``lora.name``, default ``lora_<domain>``."""
    return rc.lora.name or f"lora_{rc.lora.domain or rc.data.domain}"


def finetune_draft_name(rc) -> str:
    """The folder a ``finetune`` stage writes: ``finetune_<domain>`` (the domain of ``lora.domain``)."""
    return f"finetune_{rc.lora.domain or rc.data.domain}"


STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("reference_target", _reference_target),
    Stage("draft_init", _draft_init, draft=lambda rc: rc.draft.init),  # drafts/layer_pruned or drafts/pretrained
    Stage("distill", distill_stage, draft=lambda rc: "distilled"),
    Stage("baseline", baseline_stage, draft=lambda rc: "baseline"),
    Stage("distill_small", distill_small_stage, draft=lambda rc: "small_distilled"),
    Stage("lora", _lora, draft=lora_draft_name),
    # the lora stage's data, teacher, steps and batch with every weight training (the full fine-tuning comparison)
    Stage("finetune", _finetune, draft=finetune_draft_name),
    Stage("adapt", _adapt),
    Stage("eval", _eval),
    Stage("domain_tau", domain_tau_stage),
)}
KNOWN_STAGES = tuple(STAGES)
