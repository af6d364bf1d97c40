"""The teacher signal: online (a teacher forward inside the training loop) or cached top-k logits on disk.

``distill.teacher_signal=cached`` runs the teacher once over the training blocks and stores, per position, its
``distill.cache_top_k`` largest logits (values fp32, vocabulary ids int32) in shards of
``distill.cache_shard_blocks`` blocks (:class:`distill.teacher.ShardStore`: safetensors files, a manifest with each
shard's SHA-256, temp-name-then-rename writes, finished shards skipped after a kill, corrupt shards recomputed).
Training then needs no teacher forward; the loss uses the renormalised top-k (see :mod:`distill.losses`).

The cache folder name is a hash of everything that determines its content: the teacher's weights, the training
blocks, k and the vocabulary the top-k ranges over, so a changed model or data set never reads a stale cache.
Memory: the whole cache is loaded for training, ``N * T * k * 8`` bytes (N blocks of T tokens).

A resumable, checksummed store of tensor shards on disk (teacher top-k cache, teacher generations).

Layout of a store folder::

    <root>/manifest.json          {"format": 1, "meta": {...}, "num_shards": n,
                                   "shards": {"0": {"file": "shard-00000.safetensors", "sha256": "...", "bytes": b,
                                                    "seconds": s}}}
    <root>/shard-00000.safetensors ...

Guarantees
    * Atomic shards: a shard is written to a temporary name in the same folder, fsynced and renamed, and only then
      entered into the manifest (itself written atomically). A process killed at any point leaves complete shards
      and a manifest that lists a subset of them.
    * Resumable: :meth:`ShardStore.ensure` skips every shard that the manifest lists *and* whose file still has the
      recorded SHA-256; it computes the others (missing, unlisted, or corrupt: the checksum differs).
    * ``meta`` identifies the content (e.g. model and data fingerprints, k). A manifest with different ``meta`` is
      stale: its shards are recomputed.

Shards hold named tensors (``safetensors``), which load without unpickling.

Vocabulary alignment between the target (teacher) and the draft (student) output layers.

Models often pad their embedding / LM-head rows beyond the tokenizer's vocabulary (to a multiple of 64 or 128
for speed), so a target and a draft that share one tokenizer can still have different ``config.vocab_size``.
Rows beyond ``len(tokenizer)`` are never produced by the tokenizer, so the two models' logits are comparable over
the ids ``[0, n)`` with ``n = min(teacher_vocab_size, student_vocab_size) >= len(tokenizer)``: slice both logits
to ``n`` with :func:`slice_to_shared` before computing a divergence (``distill.losses``). Any other difference
means the two models do not share a vocabulary, which no slicing can fix: :class:`VocabMismatchError`.

A draft may also keep fewer output rows than the target on purpose: :func:`trim_draft_vocab` gives a draft being
trained a trimmed head over the ids it learns from most (``draft.draft_vocab_size``, :mod:`models.vocab`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor
from tqdm.auto import tqdm

from core.errors import VocabMismatchError
from core.io import sha256_file, write_json_atomic
from distill.losses import densify_topk, teacher_topk, topk_forward_kl
from distill.trainer import MicroBatch, StepLoss


log = logging.getLogger(__name__)

FORMAT = 1


def _save_shard_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    os.close(fd)
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ShardStore:
    """``num_shards`` shards of named tensors under ``root``, identified by ``meta`` (JSON-serialisable dict)."""

    def __init__(self, root: str | os.PathLike, meta: dict, num_shards: int):
        if num_shards < 1:
            raise ValueError(f"a shard store needs at least one shard, got num_shards={num_shards}")
        self.root = Path(root)
        self.meta = json.loads(json.dumps(meta, default=str))  # normalise (tuples -> lists) for comparison
        self.num_shards = int(num_shards)

    def shard_path(self, i: int) -> Path:
        return self.root / f"shard-{i:05d}.safetensors"

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    def _read_manifest(self) -> dict:
        empty = {"format": FORMAT, "meta": self.meta, "num_shards": self.num_shards, "shards": {}}
        if not self.manifest_path.exists():
            return empty
        try:
            m = json.loads(self.manifest_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            log.warning("unreadable shard manifest %s (%s); recomputing every shard", self.manifest_path, e)
            return empty
        if m.get("format") != FORMAT or m.get("meta") != self.meta or m.get("num_shards") != self.num_shards:
            log.warning("shard manifest %s describes different content; recomputing every shard", self.manifest_path)
            return empty
        return m

    def status(self) -> dict[int, str]:
        """Shard index -> ``ok`` (listed, checksum matches), ``missing`` (not listed or no file) or ``corrupt``."""
        m = self._read_manifest()
        out = {}
        for i in range(self.num_shards):
            entry, path = m["shards"].get(str(i)), self.shard_path(i)
            if entry is None or not path.exists():
                out[i] = "missing"
            else:
                out[i] = "ok" if sha256_file(path) == entry["sha256"] else "corrupt"
        return out

    def ensure(self, compute: Callable[[int], dict[str, torch.Tensor]], desc: str = "shards",
               only: int | None = None) -> dict:
        """Compute every shard that is not ``ok`` with ``compute(i) -> {name: tensor}``; with ``only``, just the
        first ``only`` shards (the others stay as they are: a later call may compute them). Returns counts
        ``{"reused", "computed", "corrupt"}`` over those shards (``corrupt`` ones are also counted in ``computed``)
        and ``cost_s``: the seconds their computation took, whenever it ran (recorded per shard in the manifest;
        None when a shard written by an older version has no record)."""
        self.root.mkdir(parents=True, exist_ok=True)
        status = self.status()
        manifest = self._read_manifest()
        wanted = range(self.num_shards if only is None else min(only, self.num_shards))
        todo = [i for i in wanted if status[i] != "ok"]
        corrupt = [i for i in todo if status[i] == "corrupt"]
        for i in corrupt:
            log.warning("%s: shard %s failed its SHA-256 check; recomputing it", desc, self.shard_path(i))
        manifest["shards"] = {k: v for k, v in manifest["shards"].items() if status.get(int(k)) == "ok"}
        for i in tqdm(todo, desc=desc, disable=not todo, dynamic_ncols=True):
            path = self.shard_path(i)
            t0 = time.perf_counter()
            _save_shard_atomic(compute(i), path)
            manifest["shards"][str(i)] = {"file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size,
                                          "seconds": round(time.perf_counter() - t0, 3)}
            write_json_atomic(self.manifest_path, manifest)
        if not todo and not self.manifest_path.exists():  # pragma: no cover - num_shards >= 1 makes todo non-empty
            write_json_atomic(self.manifest_path, manifest)
        cost = [manifest["shards"][str(i)].get("seconds") for i in wanted]
        return {"reused": len(wanted) - len(todo), "computed": len(todo), "corrupt": len(corrupt),
                "cost_s": None if None in cost else float(sum(cost))}

    def load(self, i: int) -> dict[str, torch.Tensor]:
        """Tensors of shard ``i`` (call :meth:`ensure` first; this does not re-verify the checksum)."""
        from safetensors.torch import load_file

        return load_file(str(self.shard_path(i)))


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
                        device: torch.device | str | None = None, precision: str = "no", use: int | None = None,
                        follow_free_cores: bool = False) -> tuple[TeacherCache, dict]:
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
            it (:func:`core.runtime.run_precision`; part of the cache key unless ``no``); values are stored fp32.
        use: blocks needed (the first ``use``; None: all).
        follow_free_cores: the torch threads follow the free cores between batches (``trainer.follow_free_cores``);
            False keeps the caller's count (the stored logits then do not depend on the machine's load).

    Returns:
        (cache, info) where info has ``path``, ``reused``/``computed``/``corrupt`` shard counts and ``time_s``.

    Raises:
        ValueError: ``k`` outside ``[1, vocab_size]`` or ``use`` outside ``[1, N]``.
    """
    from core.runtime import run_precision
    from decode.common import output_vocab_size
    from decode.fast_settings import BlockThreads, following_free_cores

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
            update_threads()  # follow_free_cores: the cores other processes leave free
            x = part[j : j + batch_size].to(device)  # (b, T)
            with BlockThreads(device, x.numel()), run_precision(precision, device):  # decode.block_threads
                logits = teacher(input_ids=x, attention_mask=torch.ones_like(x)).logits[..., :vocab]  # (b, T, V)
            v, ix = teacher_topk(logits, k)  # (b, T, k) each
            vals.append(v.cpu())
            idx.append(ix.cpu())
        return {"values": torch.cat(vals), "indices": torch.cat(idx)}  # (n, T, k) each

    needed = -(-use // shard_blocks)
    with following_free_cores() if follow_free_cores else contextlib.nullcontext(int) as update_threads:
        counts = store.ensure(compute, desc=f"teacher top-{k} cache", only=needed)
    teacher.train(was_training)
    shards = [store.load(i) for i in range(needed)]
    cache = TeacherCache(torch.cat([s["values"] for s in shards])[:use], torch.cat([s["indices"] for s in shards])[:use],
                         vocab)
    info = {"path": str(store.root), **counts, "time_s": time.perf_counter() - t0, "top_k": k,
            "scored_tokens": use * blocks.size(1),
            # what time_s was spent on: a resumed or longer run reuses the first shards and computes the rest
            "computed_tokens": max(0, min(needed * shard_blocks, blocks.size(0))
                                   - counts["reused"] * shard_blocks) * blocks.size(1),
            "bytes": sum(store.shard_path(i).stat().st_size for i in range(needed))}
    log.info("teacher top-%d cache %s: %d shards reused, %d computed (%d corrupt) in %.1f s", k, store.root,
             counts["reused"], counts["computed"], counts["corrupt"], info["time_s"])
    return cache, info


def make_cached_distill_step(loss_name: str, temperature: float, online_teacher: torch.nn.Module | None = None,
                             **loss_kwargs) -> StepLoss:
    """A step loss that reads the teacher from a :class:`TeacherCache` (passed as the trainer's ``teacher``).

    ``forward_kl`` uses :func:`distill.losses.topk_forward_kl` (no (B, T, V) teacher tensor); the other finite
    divergences get the dense renormalised teacher from :func:`distill.losses.densify_topk`. Student logits are cut
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
    from distill.losses import get_loss

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
    from models.vocab import RemappedTeacher, trimmed_head

    head = head if head is not None else trimmed_head(draft)
    if head is None:
        return teacher
    if isinstance(teacher, TeacherCache):
        return TrimmedTeacherCache(teacher, head)
    return RemappedTeacher(teacher, head) if isinstance(teacher, torch.nn.Module) else teacher


class TrimmedTeacherCache:
    """A :class:`distill.teacher.TeacherCache` read over a trimmed draft's kept ids (:func:`models.vocab.remap_topk`:
    top-k entries outside the kept set get ``-inf``, so the renormalised top-k is conditioned on the kept set)."""

    def __init__(self, cache, head):
        self.cache, self.head, self.vocab_size = cache, head, head.num_kept

    @property
    def top_k(self) -> int:
        return self.cache.top_k

    def lookup(self, block_index: torch.Tensor, device="cpu"):
        from models.vocab import remap_topk

        values, indices = self.cache.lookup(block_index, device)
        return remap_topk(self.head, values, indices)


class VocabPaddingWarning(UserWarning):
    """The target and draft differ only by padded embedding rows; logits are compared over the shared ids."""


def _check_size(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def shared_vocab_size(teacher_vocab_size: int, student_vocab_size: int, tokenizer_vocab_size: int) -> int:
    """Number of leading logit columns over which target and draft are compared.

    Args:
        teacher_vocab_size: output rows of the target (teacher), e.g. ``target.config.vocab_size`` or
            ``target.get_output_embeddings().weight.shape[0]``.
        student_vocab_size: output rows of the draft (student).
        tokenizer_vocab_size: ``len(tokenizer)`` of the shared tokenizer (base vocabulary plus added tokens).

    Returns:
        ``teacher_vocab_size`` when the two are equal (no warning). When they differ only by padded rows beyond
        the tokenizer (both ``>= tokenizer_vocab_size``), ``min(teacher_vocab_size, student_vocab_size)`` and
        exactly one :class:`VocabPaddingWarning` saying the logits are compared over the shared ids.

    Raises:
        VocabMismatchError: a model has fewer output rows than the tokenizer has tokens (some token ids would
            have no logit), naming both sizes, the tokenizer size and the fix.
        ValueError: a size that is not a positive int.
    """
    teacher = _check_size("teacher_vocab_size", teacher_vocab_size)
    student = _check_size("student_vocab_size", student_vocab_size)
    tok = _check_size("tokenizer_vocab_size", tokenizer_vocab_size)
    sizes = f"target (teacher) vocab size {teacher}, draft (student) vocab size {student}, tokenizer size {tok}"
    short = [name for name, size in (("target (teacher)", teacher), ("draft (student)", student)) if size < tok]
    if short:
        raise VocabMismatchError(
            f"vocabulary mismatch: {sizes}. The {' and the '.join(short)} has fewer output rows than the tokenizer "
            "has tokens, so the two models do not share one vocabulary. Fix: build or load the draft with the "
            "target's tokenizer and resize its embeddings to cover it, e.g. "
            "draft.resize_token_embeddings(len(tokenizer)) (optionally pad_to_multiple_of=64), then re-train; "
            "padded rows beyond the tokenizer are fine and are sliced away."
        )
    if teacher == student:
        return teacher
    shared = min(teacher, student)
    warnings.warn(
        f"{sizes}: the models differ only by padded embedding rows beyond the tokenizer's vocabulary; "
        f"logits are compared over the shared ids [0, {shared}).",
        VocabPaddingWarning,
        stacklevel=2,
    )
    return shared


def shared_vocab(target, draft, tokenizer, quiet: bool = False) -> tuple[int, int | None]:
    """``(shared, cut)`` of two loaded models sharing ``tokenizer``: :func:`shared_vocab_size` of their
    ``config.vocab_size``, and where their logits are cut (``shared``, or None when neither has padded rows beyond
    it). ``quiet``: no :class:`VocabPaddingWarning` (the caller's pair warns once). Raises as
    :func:`shared_vocab_size`."""
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore", VocabPaddingWarning)
        shared = shared_vocab_size(target.config.vocab_size, draft.config.vocab_size, len(tokenizer))
    return shared, shared if shared < max(target.config.vocab_size, draft.config.vocab_size) else None


def slice_to_shared(logits: Tensor, n: int) -> Tensor:
    """The first ``n`` vocabulary columns of ``logits`` (..., V) -> (..., n); a view, ``logits`` itself if V == n.

    Raises ``ValueError`` if ``n`` is not in ``[1, V]``.
    """
    vocab = logits.shape[-1]
    if not 1 <= n <= vocab:
        raise ValueError(f"cannot slice logits with vocab size {vocab} to {n} shared ids (need 1 <= n <= {vocab})")
    return logits if n == vocab else logits[..., :n]  # (..., n)


def forced_ids(tokenizer, target) -> list[int]:
    """Ids a trimmed draft vocabulary always keeps: the tokenizer's special tokens (chat-template markers, BOS,
    padding) and every EOS id of the target's generation config, so the draft can propose the end of an answer."""
    from decode.common import default_eos

    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    eos = default_eos(target)
    ids.update([eos] if isinstance(eos, int) else list(eos or []))
    return sorted(i for i in ids if i is not None and i >= 0)


