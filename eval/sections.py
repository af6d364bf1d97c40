"""The report's comparison sections: adaptation, draft sources, sweep comparisons, the serving handoff and the
decoder benchmark's tables.

The report's "Adaptation" section: a domain's adapted drafts beside the alternatives, in one table.

For the domain a LoRA (kind ``lora``) or fully fine-tuned (kind ``finetune``) draft of the evaluation was adapted
to, one row per evaluated draft: how it was made, its trainable parameters, its training time (training loop +
one-off teacher passes, from its ``specdraft.json``), its tau on that domain with the 95% bootstrap interval over
prompts, tau relative to the base draft the adaptation started from, its measured speedup with interval, and
for a LoRA draft the adapter's size on disk and the time to merge it into the base weights.

Report sections comparing drafts by where they came from: initialisation (config, layer-pruned self-draft,
pretrained), before / after distillation, and INT8 against the fp32 draft it was quantized from.

:func:`draft_sources_section` is passed to :func:`eval.report.write_report` as an extra section; it adds
``draft_sources`` (per draft: how it was made) and ``int8_vs_fp32`` (per INT8 draft and domain: acceptance, tau,
draft tokens/s and its speedup against the fp32 draft, all measured in this evaluation) to ``metrics.json``.

Combine the runs of a Hydra multirun sweep into one comparison report.

    python -m train -m +experiment=distill_med_losses      # five losses; writes the comparison when the sweep ends
    python scripts/compare_runs.py outputs/multirun/distill_med_losses/<timestamp>   # (re)write it for any sweep

Every multirun of ``python -m train`` writes it at the end (``train.run.CompareSweep``, in conf/config.yaml).

Every job folder under SWEEP_DIR that holds a ``metrics.json`` is one run; its label is the distillation loss
(``resolved_config.json``: ``distill.loss``), followed by the data source when two jobs share a loss, else by the
job's override folder name.
Writes, atomically, into SWEEP_DIR:

* ``comparison.json``: ``{"sweep_dir", "domains", "num_draft_tokens", "runs": [{"label", "job", "loss",
  "data_source", "teacher_signal", "off_policy_data", "selected_step", "cost": {"steps", "train_s", "one_off_s",
  "on_policy_generation_s", "on_policy_target_scoring_s"}, "mean_accepted_length": {domain: tau}, "mean_accepted_length_ci": {domain: [lo, hi]}, "acceptance_rate":
  {domain: alpha}, "vs_baseline": {domain: tau / tau_baseline}}], "baseline": {"mean_accepted_length": {domain: tau},
  "jobs": n, "spread": {domain: max - min over jobs}}, "skipped": [{"job", "reason"}]}``
* ``comparison.md``: the same as a loss x domain table of mean accepted length (distilled draft, its interval; in parentheses the
  ratio to the cross-entropy baseline), with the baseline as the last row; then what each draft cost (steps,
  training-loop seconds, one-off teacher passes, on-policy generation and target scoring).

The baseline row is the mean over the jobs' baseline drafts (every job of a loss sweep trains the same baseline;
``spread`` shows whether they differ). Exit status 2 (with a message) when SWEEP_DIR holds no finished run.

The handoff to serving: for each domain's recommended draft and gamma, the settings to paste into vLLM, SGLang
and transformers (``serving.json`` and the report's "Serving settings" section).

The recommendation is read through :func:`eval.decision.recommended_settings` alone, so the rule that picks it (today the
evaluation's ``recommendation.<domain>``: the highest measured speedup) can change in one place.

- vLLM: ``LLM(model=TARGET, speculative_config={"method": "draft_model", "model": DRAFT,
  "num_speculative_tokens": G})`` (``vllm serve TARGET --speculative-config '{...}'``);
- SGLang: ``--speculative-algorithm STANDALONE --speculative-draft-model-path DRAFT --speculative-num-steps G
  --speculative-eagle-topk 1 --speculative-num-draft-tokens G+1`` (a chain of G drafted tokens: one candidate per
  step, G + 1 tokens verified with the root);
- llama.cpp: ``llama-server -m TARGET.gguf -md DRAFT.gguf --spec-type draft-simple --spec-draft-n-max G
  --spec-draft-n-min 0 --spec-draft-p-min 0`` (the GGUF files of :mod:`decode.llamacpp`);
- transformers: ``model.generate(**inputs, assistant_model=draft, ...)`` with
  ``draft.generation_config.num_assistant_tokens = G`` and ``num_assistant_tokens_schedule = "constant"``.

Engines take a fixed number of drafted tokens: where the recommendation is a draft-length policy (adaptive,
confidence) the draft's fastest fixed gamma among those that pay for themselves (tau floor, tau bound, at least
1x: :func:`eval.decision.paying_fixed`) is given and the note says so; without one, the target alone.

The decoder benchmark's results (:func:`eval.bench.run_bench`) as Markdown tables: one ``| metric | value |``
row per number (:func:`format_table`) and chain vs tree (:func:`format_compare`).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from core.io import fmt, fmt_interval, write_json_atomic, write_text_atomic
from eval.decision import recommended_settings, route_path
from eval.metrics import json_clean
from models.checkpoints import SpecdraftMeta, read_specdraft_meta


ADAPTED_KINDS = ("lora", "finetune")


def _ci(ci) -> str:
    return fmt_interval(ci)


def _how(m: SpecdraftMeta) -> str:
    """How a draft was made, in words, from its ``specdraft.json``."""
    data = f"({m.data_source} data, {m.teacher_signal} teacher)"
    if m.kind == "lora":
        full = (m.lora or {}).get("modules_to_save")
        return (f"LoRA r={(m.lora or {}).get('rank')} on the base"
                f"{' + ' + ', '.join(full) + ' trained in full' if full else ''} {data}")
    if m.kind == "finetune":
        return f"every weight of the base fine-tuned {data}"
    if m.distilled:
        return f"distilled from scratch {data}"
    return m.kind or "?"


def adaptation_rows(doc: dict, meta: dict[str, SpecdraftMeta], draft_paths: dict[str, str | Path]) -> list[dict]:
    """One dict per evaluated draft for the domain of the first adapted draft in ``meta`` (empty when none):
    ``draft, kind, trainable_parameters, train_time_s, one_off_s, total_time_s, passes_reused, tau, tau_ci,
    tau_vs_base, speedup, speedup_ci, adapter_bytes, merge_time_s, base``. ``doc``: the evaluation's metrics document (its ``drafts``
    section at the primary gamma); ``draft_paths``: name -> directory, to find which evaluated draft is the base."""
    adapted = [n for n, m in meta.items() if m.kind in ADAPTED_KINDS and n in doc.get("drafts", {})]
    if not adapted:
        return []
    domain = meta[adapted[0]].domain
    base_path = Path(meta[adapted[0]].base).resolve()
    base = next((n for n, p in draft_paths.items() if Path(p).resolve() == base_path), None)
    base_tau = doc["drafts"].get(base, {}).get(domain, {}).get("mean_accepted_length") if base else None
    rows = []
    for name, per_domain in doc["drafts"].items():
        e = per_domain.get(domain)
        if e is None:
            continue
        m = meta.get(name) or SpecdraftMeta()
        tr = m.train or {}
        train_s = tr.get("train_time_s")
        one_off = m.one_off_pass_seconds if m else None
        tau = e.get("mean_accepted_length")
        rows.append({
            "draft": name, "domain": domain, "base": name == base,
            "kind": "base: the draft adapted" if name == base else _how(m),
            "trainable_parameters": m.trainable_parameters if m.trainable_parameters is not None
            else m.draft_parameters,
            "steps": tr.get("steps"),
            "train_time_s": train_s, "one_off_s": one_off,
            "total_time_s": (train_s + one_off) if train_s is not None else None,
            # every one-off pass came from the cache (stored by another stage or an earlier run): not paid here
            "passes_reused": m.passes_reused,
            "tau": tau, "tau_ci": e.get("mean_accepted_length_ci"),
            "tau_vs_base": tau / base_tau if tau is not None and base_tau else None,
            "speedup": e.get("measured_speedup"), "speedup_ci": e.get("measured_speedup_ci"),
            "adapter_bytes": m.adapter_bytes, "merge_time_s": m.merge_time_s,
        })
    return rows


class AdaptationSection:
    """A report section (called with the metrics document, like the other callable sections)."""

    def __init__(self, meta: dict[str, SpecdraftMeta], draft_paths: dict[str, str | Path]):
        self.meta, self.draft_paths = meta, draft_paths
        self.rows: list[dict] = []

    def __call__(self, doc: dict) -> str:
        self.rows = rows = adaptation_rows(doc, self.meta, self.draft_paths)
        if not rows:
            return ""
        lines = [f"## Adaptation ({rows[0]['domain']})", "",
                 "| draft | how it was made | trainable parameters | steps | training time s (loop + one-off "
                 "passes) | tau [95% CI] | tau / base | measured speedup [95% CI] | adapter bytes | merge s |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            time_s = "-" if r["train_time_s"] is None or r["base"] else \
                f"{r['total_time_s']:.0f} ({r['train_time_s']:.0f} + {r['one_off_s']:.0f}" \
                f"{', passes reused' if r['passes_reused'] else ''})"
            params = f"{r['trainable_parameters']:,}" if r["trainable_parameters"] else "-"
            lines.append(
                f"| {r['draft']} | {r['kind']} | {params} | {r['steps'] if r['steps'] and not r['base'] else '-'} | "
                f"{time_s} | {fmt(r['tau'], '.2f')}{_ci(r['tau_ci'])} | {fmt(r['tau_vs_base'], '.2f')} | "
                f"{fmt(r['speedup'], '.2f')}x{_ci(r['speedup_ci'])} | "
                f"{r['adapter_bytes'] if r['adapter_bytes'] is not None else '-'} | "
                f"{fmt(r['merge_time_s'], '.3f') if r['merge_time_s'] is not None else '-'} |")
        lines += ["", "Training time: the training loop's wall clock (checkpoint-selection evaluations excluded) "
                  "plus the one-off teacher passes the stage ran (target generations, top-k cache; a pass another "
                  "stage or an earlier run stored costs only its load time). tau: tokens per verify step on the "
                  "domain's test prompts at the primary gamma. The base row is the draft the adaptation started from.",
                  ""]
        return "\n".join(lines)


def draft_tokens_per_s(entry: dict) -> float | None:
    """Drafted tokens per second of draft time, pooled over the domain's prompts: ``stats.drafted_tokens /
    stats.draft_time_s`` of a metrics entry (the draft's own forwards inside speculative decoding), ``None`` when
    nothing was drafted."""
    st = entry.get("stats") or {}
    t, n = st.get("draft_time_s"), st.get("drafted_tokens")
    return n / t if t and n else None


def _describe(m: SpecdraftMeta, decoder_forward: str | None) -> dict:
    head = m.extra.get("eagle3") if isinstance(m.extra.get("eagle3"), dict) else {}  # an EAGLE-3 head's settings
    vocab = head.get("draft_vocab_size") or (m.draft_vocab or {}).get("size")
    return {"init": m.init_kind, "layers": m.layers, "target_layers": head.get("target_layers"),
            "draft_vocab_size": vocab, "pretrained_from": m.pretrained_from,
            "distilled": m.is_distilled, "training": m.loss, "steps": m.steps_trained, "quantize": m.quantize_mode,
            "fp32_draft": m.fp32_draft, "draft_parameters": m.draft_parameters, "decoder_forward": decoder_forward}


def draft_sources_section(meta: dict[str, tuple[SpecdraftMeta, str | None]]):
    """A callable ``f(doc) -> str`` (see :func:`eval.report.write_report`) rendering, from each draft's
    ``specdraft.json`` and the forward it decoded with (``meta``: name -> ``(SpecdraftMeta, "lean" /
    "hugging_face")``) and the metrics document:

    * **Draft sources**: init, kept layers (self-drafts), distilled or not, quantization, parameters;
    * **Mean accepted length by draft**: tau per domain, one column per draft (before / after distillation and the
      small-config draft side by side);
    * **INT8 vs fp32**: per INT8 draft whose fp32 draft was evaluated too, per domain: acceptance rate, tau, draft
      tokens/s (:func:`draft_tokens_per_s`) of both and the INT8 draft-speed speedup, plus the end-to-end measured
      speedup of each. Nothing is estimated: every number comes from this evaluation's decodes.
    """

    def section(doc: dict) -> str:
        from eval.metrics import domains_of

        names, domains = list(doc["drafts"]), domains_of(doc)
        src = {n: _describe(*meta.get(n, (SpecdraftMeta(), None))) for n in names}
        int8 = _int8_vs_fp32(doc, names, domains, src)
        doc["draft_sources"] = json_clean(src)
        doc["int8_vs_fp32"] = json_clean(int8)
        return "\n".join(_sources_lines(names, src) + _tau_lines(doc, names, domains) + _int8_lines(int8, src))

    return section


def _sources_lines(names: list[str], src: dict) -> list[str]:
    """The "Draft sources" table: init, kept layers (an EAGLE-3 head: the target layers it reads), output
    vocabulary, distilled, quantization, parameters per draft."""
    lines = ["## Draft sources", "", "| draft | init | layers kept | vocabulary | distilled | quantize | parameters |",
             "|---|---|---|---|---|---|---|"]
    for n in names:
        s = src[n]
        init = (s["init"] or "n/a") + (f" (`{s['pretrained_from']}`)" if s["pretrained_from"] else "")
        layers = ("-" if s["layers"] is None else str(s["layers"])) if not s.get("target_layers") else \
            f"reads target layers {s['target_layers']}"
        vocab = f"{s['draft_vocab_size']:,} ids" if s.get("draft_vocab_size") else "full"
        distilled = {True: "yes", False: "no"}.get(s["distilled"], "n/a")
        if s["distilled"] and s["steps"]:
            distilled += f" ({s['steps']} steps)"
        params = f"{s['draft_parameters']:,}" if s["draft_parameters"] else "n/a"
        lines.append(f"| {n} | {init} | {layers} | {vocab} | {distilled} | {s['quantize']} | {params} |")
    return lines


def _tau_lines(doc: dict, names: list[str], domains: list[str]) -> list[str]:
    """Mean accepted length per domain, one column per draft."""
    lines = ["", f"### Mean accepted length by draft (gamma = {doc['num_draft_tokens']})", "",
             "| domain | " + " | ".join(names) + " |", "|" + "---|" * (1 + len(names))]
    return lines + [f"| {d} | " + " | ".join(fmt(doc["drafts"][n][d]["mean_accepted_length"], '.2f', exact_ints=True, text=True) if d in doc["drafts"][n]
                                              else "n/a" for n in names) + " |" for d in domains]


def _int8_vs_fp32(doc: dict, names: list[str], domains: list[str], src: dict) -> dict:
    """Per INT8 draft whose fp32 draft was evaluated too: per domain both drafts' acceptance, tau, draft tokens/s,
    the INT8 draft-speed speedup and both measured speedups, and the two drafts' forward times."""
    int8: dict = {}
    for n in names:
        fp = src[n]["fp32_draft"]
        # its fp32 draft evaluated under its own name (not this int8 draft itself, e.g. eval.drafts naming
        # drafts/distilled_int8 "distilled", whose specdraft.json names its fp32 draft "distilled" too)
        if src[n]["quantize"] != "int8" or fp not in doc["drafts"] or fp == n or src[fp]["quantize"] == "int8":
            continue
        rows = {}
        for d in domains:
            q, f = doc["drafts"][n].get(d), doc["drafts"][fp].get(d)
            if q is None or f is None:
                continue
            tq, tf = draft_tokens_per_s(q), draft_tokens_per_s(f)
            rows[d] = {"acceptance_rate": {"fp32": f["acceptance_rate"], "int8": q["acceptance_rate"]},
                       "mean_accepted_length": {"fp32": f["mean_accepted_length"], "int8": q["mean_accepted_length"]},
                       "draft_tokens_per_s": {"fp32": tf, "int8": tq}, "draft_speedup": tq / tf if tq and tf else None,
                       "measured_speedup": {"fp32": f["measured_speedup"], "int8": q["measured_speedup"]}}
        cq, cf = doc["cost_ratio"].get(n), doc["cost_ratio"].get(fp)
        int8[n] = {"fp32_draft": fp, "domains": rows,
                   "draft_forward_s": {"fp32": cf and cf["draft_forward_s"], "int8": cq and cq["draft_forward_s"]}}
    return int8


def _int8_lines(int8: dict, src: dict) -> list[str]:
    """The "INT8 vs fp32" tables of :func:`_int8_vs_fp32`'s comparison."""
    lines = []
    for n, r in int8.items():
        fw = r["draft_forward_s"]
        lines += ["", f"### INT8 vs fp32: `{n}` against `{r['fp32_draft']}` (measured, same prompts)", ""]
        paths = {k: src[x]["decoder_forward"] for k, x in (("fp32", r["fp32_draft"]), ("int8", n))}
        if fw["fp32"] and fw["int8"]:
            note = (" The two ran through different forwards (the lean forward runs int8 drafts only of the families "
                    "without projection biases), so the int8 figures include the Hugging Face forward's Python "
                    "overhead."
                    if paths["fp32"] != paths["int8"] else "")
            lines += [f"One cached draft forward: fp32 {fw['fp32'] * 1e3:.2f} ms ({paths['fp32']} forward), int8 "
                      f"{fw['int8'] * 1e3:.2f} ms ({paths['int8']} forward): the int8 draft runs at "
                      f"{fw['fp32'] / fw['int8']:.2f}x the fp32 draft's speed.{note}", ""]
        lines += ["| domain | acceptance rate fp32 / int8 | tau fp32 / int8 | draft tok/s fp32 / int8 | "
                  "draft speedup | measured speedup fp32 / int8 |", "|---|---|---|---|---|---|"]
        for d, x in r["domains"].items():
            lines.append(
                f"| {d} | {fmt(x['acceptance_rate']['fp32'], '.3f', exact_ints=True, text=True)} / {fmt(x['acceptance_rate']['int8'], '.3f', exact_ints=True, text=True)} | "
                f"{fmt(x['mean_accepted_length']['fp32'], '.2f', exact_ints=True, text=True)} / {fmt(x['mean_accepted_length']['int8'], '.2f', exact_ints=True, text=True)} | "
                f"{fmt(x['draft_tokens_per_s']['fp32'], '.0f', exact_ints=True, text=True)} / {fmt(x['draft_tokens_per_s']['int8'], '.0f', exact_ints=True, text=True)} | "
                f"{fmt(x['draft_speedup'], '.2f', exact_ints=True, text=True)}x | {fmt(x['measured_speedup']['fp32'], '.2f', exact_ints=True, text=True)}x / "
                f"{fmt(x['measured_speedup']['int8'], '.2f', exact_ints=True, text=True)}x |")
    return lines


DRAFT, BASELINE = "distilled", "baseline"


def collect_runs(sweep_dir: Path) -> tuple[list[dict], list[dict]]:
    """(runs, skipped): one dict per job folder with a ``metrics.json`` (sorted by folder name)."""
    runs, skipped = [], []
    for metrics_path in sorted(sweep_dir.rglob("metrics.json")):
        if any(part.startswith(".") for part in metrics_path.relative_to(sweep_dir).parts):
            continue  # a stored report version (.report/<version>/) or Hydra's folders: the job's link is enough
        job = metrics_path.parent
        try:
            metrics = json.loads(metrics_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            skipped.append({"job": str(job.relative_to(sweep_dir)), "reason": f"unreadable metrics.json: {e}"})
            continue
        cfg_path = job / "resolved_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        meta = read_specdraft_meta(job / "drafts" / DRAFT)
        if DRAFT not in metrics.get("drafts", {}):
            skipped.append({"job": str(job.relative_to(sweep_dir)), "reason": f"no {DRAFT!r} draft in metrics.json"})
            continue
        distill = cfg.get("distill", {})
        runs.append({"job": str(job.relative_to(sweep_dir)) or ".", "metrics": metrics,
                     "loss": distill.get("loss", meta.loss or "?"),
                     "data_source": distill.get("data_source", meta.data_source),
                     "teacher_signal": distill.get("teacher_signal", meta.teacher_signal),
                     "off_policy_data": meta.off_policy_data,
                     "selected_step": meta.selected_step, "cost": _cost(meta)})
    return runs, skipped


def _cost(meta) -> dict:
    """What the distilled draft cost (its ``specdraft.json``, :class:`models.checkpoints.SpecdraftMeta`): optimizer
    steps, training-loop seconds (on-policy generation and target scoring included), one-off teacher passes (teacher
    data, top-k cache) in seconds, and the on-policy part of the loop (draft generation, target scoring of the draft
    rows)."""
    train, op = meta.train or {}, meta.on_policy or {}
    return {"steps": train.get("steps"), "train_s": train.get("train_time_s"),
            "one_off_s": meta.one_off_pass_seconds if meta else None,
            "on_policy_generation_s": op.get("generation_s"), "on_policy_target_scoring_s": op.get("target_scoring_s")}


def _field(metrics: dict, draft: str, domain: str, name: str):
    return metrics.get("drafts", {}).get(draft, {}).get(domain, {}).get(name)


def _label(r: dict, runs: list[dict], losses: list[str]) -> str:
    """The loss; with the data source when that tells jobs of one loss apart; else with the job folder."""
    if losses.count(r["loss"]) == 1:
        return r["loss"]
    key = (r["loss"], r["data_source"])
    if sum((o["loss"], o["data_source"]) == key for o in runs) == 1:
        return f"{r['loss']} / {r['data_source']}"
    return f"{r['loss']} ({r['job']})"


def compare(runs: list[dict], sweep_dir: str = "") -> dict:
    """The comparison document (see the module docstring) from :func:`collect_runs`' runs."""
    domains: list[str] = []
    for r in runs:
        for d in r["metrics"]["drafts"][DRAFT]:
            if d not in domains:
                domains.append(d)
    base_values = {d: [v for r in runs if (v := _field(r["metrics"], BASELINE, d, "mean_accepted_length")) is not None]
                   for d in domains}
    baseline = {
        "mean_accepted_length": {d: (sum(v) / len(v) if v else None) for d, v in base_values.items()},
        "jobs": sum(1 for r in runs if BASELINE in r["metrics"].get("drafts", {})),
        "spread": {d: (max(v) - min(v) if v else None) for d, v in base_values.items()},
    }
    losses = [r["loss"] for r in runs]
    out_runs = []
    for r in runs:
        tau = {d: _field(r["metrics"], DRAFT, d, "mean_accepted_length") for d in domains}
        base = baseline["mean_accepted_length"]
        out_runs.append({
            "label": _label(r, runs, losses),
            "job": r["job"], "loss": r["loss"], "data_source": r["data_source"],
            "teacher_signal": r["teacher_signal"], "off_policy_data": r.get("off_policy_data"),
            "selected_step": r["selected_step"], "cost": r.get("cost", {}),
            "mean_accepted_length": tau,
            "mean_accepted_length_ci": {d: _field(r["metrics"], DRAFT, d, "mean_accepted_length_ci") for d in domains},
            "acceptance_rate": {d: _field(r["metrics"], DRAFT, d, "acceptance_rate") for d in domains},
            "vs_baseline": {d: (tau[d] / base[d] if tau[d] is not None and base[d] else None) for d in domains},
        })
    gammas = sorted({r["metrics"].get("num_draft_tokens") for r in runs} - {None})
    return {"sweep_dir": sweep_dir, "domains": domains, "num_draft_tokens": gammas[0] if len(gammas) == 1 else gammas,
            "runs": out_runs, "baseline": baseline}


def _cell(v, ratio=None, ci=None) -> str:
    if v is None:
        return "-"
    return fmt(v) + fmt_interval(ci) + (f" ({fmt(ratio)}x)" if ratio is not None else "")


def render_markdown(doc: dict) -> str:
    """``comparison.md``: loss x domain mean accepted length, the baseline last."""
    domains = doc["domains"]
    lines = [f"# Sweep comparison: {doc['sweep_dir']}", "",
             f"Mean accepted length tau (tokens per verify step, bonus included; gamma = {doc['num_draft_tokens']}) "
             f"of the distilled draft per domain with its bootstrap interval over prompts; in parentheses tau / tau "
             f"of the cross-entropy baseline (when jobs trained one).", "",
             "| loss | " + " | ".join(domains) + " | selected step |",
             "|---|" + "---|" * (len(domains) + 1)]
    for r in doc["runs"]:
        cis = r.get("mean_accepted_length_ci", {})
        cells = [_cell(r["mean_accepted_length"][d], r["vs_baseline"][d], cis.get(d)) for d in domains]
        step = r["selected_step"] if r["selected_step"] is not None else "-"
        lines.append(f"| {r['label']} | " + " | ".join(cells) + f" | {step} |")
    b = doc["baseline"]
    if b["jobs"]:
        lines.append("| baseline (cross-entropy) | "
                     + " | ".join(_cell(b["mean_accepted_length"][d]) for d in domains) + " | - |")
        spread = [s for s in b["spread"].values() if s]
        lines += ["", f"Baseline: mean over {b['jobs']} job(s)" + (f"; max spread between jobs {max(spread):.3f}."
                                                                   if spread else ".")]
    else:
        lines += ["", "No job trained a cross-entropy baseline (stage `baseline`), so there are no ratios."]
    costs = [r for r in doc["runs"] if r.get("cost", {}).get("steps") is not None]
    if costs:
        def sec(v):
            return f"{v:.0f}" if v is not None else "-"

        lines += ["", "What each distilled draft cost (training-loop seconds include on-policy generation and the "
                      "target's scoring of the draft rows; one-off passes: teacher data and top-k cache):", "",
                  "| loss | data | steps | training s | one-off s | on-policy generation s | target scoring s |",
                  "|---|---|---|---|---|---|---|"]
        for r in costs:
            c = r["cost"]
            data = r.get("data_source") or "?"
            if data == "on_policy" and r.get("off_policy_data"):
                data += f" (+ {r['off_policy_data']})"
            lines.append(f"| {r['label']} | {data} | {c['steps']} | {sec(c['train_s'])} | {sec(c['one_off_s'])} | "
                         f"{sec(c.get('on_policy_generation_s'))} | {sec(c.get('on_policy_target_scoring_s'))} |")
    if doc.get("skipped"):
        lines += ["", "Skipped jobs: " + "; ".join(f"{s['job']} ({s['reason']})" for s in doc["skipped"])]
    return "\n".join(lines) + "\n"


def write_comparison(sweep: Path) -> dict:
    """Collect the finished jobs under ``sweep`` and write ``comparison.json`` + ``comparison.md`` there (atomic).

    Returns the comparison document.

    Raises:
        FileNotFoundError: ``sweep`` is not a directory.
        ValueError: no job folder under ``sweep`` holds a finished run (the message lists the skipped ones).
    """
    sweep = Path(sweep)
    if not sweep.is_dir():
        raise FileNotFoundError(f"{sweep} is not a directory (give the multirun folder, hydra.sweep.dir)")
    runs, skipped = collect_runs(sweep)
    if not runs:
        raise ValueError(f"no finished run (a job folder with metrics.json and a {DRAFT!r} draft) under {sweep}"
                         + (f"; skipped: {skipped}" if skipped else ""))
    doc = {**compare(runs, str(sweep)), "skipped": skipped}
    write_json_atomic(sweep / "comparison.json", doc)
    write_text_atomic(sweep / "comparison.md", render_markdown(doc))
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir", type=Path, help="the multirun folder (hydra.sweep.dir)")
    args = ap.parse_args(argv)
    try:
        doc = write_comparison(args.sweep_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render_markdown(doc))
    print(f"wrote {args.sweep_dir / 'comparison.md'} and {args.sweep_dir / 'comparison.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


SCHEMA = "specdraft.serving/1"


def llama_cpp_settings(target: str, draft_path: str, gamma: int, gguf_dir: str | Path | None,
                       target_format: str = "source", draft_format: str = "q8_0") -> dict:
    """llama.cpp's ``llama-server`` command for one (draft, gamma): the target's GGUF file (its own file when it was
    converted from one, else the q8_0 export the engine check writes), the draft's q8_0 export under ``gguf_dir``
    (``<run dir>/gguf``, written by the engine check; the ``export`` command writes it otherwise), greedy chain
    drafting of exactly gamma tokens."""
    from decode.llamacpp import source_gguf, target_export_name

    src = source_gguf(target)
    gdir = Path(gguf_dir) if gguf_dir is not None else Path(draft_path).parent.parent / "gguf"
    tfmt = "q8_0" if target_format == "source" else target_format
    target_gguf = str(src) if src is not None and target_format == "source" else str(
        gdir / (target_export_name(target, tfmt) if Path(target).is_dir() else f"target-{tfmt}.gguf"))
    from models.eagle3 import is_eagle3_dir

    draft_gguf = str(gdir / f"{Path(draft_path).name}-{draft_format}.gguf")
    head = is_eagle3_dir(draft_path)  # an EAGLE-3 head: llama.cpp's converter writes it, draft-eagle3 serves it
    args = ["-m", target_gguf, "-md", draft_gguf, "--spec-type", "draft-eagle3" if head else "draft-simple",
            "--spec-draft-n-max", str(gamma), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]
    export = (["python", "<engine dir>/converter/convert_hf_to_gguf.py", draft_path, "--target-model-dir", target,
               "--outtype", draft_format, "--outfile", draft_gguf] if head else
              ["python", "scripts/export_gguf.py", draft_path, draft_gguf, "--outtype", draft_format, "--target", target])
    return {"target_gguf": target_gguf, "draft_gguf": draft_gguf, "args": args,
            "command": "llama-server " + " ".join(map(shlex.quote, args)),
            "export": " ".join(map(shlex.quote, export))}


def lookup_engine_settings(target: str, spec: str, settings: dict, gamma: int, gguf_dir: str | Path | None = None,
                           formats: dict | None = None) -> dict:
    """The engine settings of a lookup draft (``ngram:<kind>``, decode/ngram.py; ``settings``: its
    :meth:`~decode.ngram.NgramDraft.settings`): vLLM's ``ngram`` method (``prompt_lookup_min`` / ``_max``) or
    ``suffix`` method (``suffix_decoding_min_token_prob`` = our ``min_share``), llama.cpp's ``ngram-simple`` /
    ``ngram-cache`` (:func:`decode.llamacpp.lookup_server_args`), transformers' ``prompt_lookup_num_tokens``
    (prompt lookup only); SGLang has no lookup method (None)."""
    from decode.llamacpp import lookup_server_args, source_gguf, target_export_name
    from decode.ngram import parse_lookup_spec

    kind = parse_lookup_spec(spec)
    if kind == "prompt_lookup":
        vllm = {"method": "ngram", "num_speculative_tokens": gamma, "prompt_lookup_min": settings["min_ngram"],
                "prompt_lookup_max": settings["max_ngram"]}
    else:
        vllm = {"method": "suffix", "num_speculative_tokens": gamma,
                "suffix_decoding_min_token_prob": settings["min_share"]}
    src = source_gguf(target)
    fmt_ = (formats or {}).get("target_format", "source")
    gdir = Path(gguf_dir) if gguf_dir is not None else Path("gguf")
    tfmt = "q8_0" if fmt_ == "source" else fmt_
    target_gguf = str(src) if src is not None and fmt_ == "source" else str(
        gdir / (target_export_name(target, tfmt) if Path(target).is_dir() else f"target-{tfmt}.gguf"))
    args = ["-m", target_gguf, *lookup_server_args(kind, settings, gamma)]
    hf = None
    if kind == "prompt_lookup":
        hf = {"prompt_lookup_num_tokens": gamma, "max_matching_ngram_size": settings["max_ngram"], "snippet": "\n".join([
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f"tok = AutoTokenizer.from_pretrained({target!r})",
            f"model = AutoModelForCausalLM.from_pretrained({target!r})",
            "inputs = tok.apply_chat_template([{\"role\": \"user\", \"content\": \"Hello\"}], add_generation_prompt=True,"
            " return_tensors=\"pt\", return_dict=True)",
            f"out = model.generate(**inputs, prompt_lookup_num_tokens={gamma}, max_matching_ngram_size="
            f"{settings['max_ngram']}, max_new_tokens=128, do_sample=False)"])}
    return {
        "lookup": settings,
        "vllm": {"speculative_config": vllm,
                 "command": f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(json.dumps(vllm))}"},
        "sglang": None,
        "llama_cpp": {"target_gguf": target_gguf, "draft_gguf": None, "args": args,
                      "command": "llama-server " + " ".join(map(shlex.quote, args)), "export": None},
        "transformers": hf,
    }


def engine_settings(target: str, draft_path: str, gamma: int, gguf_dir: str | Path | None = None,
                    formats: dict | None = None) -> dict:
    """The vLLM / SGLang / llama.cpp / transformers settings for one (draft, gamma); an EAGLE-3 head is served as
    vLLM's ``eagle3`` method and SGLang's ``EAGLE3`` algorithm (transformers has no EAGLE-3 decoding: no snippet)."""
    from models.eagle3 import is_eagle3_dir

    head = is_eagle3_dir(draft_path)
    spec = {"method": "eagle3" if head else "draft_model", "model": draft_path, "num_speculative_tokens": gamma}
    sglang = ["--model-path", target, "--speculative-algorithm", "EAGLE3" if head else "STANDALONE",
              "--speculative-draft-model-path", draft_path, "--speculative-num-steps", str(gamma),
              "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(gamma + 1)]
    hf = "\n".join([
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"tok = AutoTokenizer.from_pretrained({target!r})",
        f"model = AutoModelForCausalLM.from_pretrained({target!r})",
        f"draft = AutoModelForCausalLM.from_pretrained({draft_path!r})",
        f"draft.generation_config.num_assistant_tokens = {gamma}",
        "draft.generation_config.num_assistant_tokens_schedule = \"constant\"",
        "inputs = tok.apply_chat_template([{\"role\": \"user\", \"content\": \"Hello\"}], add_generation_prompt=True,"
        " return_tensors=\"pt\", return_dict=True)",
        "out = model.generate(**inputs, assistant_model=draft, max_new_tokens=128, do_sample=False)",
    ])
    return {
        "vllm": {"speculative_config": spec,
                 "command": f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(json.dumps(spec))}"},
        "sglang": {"args": sglang, "command": "python -m sglang.launch_server " + " ".join(map(shlex.quote, sglang))},
        "llama_cpp": llama_cpp_settings(target, draft_path, gamma, gguf_dir, **(formats or {})),
        "transformers": None if head else {"num_assistant_tokens": gamma, "snippet": hf},
    }


def serving_document(doc: dict, draft_paths: dict[str, str | Path], target: str,
                     gguf_dir: str | Path | None = None, formats: dict | None = None,
                     lookup_settings: dict | None = None) -> dict:
    """``serving.json``: ``{"schema", "target", "domains": {domain: {"draft", "draft_path", "num_draft_tokens",
    "measured_speedup", "note", "vllm", "sglang", "llama_cpp", "transformers"}}}`` (``gguf_dir``: where the
    drafts' GGUF exports are, ``<run dir>/gguf``; ``lookup_settings``: name -> the settings of each lookup draft,
    whose path is ``ngram:<kind>``: :func:`lookup_engine_settings`).

    Raises:
        ValueError: a recommended draft has no path in ``draft_paths``.
    """
    from decode.hybrid import parse_hybrid_spec

    target_path = str(Path(target).resolve()) if Path(target).exists() else str(target)
    domains = {}
    for domain, r in recommended_settings(doc).items():
        if r["draft"] is None:
            domains[domain] = {**r, "draft_path": None}
            continue
        if r["draft"] not in draft_paths:
            raise ValueError(f"serving settings: no checkpoint path for recommended draft {r['draft']!r}")
        path = route_path(draft_paths[r["draft"]])
        gguf = {"gguf_dir": gguf_dir, "formats": formats}
        hybrid = parse_hybrid_spec(path)
        if hybrid is not None:  # no engine puts a lookup in front of a draft model: they serve the trained draft
            kind, model_path = hybrid
            note = (f"{r.get('note') or ''} The engines serve {Path(model_path).name} alone: none of them puts a "
                    f"{kind} lookup in front of a draft model, which specdraft's decoder does "
                    "(decode/hybrid.py).").strip()
            domains[domain] = {**r, "note": note, "draft_path": path,
                               **engine_settings(target_path, model_path, r["num_draft_tokens"], **gguf)}
            continue
        if path.startswith("ngram:"):  # a lookup draft: no checkpoint, the engines' own n-gram methods
            settings = (lookup_settings or {}).get(r["draft"]) or {}
            domains[domain] = {**r, "draft_path": path, **lookup_engine_settings(
                target_path, path, settings, r["num_draft_tokens"], **gguf)}
            continue
        domains[domain] = {**r, "draft_path": path, **engine_settings(target_path, path, r["num_draft_tokens"], **gguf)}
    return {"schema": SCHEMA, "target": target_path, "domains": domains}


def serving_markdown(serving: dict) -> str:
    """The report's "Serving settings" section for a :func:`serving_document`."""
    lines = ["## Serving settings", "",
             "The recommended draft and gamma of each domain as engine settings (also in `serving.json`). vLLM: "
             "`speculative_config`; SGLang: launch flags (a chain: `--speculative-eagle-topk 1`, "
             "`--speculative-num-draft-tokens` = steps + 1); transformers: `generate(assistant_model=draft)`.", "",
             "| domain | draft | gamma | vLLM speculative_config | SGLang flags | note |", "|---|---|---|---|---|---|"]
    for d, s in serving["domains"].items():
        if s["draft"] is None:
            lines.append(f"| {d} | none (the target alone) | - | - | - | {s['note']} |")
            continue
        flags = " ".join(s["sglang"]["args"][2:]) if s.get("sglang") else "none (no lookup method)"
        lines.append(f"| {d} | `{s['draft']}` | {s['num_draft_tokens']} | "
                     f"`{json.dumps(s['vllm']['speculative_config'])}` | `{flags}` | {s['note'] or '-'} |")
    speculating = [s for s in serving["domains"].values() if s["draft"] is not None and s.get("transformers")]
    if speculating:
        first = speculating[0]
        lines += ["", f"transformers, for `{first['draft']}` (gamma {first['num_draft_tokens']}):", "", "```python",
                  first["transformers"]["snippet"], "```"]
    return "\n".join(lines)


class ServingSection:
    """A report section callable ``f(doc) -> markdown``; ``document`` holds the last :func:`serving_document`
    (the caller writes it to ``serving.json``)."""

    def __init__(self, draft_paths: dict[str, str | Path], target: str, gguf_dir: str | Path | None = None,
                 formats: dict | None = None, lookup_settings: dict | None = None):
        self.draft_paths, self.target, self.gguf_dir, self.formats = draft_paths, target, gguf_dir, formats
        self.lookup_settings = lookup_settings
        self.document = None

    def __call__(self, doc: dict) -> str:
        self.document = serving_document(doc, self.draft_paths, self.target, self.gguf_dir, self.formats,
                                         self.lookup_settings)
        return serving_markdown(self.document)


SKIPPED = "skipped (--no-hf)"


def _setup_rows(r: dict) -> list[tuple[str, str]]:
    """The machine's load while timing, and what ran where."""
    load = r["load"]
    other = load.get("other_load")
    return [
        ("machine load while timing (other processes' busy cores)",
         ("unknown" if other is None else f"{other:.2f} of {load['cores']}")
         + (": DISTURBED, other processes kept more than a quarter of a core busy; re-run on a quiet machine "
            "before trusting these timings" if load.get("overloaded") else "")),
        ("model family (tiny random, --family)", r["family"] or "-"),
        ("device / dtype (target, draft) / threads (one-token, block)",
         f"{r['device']} / {r['target_dtype']}, {r['draft_dtype']} / {r['num_threads']}, "
         f"{r['block_threads']['threads'] or r['num_threads']}"),
        ("ours: lean forward (target, draft)",
         f"{r['fast_path']} ({'yes' if r['fast_path_used']['target'] else 'no'}, "
         f"{'yes' if r['fast_path_used']['draft'] else 'no'})"),
        ("prompts x repeats", f"{r['num_prompts']} x {r['repeats']}"),
        ("num_draft_tokens (gamma)", f"{r['num_draft_tokens']}"),
        ("ours: draft-length policy (mean draft length)",
         f"{r['draft_length_policy']['draft_length_policy']} ({r['mean_draft_length']:.2f})"),
        ("max_new_tokens", f"{r['max_new_tokens']}"),
    ]


def _speed_rows(r: dict) -> list[tuple[str, str]]:
    """Tokens/s of every method, the speedups and the acceptance."""
    tps = r["tokens_per_s"]
    hf_ran = tps["hf_assisted"] == tps["hf_assisted"]  # NaN: skipped (--no-hf)
    return [
        ("tokens/s target-only (ours AR)", f"{tps['target_only']:.1f}"),
        *([(f"tokens/s target-only, every forward at {r['block_threads']['threads']} threads",
            f"{tps['target_only_block_threads']:.1f}")] if "target_only_block_threads" in tps else []),
        (f"tokens/s transformers assisted (num_assistant_tokens {r['num_draft_tokens']}, constant)",
         f"{tps['hf_assisted']:.1f}" if hf_ran else SKIPPED),
        ("tokens/s ours speculative", f"{tps['ours_speculative']:.1f}"),
        ("tokens/s transformers generate (target only)", f"{tps['hf_target_only']:.1f}" if hf_ran else SKIPPED),
        ("ours / transformers assisted", f"{r['ours_over_transformers']:.2f}x" if hf_ran else SKIPPED),
        ("ours / transformers generate (target only)", f"{r['ours_over_transformers_target_only']:.2f}x" if hf_ran
         else SKIPPED),
        ("ours / target-only (measured speedup; the faster target-only)", f"{r['ours_over_target_only']:.2f}x"),
        ("acceptance rate (accepted / drafted)", f"{r['acceptance_rate']:.3f}"),
        ("per-token acceptance alpha (accepted / tested)", f"{r['token_acceptance_rate']:.3f}"),
        ("mean accepted length tau", f"{r['mean_accepted_length']:.2f}"),
    ]


def _cost_rows(r: dict) -> list[tuple[str, str]]:
    """Forward times, c and v (standalone and in the loop), the draft head, the target's memory bound, where the
    speculative wall time goes and the expected speedups."""
    bd, il = r["time_breakdown"]["ours_speculative"], r["in_loop"]
    wall = bd["wall_s"] or float("nan")
    head, bound = r["draft_head"], r["target_memory_bound"]
    return [
        ("one-position forward ms (target, draft)",
         f"{1e3 * r['target_forward_s']:.3f}, {1e3 * r['draft_forward_s']:.3f}"),
        ("verify forward ms (gamma + 1 positions)", f"{1e3 * r['target_verify_forward_s']:.3f}"),
        ("cost ratio c (draft / target forward)", f"{r['cost_ratio']:.3f} (in loop {il['cost_ratio']:.3f})"),
        ("draft head: rows, ms per position, share of the draft forward",
         f"{head['head_rows']}, {1e3 * head['head_forward_s']:.3f}, {head['share_of_draft_forward']:.0%}"),
        ("target memory bound: MB read / GB/s measured / bound ms; verify and 1-pos forward over it",
         f"{bound['weight_bytes'] / 1e6:.0f} / {bound['bandwidth_gb_s']:.1f} / {1e3 * bound['bound_s']:.2f}; "
         f"{bound['verify_over_bound']:.2f}x, {bound['one_token_over_bound']:.2f}x"),
        ("verify cost ratio v (verify / 1-pos forward)",
         f"{r['verify_cost_ratio']:.2f} (in loop {il['verify_cost_ratio']:.2f})"),
        ("spec wall: prefill / draft / verify / other",
         f"{bd['prefill_s'] / wall:.0%} / {bd['draft_s'] / wall:.0%} / {bd['verify_s'] / wall:.0%} / "
         f"{bd['other_s'] / wall:.0%}"),
        ("loop efficiency (time in forwards / wall)",
         f"{bd['loop_efficiency']:.2f} (target-only {r['time_breakdown']['target_only']['loop_efficiency']:.2f})"),
        ("expected speedup (Leviathan Thm 3.8, v = 1)", f"{r['expected_speedup']:.2f}x"),
        ("expected speedup (measured c and v)", f"{r['expected_speedup_components']:.2f}x"),
        ("measured / expected (Leviathan)", f"{r['measured_over_expected']:.2f}"),
    ]


def _check_rows(r: dict) -> list[tuple[str, str]]:
    """Greedy outputs differing from target-only, compilation and the several-row layout."""
    hf_ran = r["tokens_per_s"]["hf_assisted"] == r["tokens_per_s"]["hf_assisted"]
    peer, calls = r["row_layout"]["peer"], r["num_prompts"] * r["repeats"]
    return [
        ("ours: greedy outputs differing from target-only (of prompts x repeats)",
         f"{r['greedy_output_mismatches']['ours_speculative']} of {calls}"),
        ("decode.compile (compiled; compile s warm-up / timed)",
         f"{r['compile']['setting']} ({'yes' if r['compile']['compiled'] else 'no'}; "
         f"{r['compile']['compile_time_s']:.1f} / {r['compile']['compile_time_in_timed_s']:.1f})"),
        *([("ours compiled / uncompiled (tokens/s)", f"{r['compile']['compiled_over_uncompiled']:.2f}x"),
           ("ours uncompiled: outputs differing from target-only",
            f"{r['greedy_output_mismatches']['ours_speculative_uncompiled']}")] if r["compile"]["compiled"] else []),
        ("ours: several-row products (row layout; auto: per model, the timed set of its products)",
         _layout_choices(r["row_layout"], "measured", lambda m: f"hidden {m['shapes'][0][0]}")),
        ("ours: one-row products (one-token forwards; auto: all of a model's products, one row as two)",
         _layout_choices(r["row_layout"], "one_row", lambda m: f"{m['layers']} layers")),
        *([(f"ours / ours with row layout {peer} (tokens/s; its mismatches)",
            f"{r['row_layout']['ours_over_peer']:.2f}x; "
            f"{r['greedy_output_mismatches'][f'ours_speculative_row_layout_{peer}']}")] if peer else []),
        ("transformers: outputs differing from target-only (of prompts x repeats)",
         f"{r['greedy_output_mismatches']['hf_assisted']} of {calls}" if hf_ran else SKIPPED),
    ]


def _layout_choices(record: dict, kind: str, label) -> str:
    """The setting, then per model measured under ``auto`` (``record[kind]``, see ``row_layout_record``): its
    ``label(m)``, the chosen layout and the two forms' timed sweeps."""
    return record["setting"] + "".join(
        f"; {label(m)}: {m['chosen']} (weight-left {m['weight_left_us']:.0f} us, "
        f"activation-left {m['activation_left_us']:.0f} us)" for m in record.get(kind, []))


def format_table(r: dict) -> str:
    """``| metric | value |`` Markdown rows of a :func:`eval.bench.run_bench` result (ratios as ``1.23x``, shares
    as percentages, forward times in ms, the load first: DISTURBED above a quarter of a core)."""
    rows = _setup_rows(r) + _speed_rows(r) + _cost_rows(r) + _check_rows(r)
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)


def format_compare(r: dict) -> str:
    """Chain vs tree: one row per chain / tree method (equal target forwards: tokens per target forward)."""
    lines = ["| method | tokens / target forward (tau) | nodes / target forward | target forwards | tokens/s | "
             "tokens/s vs chain | vs target-only | vs transformers | greedy mismatches |",
             "|---|---|---|---|---|---|---|---|---|"]
    hf = r["tokens_per_s"]["hf_assisted"]
    for name, c in r["chain_vs_tree"].items():
        vs_hf = f"{c['tokens_per_s'] / hf:.2f}x" if hf == hf else "skipped"
        lines.append(f"| {name} | {c['tokens_per_target_forward']:.2f} | {c['nodes_per_target_forward']:.1f} | "
                     f"{c['target_forwards']} | {c['tokens_per_s']:.1f} | {c['tokens_per_s_over_chain']:.2f}x | "
                     f"{c['tokens_per_s_over_target_only']:.2f}x | {vs_hf} | {c['greedy_output_mismatches']} |")
    return "\n".join(lines)
