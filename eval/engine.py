"""The engine check: the evaluation's drafts served by llama.cpp (``llama-server``), measured by the engine's own
counters on the evaluation's prompts, beside our decoder's numbers (``eval.engine``; report section "Engine check",
``metrics.json["engine"]``).

For the target alone and for each draft (exported to GGUF with the target's tokenizer, :mod:`decode.llamacpp`),
one ``llama-server`` process decodes every evaluation prompt greedily (the same token ids our decoder got, at most
``eval.max_new_tokens`` new tokens, ``eval.engine.num_draft_tokens`` drafted per step). Per (draft, domain) it
records, pooled over prompts (sums, never a mean of per-prompt means):

- **acceptance** alpha = sum ``draft_n_accepted`` / sum ``draft_n`` (the engine's counters; our
  ``acceptance_rate`` is the same ratio), with a 95% percentile bootstrap interval over prompts;
- **tokens/s** = sum ``predicted_n`` / sum ``predicted_ms`` (generation only, prompt processing excluded) of the
  target alone and with the draft, their ratio the engine's **speedup**, with a paired bootstrap interval; the
  target alone is timed twice, before and after every draft, per prompt the mean of the two, and never with
  ``n_probs`` (the top-2 gaps of the prompts where a draft's output parted from it come from a third, untimed pass:
  per-token probabilities slow the server);
- **mean accepted length** tau = (accepted + steps) / steps with steps = ``predicted_n - 1 - accepted`` (the first
  token comes from the prompt pass; every verify step emits its accepted tokens plus one);
- **c** = the draft's per-token decode time / the target's (each served alone, tokens/s ratio) and **v** = the
  time of one speculative step / one target token - gamma * c (derived from the timings, so it also holds the
  engine's per-step overhead); the **expected speedup** (Leviathan et al. 2023, Thm 3.8, with v) from them;
- the **verdict**: speculate with this draft where the speedup's interval lies above 1, else the target alone;
  ``re-measure`` where the speedup exceeds 1.1 tau (a verify step emits tau tokens for at least one token's time:
  a disturbed timing, as :func:`eval.decision.speedup_bound` says of our decoder's);
- **lossless**: the greedy output with the draft equals the target alone's, prompt by prompt.

Engine and own acceptance **agree** when their intervals overlap. Where they do not, the report says why when it can
tell: the engine's target (``eval.engine.target_format=source``: SmolLM2's Q4_1 file) is not the float32
conversion our decoder runs, so its greedy answers (the text both drafts are scored on) differ from ours on the
share of prompts it prints.
"""
from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

import numpy as np

from core.io import fmt, fmt_interval
from eval.decision import IMPLAUSIBLE_OVER_TAU
from eval.metrics import _cell_seed, _ratio, bootstrap_ratio_ci

log = logging.getLogger(__name__)

SCHEMA = "specdraft.engine_check/1"


def engine_wanted(ec) -> tuple[bool, str]:
    """Whether the engine check runs under ``eval.engine`` (``ec``), and why (the report's one line when not).

    Raises:
        decode.llamacpp.EngineNotInstalled: ``enabled: true`` and no engine is installed.
    """
    from decode.llamacpp import engine_available, find_engine

    if ec.enabled == "false":
        return False, "eval.engine.enabled=false"
    if ec.enabled == "true":
        return True, find_engine().describe()  # raises with the install command
    return engine_available()


def prepare_ggufs(ec, target_path: str | os.PathLike, draft_paths: dict[str, Path], out_dir: Path) -> dict:
    """The target's and each draft's GGUF file under ``out_dir`` (exported once; an existing file newer than its
    checkpoint is reused). Returns ``{"target": path, "target_from": str, "drafts": {name: path}}``."""
    from decode.llamacpp import export_eagle3_gguf, export_once, source_gguf, target_gguf, vocab_compatibility
    from models.eagle3 import is_eagle3_dir

    target_file, target_from = target_gguf(target_path, ec.target_format, out_dir)
    source = source_gguf(target_path)
    drafts = {}
    for name, path in draft_paths.items():
        # named after the checkpoint's folder, as serving.json names it (eval/sections.py)
        out = out_dir / f"{Path(path).name}-{ec.draft_format}.gguf"
        drafts[name] = (export_eagle3_gguf(Path(path), out, target_path, outtype=ec.draft_format)
                        if is_eagle3_dir(path) else export_once(Path(path), out, ec.draft_format, source))
        bad = vocab_compatibility(target_file, drafts[name])
        if bad:
            raise ValueError(f"draft {name!r} exported to {drafts[name]} fails llama.cpp's vocabulary check against "
                             f"the target: {bad[0]}")
    return {"target": target_file, "target_from": target_from, "drafts": drafts}


