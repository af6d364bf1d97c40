"""The handoff to serving: for each domain's recommended draft and gamma, the settings to paste into vLLM, SGLang
and transformers (``serving.json`` and the report's "Serving settings" section).

The recommendation is read through :func:`recommended_settings` alone, so the rule that picks it (today the
evaluation's ``recommendation.<domain>``: the highest measured speedup) can change in one place.

- vLLM: ``LLM(model=TARGET, speculative_config={"method": "draft_model", "model": DRAFT,
  "num_speculative_tokens": G})`` (``vllm serve TARGET --speculative-config '{...}'``);
- SGLang: ``--speculative-algorithm STANDALONE --speculative-draft-model-path DRAFT --speculative-num-steps G
  --speculative-eagle-topk 1 --speculative-num-draft-tokens G+1`` (a chain of G drafted tokens: one candidate per
  step, G + 1 tokens verified with the root);
- llama.cpp: ``llama-server -m TARGET.gguf -md DRAFT.gguf --spec-type draft-simple --spec-draft-n-max G
  --spec-draft-n-min 0 --spec-draft-p-min 0`` (the GGUF files of :mod:`decode.gguf_export`);
- transformers: ``model.generate(**inputs, assistant_model=draft, ...)`` with
  ``draft.generation_config.num_assistant_tokens = G`` and ``num_assistant_tokens_schedule = "constant"``.

Engines take a fixed number of drafted tokens: where the recommendation is a draft-length policy (adaptive,
confidence) the draft's fastest fixed gamma among those that pay for themselves (tau floor, tau bound, at least
1x: :func:`eval.decision.paying_fixed`) is given and the note says so; without one, the target alone.
"""
from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

from .decision import paying_fixed

SCHEMA = "specdraft.serving/1"


def recommended_settings(doc: dict) -> dict[str, dict]:
    """domain -> ``{"draft", "num_draft_tokens", "measured_speedup", "note"}``: the draft and fixed gamma to serve
    each domain with, read from a ``metrics.json`` document's recommendation (the one place to re-point when the
    verdict logic moves)."""
    out = {}
    for domain, r in (doc.get("recommendation") or {}).items():
        if r.get("action", "speculate") != "speculate" or r.get("draft") is None:  # the verdict: no draft pays
            out[domain] = {"draft": None, "num_draft_tokens": 0, "measured_speedup": r.get("measured_speedup"),
                           "note": "serve with the target alone: " + (r.get("reason") or "no draft measured faster")}
            continue
        gamma, note, s = r["num_draft_tokens"], "", r.get("measured_speedup")
        policy = r.get("draft_length_policy", "fixed")
        if policy != "fixed":
            fixed = paying_fixed(doc, r["draft"], domain)
            if not fixed:  # no fixed gamma of this draft paid for itself here: an engine would be slower
                out[domain] = {"draft": None, "num_draft_tokens": 0, "measured_speedup": s, "note": (
                    f"the recommendation is draft_length_policy={policy}, which engines with a fixed draft length "
                    f"cannot run, and no fixed gamma of `{r['draft']}` paid for itself here: serve with the target "
                    f"alone (or an engine with adaptive draft lengths)")}
                continue
            best = max(fixed, key=lambda c: c["measured_speedup"])
            gamma, s = best["num_draft_tokens"], best["measured_speedup"]
            note = (f"the recommendation is draft_length_policy={policy}; engines take a fixed count, so this is "
                    f"the draft's fastest fixed gamma among those that pay for themselves")
        if isinstance(s, (int, float)) and math.isfinite(s) and s < 1:
            note = (note + "; " if note else "") + (f"measured speedup {s:.2f}x < 1 here: speculative decoding was "
                                                    f"slower than the target alone on this machine")
        out[domain] = {"draft": r["draft"], "num_draft_tokens": int(gamma), "measured_speedup": s, "note": note}
    return out


