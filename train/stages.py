"""The stage registry: every stage ``python -m train`` can run, keyed by the name used in ``stages: [...]``.

A stage is a recipe ``(root config, data options, run_dir, events) -> summary dict`` (docs/architecture.md,
"The stage contract"); ``draft`` names the folder under ``<run_dir>/drafts`` it writes, where it writes one that
later stages of the run may start from. Adding a stage is adding an entry here.

The ``adapt`` stage (``+experiment=adapt_domains``): automatic per-domain adaptation, closing the loop.

1. **before**: evaluate the draft ``adapt.draft`` on every configured domain (``eval.domains`` +
   ``eval.extra_domains``) -> ``adapt/before/`` (a full evaluation report);
2. **adapt**: for each domain whose pooled mean accepted length tau is below ``adapt.min_mean_accepted_length``,
   LoRA-adapt the draft to that domain by distillation from the target (:func:`distill.lora.adapt_draft`,
   settings in the ``lora`` section) -> ``drafts/lora_<domain>/`` (merged) + ``adapters/lora_<domain>/``. Domains
   without training text (test-only benchmarks, user files) are reported as not adaptable;
3. **after**: evaluate the draft and every adapted draft on every domain -> ``adapt/after/`` (report + routing
   table over every draft);
4. **keep or refuse** each adapter (:func:`eval.decision.adapter_decision`): kept only where the adapted draft's tau
   interval (95% bootstrap over the domain's prompts) lies wholly above the base draft's, both from the
   after-evaluation; otherwise the report says why (overlap, worse, no interval);
5. write ``routing.json`` (:func:`adapted_routing`: each domain's verdict re-taken among the base draft and its own
   kept adapter, so a refused adapter is never routed; the target alone when neither is faster), ``adapt.json`` and
   ``adapt_report.md`` (per domain: tau before, the action, base and adapted tau with intervals, why, the routed
   draft and its measured speedup) in the run directory, each atomically.

Resume (``trainer.resume=true`` in the same run directory): a finished before-evaluation and every completed adapter
are reused; an interrupted adaptation continues from its last training checkpoint.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from core.io import write_json_atomic, write_text_atomic
from distill.pipeline import baseline_stage, distill_small_stage, distill_stage

log = logging.getLogger("specdraft")


@dataclass
class AdaptConfig:
    """The ``adapt`` config section (``conf/config.yaml``)."""

    draft: str = "drafts/distilled"  # draft evaluated and adapted: HF dir, or drafts/<name> of this run
    min_mean_accepted_length: float = 2.0  # adapt a domain whose tau (tokens per verify step) is below this

    def __post_init__(self):
        if not self.draft:
            raise ValueError("adapt.draft must name the draft to evaluate and adapt (HF dir or drafts/<name>)")
        if not self.min_mean_accepted_length >= 1:
            raise ValueError(f"adapt.min_mean_accepted_length must be >= 1 token per verify step (tau >= 1 always), "
                             f"got {self.min_mean_accepted_length}")


def trainable_domain(name: str) -> bool:
    """A registered (built-in or declared) domain with at least one source that has a training split."""
    from core.errors import UnknownDomainError
    from data.loading import get_domain

    try:
        dom = get_domain(name)
    except UnknownDomainError:
        return False
    return any(s.split_policy not in ("test", "validation") for s in dom.sources)


def _evaluate(rc, opts, out_dir: Path, drafts: dict[str, str], events, resume: bool) -> dict:
    """Evaluate ``drafts`` (name -> path) into ``out_dir``, those alone (the stage chooses between a draft and its
    adapter: no lookup or hybrid drafts); reuse a finished evaluation on resume."""
    from eval.pipeline import evaluate_run

    metrics = out_dir / "metrics.json"
    if resume and metrics.is_file() and (out_dir / "routing.json").is_file():
        doc = json.loads(metrics.read_text())
        if set(doc["drafts"]) == set(drafts):
            log.info("adapt: reusing the finished evaluation in %s (trainer.resume=true)", out_dir)
            return doc
    sub = replace(rc, eval=replace(rc.eval, drafts=dict(drafts), lookup_drafts=[], hybrid_lookups=[]),
                  decode=replace(rc.decode, draft_routing=None))
    evaluate_run(sub, opts, out_dir, events=events)
    return json.loads(metrics.read_text())


def adapt_domains(rc, opts, run_dir: Path, events=None) -> dict:
    """Run the stage (see the module docstring); returns the ``adapt.json`` summary.

    Raises:
        ValueError: ``lora=none`` (no LoRA settings), a missing draft, and every error of the evaluation and of
            :func:`distill.lora.adapt_draft`.
    """
    from core.errors import LoraError
    from distill.lora import resolve_base
    from eval.decision import adapter_decision

    ev = events or (lambda *a, **k: None)
    if not rc.lora.enabled:
        raise LoraError("the adapt stage LoRA-adapts drafts: add `lora=default` (conf/lora/default.yaml)")
    run_dir = Path(run_dir)
    base_path = resolve_base(rc.adapt.draft, run_dir)
    base_name = base_path.name
    resume = rc.trainer.resume
    t0 = time.perf_counter()
    before = _evaluate(rc, opts, run_dir / "adapt" / "before", {base_name: str(base_path)}, ev, resume)
    t_before = time.perf_counter() - t0
    threshold = rc.adapt.min_mean_accepted_length
    rows, drafts, adapt_times = _adapt_low_domains(rc, opts, run_dir, base_path, before, ev, events)
    t2 = time.perf_counter()
    retrained = any(r["action"] == "adapted" and not r["reused"] for r in rows.values())
    after = _evaluate(rc, opts, run_dir / "adapt" / "after", drafts, ev, resume and not retrained)
    t_after = time.perf_counter() - t2
    for d, row in rows.items():
        a = after["drafts"]
        row["after_base_mean_accepted_length"] = a[base_name][d]["mean_accepted_length"]
        row["after_base_mean_accepted_length_ci"] = a[base_name][d].get("mean_accepted_length_ci")
        if row.get("adapted_draft"):
            e = a[row["adapted_draft"]][d]
            row["after_mean_accepted_length"] = e["mean_accepted_length"]
            row["after_mean_accepted_length_ci"] = e.get("mean_accepted_length_ci")
            row["after_measured_speedup"] = e["measured_speedup"]
            verdict = adapter_decision(row["after_base_mean_accepted_length"],
                                       row["after_base_mean_accepted_length_ci"],
                                       row["after_mean_accepted_length"], row["after_mean_accepted_length_ci"])
            row.update(adapter_kept=verdict["keep"], adapter_decision=verdict["basis"],
                       adapter_reason=verdict["reason"])
            row["action"] = "adapted, adapter kept" if verdict["keep"] else "adapted, adapter refused"
    table = adapted_routing(after, rows, base_name, drafts)
    for d, row in rows.items():
        r = table["routes"].get(d)
        if r:
            row.update(routed_draft=r["draft"], routed_measured_speedup=r.get("measured_speedup"),
                       routed_mean_accepted_length=r.get("mean_accepted_length"))  # target alone: draft None
    write_json_atomic(run_dir / "routing.json", table)  # base + kept adapters only (adapt/after/: every draft)
    summary = {"draft": str(base_path), "draft_name": base_name, "min_mean_accepted_length": threshold,
               "num_draft_tokens": after["num_draft_tokens"], "domains": rows, "drafts": drafts,
               "routing": str(run_dir / "routing.json"), "reports": {"before": str(run_dir / "adapt/before/report.md"),
                                                                     "after": str(run_dir / "adapt/after/report.md")},
               "times_s": {"before_eval": t_before, "adapt": adapt_times, "after_eval": t_after,
                           "total": time.perf_counter() - t0}}
    write_json_atomic(run_dir / "adapt.json", summary)
    write_text_atomic(run_dir / "adapt_report.md", render_adapt_report(summary))
    ev("adapt_done", adapted=[d for d, r in rows.items() if r.get("adapted_draft")],
       kept=[d for d, r in rows.items() if r.get("adapter_kept")], routing=summary["routing"])
    return summary


def _adapt_low_domains(rc, opts, run_dir: Path, base_path: Path, before: dict, ev, events):
    """Step 2: LoRA-adapt the base draft to every domain of the before-evaluation whose tau is below
    ``adapt.min_mean_accepted_length`` and that has training text (:func:`distill.lora.adapt_draft`).

    Returns:
        ``(rows, drafts, adapt_times)``: per domain its ``adapt.json`` row so far (tau before, the action, the
        adapted draft), every draft to evaluate after (name -> path, the base first) and seconds per adaptation.
    """
    from distill.lora import adapt_draft

    base_name, threshold = base_path.name, rc.adapt.min_mean_accepted_length
    rows: dict[str, dict] = {}
    drafts = {base_name: str(base_path)}
    adapt_times = {}
    for d in before["drafts"][base_name]:
        tau = before["drafts"][base_name][d]["mean_accepted_length"]
        row = {"before_mean_accepted_length": tau,
               "before_measured_speedup": before["drafts"][base_name][d]["measured_speedup"]}
        if tau is not None and tau >= threshold:
            row["action"] = "left alone (tau >= threshold)"
        elif not trainable_domain(d):
            row["action"] = "not adaptable (no training split: test-only benchmark or user file)"
        else:
            name = f"lora_{d}"
            ev("adapt_domain_start", domain=d, before_mean_accepted_length=tau, threshold=threshold)
            t1 = time.perf_counter()
            summary = adapt_draft(rc, opts, run_dir, base=str(base_path), domain=d, name=name, events=events)
            adapt_times[d] = time.perf_counter() - t1
            drafts[name] = summary["path"]
            row.update(action="adapted", adapted_draft=name, adapter=summary["adapter_path"],
                       reused=bool(summary.get("reused")), adapt_time_s=adapt_times[d],
                       validation_mean_accepted_length_before=summary.get("base_mean_accepted_length"),
                       validation_mean_accepted_length_after=summary.get("selected_mean_accepted_length"))
            ev("adapt_domain_done", domain=d, draft=name, seconds=adapt_times[d])
        rows[d] = row
    return rows, drafts, adapt_times


def adapted_routing(after: dict, rows: dict, base_name: str, drafts: dict) -> dict:
    """The run's routing table (:func:`eval.decision.routing_table`) over the base draft and the adapters that were
    kept (:func:`eval.decision.adapter_decision`): each domain's decision (:func:`eval.decision.decide`) is
    re-taken among the base draft and its own kept adapter, so a domain whose adapter was refused goes to the base
    draft, or to the target alone when the base is not faster than it (its interval below 1)."""
    from eval.decision import candidates, decide, routing_table
    from eval.report import explain

    kept = {r["adapted_draft"] for r in rows.values() if r.get("adapter_kept")}
    doc = {**after, "drafts": {n: e for n, e in after["drafts"].items() if n == base_name or n in kept}}
    rec = {}
    for d in after["recommendation"]:
        own = rows.get(d, {}).get("adapted_draft") if rows.get(d, {}).get("adapter_kept") else None
        r = decide([c for c in candidates(doc, d) if c["draft"] in (base_name, own)])
        rec[d] = {**r.as_dict(), "reason": explain(r)}
    doc["recommendation"] = rec
    return routing_table(doc, {n: p for n, p in drafts.items() if n in doc["drafts"]})


def render_adapt_report(s: dict) -> str:
    """Markdown before/after report of the adapt stage: per domain what was done and why (left alone, not
    adaptable, adapter kept / refused with the two tau intervals), the routed draft and its measured speedup."""
    def f(x, d=2):
        return "n/a" if x is None else f"{x:.{d}f}"

    def ci(c):
        return f" [{f(c[0])}, {f(c[1])}]" if c else ""

    rows = s["domains"]
    adapted = [d for d, r in rows.items() if r.get("adapted_draft")]
    kept = [d for d, r in rows.items() if r.get("adapter_kept")]
    lines = ["# Automatic per-domain adaptation", "",
             f"- draft: `{s['draft_name']}` (`{s['draft']}`)",
             f"- threshold: adapt domains whose mean accepted length tau < {s['min_mean_accepted_length']:g} "
             f"(num_draft_tokens = {s['num_draft_tokens']}, greedy, test prompts)",
             f"- adapted: {', '.join(adapted) or 'none'}; adapter kept (its tau interval lies wholly above the "
             f"base draft's, both measured in the after-evaluation): {', '.join(kept) or 'none'}",
             f"- left alone: {', '.join(d for d in rows if d not in kept) or 'none'} (why: the table below)",
             f"- routing table: `{s['routing']}` (use it with `decode.draft_routing=PATH`): the base draft and the "
             f"kept adapters only; a domain goes to its kept adapter, else the base draft, else the target alone "
             f"(the verdict rule of the evaluation)",
             f"- full reports: before `{s['reports']['before']}`, after `{s['reports']['after']}`",
             f"- time: before-evaluation {f(s['times_s']['before_eval'], 0)} s, adaptation "
             f"{f(sum(s['times_s']['adapt'].values()), 0)} s, after-evaluation {f(s['times_s']['after_eval'], 0)} s, "
             f"total {f(s['times_s']['total'], 0)} s", "",
             "| domain | tau before | action | base tau after [95% CI] | adapted tau [95% CI] | change | why | "
             "routed draft | routed tau | routed measured speedup (before: draft) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for d, r in rows.items():
        after = r.get("after_mean_accepted_length")
        base_after = r.get("after_base_mean_accepted_length")
        change = f"{after - base_after:+.2f}" if after is not None and base_after is not None else "-"
        routed = f"`{r['routed_draft']}`" if r.get("routed_draft") else "the target alone"
        if r.get("adapted_draft"):
            why = r.get("adapter_reason", "")
        elif r["action"].startswith("left alone"):
            why = f"tau {f(r['before_mean_accepted_length'])} >= {s['min_mean_accepted_length']:g}"
        else:
            why = "no training split"
        lines.append(f"| {d} | {f(r['before_mean_accepted_length'])} | {r['action']} | "
                     f"{f(base_after)}{ci(r.get('after_base_mean_accepted_length_ci'))} | "
                     f"{f(after)}{ci(r.get('after_mean_accepted_length_ci'))} | {change} | {why} | {routed} | "
                     f"{f(r.get('routed_mean_accepted_length'))} | {f(r.get('routed_measured_speedup'))}x "
                     f"({f(r.get('before_measured_speedup'))}x) |")
    lines += ["", "tau: tokens emitted per verify step (bonus token included), pooled over the domain's prompts, "
              "with its 95% percentile-bootstrap interval over prompts. An adapter is kept only where its tau "
              "interval lies wholly above the base draft's on the same prompts (eval.decision.adapter_decision). "
              "Every adapted draft, kept or not, is evaluated on every domain in the after report.", ""]
    return "\n".join(lines)


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[..., dict]  # (rc, opts, run_dir, events) -> summary
    draft: Callable[[Any], str] | None = None  # rc -> the draft folder name it writes (drafts/<name>)


def _reference_target(rc, opts, run_dir: Path, events) -> dict:
    from distill.draft_init import build_reference_target

    rc.reference.trainer.resume = rc.reference.trainer.resume or rc.trainer.resume
    return build_reference_target(rc.reference, opts, run_dir / "reference_train", seed=rc.seed)


def _draft_init(rc, opts, run_dir: Path, events) -> dict:
    from distill.draft_init import run_draft_init

    return run_draft_init(rc, opts, run_dir, events=events)


def _lora(rc, opts, run_dir: Path, events) -> dict:
    from distill.lora import adapt_draft

    return adapt_draft(rc, opts, run_dir, events=events)


def _finetune(rc, opts, run_dir: Path, events) -> dict:
    from distill.lora import finetune_draft

    return finetune_draft(rc, opts, run_dir, events=events)


def _adapt(rc, opts, run_dir: Path, events) -> dict:

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

    from core.io import write_json_atomic
    from models.checkpoints import read_specdraft_meta

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


def _distill(rc, opts, run_dir: Path, events) -> dict:
    """Stage ``distill``: a token draft (distill/pipeline.py) or, with ``draft=eagle3``, an EAGLE-3 head."""
    if rc.draft.init == "eagle3":
        from distill.eagle3 import eagle3_stage

        return eagle3_stage(rc, opts, run_dir, events, distilled=True)
    return distill_stage(rc, opts, run_dir, events)


def _baseline(rc, opts, run_dir: Path, events) -> dict:
    """Stage ``baseline``: the same draft kind with cross-entropy (an EAGLE-3 head's on hard labels)."""
    if rc.draft.init == "eagle3":
        from distill.eagle3 import eagle3_stage

        return eagle3_stage(rc, opts, run_dir, events, distilled=False)
    return baseline_stage(rc, opts, run_dir, events)


STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("reference_target", _reference_target),
    Stage("draft_init", _draft_init, draft=lambda rc: rc.draft.init),  # drafts/layer_pruned or drafts/pretrained
    Stage("distill", _distill, draft=lambda rc: "distilled"),
    Stage("baseline", _baseline, draft=lambda rc: "baseline"),
    Stage("distill_small", distill_small_stage, draft=lambda rc: "small_distilled"),
    Stage("lora", _lora, draft=lora_draft_name),
    # the lora stage's data, teacher, steps and batch with every weight training (the full fine-tuning comparison)
    Stage("finetune", _finetune, draft=finetune_draft_name),
    Stage("adapt", _adapt),
    Stage("eval", _eval),
    Stage("domain_tau", domain_tau_stage),
)}
KNOWN_STAGES = tuple(STAGES)