def run_engine_check(ec, *, target_path, draft_paths: dict[str, Path], prompt_ids: dict[str, list[tuple[str, list[int]]]],
                     max_new_tokens: int, num_draft_tokens: int, threads: int | None, out_dir: Path,
                     events=None, lookup_settings: dict | None = None) -> dict:
    """Serve the target alone, each draft alone (for c) and the target with each draft (a lookup draft,
    ``ngram:<kind>`` with ``lookup_settings[name]``: llama.cpp's own n-gram speculation,
    :func:`decode.llamacpp.lookup_server_args`, no c); returns the raw record
    ``{"engine", "target_gguf", "target_from", "drafts_gguf", "num_draft_tokens", "threads", "runs": {"target" | draft
    name: {domain: [per-prompt {"id", "tokens", "predicted_n", "predicted_ms", "draft_n", "draft_n_accepted"}]}},
    "alone_tokens_per_s": {name: tokens/s served alone}, "commands": {name: argv}}``."""
    from decode.fast_settings import free_cores
    from decode.llamacpp import LlamaServer, find_engine

    ev = events or (lambda *a, **k: None)
    engine = find_engine()
    threads = int(threads or free_cores())  # the cores free now: llama.cpp's threads spin on a busy core
    from decode.llamacpp import lookup_server_args
    from decode.ngram import parse_lookup_spec

    lookups = {n: parse_lookup_spec(p) for n, p in draft_paths.items() if parse_lookup_spec(p)}
    files = prepare_ggufs(ec, target_path, {n: p for n, p in draft_paths.items() if n not in lookups}, out_dir)
    need = max(len(ids) for ps in prompt_ids.values() for _, ids in ps) + max_new_tokens + num_draft_tokens + 8
    ctx = 1 << max(8, math.ceil(math.log2(need)))
    runs, alone_tps, commands = {}, {}, {}

    from models.eagle3 import is_eagle3_dir

    heads = {n for n, p in draft_paths.items() if is_eagle3_dir(p)}  # EAGLE-3: --spec-type draft-eagle3

    def serve(name: str, target_gguf, draft_gguf=None, domains=None, n_probs: int = 0, spec="draft-simple",
              extra=()) -> dict:
        t0 = time.perf_counter()
        with LlamaServer(engine, target_gguf, draft_gguf, num_draft_tokens=num_draft_tokens, threads=threads,
                         ctx_size=ctx, spec_type=spec, extra_args=tuple(extra)) as s:
            commands[name] = [c if c != str(s.port) else "PORT" for c in s.command]
            s.complete(next(iter(prompt_ids.values()))[0][1], 4)  # warm-up: the first request pays page faults
            out = {}
            for domain, ps in (domains or prompt_ids).items():
                out[domain] = []
                for pid, ids in ps:
                    r = s.complete(ids, max_new_tokens, n_probs=n_probs)
                    out[domain].append({"id": pid, "tokens": r.tokens, "predicted_n": r.predicted_n,
                                        "predicted_ms": r.predicted_ms, "draft_n": r.draft_n,
                                        "draft_n_accepted": r.draft_n_accepted})
                    if n_probs:  # the gap between the two most probable tokens, in nats, per generated token
                        out[domain][-1]["top2_gap"] = [
                            math.log(row[0][1] / row[1][1]) if len(row) > 1 and row[1][1] > 0 else None
                            for row in r.top_probs]
        ev("eval_engine_run", name=name, seconds=time.perf_counter() - t0)
        return out

    # the target alone, timed before and after every draft (its tokens/s is the mean of the two passes: a slow drift
    # of the machine weighs on both sides alike) and without n_probs, whose per-token probabilities slow the server
    runs["target"] = serve("target", files["target"])
    first = dict([next(iter(prompt_ids.items()))])  # c: each draft served alone on the first domain's prompts
    for name, g in files["drafts"].items():
        if name in heads:  # a head runs only on the target's features: no c from serving it alone
            alone_tps[name] = math.nan
            runs[name] = serve(name, files["target"], g, spec="draft-eagle3")
            continue
        alone = serve(f"{name} alone", g, domains=first)
        alone_tps[name] = _tps([r for rs in alone.values() for r in rs])
        runs[name] = serve(name, files["target"], g)
    for name, kind in lookups.items():  # llama.cpp's own n-gram speculation: no draft model, no c
        alone_tps[name] = math.nan
        runs[name] = serve(name, files["target"], extra=lookup_server_args(
            kind, (lookup_settings or {}).get(name) or {"min_ngram": 2}, num_draft_tokens))
    runs["target"] = _mean_passes(runs["target"], serve("target again", files["target"]))
    # the top-2 gaps (untimed) of the prompts where some draft's greedy output left the target alone's: whether the
    # engine broke a near-tie there
    alone = {d: {r["id"]: r for r in rows} for d, rows in runs["target"].items()}
    parted = {d: [(pid, ids) for pid, ids in ps if any(
        r["id"] == pid and r["tokens"] != alone[d][pid]["tokens"] for n, by in runs.items() if n != "target"
        for r in by.get(d, []))] for d, ps in prompt_ids.items()}
    parted = {d: ps for d, ps in parted.items() if ps}
    if parted:
        for domain, rows in serve("target top-2", files["target"], domains=parted, n_probs=2).items():
            for g in rows:
                r = alone[domain][g["id"]]
                r["top2_gap"] = g.get("top2_gap") if g["tokens"] == r["tokens"] else None
    alone_tps["target"] = _tps([r for r in runs["target"][next(iter(first))]])
    return {"schema": SCHEMA, "engine": engine.describe(), "target_gguf": str(files["target"]),
            "target_from": files["target_from"], "drafts_gguf": {n: str(p) for n, p in files["drafts"].items()},
            "num_draft_tokens": num_draft_tokens, "threads": threads, "runs": runs, "alone_tokens_per_s": alone_tps,
            "commands": commands}


