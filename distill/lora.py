"""LoRA adapters on an existing draft through peft (the ``lora`` config section, ``lora=default``).

Low-rank adapters (Hu et al., ICLR 2022: W x + (alpha / r) B A x, with A (r, in), B (out, r), B initialised to 0, so
the adapted draft starts equal to the base) go on ``lora.target_modules`` (:func:`wrap_lora`: ``all-linear``,
peft's per-architecture default, or module names; any layer type peft's LoRA adapts), with ``lora.modules_to_save``
trained in full beside them; :func:`merge_lora` folds them into a standalone draft (``merge_and_unload``:
W <- W + (alpha / r) B A). The module names are checked against the draft's layers (:func:`check_modules`, before
any weights load: :func:`check_modules_before_loading`), and the base draft ``lora.base`` is found by
:func:`resolve_base`.

The ``lora`` and ``finetune`` stages that train these adapters (or every weight) on the target's signal are
:mod:`distill.lora`, on the shared draft-training recipe (:func:`distill.pipeline.train_and_save`).

The ``lora`` and ``finetune`` stages: an existing draft adapted to one domain, on the shared draft-training recipe.

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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from core.errors import LoraError
from core.io import atomic_dir
from distill.pipeline import Pair, Recipe, Signal, teacher_signal_data, train_and_save
from distill.trainer import evaluate_loss
from models.checkpoints import SpecdraftMeta, read_specdraft_meta, save_hf_atomic

log = logging.getLogger(__name__)

ALL_LINEAR = "all-linear"  # peft's shorthand: every Linear / Conv1D layer except the output head
DEFAULT_TARGET_MODULES = ALL_LINEAR


@dataclass
class LoraSectionConfig:
    """The ``lora`` config group (``conf/lora/{none,default}.yaml``). ``enabled`` is false in ``lora=none``; the
    ``lora`` and ``adapt`` stages need ``lora=default`` (or ``lora.enabled=true``)."""

    enabled: bool = False
    rank: int = 8  # r: rank of the update B A
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter input while training, in [0, 1)
    # "all-linear" (every Linear / Conv1D layer but the output head), null (peft's default for the model family) or
    # a list of module names (peft's matching: a full module name or its suffix after a dot)
    target_modules: Any = DEFAULT_TARGET_MODULES
    # layers trained in full beside the adapters and saved with them (peft's modules_to_save), e.g. [lm_head]: the
    # output head of a 4096-token vocabulary trains faster in full than through a LoRA pair (measured: 0.36 vs 0.43 s
    # per step on the general draft), null: none
    modules_to_save: Any = None
    base: str = "drafts/distilled"  # draft to adapt: HF dir; a relative path is looked up in the run dir first
    domain: str | None = None  # domain adapted to (null: data.domain)
    name: str | None = None  # output name under drafts/ and adapters/ (null: lora_<domain>)
    lr: float = 5e-3  # adapter learning rate (AdamW, cosine with warmup as the trainer)
    max_steps: int = 150  # optimizer steps per adapted domain
    micro_batch_size: int = 16  # blocks of data.block_size tokens per micro-batch
    warmup_steps: int = 10
    save_every: int = 50  # steps between resumable checkpoints (0: only at the end)
    eval_every: int = 50  # steps between acceptance evaluations for checkpoint selection (0: keep the last)
    eval_prompts: int = 8  # validation prompts of the adapted domain used for selection
    eval_max_new_tokens: int = 32  # tokens generated per selection prompt
    # The learning signal, with the distill stage's machinery (distill.pipeline.teacher_signal_data) and divergence
    # (distill.loss, distill.temperature): teacher (the target's continuations of generation_prompts training prompts
    # of the domain, distill.generation's sampling settings) or dataset (the domain's text); cached (the target's
    # top-distill.cache_top_k logits stored once) or online (a target forward in every step). Both passes are stored
    # under distill.cache_dir keyed by their content: a second run with the same target and settings reuses them.
    data_source: str = "teacher"
    teacher_signal: str = "cached"
    generation_prompts: int = 512
    finetune_lr: float | None = None  # stage finetune (every weight trains): its learning rate (null: trainer.lr)

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"lora.rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        tm = self.target_modules
        if isinstance(tm, str) and tm.lower() == ALL_LINEAR:
            self.target_modules = ALL_LINEAR
        elif tm is not None:
            self.target_modules = _module_names(tm, "lora.target_modules must be all-linear, null (peft's default for "
                                                    "the draft's model family) or a non-empty list of module names "
                                                    "(e.g. [q_proj, v_proj])")
        if self.modules_to_save is not None:
            self.modules_to_save = _module_names(self.modules_to_save, "lora.modules_to_save must be null or a "
                                                 "non-empty list of module names trained in full beside the adapters "
                                                 "(e.g. [lm_head])")
            adapted = self.target_modules if isinstance(self.target_modules, list) else []
            both = sorted(set(self.modules_to_save) & set(adapted))
            if both:
                raise ValueError(f"lora.target_modules and lora.modules_to_save both name {both}: a layer gets either "
                                 f"an adapter or full training; drop it from one of them")
        if not self.lr > 0:
            raise ValueError(f"lora.lr must be > 0, got {self.lr}")
        if self.max_steps < 1 or self.micro_batch_size < 1:
            raise ValueError("lora.max_steps and lora.micro_batch_size must be >= 1")
        if self.warmup_steps < 0 or self.save_every < 0 or self.eval_every < 0:
            raise ValueError("lora.warmup_steps, lora.save_every and lora.eval_every must be >= 0")
        if self.eval_prompts < 1 or self.eval_max_new_tokens < 1:
            raise ValueError("lora.eval_prompts and lora.eval_max_new_tokens must be >= 1")
        if self.data_source not in ("dataset", "teacher"):
            raise ValueError(f"lora.data_source must be teacher (the target's continuations of the domain's "
                             f"prompts) or dataset (the domain's text), got {self.data_source!r}")
        if self.teacher_signal not in ("online", "cached"):
            raise ValueError(f"lora.teacher_signal must be cached (top-k logits stored once) or online, "
                             f"got {self.teacher_signal!r}")
        if self.generation_prompts < 1:
            raise ValueError(f"lora.generation_prompts must be >= 1, got {self.generation_prompts}")
        if self.finetune_lr is not None and not self.finetune_lr > 0:
            raise ValueError(f"lora.finetune_lr must be > 0 or null (trainer.lr), got {self.finetune_lr}")
        if not self.base:
            raise ValueError("lora.base must name the draft to adapt (an HF directory or drafts/<name> of this run)")
        if self.name is not None and (not self.name or "/" in self.name or self.name.startswith(".")):
            raise ValueError(f"lora.name must be a plain folder name (no '/', not hidden), got {self.name!r}")
        if self.domain is not None:
            from data.loading import get_domain

            get_domain(self.domain)

    def trainer_config(self, base):
        """A :class:`distill.trainer.TrainerConfig` for the adapter: ``base`` (the ``trainer`` section) with this
        section's steps, learning rate, batch, warmup and checkpoint interval (no wall-clock budget). The adapter's
        batch is ``lora.micro_batch_size`` sequences per optimizer step: the trainer's global batch and
        accumulation settings belong to the draft stages and are not inherited."""
        return replace(base, max_steps=self.max_steps, lr=self.lr, micro_batch_size=self.micro_batch_size,
                       grad_accum_steps=1, global_batch_size=0, warmup_steps=self.warmup_steps,
                       save_every=self.save_every, max_time_s=0.0, schedule_over="steps")


def _module_names(value, rule: str) -> list[str]:
    """``value`` as a list of module names; ``ValueError(rule + got ...)`` unless it is a non-empty list / tuple of
    non-empty strings."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value \
            or any(not isinstance(m, str) or not m for m in value):
        raise ValueError(f"{rule}, got {value!r}")
    return list(value)