def llama_cpp_settings(target: str, draft_path: str, gamma: int, gguf_dir: str | Path | None,
                       target_format: str = "source", draft_format: str = "q8_0") -> dict:
    """llama.cpp's ``llama-server`` command for one (draft, gamma): the target's GGUF file (its own file when it was
    converted from one, else the q8_0 export the engine check writes), the draft's q8_0 export under ``gguf_dir``
    (``<run dir>/gguf``, written by the engine check; the ``export`` command writes it otherwise), greedy chain
    drafting of exactly gamma tokens."""
    from decode.gguf_export import source_gguf, target_export_name

    src = source_gguf(target)
    gdir = Path(gguf_dir) if gguf_dir is not None else Path(draft_path).parent.parent / "gguf"
    tfmt = "q8_0" if target_format == "source" else target_format
    target_gguf = str(src) if src is not None and target_format == "source" else str(
        gdir / (target_export_name(target, tfmt) if Path(target).is_dir() else f"target-{tfmt}.gguf"))
    draft_gguf = str(gdir / f"{Path(draft_path).name}-{draft_format}.gguf")
    args = ["-m", target_gguf, "-md", draft_gguf, "--spec-type", "draft-simple", "--spec-draft-n-max", str(gamma),
            "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]
    export = ["python", "scripts/export_gguf.py", draft_path, draft_gguf, "--outtype", draft_format, "--target", target]
    return {"target_gguf": target_gguf, "draft_gguf": draft_gguf, "args": args,
            "command": "llama-server " + " ".join(map(shlex.quote, args)),
            "export": " ".join(map(shlex.quote, export))}


def engine_settings(target: str, draft_path: str, gamma: int, gguf_dir: str | Path | None = None,
                    formats: dict | None = None) -> dict:
    """The vLLM / SGLang / llama.cpp / transformers settings for one (draft, gamma)."""
    spec = {"method": "draft_model", "model": draft_path, "num_speculative_tokens": gamma}
    sglang = ["--model-path", target, "--speculative-algorithm", "STANDALONE",
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
        "transformers": {"num_assistant_tokens": gamma, "snippet": hf},
    }


def serving_document(doc: dict, draft_paths: dict[str, str | Path], target: str,
                     gguf_dir: str | Path | None = None, formats: dict | None = None) -> dict:
    """``serving.json``: ``{"schema", "target", "domains": {domain: {"draft", "draft_path", "num_draft_tokens",
    "measured_speedup", "note", "vllm", "sglang", "llama_cpp", "transformers"}}}`` (``gguf_dir``: where the
    drafts' GGUF exports are, ``<run dir>/gguf``).

    Raises:
        ValueError: a recommended draft has no path in ``draft_paths``.
    """
    target_path = str(Path(target).resolve()) if Path(target).exists() else str(target)
    domains = {}
    for domain, r in recommended_settings(doc).items():
        if r["draft"] is None:
            domains[domain] = {**r, "draft_path": None}
            continue
        if r["draft"] not in draft_paths:
            raise ValueError(f"serving settings: no checkpoint path for recommended draft {r['draft']!r}")
        path = str(Path(draft_paths[r["draft"]]).resolve())
        gguf = {"gguf_dir": gguf_dir, "formats": formats}
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
        flags = " ".join(s["sglang"]["args"][2:])
        lines.append(f"| {d} | `{s['draft']}` | {s['num_draft_tokens']} | "
                     f"`{json.dumps(s['vllm']['speculative_config'])}` | `{flags}` | {s['note'] or '-'} |")
    speculating = [s for s in serving["domains"].values() if s["draft"] is not None]
    if speculating:
        first = speculating[0]
        lines += ["", f"transformers, for `{first['draft']}` (gamma {first['num_draft_tokens']}):", "", "```python",
                  first["transformers"]["snippet"], "```"]
    return "\n".join(lines)


class ServingSection:
    """A report section callable ``f(doc) -> markdown``; ``document`` holds the last :func:`serving_document`
    (the caller writes it to ``serving.json``)."""

    def __init__(self, draft_paths: dict[str, str | Path], target: str, gguf_dir: str | Path | None = None,
                 formats: dict | None = None):
        self.draft_paths, self.target, self.gguf_dir, self.formats = draft_paths, target, gguf_dir, formats
        self.document = None

    def __call__(self, doc: dict) -> str:
        self.document = serving_document(doc, self.draft_paths, self.target, self.gguf_dir, self.formats)
        return serving_markdown(self.document)
