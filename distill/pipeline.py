"""The ``distill`` and ``baseline`` stages: train a draft on one domain and save it as a Hugging Face directory.

``distilled``: the draft matches the target's soft labels with ``distill.loss`` at ``distill.temperature``, on the
training data of ``distill.data_source`` (dataset text, target generations, or on-policy draft generations) with
the teacher signal of ``distill.teacher_signal`` (online forward or cached top-k logits).
``baseline``: the same architecture, dataset blocks and step / wall-clock budget with plain next-token
cross-entropy, so the report shows what distillation buys.

Both drafts are scored every ``distill.eval_every`` steps by the mean accepted length of greedy speculative
decoding on ``distill.eval_prompts`` validation prompts; the best-scoring weights are the saved draft and its
``specdraft.json`` records the selected step and score.

:func:`train_and_save` is the recipe every draft-training stage shares (load the pair, learning signal, budget,
training with selection, metadata, save); a :class:`Recipe` says how a stage differs. The LoRA and full
fine-tuning stages are recipes too (:class:`distill.lora.Adaptation`: a base draft with adapters as the draft,
the ``lora`` section's signal and steps, an adapter + merged-draft save hook).
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from data.blocks import training_blocks, training_fingerprint, training_prompts
from data.loading import DataOptions
from data.text import encode_prompt
from distill.drafts import build_llama, count_parameters
from distill.losses import get_loss
from distill.teacher import trim_draft_vocab
from distill.trainer import (
    batch_indices,
    cross_entropy_step,
    evaluate_loss,
    make_distill_step,
    rows_this_run_uses,
    train,
)
from models.checkpoints import check_context_fits, load_causal_lm, read_specdraft_meta

log = logging.getLogger(__name__)


def matched_wall_clock_budget(run_dir: Path) -> dict:
    """The baseline's budget under ``distill.baseline_budget=wall_clock``: the distilled draft's training-loop time
    plus its one-off teacher passes (teacher cache, teacher data), as recorded in its ``specdraft.json``.

    Returns ``{"kind": "wall_clock", "seconds", "distilled_train_s", "distilled_one_off_s"}``.

    Raises:
        ValueError: this run has no distilled draft yet (the distill stage must run before the baseline).
    """
    meta_path = run_dir / "drafts" / "distilled" / "specdraft.json"
    if not meta_path.exists():
        raise ValueError(f"distill.baseline_budget=wall_clock matches the baseline's time to the distilled draft's, "
                         f"but {meta_path} does not exist: run the distill stage before the baseline "
                         f"(stages: [distill, baseline, ...]) or set distill.baseline_budget=steps")
    meta = read_specdraft_meta(run_dir / "drafts" / "distilled")
    train_s = float(meta.train["train_time_s"])
    one_off = meta.one_off_pass_seconds
    return {"kind": "wall_clock", "seconds": train_s + one_off, "distilled_train_s": train_s,
            "distilled_one_off_s": one_off}


def check_draft_config(rc) -> None:
    """Cross-section checks that no single section can make (before any model loads)."""
    if rc.draft.draft_vocab_size and rc.distill.data_source == "on_policy":
        raise ValueError("draft.draft_vocab_size (a trimmed draft head) does not support distill.data_source="
                         "on_policy yet: the target scores the draft's own rows over its full vocabulary. Use "
                         "data_source=teacher or dataset, or set draft.draft_vocab_size=null")
    if rc.distill.data_source == "on_policy" and rc.trainer.strategy == "deepspeed_zero3":
        raise ValueError("distill.data_source=on_policy cannot run under trainer=deepspeed_zero3: each process "
                         "generates from its own micro-batches, but ZeRO-3 forwards are collective. Use "
                         "trainer=deepspeed_zero2 or ddp for on-policy distillation.")
    if rc.distill.data_source == "on_policy" and rc.distill.on_policy_gen.max_new_tokens >= rc.data.block_size:
        key = "on_policy_generation" if rc.distill.on_policy_generation is not None else "generation"
        raise ValueError(f"distill.{key}.max_new_tokens ({rc.distill.on_policy_gen.max_new_tokens}) must be < "
                         f"data.block_size ({rc.data.block_size}) with distill.data_source=on_policy: each block's "
                         f"first block_size - max_new_tokens tokens are the prompt the draft continues")


@dataclass
class Pair:
    """What every draft-training recipe starts from: the target and its tokenizer, the draft to train and how it
    was initialised, the shared vocabulary (``cut``: where logits are cut when the two sizes differ, else None),
    the training blocks ``(N, block_size)`` and the run's domain weights (``{data.domain: 1}`` or
    ``data.mixture``)."""

    target: torch.nn.Module
    tokenizer: Any
    draft: torch.nn.Module
    init_info: dict
    shared: int
    cut: int | None
    blocks: torch.Tensor
    weights: dict[str, float]
    dist: Any
    draft_parameters: int  # counted at load time (before ZeRO-3 may partition a copy)
    target_parameters: int


@dataclass
class Signal:
    """How a draft learns: the per-micro-batch ``step`` loss (:data:`distill.trainer.StepLoss`) and the
    ``teacher`` passed to it, the ``blocks (N, T)`` to train on, an optional on-policy ``hook``, the one-off
    teacher ``passes`` (teacher data / teacher cache records) and the ``meta`` fields it adds to
    ``specdraft.json``."""

    step: Any
    teacher: Any
    blocks: torch.Tensor
    hook: Any = None
    passes: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    answer_counts: torch.Tensor | None = None  # (V,) ids in the target's generated answers (teacher data only)


def load_pair(rc, opts: DataOptions, run_dir: Path, recipe: "Recipe", events=None) -> Pair:
    """Load the target, build the draft with ``recipe.build_draft``, check that both can be decoded
    speculatively, and pack the training blocks of ``recipe.domains`` (when ``recipe.needs_blocks``; else
    ``blocks`` is None).

    Raises:
        ValueError: a model whose context is shorter than ``data.block_size`` or whose cache cannot be rolled back;
            a domain without text.
    """
    from distill.launch import distributed_state
    from distill.teacher import shared_vocab

    dist = distributed_state()
    target, tokenizer = load_causal_lm(rc.target.name_or_path, role="target")
    _check_decodable(rc, target, "target")  # before the draft is built (a layer search takes minutes)
    draft, init_info = recipe.build_draft(rc, opts, run_dir, target, tokenizer, events)
    _check_decodable(rc, draft, "draft")
    shared, cut = shared_vocab(target, draft, tokenizer)
    weights, blocks = recipe.domains(rc), None  # {data.domain: 1} or data.mixture for the distill stages
    if recipe.needs_blocks(rc):
        with dist.main_process_first():  # the main process fills the on-disk caches, the others read them
            blocks = training_blocks(weights, "train", tokenizer, rc.data.block_size, opts, rc.data.max_train_blocks,
                                     rc.seed)
    return Pair(target, tokenizer, draft, init_info, shared, cut, blocks, weights, dist, count_parameters(draft),
                count_parameters(target))


def _check_decodable(rc, model, role: str) -> None:
    """``model`` holds a ``data.block_size`` context and speculative decoding can roll its cache back (an EAGLE-3
    head keeps its own cache: decode/eagle3.py)."""
    from decode import cache_policy

    if getattr(model, "is_eagle3", False):
        return

    check_context_fits(model, rc.data.block_size, role, f"data.block_size ({rc.data.block_size})")
    cache_policy(model, role=role)


def _initial_draft(rc, opts, run_dir, target, tokenizer, events):
    """``draft.init``: a config-built draft, or the saved layer-pruned / pretrained draft (:mod:`distill.draft_init`)."""
    from distill.draft_init import initial_draft

    draft, info = initial_draft(rc, opts, run_dir, target, tokenizer, events)
    if not rc.draft.train_embeddings:
        freeze_embeddings(draft)
    return draft, info


def freeze_embeddings(model) -> None:
    """Keep ``model``'s input embeddings and its output head (when tied to them, as in SmolLM2) out of training."""
    model.get_input_embeddings().weight.requires_grad_(False)
    out = model.get_output_embeddings()
    if out is not None and out.weight is model.get_input_embeddings().weight:
        out.weight.requires_grad_(False)