def trim_draft_vocab(rc, pair, sig) -> dict:
    """``draft.draft_vocab_size = N``: give ``pair.draft`` a :class:`models.vocab.TrimmedLMHead` over the ``N``
    ids most frequent in what this draft learns from (the target's generated answers with teacher data, else the
    training blocks), special tokens always kept, and map the learning signal to those ids: labels outside the
    kept set are ignored, the teacher (cached top-k or online logits) is conditioned on the kept set (its mass
    outside is dropped and the rest renormalised; docs/drafts.md). Returns the ``draft_vocab`` record for
    ``specdraft.json``.

    Raises:
        ValueError: ``N`` larger than the vocabulary or smaller than the special tokens; a draft whose vocabulary
            differs from the target's (padded rows) or an on-policy signal, which a trimmed head does not support.
    """
    import torch

    from distill.drafts import count_parameters
    from models.vocab import draft_vocab_record, install_trimmed_head, kept_mass, kept_token_ids

    if pair.cut is not None:
        raise ValueError("draft.draft_vocab_size needs a draft with the target's vocabulary size (this draft's "
                         "embedding is padded differently); drop draft.draft_vocab_size or rebuild the draft")
    if sig.answer_counts is not None:
        counts, on = sig.answer_counts, "target_answers"
    else:
        # every training block, not only those a short run reads: the distilled and baseline drafts count alike
        counts, on = torch.bincount(pair.blocks.flatten(), minlength=pair.shared).double(), "training_blocks"
    kept = kept_token_ids(counts[: pair.shared], rc.draft.draft_vocab_size, forced_ids(pair.tokenizer, pair.target))
    head = install_trimmed_head(pair.draft, kept)
    # draft.train_head (null: draft.train_embeddings) decides whether the kept rows train or stay the target's
    train_head = rc.draft.train_embeddings if rc.draft.train_head is None else rc.draft.train_head
    head.weight.requires_grad_(train_head)
    pair.draft_parameters = count_parameters(pair.draft)
    sig.teacher = over_kept_ids(sig.teacher, pair.draft)
    return draft_vocab_record(head, counted_on=on, counted_tokens=int(counts.sum()),
                              counted_share_kept=kept_mass(counts, kept), distinct_counted=int((counts > 0).sum()))
