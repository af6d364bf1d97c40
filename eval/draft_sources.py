"""Report sections comparing drafts by where they came from: initialisation (config, layer-pruned self-draft,
pretrained), before / after distillation, and INT8 against the fp32 draft it was quantized from.

:func:`draft_sources_section` is passed to :func:`eval.report.write_report` as an extra section; it adds
``draft_sources`` (per draft: how it was made) and ``int8_vs_fp32`` (per INT8 draft and domain: acceptance, tau,
draft tokens/s and its speedup against the fp32 draft, all measured in this evaluation) to ``metrics.json``.
"""
from __future__ import annotations

from data.specdraft_meta import SpecdraftMeta

from .metrics import json_clean

__all__ = ["draft_sources_section", "draft_tokens_per_s"]


def draft_tokens_per_s(entry: dict) -> float | None:
    """Drafted tokens per second of draft time, pooled over the domain's prompts: ``stats.drafted_tokens /
    stats.draft_time_s`` of a metrics entry (the draft's own forwards inside speculative decoding), ``None`` when
    nothing was drafted."""
    st = entry.get("stats") or {}
    t, n = st.get("draft_time_s"), st.get("drafted_tokens")
    return n / t if t and n else None


def _describe(m: SpecdraftMeta, decoder_forward: str | None) -> dict:
    return {"init": m.init_kind, "layers": m.layers, "pretrained_from": m.pretrained_from,
            "distilled": m.is_distilled, "training": m.loss, "steps": m.steps_trained, "quantize": m.quantize_mode,
            "fp32_draft": m.fp32_draft, "draft_parameters": m.draft_parameters, "decoder_forward": decoder_forward}


def _f(x, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


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
        from .metrics import domains_of

        names, domains = list(doc["drafts"]), domains_of(doc)
        src = {n: _describe(*meta.get(n, (SpecdraftMeta(), None))) for n in names}
        int8 = _int8_vs_fp32(doc, names, domains, src)
        doc["draft_sources"] = json_clean(src)
        doc["int8_vs_fp32"] = json_clean(int8)
        return "\n".join(_sources_lines(names, src) + _tau_lines(doc, names, domains) + _int8_lines(int8, src))

    return section


def _sources_lines(names: list[str], src: dict) -> list[str]:
    """The "Draft sources" table: init, kept layers, distilled, quantization, parameters per draft."""
    lines = ["## Draft sources", "", "| draft | init | layers kept | distilled | quantize | parameters |",
             "|---|---|---|---|---|---|"]
    for n in names:
        s = src[n]
        init = (s["init"] or "n/a") + (f" (`{s['pretrained_from']}`)" if s["pretrained_from"] else "")
        layers = "-" if s["layers"] is None else str(s["layers"])
        distilled = {True: "yes", False: "no"}.get(s["distilled"], "n/a")
        if s["distilled"] and s["steps"]:
            distilled += f" ({s['steps']} steps)"
        params = f"{s['draft_parameters']:,}" if s["draft_parameters"] else "n/a"
        lines.append(f"| {n} | {init} | {layers} | {distilled} | {s['quantize']} | {params} |")
    return lines


def _tau_lines(doc: dict, names: list[str], domains: list[str]) -> list[str]:
    """Mean accepted length per domain, one column per draft."""
    lines = ["", f"### Mean accepted length by draft (gamma = {doc['num_draft_tokens']})", "",
             "| domain | " + " | ".join(names) + " |", "|" + "---|" * (1 + len(names))]
    return lines + [f"| {d} | " + " | ".join(_f(doc["drafts"][n][d]["mean_accepted_length"]) if d in doc["drafts"][n]
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
                f"| {d} | {_f(x['acceptance_rate']['fp32'], 3)} / {_f(x['acceptance_rate']['int8'], 3)} | "
                f"{_f(x['mean_accepted_length']['fp32'])} / {_f(x['mean_accepted_length']['int8'])} | "
                f"{_f(x['draft_tokens_per_s']['fp32'], 0)} / {_f(x['draft_tokens_per_s']['int8'], 0)} | "
                f"{_f(x['draft_speedup'])}x | {_f(x['measured_speedup']['fp32'])}x / "
                f"{_f(x['measured_speedup']['int8'])}x |")
    return lines
