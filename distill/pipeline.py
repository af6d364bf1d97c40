"""The ``distill`` and ``baseline`` stages: train a draft on one domain and save it as a Hugging Face directory.

``distilled``: the draft matches the target's soft labels with ``distill.loss`` at ``distill.temperature``.
``baseline``: the same architecture, data and step budget with plain next-token cross-entropy, so the report
shows what distillation buys.
"""
from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

import torch

from data.io import save_hf_atomic
from data.loading import DataOptions, files_fingerprint, load_domain
from data.tokenization import cached_pack_blocks

from .losses import get_loss
from data.checkpoints import load_causal_lm, read_specdraft_meta

from .models import build_llama, count_parameters
from .trainer import cross_entropy_step, evaluate_loss, make_distill_step, train

log = logging.getLogger(__name__)


def domain_blocks(domain: str, split: str, tokenizer, block_size: int, opts: DataOptions,
                  max_blocks: int | None = None) -> torch.Tensor:
    """LongTensor (N, block_size) of the domain split tokenized with ``tokenizer`` (cached on disk)."""
    ds = cached_pack_blocks(
        [files_fingerprint(domain, opts), domain, split, opts.validation_fraction, opts.test_fraction, opts.source],
        lambda: load_domain(domain, opts)[split].map(
            lambda r: {"text": r["prompt"] + r["completion"]}, remove_columns=["id", "source", "prompt", "completion"]),
        tokenizer, block_size)
    blocks = torch.tensor(ds["input_ids"], dtype=torch.long).view(-1, block_size)  # (N, block_size)
    if blocks.size(0) == 0:
        raise ValueError(f"domain {domain!r} split {split!r} has no text to train on (fewer than {block_size} tokens)")
    return blocks[:max_blocks] if max_blocks else blocks


def train_draft(rc, opts: DataOptions, run_dir: Path, kind: str, events=None) -> dict:
    """Train one draft (``kind`` = ``distilled`` or ``baseline``) and save it to ``<run_dir>/drafts/<kind>``.

    Returns a summary: parameters of target and draft, training loss and time, validation cross-entropy of the
    draft on the training domain, and the checkpoint path.
    """
    from data.tokenizer_check import check_tokenizers_compatible

    from .vocab import shared_vocab_size

    out = run_dir / "drafts" / kind
    if rc.trainer.resume and (out / "specdraft.json").exists():
        log.info("%s draft already complete in %s; reusing it (trainer.resume=true)", kind, out)
        return {**read_specdraft_meta(out), "path": str(out), "reused": True}
    target, tokenizer = load_causal_lm(rc.target.name_or_path, role="target")
    draft = build_llama(rc.draft.arch, tokenizer, seed=rc.seed)
    check_tokenizers_compatible(tokenizer, tokenizer)  # a config-built draft uses the target tokenizer itself
    train_blocks = domain_blocks(rc.data.domain, "train", tokenizer, rc.data.block_size, opts, rc.data.max_train_blocks)
    log.info("%s draft: %d params (target %d), %d training blocks of %d tokens", kind, count_parameters(draft),
             count_parameters(target), train_blocks.size(0), rc.data.block_size)
    if kind == "distilled":
        shared = shared_vocab_size(target.config.vocab_size, draft.config.vocab_size, len(tokenizer))
        extra = rc.distill.loss_kwargs()
        step = make_distill_step(get_loss(rc.distill.loss), rc.distill.temperature,
                                 shared if shared < max(target.config.vocab_size, draft.config.vocab_size) else None,
                                 **extra)
        teacher = target
    else:
        step, teacher = cross_entropy_step, None
    stats = train(draft, train_blocks, run_dir / "train" / kind, rc.trainer, step, teacher=teacher, seed=rc.seed,
                  desc=f"{kind} draft",
                  on_step=(lambda s, r: events("train_step", stage=kind, **r)) if events else None)
    val_blocks = domain_blocks(rc.data.domain, "validation", tokenizer, rc.data.block_size, opts)[:64]
    val_loss = evaluate_loss(draft, val_blocks)
    target_val_loss = evaluate_loss(target, val_blocks)
    meta = {
        "kind": kind, "target": str(rc.target.name_or_path), "domain": rc.data.domain,
        "loss": rc.distill.loss if kind == "distilled" else "cross_entropy",
        "temperature": rc.distill.temperature if kind == "distilled" else None,
        "draft_parameters": count_parameters(draft), "target_parameters": count_parameters(target),
        "validation_loss_nats_per_token": val_loss, "target_validation_loss_nats_per_token": target_val_loss,
        "train": {k: v for k, v in stats.items() if k != "config"}, "trainer": asdict(rc.trainer),
        "data_fingerprint_sha256": files_fingerprint(rc.data.domain, opts),
    }
    save_hf_atomic(draft, tokenizer, out, extra=meta)
    log.info("%s draft saved to %s (validation CE %.3f, target %.3f)", kind, out, val_loss, target_val_loss)
    return {**meta, "path": str(out)}
