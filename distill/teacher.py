"""The teacher signal: online (a teacher forward inside the training loop) or cached top-k logits on disk.

``distill.teacher_signal=cached`` runs the teacher once over the training blocks and stores, per position, its
``distill.cache_top_k`` largest logits (values fp32, vocabulary ids int32) in shards of
``distill.cache_shard_blocks`` blocks (:class:`distill.shards.ShardStore`: safetensors files, a manifest with each
shard's SHA-256, temp-name-then-rename writes, finished shards skipped after a kill, corrupt shards recomputed).
Training then needs no teacher forward; the loss uses the renormalised top-k (see :mod:`distill.topk`).

The cache folder name is a hash of everything that determines its content: the teacher's weights, the training
blocks, k and the vocabulary the top-k ranges over, so a changed model or data set never reads a stale cache.
Memory: the whole cache is loaded for training, ``N * T * k * 8`` bytes (N blocks of T tokens).
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

import torch

from .shards import ShardStore
from .topk import densify_topk, teacher_topk, topk_forward_kl
from .step_losses import MicroBatch, StepLoss

log = logging.getLogger(__name__)


def tensor_fingerprint(t: torch.Tensor) -> str:
    """Hex SHA-256 of a tensor's dtype, shape and bytes."""
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_fingerprint(model: torch.nn.Module) -> str:
    """Hex SHA-256 over a model's state dict (names, dtypes, shapes, bytes): identifies the exact weights."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + b"\0" + tensor_fingerprint(t).encode())
    return h.hexdigest()


class TeacherCache:
    """Cached teacher top-k for every training block, in memory.

    Attributes:
        values: FloatTensor (N, T, k) teacher logits (temperature 1), sorted descending per position.
        indices: IntTensor (N, T, k) their vocabulary ids.
        vocab_size: the number of ids the top-k was taken over (the shared vocabulary).
    """

    def __init__(self, values: torch.Tensor, indices: torch.Tensor, vocab_size: int):
        if values.shape != indices.shape or values.dim() != 3:
            raise ValueError(f"cache values {tuple(values.shape)} / indices {tuple(indices.shape)} must be (N, T, k)")
        self.values, self.indices, self.vocab_size = values, indices, int(vocab_size)

    @property
    def top_k(self) -> int:
        return self.values.size(-1)

    def lookup(self, block_index: torch.Tensor,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of blocks ``block_index`` (B,): values (B, T, k) fp32, indices (B, T, k) long, on ``device``."""
        i = block_index.cpu().long()
        return self.values[i].to(device), self.indices[i].to(device=device, dtype=torch.long)


def cache_key(teacher: torch.nn.Module, blocks: torch.Tensor, k: int, vocab_size: int) -> dict:
    """What determines the cache content (stored as the shard manifest's ``meta``)."""
    return {"kind": "teacher_topk", "teacher_sha256": model_fingerprint(teacher),
            "blocks_sha256": tensor_fingerprint(blocks), "num_blocks": blocks.size(0), "block_size": blocks.size(1),
            "top_k": int(k), "vocab_size": int(vocab_size)}


