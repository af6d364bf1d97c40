"""The reference target: a small Llama pretrained here on public text, for machines with no model hub.

``python -m train +experiment=reference_target`` trains a byte-level BPE tokenizer and a Llama model on the data
root's ``corpus/`` books plus the training splits of the task domains, then writes a standard Hugging Face
directory with ``specdraft.json`` (the config, the data fingerprint and the validation loss per domain).
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from data.io import save_hf_atomic
from data.loading import DataOptions, files_fingerprint, load_domain
from data.tokenization import cached_pack_blocks, iter_texts, train_bpe_tokenizer

from .models import LlamaArch, build_llama, count_parameters
from .step_losses import evaluate_loss
from .trainer import train
from .trainer_config import TrainerConfig

log = logging.getLogger(__name__)


@dataclass
class ReferenceConfig:
    """Settings of the reference-target stage (``reference`` config group)."""

    output_dir: str = "reference_target"  # where the HF directory goes (the default target.name_or_path)
    domains: list[str] = field(default_factory=lambda: ["corpus", "medical", "code", "chat", "math"])
    vocab_size: int = 4096
    block_size: int = 256
    arch: LlamaArch = field(default_factory=lambda: LlamaArch(hidden_size=256, num_layers=6, num_heads=8,
                                                              intermediate_size=640))
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(max_steps=1000, micro_batch_size=16,
                                                                         lr=3e-3, warmup_steps=50, save_every=100))
    eval_blocks_per_domain: int = 32


def _tokenizer_texts(domains, opts):
    for d in domains:
        yield from iter_texts(load_domain(d, opts)["train"])


def build_reference_target(rc: ReferenceConfig, opts: DataOptions, work_dir: Path, seed: int = 0) -> dict:
    """Train tokenizer + model and save them to ``rc.output_dir``; returns the metadata written.

    ``work_dir`` holds the resumable training state (so an interrupted build resumes with trainer.resume=true).
    """
    work_dir = Path(work_dir)
    log.info("training byte-level BPE tokenizer (vocab %d) on %s", rc.vocab_size, rc.domains)
    tokenizer = train_bpe_tokenizer(_tokenizer_texts(rc.domains, opts), rc.vocab_size)
    fingerprints = {d: files_fingerprint(d, opts) for d in rc.domains}
    data_fp = hashlib.sha256("".join(fingerprints[d] for d in rc.domains).encode()).hexdigest()

    def blocks_of(split):
        parts = []
        for d in rc.domains:
            ds = cached_pack_blocks(
                [fingerprints[d], d, split, opts.validation_fraction, opts.test_fraction],
                lambda d=d: load_domain(d, opts)[split].map(
                    lambda r: {"text": r["prompt"] + r["completion"]}, remove_columns=["id", "source", "prompt", "completion"]),
                tokenizer, rc.block_size)
            parts.append(torch.tensor(ds["input_ids"], dtype=torch.long).view(-1, rc.block_size))
        return parts

    train_parts = blocks_of("train")
    train_blocks = torch.cat(train_parts)
    log.info("reference target: %d training blocks of %d tokens", train_blocks.size(0), rc.block_size)
    model = build_llama(rc.arch, tokenizer, seed=seed)
    stats = train(model, train_blocks, work_dir, rc.trainer, seed=seed, desc="reference target")
    val = {}
    for d, blocks in zip(rc.domains, blocks_of("validation")):
        val[d] = evaluate_loss(model, blocks[: rc.eval_blocks_per_domain]) if blocks.numel() else float("nan")
    meta = {
        "kind": "reference_target",
        "parameters": count_parameters(model),
        "validation_loss_nats_per_token": val,
        "data_fingerprint_sha256": data_fp,
        "data_file_fingerprints": fingerprints,
        "config": {**asdict(rc), "seed": seed, "data": asdict(opts)},
        "train": {k: v for k, v in stats.items() if k != "config"},
    }
    from .launch import distributed_state

    dist = distributed_state()
    from data.chat import REFERENCE_CHAT_TEMPLATE

    # the chat template renders exactly the plain "User: ...\nAssistant:" text the model was trained on, so the
    # default target exercises the chat-template path (data/chat.py) without changing a token
    tokenizer.chat_template = REFERENCE_CHAT_TEMPLATE
    if dist.is_main_process:
        save_hf_atomic(model, tokenizer, rc.output_dir, extra=meta)
    dist.wait_for_everyone()
    return meta