def _fresh_small_draft(rc, opts, run_dir, target, tokenizer, events):
    """The small ``draft.arch`` draft next to a self-draft / pretrained draft (stage ``distill_small``)."""
    return build_llama(rc.draft.arch, tokenizer, seed=rc.seed), {"init": "config"}


def teacher_signal_data(rc, opts: DataOptions, *, target, tokenizer, weights: dict[str, float], blocks: torch.Tensor,
                        shared: int, cut: int | None, data_source: str, teacher_signal: str, max_prompts: int,
                        tcfg, run_dir: Path, dist, score_draft_rows: bool = False) -> tuple[Any, Any, torch.Tensor, dict]:
    """The training data and teacher of a distillation-trained draft, shared by the ``distill`` stage and the LoRA /
    fine-tuning stages (:mod:`distill.lora`): with ``data_source="teacher"`` the target's continuations of
    ``max_prompts`` training prompts of ``weights`` (one domain or a mixture; ``distill.generation``'s other
    sampling settings), packed into ``(N, data.block_size)`` blocks; else ``blocks`` (dataset text). With
    ``teacher_signal="cached"`` the target's top-``distill.cache_top_k`` logits over the blocks the run reads
    (:func:`distill.trainer.blocks_this_run_uses` with ``tcfg``), and a step loss that reads them; else the online teacher.
    Both one-off passes are stored under ``distill.cache_dir`` (null: ``<run_dir>/teacher_cache``) keyed by their
    content, so another run (or stage) with the same target, prompts and settings reuses them.
    ``score_draft_rows`` (on-policy distillation): micro-batches will also hold the draft's own rows, which no
    cache covers; with the cached signal the step loss scores those rows with the target online (the target then
    stays where training runs, on every process).

    Returns:
        (step, teacher, blocks (N, T), passes, answer_counts) where ``passes`` holds the ``teacher_data`` /
        ``teacher_cache`` records (path, reused / computed shard counts, ``time_s``) of the passes that ran and
        ``answer_counts`` is ``(V,)`` float64: how often each id occurs in the target's generated answers (the
        sequences minus their prompts; ``None`` without teacher data), what a trimmed draft vocabulary is counted on.
    """
    from distill.generation import answer_loss_mask, generate_teacher_sequences, pack_sequences
    from distill.teacher import build_teacher_cache, make_cached_distill_step

    dc = rc.distill
    cache_root = Path(dc.cache_dir).expanduser() if dc.cache_dir else run_dir / "teacher_cache"
    precision = rc.trainer.mixed_precision  # the teacher's precision in every pass (docs/devices.md, "Devices and precision")
    hybrid = score_draft_rows and teacher_signal == "cached"  # cache for the data rows, target for the draft's
    if hybrid and torch.cuda.is_available():
        target.to(dist.device)  # every process scores its own on-policy rows
    elif (data_source == "teacher" or teacher_signal == "cached") and torch.cuda.is_available() \
            and dist.is_main_process:
        target.to(dist.device)  # the passes run where training will, on the main process only
    passes: dict = {}
    answer_counts = answer_mask = None
    if not dist.is_main_process:  # the one-off teacher passes below write shared caches: main process first
        dist.wait_for_everyone()
    if data_source == "teacher":
        texts = training_prompts(weights, "train", opts, max_prompts, tokenizer, rc.seed)
        prompts = [encode_prompt(tokenizer, t, dc.generation.max_prompt_tokens)[0][0].tolist() for t in texts]
        gen = replace(dc.generation, max_prompts=max_prompts)
        seqs, passes["teacher_data"] = generate_teacher_sequences(  # distill.generation.engine: ours or llama.cpp
            target, prompts, gen, cache_root, seed=rc.seed, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, vocab_size=shared, precision=precision,
            target_path=rc.target.name_or_path, follow_free_cores=rc.trainer.follow_free_cores)
        blocks = pack_sequences(seqs, rc.data.block_size)[: rc.data.max_train_blocks]  # (N, block_size)
        # the sequences come back in the order they were generated: the prompts sorted by length (stable)
        answer_mask = answer_loss_mask(seqs, [len(p) for p in sorted(prompts, key=len)],
                                       rc.data.block_size)[: rc.data.max_train_blocks]  # (N, block_size)
        answer_counts = (torch.bincount(torch.tensor([t for q in seqs for t in q]), minlength=shared)
                         - torch.bincount(torch.tensor([t for q in prompts for t in q]), minlength=shared)).double()
    if teacher_signal == "cached":
        rows = rows_this_run_uses(blocks.size(0), tcfg, rc.seed, dist.num_processes)
        # a run reading part of the blocks scores a prefix of their epoch-0 order: shorter runs share its shards
        order = None if rows is None else batch_indices(blocks.size(0), 0, blocks.size(0), rc.seed)
        teacher, passes["teacher_cache"] = build_teacher_cache(
            target, blocks if order is None else blocks[order], cache_root, k=dc.cache_top_k, vocab_size=shared,
            shard_blocks=dc.cache_shard_blocks, precision=precision, use=None if rows is None else rows.numel(),
            follow_free_cores=rc.trainer.follow_free_cores)
        if rows is not None:  # rows == order[:len(rows)]
            blocks, answer_mask = blocks[rows], (answer_mask[rows] if answer_mask is not None else None)
        step = make_cached_distill_step(dc.loss, dc.temperature, target.eval().requires_grad_(False) if hybrid else None,
                                        **dc.loss_kwargs())
    else:
        step, teacher = make_distill_step(get_loss(dc.loss), dc.temperature, cut, **dc.loss_kwargs()), target
        if tcfg.unique_blocks:  # the online teacher reads the same first blocks of the epoch-0 order
            rows = rows_this_run_uses(blocks.size(0), tcfg, rc.seed, dist.num_processes)
            if rows is not None:
                blocks, answer_mask = blocks[rows], (answer_mask[rows] if answer_mask is not None else None)
    if dist.is_main_process:
        dist.wait_for_everyone()
    return step, teacher, blocks, passes, answer_counts, answer_mask