def resolve_base(base: str, run_dir: Path) -> Path:
    """The draft directory named by ``lora.base``: absolute as given; relative first under ``run_dir`` (so
    ``drafts/distilled`` is the draft an earlier stage of the run wrote), else relative to the working directory."""
    p = Path(base).expanduser()
    if p.is_absolute():
        return p
    in_run = Path(run_dir) / p
    return in_run if in_run.exists() or not p.exists() else p


def check_base_available(base: str, run_dir: Path, produced: set[str], key: str = "lora.base") -> None:
    """Before any model loads: the base draft exists, or is ``drafts/<kind>`` made by an earlier stage.

    Raises:
        LoraError: naming the path looked up and how to fix it.
    """
    p = Path(base)
    if not p.is_absolute() and p.parts[:1] == ("drafts",) and len(p.parts) == 2 and p.parts[1] in produced:
        return
    found = resolve_base(base, run_dir)
    if not (found / "config.json").is_file():
        where = str(found) if p.is_absolute() else f"{Path(run_dir) / p} nor {p.resolve()}"
        raise LoraError(f"{key} {base!r}: no draft checkpoint at {where}. Point it at a Hugging Face model "
                        f"directory, or at drafts/distilled / drafts/baseline with the distill / baseline stage "
                        f"earlier in `stages`.")


