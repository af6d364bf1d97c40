"""The pipeline's ``eval`` stage (also ``python -m eval``): evaluate drafts against the target, write the report.

``evaluate_run(rc, opts, run_dir, events=events)`` is the one implementation both entry points call. It loads the
target and the drafts (``eval.drafts`` or ``<run_dir>/drafts/*``), the prompts of ``eval.domains`` (+
``eval.extra_domains``), decodes (:mod:`eval.evaluate`), aggregates (:mod:`eval.metrics`), writes ``report.md``,
``metrics.json``, ``per_prompt.csv``, ``plots/*.png`` (:mod:`eval.report`), ``routing.json`` (domain -> the draft
with the best measured speedup, :mod:`eval.decision`) and, with ``logger=wandb``, a wandb run.
With ``decode.draft_routing=PATH`` each domain is decoded only with the draft the table routes it to.
Beside the fixed-gamma sweep every draft also decodes under each draft-length policy of
``eval.draft_length_policies`` (default: ``decode.draft_length_policy``), a fresh policy per prompt.

Which drafts an evaluation reads (``eval.drafts``, a routing table, or the run directory's ``drafts/*``), and the
check, before a training run loads anything, that the drafts its stages must still write can be written.

Tracking: the run's local JSONL event log and, with ``logger=wandb``, a Weights & Biases run.

The wandb run defaults to ``mode=offline`` (nothing leaves the machine; ``wandb sync <dir>`` uploads later) and
writes its folder under the run directory (``<run_dir>/wandb/offline-run-*``). It receives the same numbers as
``metrics.json`` (flattened ``<draft>/<domain>/<field>`` into the run summary and one history step), the plots as
``wandb.Image``, a ``metrics`` table (one row per draft x domain x num_draft_tokens), optionally the per-prompt
table, and copies of ``metrics.json`` / ``report.md`` (``specdraft_metrics.json`` / ``specdraft_report.md``)
in the run's files.
"""
from __future__ import annotations

import json
import logging
import math
import shutil
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from core.runtime import torch_threads
from core.errors import PromptTooLongError
from core.io import atomic_file_set, write_text_atomic
from data.loading import DataOptions, eval_prompts, user_domain
from eval.config import (check_draft_names, hybrid_head_error, hybrid_paths, hybrid_specs, in_run,  # noqa: F401
                         lookup_specs)  # (lookup_specs: eval.pipeline's API)
from eval.decision import routing_section, write_routing
from eval.evaluate import Prompt, evaluate_drafts
from eval.report import render_markdown, setting_label, target_description, verdicts_section, write_report


def routed_drafts(table_path: str, domains: list[str], eval_drafts: dict | None) -> tuple[dict, dict]:
    """``decode.draft_routing``: (draft name -> path, domain -> draft name, None for a domain routed to the target
    alone) for ``domains``, checked before any model loads.

    Raises:
        RoutingError (a ValueError): missing / invalid table, a domain without a route and no ``default``, or
            ``eval.drafts`` given as well (the table decides the drafts).
    """
    from core.errors import RoutingError
    from decode.config import load_routing

    if eval_drafts:
        raise RoutingError("decode.draft_routing and eval.drafts both name drafts; with a routing table the table "
                           "decides which draft decodes each domain. Drop one of them.")
    table = load_routing(table_path)
    paths: dict[str, Path] = {}
    routed: dict[str, str] = {}
    for d in domains:
        r = table.draft_for(d)
        if r.target_only:  # routed to no draft: decoded with the target alone
            routed[d] = None
            continue
        name = r.draft
        if name in paths and paths[name] != Path(r.path):  # two different checkpoints share a name
            name = f"{r.draft}@{Path(r.path).parent.name}/{Path(r.path).name}"
        paths[name] = Path(r.path)
        routed[d] = name
    return paths, routed


def draft_paths(rc, run_dir: Path) -> dict[str, Path]:
    """name -> draft directory: ``eval.drafts``, else ``<run_dir>/drafts/*``. A relative ``eval.drafts`` path
    ``drafts/<name>`` is the run directory's (a draft an earlier stage of the run writes) unless only the working
    directory has it, so an experiment can evaluate its own drafts beside one from elsewhere (``lora_med``: the
    committed general draft).

    Raises:
        ValueError: no drafts at all (says how to give some).
    """
    drafts_dir = Path(run_dir) / "drafts"
    if rc.decode.draft_routing:  # the table decides (checked: it loads, every domain has a route)
        paths = routed_drafts(rc.decode.draft_routing, rc.eval.all_domains(), rc.eval.drafts)[0]
    elif rc.eval.drafts is not None:  # {}: no trained drafts (the lookup drafts alone)
        paths = {n: in_run(p, run_dir) for n, p in rc.eval.drafts.items()}
    else:
        paths = {p.name: p for p in sorted(drafts_dir.iterdir()) if p.is_dir() and not p.name.startswith(".")} \
            if drafts_dir.is_dir() else {}
    paths = {n: q for n, q in paths.items() if not str(q).startswith("ngram:")}  # lookup drafts: lookup_specs
    if not paths and not rc.decode.draft_routing and not lookup_specs(rc) and not hybrid_specs(rc):
        # (a table may route to the target alone)
        if rc.eval.drafts is not None and drafts_dir.is_dir() and any(drafts_dir.iterdir()):
            raise ValueError(f"no drafts to evaluate: eval.drafts names none (it is {{}} or every entry is null) and "
                             f"eval.lookup_drafts is []; set eval.drafts=null to evaluate every draft under "
                             f"{drafts_dir}, or name one: eval.drafts='{{name: /path/to/draft_dir}}'.")
        raise ValueError(f"no drafts to evaluate: none under {drafts_dir} and eval.drafts is empty. Run the distill "
                         f"and/or baseline stage first, or pass eval.drafts='{{name: /path/to/draft_dir}}'.")
    return dict(sorted(paths.items(), key=lambda kv: (kv[0] != "distilled", kv[0])))


