"""Training EAGLE-3 heads (``draft=eagle3``; :mod:`models.eagle3`): the ``distill`` and ``baseline`` stages for a
head that reads the target's hidden states.

Per micro-batch of blocks ``x (B, T)`` the target's features at its three layers (``(B, T, 3 H_t)``) and its logits
come from one frozen target forward (``distill.teacher_signal=online``) or from a store written once
(``cached``: float16 features and the top-``distill.cache_top_k`` logits per position, in shards under
``distill.cache_dir``, content-keyed and resumable; :class:`FeatureCache`). The head is unrolled
``draft.eagle3.ttt_steps = k`` steps with training-time test (:meth:`models.eagle3.Eagle3Draft.unroll`; Li et al.
2025, Sec. 3.1): step ``j`` at position ``t`` predicts ``x_{t+j+2}``.

- **Distilled** (stage ``distill``): forward KL from the target's distribution at position ``t + j + 1``
  conditioned on the draft vocabulary (its mass outside dropped, the rest renormalised: what the head can propose) to
  the head's; positions whose target argmax is outside the draft vocabulary are left out (the head cannot propose
  it; SpecForge's ``position_mask``). Loss of step ``j`` weighted ``draft.eagle3.step_weight ** j`` (EAGLE-3's 0.8).
- **Cross-entropy** (stage ``baseline``): the data's next tokens ``x_{t+j+2}`` as hard labels (ids outside the
  draft vocabulary ignored), the same unroll and weights.

The token count of a micro-batch is the number of step-0 positions that count, so step losses add up to about
``sum_j w^j`` times a per-token loss.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from distill.pipeline import Recipe, Signal, draft_meta, teacher_signal_data
from distill.trainer import MicroBatch
from models.eagle3 import Eagle3Config, Eagle3Draft, save_eagle3

log = logging.getLogger(__name__)


def target_outputs(target, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers) -> tuple:
    """One frozen target forward: ``(features (B, T, 3 H_t), logits (B, T, V))``."""
    with torch.no_grad():
        out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in layers], -1), out.logits


def _counted(batch: MicroBatch) -> torch.Tensor:
    """``(B, T-1)`` bool: step-0 positions ``t`` that count (the block's ``counted()[t]`` and a real ``x_{t+1}``)."""
    return batch.counted()[:, :-1] & batch.attention_mask[:, 1:].bool()


def ttt_loss(head: Eagle3Draft, batch: MicroBatch, features: torch.Tensor, teacher_logp_at, *, steps: int,
             weight: float, distilled: bool) -> torch.Tensor:
    """The summed training-time-test loss of one micro-batch (module docstring).

    Args:
        features: ``(B, T, 3 H_t)`` the target's features of ``batch.input_ids``.
        teacher_logp_at: ``j -> (logp (B, T-1, N_d), keep (B, T-1))``: the target's log-distribution over draft ids
            at positions ``t + j + 1`` and where it is defined (distilled only; ``None`` for cross-entropy).
    Returns:
        A scalar: ``sum_j weight^j * sum_t loss_j(t)`` over counted positions.
    """
    ids = batch.input_ids
    t = ids.shape[1] - 1
    counted = _counted(batch)
    outs = head.unroll(ids[:, 1:], head.fuse(features[:, :-1]), steps, valid=batch.attention_mask[:, :-1].bool())
    total = features.new_zeros(())
    pos = torch.arange(t, device=ids.device)
    real = batch.attention_mask.bool()
    for j, hidden in enumerate(outs):
        # the label x_{t+j+2} lies in the block and is real (right padding: then every token before it is too)
        keep = counted & (pos + j + 2 <= t)[None, :] & real[:, (pos + j + 2).clamp(max=t)]
        logq = head.logits(hidden).float().log_softmax(-1)  # (B, T-1, N_d)
        if distilled:
            logp, defined = teacher_logp_at(j)
            keep = keep & defined
            per = (logp.exp() * (logp - logq)).nan_to_num(0.0).sum(-1)  # KL(p || q) per position
        else:
            label = head.target_to_draft(ids[:, (pos + j + 2).clamp(max=t)])  # (B, T-1)
            keep = keep & (label >= 0)
            per = -logq.gather(-1, label.clamp(min=0)[..., None]).squeeze(-1)
        total = total + (weight ** j) * (per * keep).sum()
    return total


def draft_logp_from_logits(head: Eagle3Draft, logits: torch.Tensor):
    """The teacher of the distilled loss from full logits ``(B, T, V)``: ``j -> (log p over draft ids at t+j+1,
    defined)``; defined where the target's argmax is a draft id."""
    kept = head.draft_to_target.to(logits.device)
    logp_all = logits[..., kept].float().log_softmax(-1)  # (B, T, N_d) conditioned on the kept ids
    inside = head.t2d.to(logits.device)[logits.argmax(-1)]  # (B, T)
    t = logits.shape[1] - 1

    def at(j: int):
        idx = torch.arange(t, device=logits.device) + j + 1
        idx = idx.clamp(max=t)
        return logp_all[:, idx], inside[:, idx]

    return at


def draft_logp_from_topk(head: Eagle3Draft, values: torch.Tensor, indices: torch.Tensor):
    """As :func:`draft_logp_from_logits` from cached top-k logits ``values, indices (B, T, K)``: the top-k mass on
    draft ids, renormalised (ids outside the top-k get probability 0, as the cached teacher of token drafts)."""
    d = head.target_to_draft(indices.long())  # (B, T, K), -1 outside
    lv = values.float().masked_fill(d < 0, float("-inf"))
    logp_k = lv.log_softmax(-1)  # (B, T, K)
    n = head.cfg.draft_vocab_size
    logp = torch.full((*values.shape[:2], n + 1), float("-inf"), device=values.device)
    logp.scatter_(-1, torch.where(d >= 0, d, n), logp_k)  # ids outside the draft vocabulary land in column n
    logp = logp[..., :n]
    inside = d[..., 0] >= 0  # the top-1 id (values are sorted) is a draft id
    inside = inside & torch.isfinite(logp_k).any(-1)
    t = values.shape[1] - 1

    def at(j: int):
        idx = (torch.arange(t, device=values.device) + j + 1).clamp(max=t)
        return logp[:, idx], inside[:, idx]

    return at


class FeatureCache:
    """The cached teacher of an EAGLE-3 head: per training block, the target's float16 features ``(T, 3 H_t)`` and
    its top-``k`` logits (``values`` float16, ``indices`` int32, sorted), in shards of ``shard_blocks`` blocks
    (``<root>/eagle3-<key>/shard-<i>.safetensors``, each written atomically; a finished shard is never recomputed,
    so an interrupted pass resumes). ``key`` hashes the target, layers, k and all of ``blocks``' tokens; with ``use``
    only the shards covering the first ``use`` blocks are scored, so runs that read prefixes of one block order (the
    learning curve's sizes) share one store, as :func:`distill.teacher.build_teacher_cache`.

    Raises:
        ValueError: ``use`` outside ``[1, N]``."""

    def __init__(self, target, blocks: torch.Tensor, root: Path, layers, k: int, shard_blocks: int, batch: int = 8,
                 use: int | None = None):
        import hashlib

        from core.io import write_json_atomic

        self.layers, self.k, self.shard_blocks = tuple(layers), int(k), int(shard_blocks)
        h = hashlib.sha256()
        h.update(json.dumps({"target": str(getattr(target, "name_or_path", "")), "layers": self.layers, "k": self.k,
                             "shard": self.shard_blocks, "cfg": target.config.to_json_string()}).encode())
        h.update(blocks.to(torch.int64).numpy().tobytes())
        self.dir = Path(root) / f"eagle3-{h.hexdigest()[:16]}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.blocks, self.batch = blocks, batch
        self.computed = self.reused = self.computed_rows = 0
        import time

        use = blocks.shape[0] if use is None else int(use)
        if not 1 <= use <= blocks.shape[0]:
            raise ValueError(f"use must be in [1, {blocks.shape[0]}] (the blocks given), got {use}")
        self.use = use
        needed = -(-use // shard_blocks)
        rows = min(needed * shard_blocks, blocks.shape[0])
        per_block = blocks.shape[1] * (3 * int(target.config.hidden_size) * 2 + self.k * (2 + 4))
        log.info("EAGLE-3 feature cache %s: %d shards of %d blocks, %.2f GB on disk when complete (float16 features "
                 "of layers %s, top-%d logits)", self.dir, needed, shard_blocks, rows * per_block / 1e9,
                 list(self.layers), self.k)
        t0 = time.perf_counter()
        for i in tqdm(range(needed), desc="EAGLE-3 feature cache", unit="shard", dynamic_ncols=True):
            self._shard(target, i)
        self.time_s = time.perf_counter() - t0
        write_json_atomic(self.dir / "cache.json", {"layers": list(self.layers), "top_k": self.k,
                                                    "blocks": int(blocks.shape[0]), "shard_blocks": shard_blocks})
        self._loaded: dict[int, dict] = {}

    def _path(self, i: int) -> Path:
        return self.dir / f"shard-{i:05d}.safetensors"

    def _shard(self, target, i: int) -> None:
        from safetensors.torch import save_file

        path = self._path(i)
        if path.is_file():
            self.reused += 1
            return
        rows = self.blocks[i * self.shard_blocks:(i + 1) * self.shard_blocks]
        feats, vals, idx = [], [], []
        for s in range(0, rows.shape[0], self.batch):
            x = rows[s:s + self.batch]
            f, logits = target_outputs(target, x, torch.ones_like(x), self.layers)
            v, ix = logits.float().topk(self.k, -1)
            feats.append(f.half())
            vals.append(v.half())
            idx.append(ix.int())
        tmp = path.with_suffix(".tmp")
        save_file({"features": torch.cat(feats), "values": torch.cat(vals), "indices": torch.cat(idx)}, str(tmp))
        os.replace(tmp, path)  # a finished shard appears whole
        self.computed += 1
        self.computed_rows += rows.shape[0]

    def get(self, block_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(features (B, T, 3 H_t) float32, values (B, T, K) float32, indices (B, T, K) int64)`` of blocks."""
        from safetensors.torch import load_file

        out = [], [], []
        for b in block_index.tolist():
            i, r = divmod(int(b), self.shard_blocks)
            if i not in self._loaded:
                if len(self._loaded) > 2:
                    self._loaded.pop(next(iter(self._loaded)))
                self._loaded[i] = load_file(str(self._path(i)))
            s = self._loaded[i]
            out[0].append(s["features"][r])
            out[1].append(s["values"][r])
            out[2].append(s["indices"][r])
        return torch.stack(out[0]).float(), torch.stack(out[1]).float(), torch.stack(out[2]).long()

    def record(self) -> dict:
        return {"path": str(self.dir), "computed_shards": self.computed, "reused_shards": self.reused,
                "scored_tokens": self.use * int(self.blocks.shape[1]),
                "computed_tokens": self.computed_rows * int(self.blocks.shape[1]),  # what time_s was spent on
                "time_s": round(self.time_s, 2), "top_k": self.k, "layers": list(self.layers)}


def feature_sample(teacher, blocks: torch.Tensor, layers, rows: int = 16) -> torch.Tensor:
    """The target's features ``(R, T, 3 H_t)`` of the first ``rows`` training blocks: read from a
    :class:`FeatureCache` or computed by the (online) target."""
    n = min(rows, blocks.shape[0])
    if isinstance(teacher, FeatureCache):
        return teacher.get(torch.arange(n))[0]
    x = blocks[:n]
    return target_outputs(teacher, x, torch.ones_like(x), layers)[0]


def make_eagle3_step(distilled: bool, steps: int, weight: float):
    """The :data:`distill.trainer.StepLoss` of an EAGLE-3 head; ``teacher`` is the target (online) or a
    :class:`FeatureCache`."""

    def step(head, teacher, batch: MicroBatch):
        if isinstance(teacher, FeatureCache):
            if batch.block_index is None:
                raise ValueError("the cached EAGLE-3 teacher needs the rows' block indices")
            feats, values, indices = teacher.get(batch.block_index)
            dev = batch.input_ids.device
            feats, values, indices = feats.to(dev), values.to(dev), indices.to(dev)
            logp_at = draft_logp_from_topk(head, values, indices) if distilled else None
        else:
            feats, logits = target_outputs(teacher, batch.input_ids, batch.attention_mask, head.cfg.target_layers)
            logp_at = draft_logp_from_logits(head, logits) if distilled else None
        loss = ttt_loss(head, batch, feats, logp_at, steps=steps, weight=weight, distilled=distilled)
        return loss, int(_counted(batch).sum())

    step.count_tokens = lambda batch: int(_counted(batch).sum())
    return step


def _build_head(rc, opts, run_dir, target, tokenizer, events):
    """An untrained head of the target's shape (the draft vocabulary and the weights come with the signal)."""
    e, vocab = rc.draft.eagle3, int(target.config.vocab_size)
    size = rc.draft.draft_vocab_size or vocab  # null: the full vocabulary
    if size > vocab:
        raise ValueError(f"draft.draft_vocab_size={size} is larger than the target's vocabulary ({vocab}): set at most "
                         f"{vocab}, or null for the full vocabulary")
    cfg = Eagle3Config.from_target(target.config, size, e.target_layers or None)
    head = Eagle3Draft(cfg)
    return head, {"init": "eagle3", "init_settings": {"eagle3": asdict(e), "target_layers": list(cfg.target_layers)}}


class Eagle3Recipe(Recipe):
    """The ``distill`` (``distilled=True``) or ``baseline`` stage of an EAGLE-3 head (module docstring)."""

    def __init__(self, distilled: bool, budget):
        super().__init__(_build_head, self._signal, budget)
        self.distilled = distilled

    def trims_vocab(self, rc) -> bool:
        return False  # the head's own draft vocabulary, set in _signal

    def _signal(self, rc, opts, pair, run_dir: Path) -> Signal:
        from distill.teacher import forced_ids
        from models.vocab import kept_mass, kept_token_ids

        dc = rc.distill
        data_source = "teacher" if dc.uses_teacher_data else "dataset"
        # all the blocks: the feature cache below keys one store on their epoch-0 order, so a run reading the first
        # trainer.unique_blocks of them several times shares the store of a run reading more of them once
        _, _, blocks, passes, answer_counts, _ = teacher_signal_data(
            rc, opts, target=pair.target, tokenizer=pair.tokenizer, weights=pair.weights, blocks=pair.blocks,
            shared=pair.shared, cut=pair.cut, data_source=data_source if self.distilled else "dataset",
            teacher_signal="online", max_prompts=dc.generation.max_prompts,
            tcfg=replace(rc.trainer, unique_blocks=0), run_dir=run_dir, dist=pair.dist)
        counts, on = ((answer_counts, "target_answers") if answer_counts is not None else
                      (torch.bincount(blocks.flatten(), minlength=pair.shared).double(), "training_blocks"))
        head = pair.draft
        kept = kept_token_ids(counts[: pair.shared], head.cfg.draft_vocab_size, forced_ids(pair.tokenizer, pair.target))
        head.init_from_target(pair.target, kept, how=rc.draft.eagle3.init, seed=rc.seed)
        teacher = pair.target
        if self.distilled and dc.teacher_signal == "cached":
            from distill.trainer import batch_indices, rows_this_run_uses

            root = Path(dc.cache_dir).expanduser() if dc.cache_dir else run_dir / "teacher_cache"
            rows = rows_this_run_uses(blocks.size(0), rc.trainer, rc.seed, pair.dist.num_processes)
            # a run reading part of the blocks scores a prefix of their epoch-0 order: shorter runs share its shards
            order = None if rows is None else batch_indices(blocks.size(0), 0, blocks.size(0), rc.seed)
            teacher = FeatureCache(pair.target, blocks if order is None else blocks[order], root,
                                   head.cfg.target_layers, dc.cache_top_k, dc.cache_shard_blocks,
                                   use=None if rows is None else rows.numel())
            if rows is not None:  # rows == order[:len(rows)]: the trainer's block i is cached row i
                blocks = blocks[rows]
            passes["teacher_cache"] = teacher.record()
        elif rc.trainer.unique_blocks:  # the online teacher reads the same first blocks of the epoch-0 order
            from distill.trainer import blocks_this_run_uses

            blocks = blocks_this_run_uses(blocks, rc.trainer, rc.seed, pair.dist.num_processes)
        e = rc.draft.eagle3
        if e.feature_norm == "channel":  # per-channel RMS of the first blocks' features, as the trainer will see them
            head.normalize_features(feature_sample(teacher, blocks, head.cfg.target_layers))
        if not e.train_lm_head:
            head.lm_head.weight.requires_grad_(False)
        pair.draft_parameters = sum(p.numel() for p in head.parameters() if p.requires_grad)
        meta = {"loss": "forward_kl" if self.distilled else "cross_entropy", "temperature": 1.0 if self.distilled
                else None, "data_source": data_source if self.distilled else "dataset",
                "teacher_signal": dc.teacher_signal if self.distilled else None, "distilled": self.distilled,
                "eagle3": {"ttt_steps": e.ttt_steps, "step_weight": e.step_weight, "init": e.init,
                           "feature_norm": e.feature_norm, "train_lm_head": e.train_lm_head,
                           "target_layers": list(head.cfg.target_layers), "draft_vocab_size": head.cfg.draft_vocab_size,
                           "draft_vocab_counted_on": on, "draft_vocab_share": kept_mass(counts, kept)}}
        return Signal(make_eagle3_step(self.distilled, e.ttt_steps, e.step_weight), teacher, blocks, None, passes,
                      meta, answer_counts)

    def describe(self, rc, opts, name, pair, signal, stats, tcfg, budget) -> dict:
        """:func:`distill.pipeline.draft_meta`'s fields; the validation losses are the head's unrolled loss per
        step-0 token (its own kind of loss, not comparable with a token draft's cross-entropy)."""
        from data.blocks import training_blocks

        with pair.dist.main_process_first():
            val = training_blocks(pair.weights, "validation", pair.tokenizer, rc.data.block_size, opts, 16, rc.seed)[:16]
        step = make_eagle3_step(self.distilled, rc.draft.eagle3.ttt_steps, rc.draft.eagle3.step_weight)
        with torch.no_grad():
            loss, n = step(pair.draft.eval(), pair.target, MicroBatch.from_blocks(val))
        return draft_meta(rc, opts, name, pair, signal, stats, tcfg, budget, draft_val_loss=float(loss) / max(n, 1))

    def save(self, pair, meta: dict, out: Path) -> dict:
        if pair.dist.is_main_process:
            save_eagle3(pair.draft, pair.tokenizer, out, meta)
        log.info("%s EAGLE-3 head saved to %s (step %s)", out.name, out, meta["selected_step"])
        return {"written": {"head": str(out)}}


def eagle3_stage(rc, opts, run_dir: Path, events=None, *, distilled: bool) -> dict:
    """Stage ``distill`` (``distilled``) or ``baseline`` with ``draft=eagle3`` -> ``drafts/distilled`` /
    ``drafts/baseline`` (a vLLM ``eagle3`` folder, :func:`models.eagle3.save_eagle3`)."""
    from distill.pipeline import baseline_budget, step_budget, train_and_save

    name = "distilled" if distilled else "baseline"
    return train_and_save(rc, opts, run_dir, name, events,
                          Eagle3Recipe(distilled, step_budget if distilled else baseline_budget))