def _adaptable_types() -> tuple[type, ...]:
    """The layer types peft's LoRA adapts (peft 0.21 ``tuners/lora/layer.py::dispatch_default``)."""
    from transformers.pytorch_utils import Conv1D

    nn = torch.nn
    return (nn.Linear, Conv1D, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)


def _matches(name: str, key: str) -> bool:
    """peft's rule for a name in a ``target_modules`` list: the full module name, or its suffix after a dot."""
    return name == key or name.endswith("." + key)


def adaptable_module_names(model: torch.nn.Module) -> list[str]:
    """Sorted distinct last name components of the model's layers that LoRA can adapt (``nn.Linear``,
    transformers ``Conv1D`` as in GPT-2, ``nn.Embedding``, ``nn.Conv1d/2d/3d``, ``nn.MultiheadAttention``)."""
    kinds = _adaptable_types()
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and isinstance(m, kinds)})


def family_target_modules(model: torch.nn.Module):
    """peft's default LoRA targets for the model's family (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``
    keyed by ``config.model_type``: ``[q_proj, v_proj]`` for Llama / Qwen2 / Qwen3 / Mistral / Gemma / OPT,
    ``[c_attn]`` for GPT-2, ``[query_key_value]`` for GPT-NeoX / Falcon, ...).

    Raises:
        LoraError: peft has no default for this model type (e.g. ``phi3``).
    """
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as MAPPING

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MAPPING:
        raise LoraError(f"lora.target_modules=null: peft has no default LoRA target modules for model type "
                        f"{model_type!r}; set lora.target_modules=all-linear or a list of module names "
                        f"(this draft has {adaptable_module_names(model)}).")
    found = MAPPING[model_type]
    return list(found) if isinstance(found, (list, tuple, set)) else found


def _untie_targeted_embeddings(draft: torch.nn.Module, targets: list[str]) -> bool:
    """When a targeted layer is one of the draft's tied input / output embeddings, give the output head its own copy
    of the matrix (and ``config.tie_word_embeddings = False``) so that merging the adapter changes only the targeted
    layer: merged == adapted. Returns whether it untied.

    Raises:
        LoraError: a targeted layer shares its weight with another layer in some other way.
    """
    names = {id(m): n for n, m in draft.named_modules()}
    targeted = [m for n, m in draft.named_modules() if n and any(_matches(n, k) for k in targets)]
    inp = draft.get_input_embeddings() if hasattr(draft, "get_input_embeddings") else None
    out = draft.get_output_embeddings() if hasattr(draft, "get_output_embeddings") else None
    untied = False
    if (inp is not None and out is not None and getattr(out, "weight", None) is not None
            and out.weight.data_ptr() == inp.weight.data_ptr() and any(m is inp or m is out for m in targeted)):
        out.weight = torch.nn.Parameter(inp.weight.detach().clone(), requires_grad=inp.weight.requires_grad)
        for cfg in {id(c): c for c in (draft.config, draft.config.get_text_config())}.values():
            cfg.tie_word_embeddings = False
        untied = True
    owners: dict[int, list[str]] = {}
    for n, p in draft.named_parameters(remove_duplicate=False):
        if p.numel():
            owners.setdefault(p.data_ptr(), []).append(n)
    for m in targeted:
        w = getattr(m, "weight", None)
        mine = names[id(m)] + "."
        others = [n for n in owners.get(w.data_ptr(), [])
                  if not n.startswith(mine)] if isinstance(w, torch.Tensor) and w.numel() else []
        if others:
            raise LoraError(f"lora.target_modules: {names[id(m)]} shares its weight with {others[0]}, so merging the "
                            f"adapter would change both; drop {names[id(m)].rsplit('.', 1)[-1]} from "
                            f"lora.target_modules.")
    return untied