def distillation_signal(rc, opts: DataOptions, pair: Pair, run_dir: Path) -> Signal:
    """The target's soft labels with ``distill.loss`` at ``distill.temperature``, online (the target's forward in
    every step) or as cached top-k logits, on dataset text, on target-generated continuations
    (``distill.data_source=teacher``) or with the draft's own samples mixed in (``on_policy``). The one-off
    teacher passes (:func:`teacher_signal_data`) run on the main process first; the other processes read its
    caches."""
    from distill.generation import OnPolicyHook

    dc = rc.distill
    step, teacher, blocks, passes, answer_counts, answer_mask = teacher_signal_data(
        rc, opts, target=pair.target, tokenizer=pair.tokenizer, weights=pair.weights, blocks=pair.blocks,
        shared=pair.shared, cut=pair.cut, data_source="teacher" if dc.uses_teacher_data else "dataset",
        teacher_signal=dc.teacher_signal, max_prompts=dc.generation.max_prompts, tcfg=rc.trainer, run_dir=run_dir,
        dist=pair.dist, score_draft_rows=dc.data_source == "on_policy")
    if rc.trainer.teacher_placement == "zero3":
        pair.target.to("cpu")  # its own ZeRO-3 engine partitions it from host memory, not from a full GPU copy
    hook = OnPolicyHook(dc.on_policy_fraction, dc.on_policy_gen, rc.seed, vocab_size=pair.shared,
                        schedule=dc.on_policy_schedule) if dc.data_source == "on_policy" else None
    if not dc.train_on_prompts:  # config check: data_source=teacher, so the blocks are prompts + target answers
        from distill.generation import AnswerMaskHook

        hook = AnswerMaskHook(answer_mask)
    meta = {"loss": dc.loss, "temperature": dc.temperature, "data_source": dc.data_source,
            "teacher_signal": dc.teacher_signal, "distilled": True, "train_on_prompts": dc.train_on_prompts,
            "on_policy_fraction": dc.on_policy_fraction if hook is not None else None,
            "off_policy_data": dc.off_policy_data if hook is not None else None}
    return Signal(step, teacher, blocks, hook, passes, meta, answer_counts)


