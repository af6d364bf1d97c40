"""A run's training data as tensors and prompts: a domain split packed into token blocks, its prompts, and
weighted mixtures of domains (``data.mixture``). Chat records are rendered as the target sees them
(:class:`data.text.Renderer`: the tokenizer's chat template, else the plain format).
"""
from __future__ import annotations

import logging

import torch

from data.loading import COLUMNS, DataOptions, files_fingerprint, load_domain
from data.text import cached_pack_blocks

log = logging.getLogger(__name__)


def domain_blocks(domain: str, split: str, tokenizer, block_size: int, opts: DataOptions,
                  max_blocks: int | None = None) -> torch.Tensor:
    """LongTensor (N, block_size) of the domain split tokenized with ``tokenizer`` (cached on disk). Chat records
    are the conversation as the target sees it: rendered with the tokenizer's chat template when it has one
    (:class:`data.text.Renderer`), else in the plain format."""
    from data.text import Renderer

    render = Renderer(tokenizer)

    def texts():
        rows = render.rows(load_domain(domain, opts)[split])
        return rows.map(lambda r: {"text": r["prompt"] + r["completion"]}, remove_columns=list(COLUMNS))

    ds = cached_pack_blocks(
        [files_fingerprint(domain, opts), domain, split, opts.validation_fraction, opts.test_fraction, opts.source,
         render.key()],
        texts, tokenizer, block_size)
    blocks = torch.tensor(ds["input_ids"], dtype=torch.long).view(-1, block_size)  # (N, block_size)
    if blocks.size(0) == 0:
        raise ValueError(f"domain {domain!r} split {split!r} has no text to train on (fewer than {block_size} tokens)")
    return blocks[:max_blocks] if max_blocks else blocks


def domain_prompts(domain: str, split: str, opts: DataOptions, limit: int, tokenizer=None) -> list[str]:
    """The first ``limit`` non-empty prompts of a domain split (hash order, as :func:`data.loading.load_domain`);
    with ``tokenizer``, chat records rendered in its chat template (:class:`data.text.Renderer`)."""
    from data.text import decode_messages, renderer

    render = renderer(tokenizer)
    rows = load_domain(domain, opts)[split]
    out = []
    for r in rows:
        p = render(r["prompt"], r["completion"], decode_messages(r["messages"]))[0] if render else r["prompt"]
        if p.strip():
            out.append(p)
        if len(out) >= limit:
            break
    if not out:
        raise ValueError(f"domain {domain!r} split {split!r} has no prompts (needed by distill.data_source=teacher "
                         f"and by distill.eval_every > 0; set distill.eval_every=0 to train without them)")
    return out


def mixture_counts(weights: dict[str, float], total: int) -> dict[str, int]:
    """Split ``total`` items over domains in proportion to ``weights`` (largest-remainder apportionment: each
    count is within 1 of ``total * w / sum(w)`` and the counts sum to ``total``; ties go to the name first in
    sorted order)."""
    w_sum = float(sum(weights.values()))
    exact = {d: total * w / w_sum for d, w in weights.items()}
    counts = {d: int(x) for d, x in exact.items()}
    rest = total - sum(counts.values())
    for d in sorted(weights, key=lambda d: (-(exact[d] - counts[d]), d))[:rest]:
        counts[d] += 1
    return counts


def mix_blocks(parts: dict[str, torch.Tensor], weights: dict[str, float], total: int | None,
               seed: int) -> torch.Tensor:
    """LongTensor (total, T): blocks drawn from each domain's blocks ``parts[d]`` (N_d, T) in proportion to
    ``weights`` (:func:`mixture_counts`), then shuffled. A domain gives each of its blocks once before any repeats
    (a permutation, tiled when its share exceeds N_d). ``total``: null: the sum of N_d. Deterministic in ``seed``.
    """
    total = total or sum(p.size(0) for p in parts.values())
    g = torch.Generator().manual_seed(seed)
    drawn = []
    for d, n in mixture_counts(weights, total).items():
        have = parts[d].size(0)
        reps = -(-n // have) if n else 0
        idx = torch.cat([torch.randperm(have, generator=g) for _ in range(reps)])[:n] if n else \
            torch.zeros(0, dtype=torch.long)
        drawn.append(parts[d][idx])
    out = torch.cat(drawn)
    return out[torch.randperm(out.size(0), generator=g)]


def training_blocks(weights: dict[str, float], split: str, tokenizer, block_size: int, opts: DataOptions,
                    max_blocks: int | None, seed: int) -> torch.Tensor:
    """(N, block_size) blocks of one domain (``{domain: w}``) or of a mixture (``data.mixture``,
    :func:`mix_blocks`); a mixture's validation split skips domains without enough validation text."""
    if len(weights) == 1:
        return domain_blocks(next(iter(weights)), split, tokenizer, block_size, opts, max_blocks)
    parts = {}
    for d in weights:
        try:
            parts[d] = domain_blocks(d, split, tokenizer, block_size, opts)
        except ValueError:
            if split == "train":
                raise
            log.warning("mixture: domain %r has no %s blocks; left out of the %s mix", d, split, split)
    if not parts:
        raise ValueError(f"no domain of data.mixture {sorted(weights)} has {split} text")
    return mix_blocks(parts, {d: weights[d] for d in parts}, max_blocks, seed)


def training_prompts(weights: dict[str, float], split: str, opts: DataOptions, limit: int, tokenizer,
                     seed: int) -> list[str]:
    """``limit`` prompts of one domain, or of a mixture drawn in proportion to its weights (each domain's first
    prompts in hash order, then shuffled with ``seed``)."""
    if len(weights) == 1:
        return domain_prompts(next(iter(weights)), split, opts, limit, tokenizer)
    import random

    out = []
    for d, n in mixture_counts(weights, limit).items():
        if n:
            try:
                out += domain_prompts(d, split, opts, n, tokenizer)
            except ValueError:
                log.warning("mixture: domain %r has no %s prompts", d, split)
    if not out:
        raise ValueError(f"no domain of data.mixture {sorted(weights)} has {split} prompts")
    random.Random(seed).shuffle(out)
    return out


def training_fingerprint(weights: dict[str, float], opts: DataOptions) -> str:
    """:func:`data.loading.files_fingerprint` of the training domain, or a hash over a mixture's domains."""
    if len(weights) == 1:
        return files_fingerprint(next(iter(weights)), opts)
    import hashlib

    h = hashlib.sha256()
    for d in sorted(weights):
        h.update(f"{d}={weights[d]}:{files_fingerprint(d, opts)}".encode())
    return h.hexdigest()