def check_modules(draft: torch.nn.Module, cfg: LoraSectionConfig) -> tuple[Any, list[str]]:
    """``(targets, modules_to_save)`` for ``draft`` (``targets``: the list, ``all-linear``, or peft's family default
    for ``null``), checked against the draft's layers.

    Raises:
        LoraError: a ``target_modules`` name matching no adaptable layer; a ``modules_to_save`` name matching no
            layer, or a layer that also gets an adapter or contains layers that do (peft would train it in full
            instead, or find nothing to adapt); ``null`` targets for a family peft has no default for.
    """
    targets = cfg.target_modules
    if targets is None:
        targets = family_target_modules(draft)
    kinds = _adaptable_types()
    if isinstance(targets, list):
        found = {k for n, m in draft.named_modules() if n and isinstance(m, kinds) for k in targets if _matches(n, k)}
        missing = [k for k in targets if k not in found]
        if missing:
            raise LoraError(f"lora.target_modules {missing} match no layer LoRA can adapt in the draft "
                            f"({type(draft).__name__}); it has {adaptable_module_names(draft)}. Set "
                            f"lora.target_modules to some of those, or to all-linear.")
    saved = cfg.modules_to_save or []
    if not saved:
        return targets, saved
    names = {n for n, _ in draft.named_modules() if n}
    absent = [k for k in saved if not any(_matches(n, k) for n in names)]
    if absent:
        raise LoraError(f"lora.modules_to_save {absent} match no layer of the draft ({type(draft).__name__}); it has "
                        f"{sorted({n.rsplit('.', 1)[-1] for n in names})}.")
    head = draft.get_output_embeddings() if hasattr(draft, "get_output_embeddings") else None
    from transformers.pytorch_utils import Conv1D

    if targets == ALL_LINEAR:  # peft: every Linear / Conv1D layer but the output head
        adapted = [n for n, m in draft.named_modules()
                   if n and isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head]
    else:
        adapted = [n for n, m in draft.named_modules()
                   if n and isinstance(m, kinds) and any(_matches(n, k) for k in targets)]
    for k in saved:
        for n in (n for n in names if _matches(n, k)):
            clash = next((a for a in adapted if a == n or a.startswith(n + ".")), None)
            if clash is not None:
                raise LoraError(f"lora.modules_to_save names {k!r}, but {clash} gets an adapter under "
                                f"lora.target_modules={cfg.target_modules!r}: a layer is either adapted or trained in "
                                f"full. Name a layer without adapters (e.g. lm_head), or take it out of "
                                f"lora.target_modules.")
    return targets, saved


def check_modules_before_loading(base: str, run_dir: Path, cfg: LoraSectionConfig) -> None:
    """Before the teacher passes: :func:`check_modules` on the base draft's architecture, built from its
    ``config.json`` on the meta device (no weights read). A base that an earlier stage of the run writes is checked
    when the stage runs. Raises :class:`LoraError` as :func:`check_modules` does."""
    found = resolve_base(base, run_dir)
    if not (found / "config.json").is_file():
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(found)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except (ValueError, OSError, KeyError):  # not a loadable config: the stage's checkpoint check reports it
        return
    check_modules(skeleton, cfg)


