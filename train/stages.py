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
    from distill.lora import adapt_draft

    return adapt_draft(rc, opts, run_dir, events=events)


def _adapt(rc, opts, run_dir: Path, events) -> dict:
    from .adapt import adapt_domains

    return adapt_domains(rc, opts, run_dir, events=events)


def _eval(rc, opts, run_dir: Path, events) -> dict:
    from eval.pipeline import evaluate_run

    return evaluate_run(rc, opts, run_dir, events=events)


def lora_draft_name(rc) -> str:
    """The folder a ``lora`` stage writes: ``lora.name``, default ``lora_<domain>``."""
    return rc.lora.name or f"lora_{rc.lora.domain or rc.data.domain}"


STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("reference_target", _reference_target),
    Stage("draft_init", _draft_init, draft=lambda rc: rc.draft.init),  # drafts/layer_pruned or drafts/pretrained
    Stage("distill", distill_stage, draft=lambda rc: "distilled"),
    Stage("baseline", baseline_stage, draft=lambda rc: "baseline"),
    Stage("distill_small", distill_small_stage, draft=lambda rc: "small_distilled"),
    Stage("lora", _lora, draft=lora_draft_name),
    Stage("adapt", _adapt),
    Stage("eval", _eval),
)}
KNOWN_STAGES = tuple(STAGES)