def cross_entropy_signal(rc, opts: DataOptions, pair: Pair, run_dir: Path) -> Signal:
    """Plain next-token cross-entropy on the dataset blocks (the baseline: what distillation is measured against)."""
    return Signal(cross_entropy_step, None, pair.blocks,
                  meta={"loss": "cross_entropy", "temperature": None, "data_source": "dataset",
                        "teacher_signal": None, "distilled": False, "on_policy_fraction": None})


def step_budget(rc, run_dir: Path) -> tuple[Any, dict]:
    """``trainer.max_steps`` (and ``trainer.max_time_s`` when set): the trainer settings as configured."""
    return rc.trainer, {"kind": "steps", "max_steps": rc.trainer.max_steps, "max_time_s": rc.trainer.max_time_s or None}


def baseline_budget(rc, run_dir: Path) -> tuple[Any, dict]:
    """The baseline's budget: ``trainer.max_steps``, or with ``distill.baseline_budget=wall_clock`` the distilled
    draft's wall clock (:func:`matched_wall_clock_budget`), the cosine following the spent time."""
    if rc.distill.baseline_budget != "wall_clock":
        return step_budget(rc, run_dir)
    budget = matched_wall_clock_budget(run_dir)
    tcfg = replace(rc.trainer, max_time_s=budget["seconds"], schedule_over="time",
                   max_steps=rc.distill.baseline_max_steps or 20 * rc.trainer.max_steps)
    log.info("baseline draft: wall-clock budget %.1f s (the distilled draft's %.1f s of training + %.1f s of "
             "one-off teacher passes), at most %d steps", budget["seconds"], budget["distilled_train_s"],
             budget["distilled_one_off_s"], tcfg.max_steps)
    return tcfg, budget


