"""The ``distill`` and ``baseline`` stages: train a draft on one domain and save it as a Hugging Face directory.

``distilled``: the draft matches the target's soft labels with ``distill.loss`` at ``distill.temperature``, on the
training data of ``distill.data_source`` (dataset text, target generations, or on-policy draft generations) with
the teacher signal of ``distill.teacher_signal`` (online forward or cached top-k logits).
``baseline``: the same architecture, dataset blocks and step / wall-clock budget with plain next-token
cross-entropy, so the report shows what distillation buys.

Both drafts are scored every ``distill.eval_every`` steps by the mean accepted length of greedy speculative
decoding on ``distill.eval_prompts`` validation prompts; the best-scoring weights are the saved draft and its
``specdraft.json`` records the selected step and score.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, replace
from pathlib import Path

import torch

from data.blocks import training_blocks, training_fingerprint, training_prompts
from data.loading import DataOptions
from data.tokenization import encode_prompt

from data.checkpoints import check_context_fits, load_causal_lm, one_off_pass_seconds, read_specdraft_meta

from .losses import get_loss
from .models import build_llama, count_parameters
from .trainer import cross_entropy_step, evaluate_loss, make_distill_step, train

log = logging.getLogger(__name__)


def blocks_this_run_uses(blocks: torch.Tensor, tcfg, seed: int, num_processes: int = 1) -> torch.Tensor:
    """The training blocks (N, T) a run of ``tcfg.max_steps`` steps will read, when that is less than one epoch:
    the first ``max_steps * global batch`` blocks of the trainer's epoch-0 permutation (the blocks an uncached run
    reads, see :func:`distill.trainer._batch_indices`); all of ``blocks`` otherwise. Caching the teacher for only
    these costs the same teacher forwards as the online teacher instead of a pass over the whole domain.
    """
    from .trainer import _batch_indices

    needed = tcfg.max_steps * tcfg.global_batch(num_processes)  # global batch: trainer.global_batch_size or mb x accum x world
    if needed >= blocks.size(0):
        return blocks
    return blocks[_batch_indices(blocks.size(0), 0, needed, seed)]  # (needed, T)


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
    train_s = float(meta["train"]["train_time_s"])
    one_off = one_off_pass_seconds(meta)
    return {"kind": "wall_clock", "seconds": train_s + one_off, "distilled_train_s": train_s,
            "distilled_one_off_s": one_off}


def check_draft_config(rc) -> None:
    """Cross-section checks that no single section can make (before any model loads)."""
    if rc.distill.data_source == "on_policy" and rc.trainer.strategy == "deepspeed_zero3":
        raise ValueError("distill.data_source=on_policy cannot run under trainer=deepspeed_zero3: each process "
                         "generates from its own micro-batches, but ZeRO-3 forwards are collective. Use "
                         "trainer=deepspeed_zero2 or ddp for on-policy distillation.")
    if rc.distill.data_source == "on_policy" and rc.distill.generation.max_new_tokens >= rc.data.block_size:
        raise ValueError(f"distill.generation.max_new_tokens ({rc.distill.generation.max_new_tokens}) must be < "
                         f"data.block_size ({rc.data.block_size}) with distill.data_source=on_policy: each block's "
                         f"first block_size - max_new_tokens tokens are the prompt the draft continues")


DISTILLED_KINDS = ("distilled", "small_distilled")


def train_draft(rc, opts: DataOptions, run_dir: Path, kind: str, events=None) -> dict:
    """Train one draft and save it to ``<run_dir>/drafts/<kind>``: ``distilled`` / ``baseline`` start from
    ``draft.init`` (:mod:`distill.draft_init`); ``small_distilled`` is a fresh ``draft.arch`` draft distilled the
    same way (stage ``distill_small``: the small-config comparison next to a self-draft or pretrained draft).
    With ``draft.quantize=int8``, ``distilled`` / ``baseline`` are also saved as ``<kind>_int8``.

    Runs with ``trainer.num_threads`` torch threads (the one-off teacher passes too).

    Returns a summary: parameters of target and draft, training loss and time, validation cross-entropy of the
    draft on the training domain, the selected step and its mean accepted length (when ``distill.eval_every``),
    the teacher cache / teacher data passes, and the checkpoint path.

    Raises:
        ValueError: inconsistent config (see :func:`check_draft_config`), a domain without text or prompts.
    """
    from data.devices import torch_threads

    with torch_threads(rc.trainer.num_threads):
        return _train_draft(rc, opts, run_dir, kind, events)


def _train_draft(rc, opts: DataOptions, run_dir: Path, kind: str, events=None) -> dict:
    from data.chat import Renderer
    from data.devices import run_precision
    from data.tokenizer_check import check_tokenizers_compatible

    from .generation import OnPolicyHook, generate_teacher_sequences, make_acceptance_eval, pack_sequences
    from .teacher import build_teacher_cache, make_cached_distill_step
    from .draft_init import initial_draft, save_draft
    from .vocab import shared_vocab_size

    dc = rc.distill
    weights = rc.data.training_domains()  # {data.domain: 1} or data.mixture
    out = run_dir / "drafts" / kind
    if rc.trainer.resume and (out / "specdraft.json").exists():
        log.info("%s draft already complete in %s; reusing it (trainer.resume=true)", kind, out)
        return {**read_specdraft_meta(out), "path": str(out), "reused": True}
    check_draft_config(rc)
    from .trainer import distributed_state

    dist = distributed_state()
    target, tokenizer = load_causal_lm(rc.target.name_or_path, role="target")
    if kind == "small_distilled":  # the small config draft next to a self-draft / pretrained draft (same run)
        draft, init_info = build_llama(rc.draft.arch, tokenizer, seed=rc.seed), {"init": "config"}
    else:
        draft, init_info = initial_draft(rc, opts, run_dir, target, tokenizer, events)
    from decode import cache_policy

    for model, role in ((target, "target"), (draft, "draft")):
        check_context_fits(model, rc.data.block_size, role, f"data.block_size ({rc.data.block_size})")
        cache_policy(model, role=role)  # speculative decoding must be able to roll its cache back
    check_tokenizers_compatible(tokenizer, tokenizer)  # a config-built draft uses the target tokenizer itself
    shared = shared_vocab_size(target.config.vocab_size, draft.config.vocab_size, len(tokenizer))
    cut = shared if shared < max(target.config.vocab_size, draft.config.vocab_size) else None
    with dist.main_process_first():  # the main process fills the on-disk caches, the others read them
        train_blocks = training_blocks(weights, "train", tokenizer, rc.data.block_size, opts,
                                       rc.data.max_train_blocks, rc.seed)
    cache_root = Path(dc.cache_dir).expanduser() if dc.cache_dir else run_dir / "teacher_cache"
    distilled = kind in DISTILLED_KINDS
    one_off_passes = distilled and (dc.data_source == "teacher" or dc.teacher_signal == "cached")
    precision = rc.trainer.mixed_precision  # the teacher's precision in every pass (README, "Devices and precision")
    if one_off_passes and torch.cuda.is_available() and dist.is_main_process:
        # The passes run where training will (accelerate picks the GPU too), on the main process only: the others
        # read its caches, so they never hold a full target on their GPU for them.
        target.to(dist.device)
    passes: dict = {}
    hook = None
    if distilled:
        if not dist.is_main_process:  # the one-off teacher passes below write shared caches: main process first
            dist.wait_for_everyone()
        if dc.data_source == "teacher":
            texts = training_prompts(weights, "train", opts, dc.generation.max_prompts, tokenizer, rc.seed)
            prompts = [encode_prompt(tokenizer, t, dc.generation.max_prompt_tokens)[0][0].tolist() for t in texts]
            seqs, passes["teacher_data"] = generate_teacher_sequences(
                target, prompts, dc.generation, cache_root, seed=rc.seed, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, vocab_size=shared, precision=precision)
            train_blocks = pack_sequences(seqs, rc.data.block_size)[: rc.data.max_train_blocks]  # (N, block_size)
        if dc.teacher_signal == "cached":
            train_blocks = blocks_this_run_uses(train_blocks, rc.trainer, rc.seed, dist.num_processes)
            teacher, passes["teacher_cache"] = build_teacher_cache(
                target, train_blocks, cache_root, k=dc.cache_top_k, shard_blocks=dc.cache_shard_blocks,
                vocab_size=shared, precision=precision)
            step = make_cached_distill_step(dc.loss, dc.temperature, **dc.loss_kwargs())
        else:
            step, teacher = make_distill_step(get_loss(dc.loss), dc.temperature, cut, **dc.loss_kwargs()), target
        if dist.is_main_process:
            dist.wait_for_everyone()
        if rc.trainer.teacher_placement == "zero3":
            target.to("cpu")  # its own ZeRO-3 engine partitions it from host memory, not from a full GPU copy
        if dc.data_source == "on_policy":
            hook = OnPolicyHook(dc.on_policy_fraction, dc.generation, rc.seed, vocab_size=shared)
    else:
        step, teacher = cross_entropy_step, None
    tcfg, budget = rc.trainer, None
    if kind == "baseline" and dc.baseline_budget == "wall_clock":
        budget = matched_wall_clock_budget(run_dir)
        tcfg = replace(rc.trainer, max_time_s=budget["seconds"], schedule_over="time",
                       max_steps=dc.baseline_max_steps or 20 * rc.trainer.max_steps)
        log.info("baseline draft: wall-clock budget %.1f s (the distilled draft's %.1f s of training + %.1f s of "
                 "one-off teacher passes), at most %d steps", budget["seconds"], budget["distilled_train_s"],
                 budget["distilled_one_off_s"], tcfg.max_steps)
    evaluate = None
    if dc.eval_every:
        texts = training_prompts(weights, "validation", opts, dc.eval_prompts, tokenizer, rc.seed)
        evaluate = make_acceptance_eval(
            target, [encode_prompt(tokenizer, t, rc.eval.max_prompt_tokens)[0] for t in texts],
            num_draft_tokens=rc.decode.num_draft_tokens, max_new_tokens=dc.eval_max_new_tokens,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, vocab_size=shared,
            move_target=teacher is not target,  # the online teacher stays where training placed it
            draft_length_policy=rc.decode.make_policy)
    n_draft, n_target = count_parameters(draft), count_parameters(target)  # before ZeRO-3 may partition them
    log.info("%s draft: %d params (target %d), %d training blocks of %d tokens", kind, n_draft, n_target,
             train_blocks.size(0), rc.data.block_size)
    stats = train(draft, train_blocks, run_dir / "train" / kind, tcfg, step, teacher=teacher, seed=rc.seed,
                  desc=f"{kind} draft", batch_hook=hook, evaluate=evaluate, eval_every=dc.eval_every,
                  on_step=(lambda s, r: events("train_step", stage=kind, **r)) if events else None,
                  on_eval=(lambda s, r: events("train_eval", stage=kind, **r)) if events else None)
    with dist.main_process_first():
        val_blocks = training_blocks(weights, "validation", tokenizer, rc.data.block_size, opts, 64, rc.seed)[:64]
    # like with like: both validation losses in the run's precision, each on its model's device
    with run_precision(precision, next(draft.parameters()).device):
        val_loss = evaluate_loss(draft, val_blocks)
    with run_precision(precision, next(target.parameters()).device):
        target_val_loss = evaluate_loss(target, val_blocks)
    best = stats.get("best")
    meta = {
        "kind": kind, "target": str(rc.target.name_or_path),
        "domain": rc.data.domain if len(weights) == 1 else "mixture", "mixture": rc.data.mixture,
        "prompt_format": Renderer(tokenizer).format,
        "loss": dc.loss if distilled else "cross_entropy",
        "temperature": dc.temperature if distilled else None,
        "data_source": dc.data_source if distilled else "dataset",
        "teacher_signal": dc.teacher_signal if distilled else None,
        "on_policy_fraction": dc.on_policy_fraction if distilled and dc.data_source == "on_policy" else None,
        **init_info, "distilled": distilled,
        "selected_step": best["step"] if best else stats["steps"],
        "selected_mean_accepted_length": best["metrics"]["mean_accepted_length"] if best else None,
        "selection": {"metric": "mean_accepted_length", "eval_every": dc.eval_every, "eval_prompts": dc.eval_prompts,
                      "eval_max_new_tokens": dc.eval_max_new_tokens, "num_draft_tokens": rc.decode.num_draft_tokens,
                      "draft_length_policy": rc.decode.policy_settings(), "split": "validation",
                      "best": best} if best else None,
        "draft_parameters": n_draft, "target_parameters": n_target,
        "validation_loss_nats_per_token": val_loss, "target_validation_loss_nats_per_token": target_val_loss,
        "precision": precision,
        "train": {k: v for k, v in stats.items() if k != "config"}, "trainer": asdict(tcfg),
        "budget": budget or {"kind": "steps", "max_steps": tcfg.max_steps, "max_time_s": tcfg.max_time_s or None},
        "data_fingerprint_sha256": training_fingerprint(weights, opts), **passes,
    }
    if hook is not None:
        meta["on_policy_generated_batches"] = hook.generated_batches
    written: dict = {}
    if dist.is_main_process:  # under ZeRO-3 only the main process holds the gathered weights
        written = save_draft(draft, tokenizer, out, meta, "none" if kind == "small_distilled" else rc.draft.quantize)
    dist.wait_for_everyone()
    log.info("%s draft saved to %s (step %s, validation CE %.3f, target %.3f)", kind, out, meta["selected_step"],
             val_loss, target_val_loss)
    return {**meta, "path": str(out), "written": written}