def _mean_passes(before: dict, after: dict) -> dict:
    """The target alone's two timed passes as one: per prompt the mean ``predicted_ms`` (both kept in
    ``predicted_ms_passes``); the tokens are the first pass's (greedy: the same in both)."""
    out = {}
    for domain, rows in before.items():
        out[domain] = [{**a, "predicted_ms": (a["predicted_ms"] + b["predicted_ms"]) / 2,
                        "predicted_ms_passes": [a["predicted_ms"], b["predicted_ms"]]}
                       for a, b in zip(rows, after[domain])]
    return out


def _tps(rows: list[dict]) -> float:
    ms = sum(r["predicted_ms"] for r in rows)
    return sum(r["predicted_n"] for r in rows) / (ms / 1000.0) if ms > 0 else math.nan


def summarize(raw: dict, own: dict | None = None, target_outputs: dict | None = None, *, samples: int = 1000,
              confidence: float = 0.95, seed: int = 0) -> dict:
    """Per draft and domain: the engine's acceptance, tau, tokens/s, speedup, c, v, expected speedup, verdict and
    losslessness from :func:`run_engine_check`'s record, with our own acceptance beside it (``own``: metrics.json's
    ``drafts`` at the same gamma) and whether the two agree; ``target_outputs``: our target's greedy ids per domain
    and prompt id (how often the engine's target answers differently)."""
    from decode.stats import expected_speedup

    gamma = int(raw["num_draft_tokens"])
    base = raw["runs"]["target"]
    out = {"schema": SCHEMA, "engine": raw["engine"], "target_gguf": raw["target_gguf"],
           "target_from": raw["target_from"], "num_draft_tokens": gamma, "threads": raw["threads"],
           "commands": raw["commands"], "target_tokens_per_s": {}, "target_greedy_differs": {}, "drafts": {}}
    for domain, rows in base.items():
        out["target_tokens_per_s"][domain] = _tps(rows)
        if target_outputs and domain in target_outputs:
            ours = target_outputs[domain]
            diff = [r["id"] for r in rows if r["id"] in ours and ours[r["id"]] != r["tokens"]]
            out["target_greedy_differs"][domain] = {"prompts": len(rows), "differ": len(diff)}
    t_tps = raw["alone_tokens_per_s"].get("target")
    for name, by_domain in raw["runs"].items():
        if name == "target":
            continue
        d_tps = raw["alone_tokens_per_s"].get(name)
        c = t_tps / d_tps if t_tps and d_tps and math.isfinite(d_tps) else math.nan
        out["drafts"][name] = {}
        for domain, rows in by_domain.items():
            ref = {r["id"]: r for r in base[domain]}
            pairs = [(r, ref[r["id"]]) for r in rows if r["id"] in ref]
            drafted = np.array([r["draft_n"] for r, _ in pairs], dtype=float)
            acc = np.array([r["draft_n_accepted"] for r, _ in pairs], dtype=float)
            n_new = np.array([r["predicted_n"] for r, _ in pairs], dtype=float)
            ms = np.array([r["predicted_ms"] for r, _ in pairs], dtype=float)
            b_new = np.array([b["predicted_n"] for _, b in pairs], dtype=float)
            b_ms = np.array([b["predicted_ms"] for _, b in pairs], dtype=float)
            steps = np.maximum(n_new - 1 - acc, 1)
            alpha = float(acc.sum() / drafted.sum()) if drafted.sum() else math.nan
            tps, base_tps = _ratio(n_new.sum(), ms.sum() / 1000), _ratio(b_new.sum(), b_ms.sum() / 1000)
            speedup = _ratio(tps, base_tps)
            cell = dict(seed=_cell_seed(seed, "engine", name, domain), samples=samples, confidence=confidence)
            speed_ci = bootstrap_ratio_ci(n_new, ms, num2=b_new, den2=b_ms, **cell)
            t1_ms = 1000.0 / base_tps if base_tps else math.nan
            v = float((ms.sum() / steps.sum()) / t1_ms - gamma * c) if math.isfinite(c) and t1_ms else math.nan
            e = {"acceptance_rate": alpha, "acceptance_rate_ci": bootstrap_ratio_ci(acc, drafted, **cell),
                 "drafted_tokens": int(drafted.sum()), "accepted_tokens": int(acc.sum()),
                 "mean_accepted_length": float((acc.sum() + steps.sum()) / steps.sum()),
                 "tokens_per_s": tps, "target_tokens_per_s": base_tps, "speedup": speedup, "speedup_ci": speed_ci,
                 "cost_ratio": c, "verify_cost_ratio": v, "prompts": len(pairs),
                 "lossless": all(r["tokens"] == b["tokens"] for r, b in pairs),
                 "greedy_differs": sum(r["tokens"] != b["tokens"] for r, b in pairs),
                 "differences": [_difference(r, b) for r, b in pairs if r["tokens"] != b["tokens"]]}
            e["expected_speedup"] = (expected_speedup(alpha, gamma, c, v) if all(
                map(math.isfinite, (alpha, c, v))) and v > 0 else None)
            # a verify step emits tau tokens and costs at least one one-token step, so a speedup above tau (10 %
            # allowed for noise) is a disturbed timing, as in our own decoder's verdicts (eval.decision.speedup_bound)
            tau = e["mean_accepted_length"]
            e["verdict"] = ("re-measure" if math.isfinite(speedup) and speedup > IMPLAUSIBLE_OVER_TAU * tau else
                            "speculate" if speed_ci and speed_ci[0] > 1 else "target alone")
            mine = ((own or {}).get(name) or {}).get(domain)
            if mine is not None and mine.get("num_draft_tokens") != gamma:  # ours at the engine's gamma, if swept
                mine = (mine.get("sweep") or {}).get(str(gamma))
            if mine is not None:
                e["own_acceptance_rate"] = mine.get("acceptance_rate")
                e["own_acceptance_rate_ci"] = mine.get("acceptance_rate_ci")
                e["own_mean_accepted_length"] = mine.get("mean_accepted_length")
                e["agree"] = _overlap(e["acceptance_rate_ci"], e["own_acceptance_rate_ci"])
            out["drafts"][name][domain] = e
    return out


