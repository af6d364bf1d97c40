"""The pipeline's ``eval`` stage: evaluate the run's drafts against the target and write the report."""
from __future__ import annotations

import logging
from pathlib import Path

from data.loading import DataOptions, eval_prompts

from .evaluate import Prompt, evaluate_drafts
from .report import write_report

log = logging.getLogger(__name__)


def load_prompts(domains: list[str], opts: DataOptions, max_prompts: int) -> dict[str, list[Prompt]]:
    """domain -> its first ``max_prompts`` evaluation prompts (test split, hash order)."""
    return {d: [Prompt(d, ex.id, ex.prompt) for ex in eval_prompts(d, opts, max_prompts)] for d in domains}


def training_section(drafts_meta: dict[str, dict]) -> str:
    rows = ["## Drafts", "", "| draft | training loss | steps | parameters (draft / target) | "
            "validation CE on training domain (draft / target, nats/token) |", "|---|---|---|---|---|"]
    for name, m in drafts_meta.items():
        rows.append(f"| {name} | {m.get('loss')} (T={m.get('temperature')}) | {m['train']['steps']} | "
                    f"{m['draft_parameters']:,} / {m['target_parameters']:,} | "
                    f"{m['validation_loss_nats_per_token']:.3f} / {m['target_validation_loss_nats_per_token']:.3f} |")
    return "\n".join(rows)


def evaluate_run(rc, opts: DataOptions, run_dir: Path, events=None) -> dict:
    """Evaluate every draft saved under ``<run_dir>/drafts/`` on ``eval.domains``; writes the report files."""
    from data.tokenizer_check import check_tokenizers_compatible
    from data.checkpoints import load_causal_lm, read_specdraft_meta

    drafts_dir = run_dir / "drafts"
    if rc.eval.drafts:
        paths = {n: Path(p).expanduser() for n, p in rc.eval.drafts.items()}
    else:
        paths = {p.name: p for p in sorted(drafts_dir.iterdir()) if p.is_dir() and not p.name.startswith(".")} \
            if drafts_dir.is_dir() else {}
    if not paths:
        raise ValueError(f"no drafts to evaluate: none under {drafts_dir} and eval.drafts is empty. Run the distill "
                         f"and/or baseline stage first, or pass eval.drafts='{{name: /path/to/draft_dir}}'.")
    prompts = load_prompts(rc.eval.domains, opts, rc.eval.max_prompts)
    target, tokenizer = load_causal_lm(rc.target.name_or_path, role="target")
    drafts, meta = {}, {}
    for n in sorted(paths, key=lambda n: (n != "distilled", n)):
        model, tok = load_causal_lm(paths[n], role=f"draft {n!r}")
        check_tokenizers_compatible(tokenizer, tok, draft_name=f"draft {n!r}")
        drafts[n], meta[n] = model, read_specdraft_meta(paths[n])
    results = evaluate_drafts(
        target, tokenizer, drafts, prompts, num_draft_tokens=rc.decode.num_draft_tokens,
        max_new_tokens=rc.eval.max_new_tokens, max_prompt_tokens=rc.eval.max_prompt_tokens,
        check_lossless=rc.eval.check_lossless, cost_ratio_trials=rc.eval.cost_ratio_trials,
        decode_kwargs=rc.decode.sampling_kwargs(),
        seed=rc.seed)
    context = {"experiment_name": rc.experiment_name, "target": rc.target.name_or_path, "seed": rc.seed,
               "drafts": {n: str(paths[n]) for n in drafts}}
    sections = [training_section(meta)] if all(m.get("train") for m in meta.values()) else []
    doc = write_report(run_dir, results, context, sections)
    if events:
        events("eval_done", lossless_all=doc["lossless_all"])
    return {"metrics": str(run_dir / "metrics.json"), "report": str(run_dir / "report.md"),
            "lossless_all": doc["lossless_all"]}