def build_teacher_cache(teacher: torch.nn.Module, blocks: torch.Tensor, root: str | os.PathLike, *, k: int,
                        shard_blocks: int = 256, vocab_size: int | None = None, batch_size: int = 16,
                        device: torch.device | str | None = None,
                        precision: str = "no", use: int | None = None) -> tuple[TeacherCache, dict]:
    """Compute (or reuse) the teacher's top-k logits for ``blocks`` (N, T) under ``root/<key>/``.

    The key covers all of ``blocks``; with ``use`` only the first ``use`` blocks are scored and returned (the
    shards covering them). So runs that read different-sized prefixes of one block order (the learning curve's
    sizes, a longer rerun) share one store: each scores only the shards no earlier run wrote.

    Args:
        teacher: the target (run in eval mode under no_grad, every position attends to its block only).
        k: logits kept per position (1 <= k <= vocab_size).
        shard_blocks: blocks per shard (the unit of resume and of checksum).
        vocab_size: top-k only over ids ``< vocab_size`` (the ids shared with the draft; default: all logits).
        batch_size: blocks per teacher forward.
        precision: the run's ``trainer.mixed_precision`` (``no``, ``bf16``, ``fp16``): the teacher forward runs in
            it (:func:`data.devices.run_precision`; part of the cache key unless ``no``); values are stored fp32.
        use: blocks needed (the first ``use``; None: all).

    Returns:
        (cache, info) where info has ``path``, ``reused``/``computed``/``corrupt`` shard counts and ``time_s``.

    Raises:
        ValueError: ``k`` outside ``[1, vocab_size]`` or ``use`` outside ``[1, N]``.
    """
    from data.devices import run_precision
    from decode.common import output_vocab_size
    from decode.threads import BlockThreads, following_free_cores

    t0 = time.perf_counter()
    vocab = int(vocab_size or output_vocab_size(teacher))
    if not 1 <= k <= vocab:
        raise ValueError(f"distill.cache_top_k must be in [1, {vocab}] (the shared vocabulary), got {k}")
    use = blocks.size(0) if use is None else int(use)
    if not 1 <= use <= blocks.size(0):
        raise ValueError(f"use must be in [1, {blocks.size(0)}] (the blocks given), got {use}")
    device = torch.device(device) if device is not None else next(teacher.parameters()).device
    meta = cache_key(teacher, blocks, k, vocab)
    if precision != "no":
        meta["precision"] = precision
    key = hashlib.sha256(repr(sorted(meta.items())).encode()).hexdigest()[:16]
    num_shards = -(-blocks.size(0) // shard_blocks)
    store = ShardStore(Path(root) / f"topk-{key}", meta, num_shards)
    was_training = teacher.training
    teacher.eval()

    @torch.no_grad()
    def compute(i: int) -> dict[str, torch.Tensor]:
        part = blocks[i * shard_blocks : (i + 1) * shard_blocks]  # (n, T)
        vals, idx = [], []
        for j in range(0, part.size(0), batch_size):
            update_threads()  # the cores other processes leave free
            x = part[j : j + batch_size].to(device)  # (b, T)
            with BlockThreads(device, x.numel()), run_precision(precision, device):  # decode.block_threads
                logits = teacher(input_ids=x, attention_mask=torch.ones_like(x)).logits[..., :vocab]  # (b, T, V)
            v, ix = teacher_topk(logits, k)  # (b, T, k) each
            vals.append(v.cpu())
            idx.append(ix.cpu())
        return {"values": torch.cat(vals), "indices": torch.cat(idx)}  # (n, T, k) each

    needed = -(-use // shard_blocks)
    with following_free_cores() as update_threads:
        counts = store.ensure(compute, desc=f"teacher top-{k} cache", only=needed)
    teacher.train(was_training)
    shards = [store.load(i) for i in range(needed)]
    cache = TeacherCache(torch.cat([s["values"] for s in shards])[:use], torch.cat([s["indices"] for s in shards])[:use],
                         vocab)
    info = {"path": str(store.root), **counts, "time_s": time.perf_counter() - t0, "top_k": k,
            "scored_tokens": use * blocks.size(1),
            "bytes": sum(store.shard_path(i).stat().st_size for i in range(needed))}
    log.info("teacher top-%d cache %s: %d shards reused, %d computed (%d corrupt) in %.1f s", k, store.root,
             counts["reused"], counts["computed"], counts["corrupt"], info["time_s"])
    return cache, info


def make_cached_distill_step(loss_name: str, temperature: float, online_teacher: torch.nn.Module | None = None,
                             **loss_kwargs) -> StepLoss:
    """A step loss that reads the teacher from a :class:`TeacherCache` (passed as the trainer's ``teacher``).

    ``forward_kl`` uses :func:`distill.topk.topk_forward_kl` (no (B, T, V) teacher tensor); the other finite
    divergences get the dense renormalised teacher from :func:`distill.topk.densify_topk`. Student logits are cut
    to ``cache.vocab_size`` (the shared vocabulary) first.

    On-policy rows (``batch.generated``, :class:`distill.generation.OnPolicyHook`) have no cache entry: with
    ``online_teacher`` (the target, eval mode, frozen) they are scored by one target forward over those rows only,
    with the dense ``loss_name`` divergence over the full shared vocabulary; the student runs one forward over the
    whole micro-batch. The micro-batch's loss is the sum of both parts. ``step.stats`` counts the target's rows
    and seconds (``online_rows``, ``online_s``).

    Raises:
        ValueError: at call time, a micro-batch without ``block_index`` whose rows are not all generated, or
            generated rows without ``online_teacher``.
    """
    from .losses import get_loss

    dense = None if loss_name == "forward_kl" else get_loss(loss_name, **loss_kwargs)
    online = get_loss(loss_name, **loss_kwargs)

    def step(student, cache: TeacherCache, batch: MicroBatch):
        gen = batch.generated
        gen = torch.zeros(batch.input_ids.size(0), dtype=torch.bool, device=batch.input_ids.device) \
            if gen is None else gen.bool()  # (B,)
        off = ~gen
        if bool(off.any()) and batch.block_index is None:
            raise ValueError("a cached teacher only covers the training blocks; this micro-batch was generated")
        if bool(gen.any()) and online_teacher is None:
            raise ValueError("this micro-batch has on-policy rows the cached teacher does not cover; build the step "
                             "with online_teacher=<the target> (distill.data_source=on_policy)")
        keep = batch.counted()  # (B, T)
        s_logits = student(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        s_logits = s_logits[..., : cache.vocab_size]  # (B, T, V_shared)
        loss = s_logits.new_zeros((), dtype=torch.float32)
        if bool(off.any()):
            s_off, keep_off = (s_logits, keep) if not bool(gen.any()) else (s_logits[off], keep[off])
            values, indices = cache.lookup(batch.block_index[off.to(batch.block_index.device)], s_logits.device)
            # a trimmed draft vocabulary can miss every top-k id of a position (-inf values): nothing to learn there
            keep_off = keep_off & torch.isfinite(values).any(-1).to(keep_off.device)
            if dense is None:
                loss = loss + topk_forward_kl(s_off, values, indices, keep_off, temperature=temperature,
                                              reduction="sum")
            else:
                t_logits = densify_topk(values, indices, s_logits.size(-1))  # (b, T, V_shared)
                loss = loss + dense(s_off, t_logits, keep_off, temperature=temperature, reduction="sum")
        if bool(gen.any()):
            t0 = time.perf_counter()
            dev = next(online_teacher.parameters()).device
            with torch.no_grad():
                t_logits = online_teacher(input_ids=batch.input_ids[gen].to(dev),
                                          attention_mask=batch.attention_mask[gen].to(dev)).logits
            t_logits = t_logits[..., : cache.vocab_size].to(s_logits.device)  # (g, T, V_shared)
            step.stats["online_rows"] += int(gen.sum())
            step.stats["online_s"] += time.perf_counter() - t0
            loss = loss + online(s_logits[gen], t_logits, keep[gen], temperature=temperature, reduction="sum")
        return loss, int(keep.sum())

    step.stats = {"online_rows": 0, "online_s": 0.0}
    return step


def over_kept_ids(teacher, draft, head=None):
    """``teacher`` (a :class:`distill.teacher.TeacherCache`, the target, or ``None``) seen over the kept ids of
    ``draft``'s trimmed head (unchanged for a full-vocabulary draft): the teacher conditioned on the kept set.
    ``head``: that head, taken before a wrapper (peft's LoRA on the head) hid it; then ``draft`` is not read."""
    from data.draft_vocab import RemappedTeacher, trimmed_head

    head = head if head is not None else trimmed_head(draft)
    if head is None:
        return teacher
    if isinstance(teacher, TeacherCache):
        return TrimmedTeacherCache(teacher, head)
    return RemappedTeacher(teacher, head) if isinstance(teacher, torch.nn.Module) else teacher


class TrimmedTeacherCache:
    """A :class:`distill.teacher.TeacherCache` read over a trimmed draft's kept ids (:func:`data.draft_vocab.remap_topk`:
    top-k entries outside the kept set get ``-inf``, so the renormalised top-k is conditioned on the kept set)."""

    def __init__(self, cache, head):
        self.cache, self.head, self.vocab_size = cache, head, head.num_kept

    @property
    def top_k(self) -> int:
        return self.cache.top_k

    def lookup(self, block_index: torch.Tensor, device="cpu"):
        from data.draft_vocab import remap_topk

        values, indices = self.cache.lookup(block_index, device)
        return remap_topk(self.head, values, indices)