def _difference(spec: dict, alone: dict) -> dict:
    """Where the greedy output with a draft first leaves the target alone's: the prompt, the position (0-based,
    in generated tokens) and the target alone's gap between its two most probable tokens there (nats; a near-tie
    that llama.cpp's multi-token verify forward can break the other way from its one-token forward)."""
    a, b = spec["tokens"], alone["tokens"]
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    gaps = alone.get("top2_gap") or []
    return {"id": spec["id"], "position": i, "top2_gap_nats": gaps[i] if i < len(gaps) else None}


def _overlap(a, b) -> bool | None:
    if not a or not b:
        return None
    return bool(a[0] <= b[1] and b[0] <= a[1])




def _ci(ci, spec: str = ".2f") -> str:
    return fmt_interval(ci, spec, missing="-")


def engine_markdown(summary: dict, ours_lossless: bool | None = None) -> str:
    """The report's "Engine check" section for a :func:`summarize` record (``ours_lossless``: metrics.json's
    ``lossless_all``, said beside the engine's divergences)."""
    g = summary["num_draft_tokens"]
    lines = ["## Engine check (llama.cpp)", "",
             f"{summary['engine']}, `llama-server` with {summary['threads']} thread(s); target: "
             f"{summary['target_from']}; greedy, gamma {g} (`--spec-type draft-simple`), the evaluation's prompts and "
             f"token ids. Acceptance, tokens/s and the speedup are the engine's own counters (`draft_n`, "
             f"`draft_n_accepted`, `predicted_n` / `predicted_ms`); c and v are derived from its timings; intervals: "
             f"95% bootstrap over prompts.", "",
             "| draft | domain | engine alpha | own alpha | agree | engine tau | tok/s (target alone) | speedup | c | v "
             "| expected | verdict | lossless |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, by_domain in summary["drafts"].items():
        for domain, e in by_domain.items():
            agree = {True: "yes", False: "NO", None: "-"}[e.get("agree")]
            lines.append(
                f"| {name} | {domain} | {fmt(e['acceptance_rate'], '.2f', missing='-')}{_ci(e['acceptance_rate_ci'])} | "
                f"{fmt(e.get('own_acceptance_rate'), '.2f', missing='-')}{_ci(e.get('own_acceptance_rate_ci'))} | {agree} | "
                f"{fmt(e['mean_accepted_length'], '.2f', missing='-')} | {fmt(e['tokens_per_s'], '.1f', missing='-')} ({fmt(e['target_tokens_per_s'], '.1f', missing='-')}) | "
                f"{fmt(e['speedup'], '.2f', missing='-')}x{_ci(e['speedup_ci'])} | {fmt(e['cost_ratio'], '.3f', missing='-')} | "
                f"{fmt(e['verify_cost_ratio'], '.2f', missing='-')} | {fmt(e['expected_speedup'], '.2f', missing='-')}x | {e['verdict']} | "
                f"{'yes' if e['lossless'] else 'NO (' + str(e['greedy_differs']) + ' prompts)'} |")
    diffs = [(n, d, x) for n, bd in summary["drafts"].items() for d, e in bd.items() for x in e.get("differences", [])]
    if diffs:
        gaps = [x["top2_gap_nats"] for _, _, x in diffs if x["top2_gap_nats"] is not None]
        lines += ["", f"Not lossless in the engine on {len(diffs)} (draft, prompt) pair(s): "
                  + "; ".join(f"{n}/{d} at token {x['position']} (top-2 gap {fmt(x['top2_gap_nats'], '.3f', missing='-')} nats)"
                              for n, d, x in diffs[:6])
                  + (". Each is a near-tie of the target's logits that llama.cpp's multi-token verify forward breaks "
                     "the other way from its one-token forward (its kernels differ with the batch)"
                     + ("; our decoder gives the target's own greedy output on every prompt." if ours_lossless else ".")
                     if gaps and max(gaps) < 0.1 else
                     ". Not every one is a near-tie of the target's logits: check the engine build.")]
    differs = summary.get("target_greedy_differs") or {}
    disagree = [(n, d) for n, bd in summary["drafts"].items() for d, e in bd.items() if e.get("agree") is False]
    if differs:
        parts = [f"{d} {x['differ']}/{x['prompts']}" for d, x in differs.items()]
        lines += ["", f"The engine's target alone answers differently from our target's greedy decode on "
                      f"{', '.join(parts)} prompts: {summary['target_from']} is not the float32 model our decoder "
                      f"runs, so the two measure acceptance on partly different answers."]
    if disagree:
        lines += ["", "Where engine and own acceptance do not agree (" +
                  ", ".join(f"{n}/{d}" for n, d in disagree) + "), the cause is the target each one verifies "
                  "against (above) or the draft's precision (the engine runs the draft as "
                  f"{Path(next(iter(summary.get('drafts_gguf', {}).values()), 'x-q8_0.gguf')).stem.rsplit('-', 1)[-1]}"
                  ", ours as saved)."]
    lines += ["", "Commands (`PORT`: any free port):", ""]
    lines += [f"- {n}: `{' '.join(cmd)}`" for n, cmd in summary["commands"].items()]
    return "\n".join(lines)


class EngineSection:
    """A report section ``f(doc) -> markdown`` that adds ``doc["engine"]`` (the :func:`summarize` record, with our
    own acceptance from ``doc["drafts"]``) or, when the check did not run, ``{"skipped": reason}``."""

    def __init__(self, raw: dict | None, reason: str, target_outputs: dict | None, *, samples: int,
                 confidence: float, seed: int):
        self.raw, self.reason, self.target_outputs = raw, reason, target_outputs
        self.kw = dict(samples=samples, confidence=confidence, seed=seed)

    def __call__(self, doc: dict) -> str:
        if self.raw is None:
            doc["engine"] = {"skipped": self.reason}
            return f"## Engine check (llama.cpp)\n\nNot run: {self.reason}."
        summary = summarize(self.raw, doc.get("drafts"), self.target_outputs, **self.kw)
        summary["drafts_gguf"] = self.raw.get("drafts_gguf")
        doc["engine"] = summary
        return engine_markdown(summary, doc.get("lossless_all"))