def selection_eval(rc, opts: DataOptions, pair: Pair, teacher, section=None) -> Any:
    """The checkpoint-selection score (mean accepted length of greedy speculative decoding on
    ``eval_prompts`` validation prompts of ``pair.weights``), or None with ``eval_every=0``; the settings are
    ``section``'s (``rc.distill`` by default, ``rc.lora`` for an adaptation)."""
    from distill.generation import selection_eval_from_texts

    dc = section if section is not None else rc.distill
    if not dc.eval_every:
        return None
    texts = training_prompts(pair.weights, "validation", opts, dc.eval_prompts, pair.tokenizer, rc.seed)
    return selection_eval_from_texts(rc, pair.target, pair.tokenizer, texts, max_new_tokens=dc.eval_max_new_tokens,
                                     vocab_size=pair.shared,
                                     move_target=teacher is not pair.target)  # an online teacher stays in place


def draft_meta(rc, opts: DataOptions, name: str, pair: Pair, signal: Signal, stats: dict, tcfg, budget: dict,
               draft_val_loss: float | None = None) -> dict:
    """``specdraft.json`` of a trained draft: how it was made (source, loss, data, budget), the selected step and
    its score, and the validation cross-entropy of draft and target (nats per token, in the run's precision;
    ``draft_val_loss``: the draft's own validation loss, measured by the caller, e.g. an EAGLE-3 head's)."""
    from core.runtime import run_precision
    from data.text import Renderer
    from distill.generation import selection_meta

    precision, dc = rc.trainer.mixed_precision, rc.distill
    with pair.dist.main_process_first():
        val_blocks = training_blocks(pair.weights, "validation", pair.tokenizer, rc.data.block_size, opts, 64,
                                     rc.seed)[:64]
    with run_precision(precision, next(pair.draft.parameters()).device):  # like with like: each on its device
        val_loss = evaluate_loss(pair.draft, val_blocks) if draft_val_loss is None else draft_val_loss
    with run_precision(precision, next(pair.target.parameters()).device):
        target_val_loss = evaluate_loss(pair.target, val_blocks)
    meta = {
        "kind": name, "target": str(rc.target.name_or_path),
        "domain": rc.data.domain if len(pair.weights) == 1 else "mixture", "mixture": rc.data.mixture,
        "prompt_format": Renderer(pair.tokenizer).format, **pair.init_info, **signal.meta,
        **selection_meta(rc, stats, eval_every=dc.eval_every, eval_prompts=dc.eval_prompts,
                         eval_max_new_tokens=dc.eval_max_new_tokens),
        "draft_parameters": pair.draft_parameters, "target_parameters": pair.target_parameters,
        "validation_loss_nats_per_token": val_loss, "target_validation_loss_nats_per_token": target_val_loss,
        "precision": precision, "train": {k: v for k, v in stats.items() if k != "config"}, "trainer": asdict(tcfg),
        "budget": budget, "data_fingerprint_sha256": training_fingerprint(pair.weights, opts), **signal.passes,
    }
    from distill.generation import OnPolicyHook

    if isinstance(signal.hook, OnPolicyHook):
        meta["on_policy_generated_batches"] = signal.hook.generated_batches
        meta["on_policy"] = {**signal.hook.summary(), **_online_scoring(signal.step)}
    return meta