def later_drafts(paths: dict[str, Path], run_dir: Path) -> dict[str, Path]:
    """The drafts of ``paths`` that are the run directory's and do not exist yet (an earlier stage writes them)."""
    run_drafts = (Path(run_dir) / "drafts").resolve()
    return {n: p for n, p in paths.items() if not p.exists() and run_drafts in p.resolve().parents}


def planned_drafts(rc, run_dir: Path) -> dict[str, Path]:
    """The ``eval.drafts`` entries of a training run that are its own ``drafts/<name>`` and do not exist yet: an
    earlier stage must write them (``{}`` under ``decode.draft_routing``, which names its own drafts)."""
    if not rc.eval.drafts or rc.decode.draft_routing:
        return {}
    return later_drafts(draft_paths(rc, run_dir), run_dir)


def check_planned_drafts(rc, run_dir: Path, later: dict[str, Path] | None = None) -> None:
    """Before a training run loads anything: every ``eval.drafts`` entry that its stages must still write can be
    written; ``drafts/<name>_int8`` only is under ``draft.quantize=int8``.

    Raises:
        ValueError: an ``_int8`` draft without ``draft.quantize=int8`` (names both fixes).
    """
    if later is None:
        later = planned_drafts(rc, run_dir)
    quantize = getattr(getattr(rc, "draft", None), "quantize", "none")
    for n, p in later.items():  # <name>_int8 copies are written only under draft.quantize=int8
        if p.name.endswith("_int8") and quantize != "int8":
            raise ValueError(f"eval.drafts.{n} is drafts/{p.name}, which this run writes only with "
                             f"draft.quantize=int8 (it is {quantize}): set draft.quantize=int8, or evaluate the "
                             f"fp32 draft with eval.drafts.{n}=drafts/{p.name[:-len('_int8')]}")


log = logging.getLogger(__name__)

SUMMARY_FIELDS = ("acceptance_rate", "token_acceptance_rate", "mean_accepted_length", "expected_mean_accepted_length",
                  "measured_speedup", "expected_speedup", "target_tokens_per_s", "speculative_tokens_per_s",
                  "cost_ratio", "draft_time_s", "verify_time_s", "num_prompts", "best_num_draft_tokens")
TABLE_COLUMNS = ("draft", "domain", "num_draft_tokens", "acceptance_rate", "acceptance_rate_ci_low",
                 "acceptance_rate_ci_high", "mean_accepted_length", "mean_accepted_length_ci_low",
                 "mean_accepted_length_ci_high", "measured_speedup", "measured_speedup_ci_low",
                 "measured_speedup_ci_high", "expected_speedup", "target_tokens_per_s", "speculative_tokens_per_s",
                 "speculative_latency_p50_s", "speculative_latency_p95_s", "speculative_latency_p99_s",
                 "num_prompts", "lossless")


def _num(x) -> Any:
    return x if x is None or not isinstance(x, float) or math.isfinite(x) else None


def flat_metrics(doc: dict) -> dict[str, Any]:
    """``{"<draft>/<domain>/<field>": value}`` for the primary gamma, plus ``.../gamma<g>/<field>`` per swept gamma,
    ``.../<policy>/<field>`` per draft-length policy, ``recommendation/<domain>/...`` and ``lossless_all``."""
    out: dict[str, Any] = {"lossless_all": doc.get("lossless_all")}
    for draft, by_domain in doc["drafts"].items():
        for domain, e in by_domain.items():
            for f in SUMMARY_FIELDS:
                out[f"{draft}/{domain}/{f}"] = _num(e.get(f))
            for f in ("mean_accepted_length_ci", "measured_speedup_ci", "acceptance_rate_ci"):
                if e.get(f):
                    out[f"{draft}/{domain}/{f}_low"], out[f"{draft}/{domain}/{f}_high"] = e[f]
            for g, s in e.get("sweep", {}).items():
                for f in ("mean_accepted_length", "measured_speedup", "expected_speedup", "acceptance_rate"):
                    out[f"{draft}/{domain}/gamma{g}/{f}"] = _num(s.get(f))
            for p, s in e.get("policies", {}).items():
                for f in ("mean_accepted_length", "measured_speedup", "expected_speedup", "acceptance_rate",
                          "mean_draft_length"):
                    out[f"{draft}/{domain}/{p}/{f}"] = _num(s.get(f))
    for domain, r in doc.get("recommendation", {}).items():
        out[f"recommendation/{domain}/draft"] = r["draft"]
        out[f"recommendation/{domain}/num_draft_tokens"] = r["num_draft_tokens"]
        out[f"recommendation/{domain}/draft_length_policy"] = r.get("draft_length_policy", "fixed")
        out[f"recommendation/{domain}/measured_speedup"] = _num(r["measured_speedup"])
    return out


def metrics_rows(doc: dict) -> list[list]:
    """One row per draft x domain x num_draft_tokens, columns :data:`TABLE_COLUMNS`."""
    rows = []
    for draft, by_domain in doc["drafts"].items():
        for domain, entry in by_domain.items():
            for g, e in entry["sweep"].items():
                def ci(f, i):
                    return e[f"{f}_ci"][i] if e.get(f"{f}_ci") else None

                lat = e["speculative_latency_s"]
                rows.append([draft, domain, int(g), e["acceptance_rate"], ci("acceptance_rate", 0),
                             ci("acceptance_rate", 1), e["mean_accepted_length"], ci("mean_accepted_length", 0),
                             ci("mean_accepted_length", 1), e["measured_speedup"], ci("measured_speedup", 0),
                             ci("measured_speedup", 1), e["expected_speedup"], e["target_tokens_per_s"],
                             e["speculative_tokens_per_s"], lat["p50"], lat["p95"], lat["p99"], e["num_prompts"],
                             e["lossless"]])
    return rows


