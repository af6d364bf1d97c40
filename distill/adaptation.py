"""The ``lora`` and ``finetune`` stages: an existing draft adapted to one domain, on the shared draft-training recipe.

An adaptation is a :class:`distill.pipeline.Recipe` (:class:`Adaptation`): its draft builder loads the base draft
(``lora.base``: a Hugging Face directory or ``drafts/<name>`` of this run), scores it, and attaches LoRA adapters
(:func:`distill.lora.wrap_lora`; only they train) or leaves every weight trainable (``finetune``: the comparison
that shows what the low-rank restriction costs); its signal is the distill stage's
(:func:`distill.pipeline.teacher_signal_data` with ``lora.data_source`` x ``lora.teacher_signal``, ``distill.loss``
at ``distill.temperature``); its budget is the ``lora`` section's steps and batch; its save hook writes

* ``adapters/<name>/``: the peft adapter (``adapter_config.json`` + ``adapter_model.safetensors``, loadable with
  ``peft.PeftModel.from_pretrained(base, path)``) plus the tokenizer and ``specdraft.json``;
* ``drafts/<name>/``: the merged standalone checkpoint (``merge_and_unload``: W <- W + (alpha / r) B A), a plain
  Hugging Face causal LM that works as our decoder's draft and as transformers' ``assistant_model``
  (``finetune``: the fine-tuned draft only),

each atomically. Loading the target, the shared vocabulary, training with checkpoint selection (by the pooled mean
accepted length on the domain's validation prompts, ``lora.eval_every``) and resuming are
:func:`distill.pipeline.train_and_save`'s.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from data.checkpoints import read_specdraft_meta
from data.io import atomic_dir, save_hf_atomic
from data.specdraft_meta import SpecdraftMeta

from .lora import (LoraError, adapted_module_names, adapter_bytes, check_base_available, count_merged, merge_lora,
                   resolve_base, trainable_parameters, wrap_lora)
from .pipeline import Pair, Recipe, Signal, teacher_signal_data, train_and_save
from .step_losses import evaluate_loss

log = logging.getLogger(__name__)


def adapt_draft(rc, opts, run_dir: str | os.PathLike, *, base: str | None = None, domain: str | None = None,
                name: str | None = None, events=None) -> dict:
    """LoRA-adapt the draft ``base`` (default ``lora.base``) to ``domain`` (default ``lora.domain`` or
    ``data.domain``) by distillation from the target; save ``adapters/<name>`` and the merged ``drafts/<name>``
    (``name`` default ``lora.name`` or ``lora_<domain>``) in ``run_dir``.

    The learning signal is ``lora.data_source`` x ``lora.teacher_signal`` through the distill stage's
    :func:`distill.pipeline.teacher_signal_data` (default: the target's continuations of ``lora.generation_prompts``
    training prompts, against its cached top-k logits, with ``distill.loss`` at ``distill.temperature``).

    With ``trainer.resume=true`` a completed adaptation (both folders present) is reused, and an interrupted one
    continues from ``train/<name>/checkpoint-last``.

    Returns:
        the summary also stored in ``specdraft.json`` (kind ``lora``, base path, domain, LoRA settings, trainable /
        total parameters, training stats, the one-off passes (``teacher_data``, ``teacher_cache``: ``time_s``,
        reused or computed), ``adaptation_time_s`` (training loop + one-off passes), adapter bytes and merge
        seconds, selected step, validation mean accepted length of the base and of the adapted draft, validation
        cross-entropy before / after) plus ``path`` and ``adapter_path``.

    Raises:
        LoraError / CheckpointError / ValueError: missing base draft, tokenizer mismatch, bad target modules,
        a domain without text.
    """
    return _adapt(rc, opts, Path(run_dir), base, domain, name, events, adapter=True)


def finetune_draft(rc, opts, run_dir: str | os.PathLike, *, base: str | None = None, domain: str | None = None,
                   name: str | None = None, events=None) -> dict:
    """Stage ``finetune``: as :func:`adapt_draft` (same data, teacher, steps and batch), but every weight of the
    draft trains (learning rate ``lora.finetune_lr``, else ``trainer.lr``), no adapter; saved as ``drafts/<name>``
    only (default name ``finetune_<domain>``): the comparison that shows what the low-rank restriction costs.

    Returns / Raises: as :func:`adapt_draft` (kind ``finetune``, ``adapter_path`` None).
    """
    return _adapt(rc, opts, Path(run_dir), base, domain, name, events, adapter=False)


def _adapt(rc, opts, run_dir: Path, base, domain, name, events, adapter: bool) -> dict:
    lc = rc.lora
    if not lc.enabled:
        raise LoraError("LoRA adaptation needs the LoRA settings: add `lora=default` (conf/lora/default.yaml) to "
                        "the command, or set lora.enabled=true.")
    domain = domain or lc.domain or rc.data.domain
    name = name or (lc.name if adapter else None) or f"{'lora' if adapter else 'finetune'}_{domain}"
    recipe = Adaptation(resolve_base(base or lc.base, run_dir), domain, adapter)
    return train_and_save(rc, opts, run_dir, name, events, recipe)


def adapted_output_complete(run_dir: Path, name: str) -> bool:
    """Both artifacts of an adapted draft exist (a completed adaptation, skipped on resume)."""
    return ((run_dir / "drafts" / name / "specdraft.json").is_file()
            and (run_dir / "adapters" / name / "adapter_config.json").is_file())


class Adaptation(Recipe):
    """The draft at ``base`` adapted to ``domain``: LoRA adapters (``adapter=True``, stage ``lora``) or every weight
    (stage ``finetune``), on the ``lora`` section's signal, steps and selection settings (see the module docstring).
    The builder records the base's scores before training (``before``) for :meth:`describe`."""

    def __init__(self, base: Path, domain: str, adapter: bool):
        super().__init__(self.adapted_draft, self.learning_signal, self.steps)
        self.base, self.domain, self.adapter = Path(base), domain, adapter
        self.kind, self.label = ("lora", "LoRA") if adapter else ("finetune", "fine-tune")
        self.before: dict = {}  # the base's validation blocks and scores, set by adapted_draft
        self.head = None  # a trimmed base draft's head (data.draft_vocab), taken before peft wraps it

    def check(self, rc, run_dir: Path, name: str) -> None:
        """Before any model loads: the base draft exists and is not this adaptation's own output.

        Raises:
            LoraError: no checkpoint at the base path, or it is the output folder.
        """
        out = run_dir / "drafts" / name
        check_base_available(str(self.base), run_dir, set())
        if self.base.resolve() == out.resolve():
            raise LoraError(f"lora.base {self.base} is the output folder of this adaptation ({out}); name the output "
                            f"differently (lora.name) or adapt another draft.")

    def domains(self, rc) -> dict[str, float]:
        return {self.domain: 1.0}

    def needs_blocks(self, rc) -> bool:
        return rc.lora.data_source == "dataset"  # teacher data brings its own blocks

    def selection(self, rc):
        return rc.lora

    def desc(self, name: str) -> str:
        return f"{self.label} {name}"

    def trims_vocab(self, rc) -> bool:
        return False  # the base's head is kept (a trimmed base: its kept ids, see learning_signal)

    def complete(self, run_dir: Path, name: str) -> bool:
        if self.adapter:
            return adapted_output_complete(run_dir, name)
        return (run_dir / "drafts" / name / "specdraft.json").is_file()

    def outputs(self, run_dir: Path, name: str) -> dict:
        return {"adapter_path": str(run_dir / "adapters" / name) if self.adapter else None}

    def steps(self, rc, run_dir: Path):
        """The ``lora`` section's steps, batch and learning rate (``finetune``: ``lora.finetune_lr`` or
        ``trainer.lr``), see :meth:`distill.lora.LoraSectionConfig.trainer_config`."""
        tcfg = rc.lora.trainer_config(rc.trainer)
        tcfg = tcfg if self.adapter else replace(tcfg, lr=rc.lora.finetune_lr or rc.trainer.lr)
        return tcfg, {"kind": "steps", "max_steps": tcfg.max_steps, "max_time_s": None}

    def adapted_draft(self, rc, opts, run_dir: Path, target, tokenizer, events):
        """The draft builder: the base draft, checked against the target's tokenizer and ``data.block_size`` and
        scored (:meth:`_score_base`), then wrapped with LoRA adapters (or left whole, in train mode).

        Raises:
            CheckpointError / ValueError: tokenizer mismatch, too few embedding rows, a context shorter than a block;
            LoraError: bad ``lora.target_modules`` / ``lora.modules_to_save``.
        """
        from data.checkpoints import check_context_fits, check_vocab_covers_tokenizer, load_causal_lm
        from data.draft_vocab import trimmed_head
        from data.tokenizer_check import check_tokenizers_compatible

        draft, draft_tok = load_causal_lm(self.base, role="lora.base draft")
        check_tokenizers_compatible(tokenizer, draft_tok, draft_name=f"lora.base draft {str(self.base)!r}")
        check_vocab_covers_tokenizer(draft, tokenizer, role="lora.base draft")
        check_context_fits(draft, rc.data.block_size, "lora.base draft", f"data.block_size ({rc.data.block_size})")
        self._score_base(rc, opts, target, tokenizer, draft)
        self.head = trimmed_head(draft)
        model = wrap_lora(draft, rc.lora, seed=rc.seed) if self.adapter else draft.train()
        n_train, n_total = trainable_parameters(model)
        log.info("%s: adapting %s to %s, %d trainable of %d parameters", self.label, self.base, self.domain, n_train,
                 n_total)
        return model, {}

    def _score_base(self, rc, opts, target, tokenizer, draft) -> None:
        """``before``: the domain's validation blocks (64), the base's validation cross-entropy on them and (with
        ``lora.eval_every``) its selection score, the mean accepted length on ``lora.eval_prompts`` prompts."""
        from data.blocks import domain_blocks, domain_prompts

        from .generation import selection_eval_from_texts
        from .vocab import shared_vocab

        lc, score = rc.lora, None
        val_blocks = domain_blocks(self.domain, "validation", tokenizer, rc.data.block_size, opts)[:64]
        if lc.eval_every:
            texts = domain_prompts(self.domain, "validation", opts, lc.eval_prompts, tokenizer)
            evaluate = selection_eval_from_texts(rc, target, tokenizer, texts, max_new_tokens=lc.eval_max_new_tokens,
                                                 vocab_size=shared_vocab(target, draft, tokenizer, quiet=True)[0])
            with torch.no_grad():
                score = evaluate(draft.eval())["mean_accepted_length"]
        self.before = {"val_blocks": val_blocks, "mean_accepted_length": score,
                       "validation_loss": evaluate_loss(draft, val_blocks)}

    def learning_signal(self, rc, opts, pair: Pair, run_dir: Path) -> Signal:
        """The distill stage's teacher signal with the ``lora`` section's data source, teacher signal and prompts,
        over a trimmed base's kept ids."""
        from .teacher import over_kept_ids

        lc = rc.lora
        step, teacher, blocks, passes, _, _ = teacher_signal_data(
            rc, opts, target=pair.target, tokenizer=pair.tokenizer, weights=pair.weights, blocks=pair.blocks,
            shared=pair.shared, cut=pair.cut, data_source=lc.data_source, teacher_signal=lc.teacher_signal,
            max_prompts=lc.generation_prompts, tcfg=self.steps(rc, run_dir)[0], run_dir=run_dir, dist=pair.dist)
        return Signal(step, over_kept_ids(teacher, pair.draft, self.head), blocks, passes=passes)

    def describe(self, rc, opts, name: str, pair: Pair, signal: Signal, stats: dict, tcfg, budget: dict) -> dict:
        """``specdraft.json`` of the adapted draft: base, domain, signal, LoRA settings, parameters, selection,
        validation scores before / after, training stats, the one-off passes and ``adaptation_time_s``."""
        from .generation import selection_meta

        lc, dc, model, val = rc.lora, rc.distill, pair.draft, self.before["val_blocks"]
        n_train, n_total = trainable_parameters(model)
        base_meta = read_specdraft_meta(self.base)
        meta = {**({"draft_vocab": base_meta.draft_vocab} if base_meta.draft_vocab else {}),
                "kind": self.kind, "target": str(rc.target.name_or_path), "base": str(self.base),
                "domain": self.domain, "base_kind": base_meta.kind, "base_domain": base_meta.domain,
                "loss": dc.loss, "temperature": dc.temperature, "data_source": lc.data_source,
                "teacher_signal": lc.teacher_signal,
                "generation_prompts": lc.generation_prompts if lc.data_source == "teacher" else None,
                "lora": {"rank": lc.rank, "alpha": lc.alpha, "dropout": lc.dropout, "target_modules": lc.target_modules,
                         "modules_to_save": lc.modules_to_save, "adapted_modules": adapted_module_names(model)}
                if self.adapter else None,
                "trainable_parameters": n_train,
                "draft_parameters": count_merged(n_total, n_train) if self.adapter else n_total,
                "target_parameters": sum(p.numel() for p in pair.target.parameters()),
                **selection_meta(rc, stats, eval_every=lc.eval_every, eval_prompts=lc.eval_prompts,
                                 eval_max_new_tokens=lc.eval_max_new_tokens),
                "base_mean_accepted_length": self.before["mean_accepted_length"],
                "base_validation_loss_nats_per_token": self.before["validation_loss"],
                "validation_loss_nats_per_token": evaluate_loss(model, val),
                "target_validation_loss_nats_per_token": evaluate_loss(pair.target, val),
                "train": {k: v for k, v in stats.items() if k != "config"}, "trainer": asdict(tcfg), **signal.passes}
        # what the adaptation cost: its training loop plus the one-off passes (a pass reused from the cache: its load time)
        meta["adaptation_time_s"] = float(stats["train_time_s"]) + SpecdraftMeta.from_dict(meta).one_off_pass_seconds
        return meta

    def save(self, pair: Pair, meta: dict, out: Path) -> dict:
        """The save hook: the adapter (``adapters/<name>``), then the merged draft (``drafts/<name>``), recording the
        adapter's bytes and the merge time in ``meta``; ``finetune``: the fine-tuned draft only."""
        if not self.adapter:
            save_hf_atomic(pair.draft.eval(), pair.tokenizer, out, extra={**meta, "artifact": "finetuned"})
            log.info("fine-tuned draft %s saved to %s", out.name, out)
            return {"adapter_path": None}
        adapter_out = out.parent.parent / "adapters" / out.name
        with atomic_dir(adapter_out) as tmp:  # the adapter first: merging modifies the model in place
            pair.draft.save_pretrained(tmp, safe_serialization=True)
            pair.tokenizer.save_pretrained(tmp)
            SpecdraftMeta.from_dict({**meta, "artifact": "adapter"}).write(tmp)
        meta["adapter_bytes"] = adapter_bytes(adapter_out)
        t_merge = time.perf_counter()
        merged = merge_lora(pair.draft)
        meta["merge_time_s"] = time.perf_counter() - t_merge
        save_hf_atomic(merged, pair.tokenizer, out, extra={**meta, "artifact": "merged", "adapter": str(adapter_out)})
        log.info("LoRA draft %s saved: merged %s, adapter %s (%d bytes, merged in %.3f s; validation tau %s -> %s)",
                 out.name, out, adapter_out, meta["adapter_bytes"], meta["merge_time_s"],
                 meta["base_mean_accepted_length"], meta["selected_mean_accepted_length"])
        return {"adapter_path": str(adapter_out)}