def _online_scoring(step) -> dict:
    """The target's cost of scoring on-policy rows next to a cached teacher (rows, seconds), when the step
    records it (:func:`distill.teacher.make_cached_distill_step`)."""
    st = getattr(step, "stats", None)
    return {"target_scored_rows": st["online_rows"], "target_scoring_s": st["online_s"]} if st else {}


def _step_logger(sig: "Signal", name: str, events):
    """The trainer's ``on_step``: adds the on-policy cost of the log window (draft rows, generated tokens,
    generation and target-scoring seconds, the scheduled fraction) to each train-log record, then emits the
    ``train_step`` event."""
    from distill.generation import OnPolicyHook

    scored = {"s": 0.0}

    def on_step(s: int, r: dict) -> None:
        if isinstance(sig.hook, OnPolicyHook):
            r["on_policy_fraction"] = sig.hook.fraction_at(s - 1)  # the fraction scheduled for the step just done
            r.update(sig.hook.window())
            now = _online_scoring(sig.step)
            if now:
                r["on_policy_target_scoring_s"] = now["target_scoring_s"] - scored["s"]
                scored["s"] = now["target_scoring_s"]
        if events:
            events("train_step", stage=name, **r)

    return on_step if (events or isinstance(sig.hook, OnPolicyHook)) else None


class Recipe:
    """How one draft-training stage differs from the others; :func:`train_and_save` does the rest.

    ``build_draft(rc, opts, run_dir, target, tokenizer, events) -> (draft, init_info)``: the model that trains;
    ``signal(rc, opts, pair, run_dir) -> Signal``: how it learns; ``budget(rc, run_dir) -> (TrainerConfig, budget
    record)``: for how long; ``quantize="int8"`` also saves ``<name>_int8``. The methods are the distill stages'
    (``distill``, ``baseline``, ``distill_small``); an adaptation of an existing draft (LoRA or every weight)
    overrides them (:class:`distill.lora.Adaptation`).
    """

    def __init__(self, build_draft: Callable, signal: Callable, budget: Callable, quantize: str = "none"):
        self.build_draft, self.signal, self.budget, self.quantize = build_draft, signal, budget, quantize

    def check(self, rc, run_dir: Path, name: str) -> None:
        """Before any model loads (a finished draft is reused before this): :func:`check_draft_config`."""
        check_draft_config(rc)

    def domains(self, rc) -> dict[str, float]:
        """The domain weights the draft trains on: ``{data.domain: 1}`` or ``data.mixture``."""
        return rc.data.training_domains()

    def needs_blocks(self, rc) -> bool:
        """Whether the pair packs the dataset's training blocks (``Pair.blocks``)."""
        return True

    def selection(self, rc):
        """The config section with the checkpoint-selection settings (``eval_every``, ``eval_prompts``, ...)."""
        return rc.distill

    def desc(self, name: str) -> str:
        """How logs, progress bars and training errors name this draft."""
        return f"{name} draft"

    def trims_vocab(self, rc) -> bool:
        """Whether the draft gets a trimmed output head (``draft.draft_vocab_size``,
        :func:`distill.teacher.trim_draft_vocab`)."""
        return bool(rc.draft.draft_vocab_size)

    def describe(self, rc, opts: DataOptions, name: str, pair: Pair, signal: Signal, stats: dict, tcfg,
                 budget: dict) -> dict:
        """The trained draft's ``specdraft.json`` fields (:func:`draft_meta`)."""
        return draft_meta(rc, opts, name, pair, signal, stats, tcfg, budget)

    def complete(self, run_dir: Path, name: str) -> bool:
        """The outputs of a finished run exist (reused with ``trainer.resume=true``)."""
        return (run_dir / "drafts" / name / "specdraft.json").exists()

    def outputs(self, run_dir: Path, name: str) -> dict:
        """Summary fields naming a reused run's outputs besides ``path``."""
        return {}

    def save(self, pair: Pair, meta: dict, out: Path) -> dict:
        """The save hook, called on every process after training: ``pair.draft`` to ``out`` (and ``<out>_int8``) on
        the main process (under ZeRO-3 only it holds the gathered weights). Returns the summary fields naming what
        was written besides ``path``."""
        from distill.draft_init import save_draft

        written = save_draft(pair.draft, pair.tokenizer, out, meta, self.quantize) if pair.dist.is_main_process else {}
        log.info("%s draft saved to %s (step %s, validation CE %.3f, target %.3f)", out.name, out,
                 meta["selected_step"], meta["validation_loss_nats_per_token"],
                 meta["target_validation_loss_nats_per_token"])
        return {"written": written}