def log_to_wandb(logger_cfg, run_dir: str | Path, doc: dict, *, config: dict | None = None,
                 name: str | None = None, per_prompt_rows: list[dict] | None = None,
                 events_path: str | Path | None = None) -> str | None:
    """Log one evaluation to a wandb run (offline unless ``logger.mode=online``); returns the run's local folder.

    Training events found in ``events_path`` (``train_step`` / ``train_eval``) are replayed as history so the same
    run shows the training curves of a pipeline run.
    """
    import wandb

    run_dir = Path(run_dir)
    wdir = Path(logger_cfg.dir).expanduser() if logger_cfg.dir else run_dir
    wdir.mkdir(parents=True, exist_ok=True)
    run = wandb.init(project=logger_cfg.project, entity=logger_cfg.entity, mode=logger_cfg.mode, dir=str(wdir),
                     name=name, config=config or {}, tags=list(logger_cfg.tags) or None, job_type="eval",
                     settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
    try:
        if events_path and Path(events_path).exists():
            _replay_training_events(run, Path(events_path))
        flat = flat_metrics(doc)
        images = {f"plots/{k}": wandb.Image(str(run_dir / rel), caption=k) for k, rel in doc.get("plots", {}).items()}
        table = wandb.Table(columns=list(TABLE_COLUMNS), data=metrics_rows(doc))
        payload = {**{f"eval/{k}": v for k, v in flat.items() if isinstance(v, (int, float)) or v is None},
                   **images, "eval/metrics_table": table}
        if logger_cfg.log_per_prompt and per_prompt_rows:
            from eval.metrics import PER_PROMPT_COLUMNS, row_to_csv

            payload["eval/per_prompt"] = wandb.Table(
                columns=list(PER_PROMPT_COLUMNS), data=[list(row_to_csv(r).values()) for r in per_prompt_rows])
        run.log(payload)
        for k, v in flat.items():
            run.summary[f"eval/{k}"] = v
        # copies in the run's files (uploaded by `wandb sync`); renamed so tools that glob for metrics.json in a
        # sweep folder (scripts/compare_runs.py) do not count the copy as a second run
        for src, dst in (("metrics.json", "specdraft_metrics.json"), ("report.md", "specdraft_report.md")):
            if (run_dir / src).exists() and run.dir:
                shutil.copyfile(run_dir / src, Path(run.dir) / dst)
        local = str(Path(run.dir).parent) if run.dir else None
    finally:
        run.finish()
    return local


def _replay_training_events(run, path: Path) -> None:
    for line in path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if ev.get("event") not in ("train_step", "train_eval"):
            continue
        stage = ev.get("stage", "train")
        nums = {f"train/{stage}/{k}": v for k, v in ev.items()
                if k not in ("time", "event", "stage") and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if nums:
            run.log(nums)


def _domain_objects(rc) -> dict:
    """domain name -> registry name or a user Domain (eval.extra_domains)."""
    extra = {e.name: user_domain(e.name, e.path, e.text_field, e.prompt_field, e.format, e.shape, e.field)
             for e in rc.eval.extra_domains}
    return {d: extra.get(d, d) for d in rc.eval.all_domains()}


def load_prompts(domains: list | dict, opts: DataOptions, max_prompts: int,
                 caps: dict[str, int | None] | None = None, tokenizer=None) -> dict[str, list[Prompt]]:
    """domain -> its first ``max_prompts`` evaluation prompts (test split, hash order). ``domains``: names, or
    name -> registry name / :class:`data.registry.Domain`. ``caps``: a per-domain cap replacing ``max_prompts``
    (``None``: every prompt), used for the user files of ``eval.extra_domains``, whose count is logged.
    ``tokenizer``: the target's; chat records are rendered in its chat template (:class:`data.text.Renderer`)."""
    from data.text import Renderer

    items = domains.items() if isinstance(domains, dict) else ((d, d) for d in domains)
    caps = caps or {}
    fmt = Renderer(tokenizer).format_of if tokenizer is not None else (lambda m: "plain" if m else "raw")
    out = {}
    for name, dom in items:
        if name in caps:
            every = eval_prompts(dom, opts, None, tokenizer)
            out[name] = [Prompt(name, ex.id, ex.prompt, fmt(ex.messages)) for ex in every[:caps[name]]]
            log.info("eval domain %r (%s): %d of its %d records are evaluation prompts%s", name,
                     getattr(dom, "description", name), len(out[name]), len(every),
                     "" if len(out[name]) == len(every) else f" (eval.extra_domains max_prompts={caps[name]})")
        else:
            out[name] = [Prompt(name, ex.id, ex.prompt, fmt(ex.messages))
                         for ex in eval_prompts(dom, opts, max_prompts, tokenizer)]
    return out


_FORMAT_WORDS = {
    "chat_template": "conversations in the target's chat template (`apply_chat_template`, generation prompt added)",
    "chat_template_user_turn": "the record's prompt (without its answer cue) as a user turn of the target's chat "
                               "template",
    "plain": "conversations in the plain `User: ...\\nAssistant:` format (the target tokenizer has no chat template)",
    "raw": "the record's text as it is (completion style; the reference target was trained on it)",
}


def prompt_format_section(formats: dict[str, list[str]]) -> str:
    """The report's "Prompt format" section: how each domain's prompts reached the target (``formats``: domain ->
    the :data:`data.text.FORMATS` its prompts used)."""
    rows = ["## Prompt format", "", "| domain | prompts sent as |", "|---|---|"]
    rows += [f"| {d} | {'; '.join(_FORMAT_WORDS.get(f, f) for f in fs)} |" for d, fs in formats.items()]
    return "\n".join(rows)


def domain_sources(domains: dict) -> dict[str, list[tuple[str, str]]]:
    """name -> [(source, license)] for the report's attribution table."""
    from data.loading import get_domain

    out = {}
    for name, dom in domains.items():
        d = get_domain(dom) if isinstance(dom, str) else dom
        out[name] = [(s.name, s.license or "user file") for s in d.sources]
    return out


def training_section(drafts_meta: dict) -> str:
    """The report's "Drafts" section: how each draft of this pipeline was trained and with what budget
    (``drafts_meta``: name -> :class:`models.checkpoints.SpecdraftMeta`; drafts not trained here are left out)."""
    rows = ["## Drafts", "", "| draft | training loss | steps trained (selected) | unique tokens (most reads) | "
            "training time s (one-off teacher passes s) | budget | parameters (draft / target) | validation CE on "
            "training domain (draft / target, nats/token) |", "|---|---|---|---|---|---|---|---|"]
    notes = []
    for name, m in drafts_meta.items():
        if not m.trained_here:
            continue  # not a draft trained by this pipeline (e.g. a reference target used as a draft)
        tr = m.train
        selected = tr["steps"] if m.selected_step is None else m.selected_step
        one_off = m.one_off_pass_seconds
        b = m.budget or {}
        if b.get("kind") == "wall_clock":
            budget = f"wall clock {b['seconds']:.0f} s"
            notes.append(f"`{name}` had the same wall-clock budget as the distilled draft: {b['seconds']:.1f} s = "
                         f"{b['distilled_train_s']:.1f} s of its training + {b['distilled_one_off_s']:.1f} s of its "
                         f"one-off teacher passes; it trained {tr['steps']} steps in {tr['train_time_s']:.1f} s "
                         f"(LR schedule over the budget).")
        elif b.get("max_time_s"):
            budget = f"{b['max_steps']} steps or {b['max_time_s']:.0f} s"
        else:
            budget = f"{b.get('max_steps', tr.get('max_steps', '?'))} steps"
        seen = f"{tr['unique_tokens']:,} ({tr['max_reads_per_token']}x)" if "unique_tokens" in tr else "-"
        rows.append(f"| {name} | {m.loss} (T={m.temperature}) | {tr['steps']} ({selected}) | {seen} | "
                    f"{tr.get('train_time_s', float('nan')):.1f} ({one_off:.1f}) | {budget} | "
                    f"{m.draft_parameters:,} / {m.target_parameters:,} | "
                    f"{m.validation_loss_nats_per_token:.3f} / {m.target_validation_loss_nats_per_token:.3f} |")
    rows += ["", "Training time: the training loop's wall clock without the periodic acceptance evaluations that "
             "select the checkpoint; one-off teacher passes (top-k cache, teacher data) are timed separately."]
    rows += [""] + notes if notes else []
    return "\n".join(rows)


def check_eval_inputs(rc, run_dir: Path, need_drafts: bool = True):
    """Everything about the evaluation's inputs that can be checked without loading a model: the drafts exist,
    every checkpoint directory is complete and readable, the user domain files exist, and every draft's tokenizer
    is the target's (vocabulary, merges, special tokens and their ids, added tokens).

    Returns:
        (draft paths, domain objects, target tokenizer); ``need_drafts=False`` (a training run whose drafts are
        made by earlier stages) returns ``{}`` for the drafts when there are none yet.

    Raises:
        ValueError: no drafts; ``CheckpointError`` (missing / partial / unreadable checkpoint, an EAGLE-3 head whose
            config.json is damaged or disagrees with its weights);
            ``TokenizerMismatchError``; ``DataSourceError`` (a user domain file is missing).
    """
    from models.checkpoints import check_checkpoint_dir, check_draft_tokenizer, load_tokenizer
    from models.checkpoints import read_model_config, read_specdraft_meta, sibling_hint
    from models.eagle3 import check_eagle3_dir, check_eagle3_fits, is_eagle3_dir
    from models.target import resolve_target

    try:
        paths = draft_paths(rc, run_dir)
    except ValueError:
        if need_drafts:
            raise
        paths = {}
    if not need_drafts:  # drafts of this run that earlier stages will write are checked when the eval stage runs
        later = later_drafts(paths, run_dir)
        check_planned_drafts(rc, run_dir, later)
        paths = {n: p for n, p in paths.items() if n not in later}
    domains = _domain_objects(rc)  # user files are checked before any model loads
    hybrids = hybrid_paths(rc, run_dir)  # the trained drafts behind named hybrids
    if not need_drafts:  # ngram:suffix+drafts/distilled: written by an earlier stage of this run
        hybrids = {n: p for n, p in hybrids.items() if n not in later_drafts(hybrids, run_dir)}
    for n, path in hybrids.items():
        if not Path(path).is_dir():
            raise ValueError(f"draft {n!r}: {path} is not a directory{sibling_hint(Path(path))}; the trained draft "
                             "behind a lookup (ngram:<kind>+<draft dir>) must be a local checkpoint folder")
        if is_eagle3_dir(path):
            raise hybrid_head_error(n, hybrid_specs(rc)[n][0], path)
    check_draft_names(rc, paths)
    for d in rc.eval.domain_sampling or {}:  # decode's settings merged with the domain's
        try:
            rc.eval.sampling_for(d, rc.decode.sampling_kwargs())
        except ValueError as e:  # a config mistake, worded as the typed config's are
            raise ValueError(f"invalid config: {e}") from None
    heads = {}
    for n, path in {**paths, **hybrids}.items():  # before a GGUF target's conversion: a typo costs no minute
        check_checkpoint_dir(path, role=f"draft {n!r}")
        read_specdraft_meta(path)  # a damaged specdraft.json: named now, not after the models load
        if is_eagle3_dir(path):  # its config.json against its weights' header, before a tokenizer hides the fault
            heads[n] = check_eagle3_dir(path, role=f"draft {n!r}")
    resolve_target(rc)  # a GGUF target (target=smollm2) is converted once into its cached folder
    check_checkpoint_dir(rc.target.name_or_path, role="target")
    doc = read_model_config(rc.target.name_or_path) if heads else None  # a head's vocabulary, width and layers
    if doc is not None:
        from types import SimpleNamespace

        if all(k in doc for k in ("vocab_size", "hidden_size", "num_hidden_layers")):  # else checked once loaded
            for n, cfg in heads.items():
                check_eagle3_fits(cfg, SimpleNamespace(**doc), f"draft {n!r} ({paths.get(n) or hybrids[n]})")
    tokenizer = load_tokenizer(rc.target.name_or_path, role="target")
    for n, path in {**paths, **hybrids}.items():
        check_draft_tokenizer(tokenizer, path, n, rc.target.name_or_path)
    return paths, domains, tokenizer


def check_prompt_lengths(prompts: dict[str, list[Prompt]], tokenizer, max_prompt_tokens: int, policy: str) -> int:
    """Number of prompts longer than ``max_prompt_tokens`` (they are truncated from the left, with a warning).

    Raises:
        PromptTooLongError: ``policy == "error"`` and some prompt is longer (names the domain, the prompt id and
            its length, and both fixes).
    """
    long = []
    for domain, ps in prompts.items():
        for p in ps:
            n = len(tokenizer(p.text, add_special_tokens=True)["input_ids"])
            if n > max_prompt_tokens:
                long.append((domain, p.id, n))
    if long and policy == "error":
        shown = "; ".join(f"{d} prompt {pid}: {n} tokens" for d, pid, n in long[:3])
        raise PromptTooLongError(
            f"{len(long)} prompt(s) are longer than eval.max_prompt_tokens={max_prompt_tokens} ({shown}"
            f"{'; ...' if len(long) > 3 else ''}) and eval.prompt_overflow=error. Raise eval.max_prompt_tokens "
            f"(prompt + eval.max_new_tokens must fit the models' context), or set eval.prompt_overflow=truncate_left "
            f"to keep the last {max_prompt_tokens} tokens of each.")
    if long:
        log.warning("%d prompt(s) longer than eval.max_prompt_tokens=%d will be truncated from the left (first: %s "
                    "prompt %s, %d tokens); eval.prompt_overflow=error makes this an error", len(long),
                    max_prompt_tokens, *long[0])
    return len(long)


def evaluate_run(rc, opts: DataOptions, run_dir: Path, events=None,
                 command_record: tuple[Path, str] | None = None) -> dict:
    """Evaluate every draft (``eval.drafts``, else ``<run_dir>/drafts/*``) on the configured domains; write the
    report files into ``run_dir`` as one set (:func:`core.io.atomic_file_set`: a killed evaluation leaves the
    previous complete report set, and rerunning the command produces the same numbers).
    ``events(name, **fields)``: the run's event log (optional). ``command_record``: ``(folder, name)``, a record of
    the command (Hydra's) copied into the report set as ``name``, so it is replaced together with the report.

    Raises:
        ValueError: no drafts, unknown domain, unreadable checkpoint (``CheckpointError``), tokenizer mismatch,
            missing data (``DataSourceError``), a prompt too long with ``eval.prompt_overflow=error``, each with a
            message saying what to fix; all of them before any model is loaded.
        ArtifactWriteError: the report could not be written (full disk, read-only folder); the previous report
            set is intact.
    """
    from decode.fast_settings import check_quantize_device

    run_dir = Path(run_dir)
    ev = events or (lambda *a, **k: None)
    paths, domains, tokenizer = check_eval_inputs(rc, run_dir)
    device, dtype = rc.eval.torch_device(), rc.eval.torch_dtype()
    hybrids = hybrid_paths(rc, run_dir)  # the trained drafts behind named hybrids
    for n, path in {**paths, **hybrids}.items():  # an unknown "quantize", or int8 on a GPU / in bf16: before loading
        check_quantize_device(path, device, dtype, role=f"draft {n!r}")
    prompts = load_prompts(domains, opts, rc.eval.max_prompts, {e.name: e.max_prompts for e in rc.eval.extra_domains},
                           tokenizer)
    check_prompt_lengths(prompts, tokenizer, rc.eval.max_prompt_tokens, rc.eval.prompt_overflow)
    from decode.fast_llama import compile_enabled, compile_seconds, row_layout_record, set_compile
    from decode.fast_settings import set_block_threads

    set_compile(rc.decode.compile)  # decode.compile: the lean forwards built from here on
    set_block_threads(rc.decode.block_threads)  # decode.block_threads: forwards over more than one token
    compile_s0 = compile_seconds()
    target, tokenizer, drafts, meta = _load_models(rc, paths, device, dtype)
    paths = {**paths, **_add_lookups(rc, drafts, meta, device)}
    paths = {**paths, **_add_hybrids(rc, target, tokenizer, drafts, meta, paths, device, dtype, hybrids)}
    routed = None  # domain -> draft name, with decode.draft_routing
    if rc.decode.draft_routing:
        routed = routed_drafts(rc.decode.draft_routing, list(prompts), rc.eval.drafts)[1]
    results, runtime = _measure(rc, target, tokenizer, drafts, prompts, routed, device, dtype, ev)
    context = {"experiment_name": rc.experiment_name, "target": rc.target.name_or_path, "seed": rc.seed,
               "target_model": target_description(target, tokenizer),
               "min_mean_accepted_length": rc.eval.min_mean_accepted_length,
               "prompt_formats": {d: sorted({p.format for p in ps}) for d, ps in prompts.items()},
               "decode_compile": {"setting": rc.decode.compile, "compiled": compile_enabled(device),
                                  "compile_time_s": compile_seconds() - compile_s0},
               "decode_block_threads": {"setting": rc.decode.block_threads, "threads": runtime["block_threads"]},
               "drafts": {n: str(paths[n]) for n in drafts}, "max_prompts": rc.eval.max_prompts, "runtime": runtime,
               "row_layout": row_layout_record()}  # the row layout the lean forward chose (several rows, one row)
    vocab = {n: {k: v for k, v in m[0].draft_vocab.items() if k != "draft_to_target"}
             for n, m in meta.items() if m[0] is not None and m[0].draft_vocab}
    if vocab:  # trimmed draft vocabularies (models/vocab.py): size and how the kept ids were counted
        context["draft_vocab"] = vocab
    if routed is not None:
        context["draft_routing"] = {"table": str(rc.decode.draft_routing), "routes": routed,
                                    "target_only": {d: results["target_only"][d] for d, n in routed.items()
                                                    if n is None and d in results["target_only"]}}
    sections, serving = _report_sections(rc, meta, tokenizer, context, {n: paths[n] for n in drafts}, run_dir)
    served = {n: paths[n] for n in drafts if not getattr(drafts[n], "is_hybrid", False)}  # engines have no hybrid
    sections.append(_engine_check(rc, served, prompts, tokenizer, results, run_dir, ev))
    sections.append(_heldout(rc, opts, target, tokenizer, drafts, ev))
    doc, routing_path = _write_report_set(rc, run_dir, results, context, sections, serving, domains, routed,
                                          {n: paths[n] for n in drafts}, _deployment(rc, target, drafts),
                                          command_record, ev)
    for domain, r in doc["recommendation"].items():
        ev("eval_recommendation", domain=domain, recommendation=r)
    out = {"metrics": str(run_dir / "metrics.json"), "report": str(run_dir / "report.md"),
           "per_prompt": str(run_dir / "per_prompt.csv"), "plots": doc["plots"], "lossless_all": doc["lossless_all"],
           "recommendation": {d: (r["draft"], r["num_draft_tokens"]) for d, r in doc["recommendation"].items()},
           "recommended_setting": {d: setting_label(r) if r["draft"] else "the target alone"
                                   for d, r in doc["recommendation"].items()},
           "summary": verdicts_section(doc),
           "routing": str(routing_path) if routing_path else None, "routed": routed,
           "serving": str(run_dir / "serving.json")}
    if rc.logger.name == "wandb":

        cfg = asdict(rc) if is_dataclass(rc) else {}
        out["wandb_dir"] = log_to_wandb(rc.logger, run_dir, doc, config=cfg, name=rc.experiment_name,
                                        per_prompt_rows=results["rows"], events_path=run_dir / "events.jsonl")
        ev("eval_wandb", dir=out["wandb_dir"], mode=rc.logger.mode)
    ev("eval_done", lossless_all=doc["lossless_all"], noisy=doc.get("noisy"))
    return out


def _load_models(rc, paths: dict[str, Path], device, dtype) -> tuple:
    """The target and every draft in ``eval.dtype`` on ``eval.device``, each checked against the tokenizer, the
    context the evaluation needs and the decoder's cache policy. Returns ``(target, tokenizer, drafts, meta)``, ``meta``
    name -> ``(specdraft.json as :class:`models.checkpoints.SpecdraftMeta`, decoder forward "lean" /
    "hugging_face")``."""
    from decode import cache_policy
    from models.checkpoints import check_context_fits, check_vocab_covers_tokenizer, load_causal_lm

    target, tokenizer = load_causal_lm(rc.target.name_or_path, role="target", dtype=dtype, device=device)
    check_vocab_covers_tokenizer(target, tokenizer, role="target")
    need, what, slots = _context_needs(rc)
    check_context_fits(target, need, "target", what)
    cache_policy(target, 1, slots, role="target")
    drafts, meta = {}, {}
    for n in paths:
        drafts[n], meta[n] = _load_draft(rc, n, paths[n], target, tokenizer, device, dtype)
    return target, tokenizer, drafts, meta


def _context_needs(rc) -> tuple[int, str, int]:
    """``(positions a decode reads, how to say so, cache slots it needs)``: prompt plus new tokens, and a block's
    overhang beyond them."""
    need = rc.eval.max_prompt_tokens + rc.eval.max_new_tokens
    what = f"eval.max_prompt_tokens + eval.max_new_tokens ({rc.eval.max_prompt_tokens} + {rc.eval.max_new_tokens})"
    return need, what, need + max(rc.eval.sweep(rc.decode.num_draft_tokens)) + 2


def _load_draft(rc, name: str, path, target, tokenizer, device, dtype) -> tuple:
    """One draft checkpoint for the evaluation (:func:`_load_models`): ``(model, (specdraft.json, decoder forward))``,
    checked against the target, the tokenizer, the context the evaluation needs and the decoder's cache policy."""
    from decode import cache_policy
    from decode.fast_llama import fast_path_supported
    from decode.fast_settings import load_draft
    from models.checkpoints import check_context_fits, check_vocab_covers_tokenizer
    from models.eagle3 import check_eagle3_fits

    need, what, slots = _context_needs(rc)
    model, _, saved = load_draft(path, role=f"draft {name!r}", dtype=dtype, device=device,  # int8: quantized
                                 target=target)
    if getattr(model, "is_eagle3", False):  # an EAGLE-3 head: the target's vocabulary and layers (decode/eagle3.py)
        check_eagle3_fits(model, target, f"draft {name!r}")
        return model, (saved, "eagle3")
    check_vocab_covers_tokenizer(model, tokenizer, role=f"draft {name!r}")
    check_context_fits(model, need, f"draft {name!r}", what)
    cache_policy(model, 1, slots, role=f"draft {name!r}")
    return model, (saved, "lean" if fast_path_supported(model) else "hugging_face")


def _add_hybrids(rc, target, tokenizer, drafts: dict, meta: dict, paths: dict, device, dtype,
                 named: dict[str, Path]) -> dict[str, str]:
    """Add the hybrids (decode/hybrid.py; the lookup's settings ``decode.lookup``) to ``drafts`` / ``meta``: a lookup
    of each ``eval.hybrid_lookups`` kind in front of every trained token draft loaded (named ``<kind>+<draft>``),
    and the ones :func:`hybrid_specs` names (their trained draft loaded here, or shared when it is loaded already).
    Returns their name -> ``ngram:<kind>+<draft dir>``.

    Raises:
        ValueError: a named hybrid whose trained draft is an EAGLE-3 head (a hybrid needs a token draft)."""
    from decode.hybrid import HybridDraft, hybrid_name, hybrid_spec

    def token_draft(m) -> bool:
        return not any(getattr(m, a, False) for a in ("is_ngram", "is_eagle3", "is_hybrid"))

    specs: dict[str, str] = {}
    trained = [n for n, m in drafts.items() if token_draft(m)]
    if rc.eval.hybrid_lookups and not trained:
        log.warning("eval.hybrid_lookups=%s makes no hybrid: no trained token draft is evaluated (name one in "
                    "eval.drafts)", list(rc.eval.hybrid_lookups))
    for kind in rc.eval.hybrid_lookups:
        for n in trained:
            name = hybrid_name(kind, n)
            drafts[name] = HybridDraft(rc.decode.lookup.make(kind).to(device), drafts[n])
            meta[name] = (meta[n][0], "hybrid")
            specs[name] = hybrid_spec(kind, Path(paths[n]).resolve())
    by_path = {str(Path(paths[n]).resolve()): n for n in trained}
    for name, (kind, _) in hybrid_specs(rc).items():
        path = named[name]  # the run's drafts/<name> when it has one (hybrid_paths)
        key = str(Path(path).resolve())
        if key in by_path:
            model, saved = drafts[by_path[key]], meta[by_path[key]][0]
        else:
            model, (saved, _) = _load_draft(rc, name, path, target, tokenizer, device, dtype)
        if not token_draft(model):
            raise hybrid_head_error(name, kind, path)
        drafts[name], meta[name] = HybridDraft(rc.decode.lookup.make(kind).to(device), model), (saved, "hybrid")
        specs[name] = hybrid_spec(kind, key)
    return specs


def _add_lookups(rc, drafts: dict, meta: dict, device) -> dict[str, str]:
    """Add the lookup drafts (:func:`lookup_specs`, settings ``decode.lookup``) to ``drafts`` / ``meta``; returns
    their name -> ``ngram:<kind>``."""
    from decode.ngram import parse_lookup_spec
    from models.checkpoints import SpecdraftMeta

    specs = lookup_specs(rc)
    for n, spec in specs.items():
        drafts[n] = rc.decode.lookup.make(parse_lookup_spec(spec)).to(device)
        meta[n] = (SpecdraftMeta(kind="lookup", init_settings=drafts[n].settings()), "lookup")
    return specs


def _measure(rc, target, tokenizer, drafts: dict, prompts: dict, routed: dict | None, device, dtype, ev) -> tuple:
    """Decode every prompt target-only and with every draft at every gamma, draft-length policy and token tree
    (with routing: each domain with its routed draft only, or the target alone). Returns ``(results, runtime)``."""
    from core.runtime import runtime_record
    from decode.fast_settings import resolved_block_threads

    gammas = rc.eval.sweep(rc.decode.num_draft_tokens)
    policy_names = rc.eval.policies(rc.decode.draft_length_policy)  # measured beside the fixed sweep
    policies = {p: (lambda p=p: rc.decode.make_policy(p)) for p in policy_names}  # a fresh policy per decode
    trees = {f"tree:{t.spec()}": t for t in rc.eval.trees()}  # eval.draft_tree, measured like the policies
    policies.update({name: (lambda t=t: t) for name, t in trees.items()})
    policy_settings = {**{p: rc.decode.policy_settings(p) for p in policy_names},
                       **{name: {"draft_tree": t.spec(), "depth": t.depth, "max_nodes": t.max_nodes}
                          for name, t in trees.items()}}
    ev("eval_start", domains=list(prompts), drafts=list(drafts), num_draft_tokens=gammas,
       draft_length_policies=policy_settings, prompts={d: len(p) for d, p in prompts.items()}, routed=routed)
    # Without routing every draft decodes every domain; with routing each domain only its routed draft.
    groups = [(drafts, prompts)] if routed is None else [
        ({n: drafts[n]}, {d: p for d, p in prompts.items() if routed[d] == n}) for n in drafts] + [
        ({}, {d: p for d, p in prompts.items() if routed[d] is None})]  # routed to no draft: the target alone
    with torch_threads(rc.eval.num_threads):
        runtime = runtime_record(device, dtype)  # threads: as set while timing
        runtime["block_threads"] = resolved_block_threads(device)  # null: the same as threads (off, or not a CPU)
        ev("eval_runtime", **runtime)
        parts = [evaluate_drafts(
            target, tokenizer, group_drafts, group_prompts, num_draft_tokens=gammas,
            max_new_tokens=rc.eval.max_new_tokens, max_prompt_tokens=rc.eval.max_prompt_tokens,
            check_lossless=rc.eval.check_lossless, cost_ratio_trials=rc.eval.cost_ratio_trials,
            decode_kwargs=rc.decode.sampling_kwargs(), seed=rc.seed, events=ev, draft_length_policies=policies,
            warn_truncation=False, timing_trials=rc.eval.timing_trials,
            domain_sampling={d: rc.eval.sampling_for(d, rc.decode.sampling_kwargs())
                             for d in rc.eval.domain_sampling or {}})
            for group_drafts, group_prompts in groups if group_prompts]
    results = {**parts[0], "rows": [r for p in parts for r in p["rows"]],
               "cost_ratio": {n: c for p in parts for n, c in p["cost_ratio"].items()},
               # each group measured v for the draft lengths its own decodes used
               "verify_cost_ratio": {k: v for p in parts for k, v in (p.get("verify_cost_ratio") or {}).items()},
               "truncated_prompts": sum(p["truncated_prompts"] for p in parts),
               "machine_load": {d: x for p in parts for d, x in p["machine_load"].items()},
               "target_only": {d: x for p in parts for d, x in p["target_only"].items()},
               "target_outputs": {d: x for p in parts for d, x in p["target_outputs"].items()},
               "draft_length_policy_settings": policy_settings}
    return results, runtime


def _report_sections(rc, meta: dict, tokenizer, context: dict, draft_paths: dict, run_dir: Path) -> tuple:
    """The report's extra sections (training, draft sources, prompt format, serving settings); the serving
    section is returned too (its document is written as ``serving.json``)."""
    from data.text import Renderer
    from eval.sections import ServingSection

    saved = {n: m for n, (m, how) in meta.items() if how != "hybrid"}  # a hybrid's model is listed under its own name
    sections = [training_section(saved)] if any(m.train is not None for m in saved.values()) else []
    if any(m.init or m.quantize_mode != "none" for m in saved.values()):
        from eval.sections import draft_sources_section

        sections.append(draft_sources_section(meta))
    if any(m.kind in ("lora", "finetune") for m in saved.values()):
        from eval.sections import AdaptationSection

        sections.append(AdaptationSection(saved, draft_paths))
    prompt_format = Renderer(tokenizer).format
    context["prompt_format"] = prompt_format
    sections.append(prompt_format_section(context.get("prompt_formats") or {}))
    formats = {"target_format": rc.eval.engine.target_format, "draft_format": rc.eval.engine.draft_format}
    lookups = {n: m.init_settings for n, (m, how) in meta.items() if how == "lookup"}
    serving = ServingSection(draft_paths, str(rc.target.name_or_path), run_dir / "gguf", formats, lookups)
    sections.append(serving)
    return sections, serving


def _engine_check(rc, draft_paths: dict, prompts: dict, tokenizer, results: dict, run_dir: Path, ev):
    """The "Engine check" report section (:mod:`eval.engine`): llama.cpp serving the target alone and with each
    draft on the same prompts, when ``eval.engine`` asks for it and the engine is installed (else one line saying
    why not). An engine failure is reported in the section, never loses the evaluation."""
    from data.text import encode_prompt
    from decode.ngram import parse_lookup_spec
    from eval.engine import EngineSection, engine_wanted, run_engine_check

    ec = rc.eval.engine
    kw = dict(samples=rc.eval.bootstrap_samples, confidence=rc.eval.confidence, seed=rc.seed)
    wanted, reason = engine_wanted(ec)
    if not wanted or not draft_paths:
        reason = reason if not wanted else "no drafts to serve"
        log.info("engine check skipped: %s", reason)
        return EngineSection(None, reason, None, **kw)
    cap = ec.max_prompts or rc.eval.max_prompts
    ids = {d: [(p.id, encode_prompt(tokenizer, p.text, rc.eval.max_prompt_tokens)[0][0].tolist()) for p in ps[:cap]]
           for d, ps in prompts.items() if ps}
    try:
        raw = run_engine_check(ec, target_path=rc.target.name_or_path, draft_paths=draft_paths, prompt_ids=ids,
                               max_new_tokens=rc.eval.max_new_tokens,
                               num_draft_tokens=ec.num_draft_tokens or _primary_gamma(rc),
                               threads=ec.threads or rc.eval.num_threads, out_dir=run_dir / "gguf", events=ev,
                               lookup_settings={n: rc.decode.lookup.make(parse_lookup_spec(p)).settings()
                                                for n, p in draft_paths.items() if parse_lookup_spec(p)})
    except Exception as e:  # noqa: BLE001 - the engine is an add-on: its failure must not lose the evaluation
        (log.error if ec.enabled == "true" else log.warning)("engine check failed: %s", e)
        return EngineSection(None, f"the engine check failed: {e}", None, **kw)
    return EngineSection(raw, "", results.get("target_outputs"), **kw)


def _heldout(rc, opts: DataOptions, target, tokenizer, drafts: dict, ev):
    """The "Held-out acceptance" report section (:mod:`eval.heldout`) over ``eval.domains`` (the built-in ones:
    a user's file has no training split to hold out from), beside the training prompts of the drafts' domains."""
    from eval.heldout import HeldoutSection, measure_heldout

    hc = rc.eval.heldout
    if not hc.enabled or not drafts or not rc.eval.domains:
        return HeldoutSection(None, "eval.heldout.enabled=false" if not hc.enabled else "no drafts or domains")
    train_domains = list(rc.data.mixture) if rc.data.mixture else [rc.data.domain]
    with torch_threads(rc.eval.num_threads):
        record = measure_heldout(target, tokenizer, drafts, list(rc.eval.domains), train_domains, opts, hc,
                                 max_prompt_tokens=rc.eval.max_prompt_tokens, samples=rc.eval.bootstrap_samples,
                                 confidence=rc.eval.confidence, seed=rc.seed)
    ev("eval_heldout", prompts=record["prompts"], near_duplicates_removed=record["near_duplicates_removed"],
       alpha_1={n: {d: s["alpha"][0] for d, s in per.items()} for n, per in record["drafts"].items()})
    return HeldoutSection(record)


def _primary_gamma(rc) -> int:
    """The gamma the report's per-draft entries are at: the swept value closest to ``decode.num_draft_tokens``
    (the smaller on a tie), as :mod:`eval.metrics` picks it."""
    want = rc.decode.num_draft_tokens
    return min(rc.eval.sweep(want), key=lambda g: (abs(g - want), g))


def _deployment(rc, target, drafts: dict) -> dict | None:
    """``eval.deployment``'s cost ratio per draft (None without deployment settings)."""
    if not rc.eval.deployment.enabled():
        return None
    from decode.timing import weights_read_per_token
    from eval.decision import deployment_cost_ratios

    count = weights_read_per_token  # a memory-bound forward reads these (an untied input embedding: a few rows)
    def weights(m):  # a lookup reads none; a hybrid its model's (an upper bound: its lookup steps read none)
        return 0 if getattr(m, "is_ngram", False) else count(m.model if getattr(m, "is_hybrid", False) else m)

    return deployment_cost_ratios(asdict(rc.eval.deployment), {n: weights(m) for n, m in drafts.items()},
                                  count(target))


def _write_report_set(rc, run_dir: Path, results: dict, context: dict, sections: list, serving, domains,
                      routed, draft_paths: dict, deployment, command_record, ev) -> tuple:
    """``report.md``, ``metrics.json``, ``per_prompt.csv``, plots, ``serving.json`` and (without routing)
    ``routing.json`` written as one set. Returns ``(metrics document, routing path or None)``."""
    sources = domain_sources(domains)
    routing_path = None
    with atomic_file_set(run_dir, "report") as staging:
        if command_record is not None:
            shutil.copytree(command_record[0], staging / command_record[1])
        doc = write_report(staging, results, context, sections, primary_num_draft_tokens=rc.decode.num_draft_tokens,
                           bootstrap_samples=rc.eval.bootstrap_samples, confidence=rc.eval.confidence, seed=rc.seed,
                           check_lossless=rc.eval.check_lossless,
                           alert_mean_accepted_length=rc.eval.alert_mean_accepted_length, plots=rc.eval.plots,
                           sources=sources, noisy_relative_width=rc.eval.noisy_relative_width,
                           deployment=deployment)
        if serving.document is not None:
            write_text_atomic(staging / "serving.json", json.dumps(serving.document, indent=2) + "\n")
        if routed is None:  # a routed evaluation measures one draft per domain: nothing to choose, no new table
            routing_path = run_dir / "routing.json"
            table = write_routing(staging / "routing.json", doc, draft_paths)
            rendered = [f(doc) if callable(f) else f for f in sections]  # as write_report renders them
            write_text_atomic(staging / "report.md", render_markdown(
                doc, rendered + [routing_section(table, str(routing_path))], doc["plots"], sources))
            ev("eval_routing", path=str(routing_path), routes={d: r["draft"] for d, r in table["routes"].items()})
    return doc, routing_path