def wrap_lora(draft: torch.nn.Module, cfg: LoraSectionConfig, seed: int = 0):
    """A peft ``PeftModel`` of ``draft`` with LoRA adapters on ``cfg.target_modules`` (base weights frozen, only
    the adapter parameters require grad). The A matrices are seeded from ``seed``; B starts at 0.

    ``cfg.target_modules``: ``all-linear`` (peft: every ``nn.Linear`` / transformers ``Conv1D`` layer except the
    output head, whatever the family calls them: Llama ``q_proj`` ... ``down_proj``, GPT-2 ``c_attn`` / ``c_proj`` /
    ``c_fc``, GPT-NeoX / Falcon ``query_key_value`` / ``dense*``, OPT ``q_proj`` ... ``fc2``, Phi-3 ``qkv_proj`` /
    ``gate_up_proj`` ...); ``None``: peft's per-family default (:func:`family_target_modules`); or module names,
    each matching a layer of a type LoRA adapts (:func:`adaptable_module_names`). Naming the output head or the
    input embedding of a draft whose embeddings are tied unties them first (the head gets its own copy, and the
    saved draft ``tie_word_embeddings=false``), so that the merged draft equals the adapted one.
    ``cfg.modules_to_save``: layers trained in full beside the adapters (peft ``modules_to_save``: a trainable copy
    saved with the adapter and swapped in by the merge); a tied head is untied the same way.

    Raises:
        LoraError: a name matches no adaptable layer of the draft (lists the names it has), a modules_to_save name
            matches no layer; ``None`` for a family
            peft has no default for; a targeted layer sharing its weight with another layer (other than tied
            embeddings).
    """
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    targets, saved = check_modules(draft, cfg)
    if isinstance(targets, list) or saved:
        if _untie_targeted_embeddings(draft, (targets if isinstance(targets, list) else []) + saved):
            log.info("lora.target_modules / lora.modules_to_save name a tied embedding: the draft's output head now "
                     "has its own copy (tie_word_embeddings=false), so the merged draft equals the adapted one")
    # GPT-2's Conv1D stores W as (in, out): peft wants fan_in_fan_out for those layers (it would warn and switch;
    # with both kinds targeted it switches per layer, which is still right)
    conv1d = any(isinstance(m, Conv1D) and (not isinstance(targets, list) or any(_matches(n, k) for k in targets))
                 for n, m in draft.named_modules())
    pc = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                    bias="none", task_type="CAUSAL_LM", fan_in_fan_out=conv1d, modules_to_save=saved or None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(draft, pc)
    return model


def adapted_module_names(peft_model) -> list[str]:
    """Sorted distinct last name components of the layers that carry a LoRA adapter."""
    from peft.tuners.lora import LoraLayer

    return sorted({n.rsplit(".", 1)[-1] for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)})


def trainable_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def merge_lora(peft_model) -> torch.nn.Module:
    """The standalone model with the adapters merged into the base weights (peft ``merge_and_unload``; modifies
    and unwraps ``peft_model``): the same class as the base draft, eval mode."""
    merged = peft_model.merge_and_unload()
    return merged.eval()


def adapter_bytes(adapter_dir: Path) -> int:
    """Bytes of a saved peft adapter's weights (``adapter_model.safetensors``)."""
    f = Path(adapter_dir) / "adapter_model.safetensors"
    return f.stat().st_size if f.is_file() else 0


def count_merged(total_with_adapters: int, adapter: int) -> int:
    """Parameters of the merged draft: the adapters fold into the base weights."""
    return total_with_adapters - adapter


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
        self.head = None  # a trimmed base draft's head (models.vocab), taken before peft wraps it

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
        from models.checkpoints import check_context_fits, check_vocab_covers_tokenizer, load_causal_lm
        from models.vocab import check_tokenizers_compatible, trimmed_head

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
        from distill.generation import selection_eval_from_texts
        from distill.teacher import shared_vocab

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
        from distill.teacher import over_kept_ids

        lc = rc.lora
        step, teacher, blocks, passes, _, _ = teacher_signal_data(
            rc, opts, target=pair.target, tokenizer=pair.tokenizer, weights=pair.weights, blocks=pair.blocks,
            shared=pair.shared, cut=pair.cut, data_source=lc.data_source, teacher_signal=lc.teacher_signal,
            max_prompts=lc.generation_prompts, tcfg=self.steps(rc, run_dir)[0], run_dir=run_dir, dist=pair.dist)
        return Signal(step, over_kept_ids(teacher, pair.draft, self.head), blocks, passes=passes)

    def describe(self, rc, opts, name: str, pair: Pair, signal: Signal, stats: dict, tcfg, budget: dict) -> dict:
        """``specdraft.json`` of the adapted draft: base, domain, signal, LoRA settings, parameters, selection,
        validation scores before / after, training stats, the one-off passes and ``adaptation_time_s``."""
        from distill.generation import selection_meta

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