def train_and_save(rc, opts: DataOptions, run_dir: Path, name: str, events, recipe: Recipe) -> dict:
    """The recipe every draft-training stage shares: load the pair, get the learning signal and the budget, train
    with checkpoint selection, describe and save ``<run_dir>/drafts/<name>`` through ``recipe`` (its hooks say how
    the stages differ). A finished draft is reused with ``trainer.resume=true``. Runs with
    ``trainer.num_threads`` torch threads (0: the count torch has when it starts), the one-off teacher passes too;
    with ``trainer.follow_free_cores`` the count follows the free cores instead.

    Returns the draft's metadata plus ``path`` and the save hook's fields (``written``; an adaptation's
    ``adapter_path``).

    Raises:
        ValueError: inconsistent config (``recipe.check``, e.g. :func:`check_draft_config`), a domain without text
            or prompts.
    """
    from core.runtime import torch_threads

    out = run_dir / "drafts" / name
    if rc.trainer.resume and recipe.complete(run_dir, name):
        log.info("%s already complete in %s; reusing it (trainer.resume=true)", recipe.desc(name), out)
        return {**read_specdraft_meta(out).to_dict(), "path": str(out), **recipe.outputs(run_dir, name),
                "reused": True}
    recipe.check(rc, run_dir, name)
    with torch_threads(rc.trainer.num_threads):
        pair = load_pair(rc, opts, run_dir, recipe, events)
        sig = recipe.signal(rc, opts, pair, run_dir)
        vocab = trim_draft_vocab(rc, pair, sig) if recipe.trims_vocab(rc) else None  # distill.teacher
        tcfg, budget_info = recipe.budget(rc, run_dir)
        log.info("%s: %d params (target %d), %d training blocks of %d tokens", recipe.desc(name),
                 pair.draft_parameters, pair.target_parameters, sig.blocks.size(0), rc.data.block_size)
        section = recipe.selection(rc)
        stats = train(pair.draft, sig.blocks, run_dir / "train" / name, tcfg, sig.step, teacher=sig.teacher,
                      seed=rc.seed, desc=recipe.desc(name), batch_hook=sig.hook,
                      evaluate=selection_eval(rc, opts, pair, sig.teacher, section), eval_every=section.eval_every,
                      on_step=_step_logger(sig, name, events),
                      on_eval=(lambda s, r: events("train_eval", stage=name, **r)) if events else None)
        meta = recipe.describe(rc, opts, name, pair, sig, stats, tcfg, budget_info)
        if vocab is not None:
            meta["draft_vocab"] = vocab
    saved = recipe.save(pair, meta, out)
    pair.dist.wait_for_everyone()
    return {**meta, "path": str(out), **saved}


def distill_stage(rc, opts: DataOptions, run_dir: Path, events=None) -> dict:
    """Stage ``distill``: the ``draft.init`` draft distilled from the target -> ``drafts/distilled``."""
    return train_and_save(rc, opts, run_dir, "distilled", events,
                          Recipe(_initial_draft, distillation_signal, step_budget, rc.draft.quantize))


def baseline_stage(rc, opts: DataOptions, run_dir: Path, events=None) -> dict:
    """Stage ``baseline``: the same draft, dataset blocks and budget, cross-entropy -> ``drafts/baseline``."""
    return train_and_save(rc, opts, run_dir, "baseline", events,
                          Recipe(_initial_draft, cross_entropy_signal, baseline_budget, rc.draft.quantize))


def distill_small_stage(rc, opts: DataOptions, run_dir: Path, events=None) -> dict:
    """Stage ``distill_small``: a fresh ``draft.arch`` draft distilled like ``distill`` -> ``drafts/small_distilled``
    (the small-config comparison next to a self-draft or pretrained draft)."""
    return train_and_save(rc, opts, run_dir, "small_distilled", events,
                          Recipe(_fresh_small_draft, distillation_signal, step_budget))
