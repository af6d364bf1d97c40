"""``specdraft.json``: how a checkpoint was made, one typed schema written and read through one class.

Every checkpoint this project writes (the reference target, initial drafts, distilled / baseline / small drafts,
LoRA adapters and their merged drafts, INT8 drafts) carries a ``specdraft.json`` beside its weights.
:class:`SpecdraftMeta` is that file: the stages build it from their fields (:meth:`SpecdraftMeta.from_dict` checks
each known field's type), :meth:`SpecdraftMeta.write` stores it, :meth:`SpecdraftMeta.read` loads and checks it,
and readers use its attributes and derived properties (:attr:`SpecdraftMeta.one_off_pass_seconds`,
:attr:`SpecdraftMeta.init_kind`, :attr:`SpecdraftMeta.is_distilled`, :attr:`SpecdraftMeta.trained_here`) instead of
string keys. Fields a later version adds are kept in :attr:`SpecdraftMeta.extra` and written back unchanged, so an
older reader never drops them.

The fields, by what they describe (absent = ``None``):

* identity: ``kind`` (``reference_target``, ``config`` / ``layer_pruned`` / ``pretrained`` initial drafts,
  ``distilled``, ``baseline``, ``small_distilled``, ``lora``, ``finetune``), ``artifact`` (LoRA: ``adapter`` /
  ``merged``; ``finetuned``),
  ``target`` (the target it was made for), ``domain`` (training domain, ``mixture`` for a mixture), ``mixture``;
* how it was initialised: ``init``, ``pretrained_from``, ``layers`` / ``layer_method`` / ``target_layers`` /
  ``layer_search`` (layer-pruned self-drafts), ``init_settings`` (reuse key of a saved initial draft);
* how it was trained: ``loss``, ``temperature``, ``data_source``, ``teacher_signal``, ``distilled``,
  ``train_on_prompts`` (false: only the target's answer positions counted), ``on_policy_fraction``,
  ``on_policy_generated_batches``, ``off_policy_data`` (the other rows of an on-policy
  run: ``dataset`` / ``teacher``), ``on_policy`` (the draft's generation and target-scoring totals), ``prompt_format``, ``precision``, ``train`` (the
  trainer's statistics: ``steps``, ``train_time_s``, ...), ``trainer`` (its settings), ``budget`` (``kind`` steps /
  wall_clock, seconds), ``teacher_data`` / ``teacher_cache`` (the one-off teacher passes, each with ``time_s``),
  ``data_fingerprint_sha256``, ``data_file_fingerprints``, ``config``;
* selection: ``selected_step``, ``selected_mean_accepted_length``, ``selection``;
* size and quality: ``parameters``, ``draft_parameters``, ``target_parameters``, ``trainable_parameters``,
  ``validation_loss_nats_per_token`` (a float; per domain for the reference target),
  ``target_validation_loss_nats_per_token``;
* adaptation (kinds ``lora`` / ``finetune``): ``base``, ``base_kind``, ``base_domain``, ``lora``, ``adapter``,
  ``base_mean_accepted_length``, ``base_validation_loss_nats_per_token``, ``generation_prompts`` (target generations
  it trained on), ``adaptation_time_s`` (training loop + one-off passes, seconds), ``adapter_bytes``,
  ``merge_time_s``;
* measured acceptance: ``domain_mean_accepted_length`` (domain -> ``{mean_accepted_length,
  mean_accepted_length_ci, num_draft_tokens, num_prompts}``, written by the ``domain_tau`` stage);
* quantization: ``quantize`` (``none`` / ``int8``), ``fp32_draft``;
* trimmed output vocabulary: ``draft_vocab`` (``size``, ``target_vocab_size``, the ``draft_to_target`` id map, how
  the ids were counted and what share of the counted tokens they cover; :mod:`data.draft_vocab`).
"""
from __future__ import annotations

import json
import os
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

from .errors import CheckpointError

FILENAME = "specdraft.json"
ONE_OFF_PASSES = ("teacher_cache", "teacher_data")  # blocks of a distilled draft's one-off teacher passes
_TRAINED_KINDS = ("distilled", "baseline", "small_distilled")


class SpecdraftMetaError(CheckpointError):
    """A ``specdraft.json`` that is not valid JSON, not an object, or has a field of the wrong type."""


@dataclass
class SpecdraftMeta:
    """The typed contents of ``specdraft.json`` (see the module docstring for the fields)."""

    kind: Optional[str] = None
    artifact: Optional[str] = None
    target: Optional[str] = None
    domain: Optional[str] = None
    mixture: Optional[dict] = None
    init: Optional[str] = None
    pretrained_from: Optional[str] = None
    layers: Optional[list] = None
    layer_method: Optional[str] = None
    target_layers: Optional[int] = None
    layer_search: Optional[dict] = None
    init_settings: Optional[dict] = None
    loss: Optional[str] = None
    temperature: Optional[float] = None
    data_source: Optional[str] = None
    teacher_signal: Optional[str] = None
    distilled: Optional[bool] = None
    train_on_prompts: Optional[bool] = None
    on_policy_fraction: Optional[float] = None
    on_policy_generated_batches: Optional[int] = None
    off_policy_data: Optional[str] = None
    on_policy: Optional[dict] = None
    prompt_format: Optional[str] = None
    precision: Optional[str] = None
    train: Optional[dict] = None
    trainer: Optional[dict] = None
    budget: Optional[dict] = None
    teacher_data: Optional[dict] = None
    teacher_cache: Optional[dict] = None
    data_fingerprint_sha256: Optional[str] = None
    data_file_fingerprints: Optional[dict] = None
    config: Optional[dict] = None
    selected_step: Optional[int] = None
    selected_mean_accepted_length: Optional[float] = None
    selection: Optional[dict] = None
    parameters: Optional[int] = None
    draft_parameters: Optional[int] = None
    target_parameters: Optional[int] = None
    trainable_parameters: Optional[int] = None
    validation_loss_nats_per_token: Optional[float | dict] = None
    target_validation_loss_nats_per_token: Optional[float] = None
    base: Optional[str] = None
    base_kind: Optional[str] = None
    base_domain: Optional[str] = None
    lora: Optional[dict] = None
    adapter: Optional[str] = None
    base_mean_accepted_length: Optional[float] = None
    base_validation_loss_nats_per_token: Optional[float] = None
    generation_prompts: Optional[int] = None
    adaptation_time_s: Optional[float] = None
    adapter_bytes: Optional[int] = None
    merge_time_s: Optional[float] = None
    domain_mean_accepted_length: Optional[dict] = None
    quantize: Optional[str] = None
    fp32_draft: Optional[str] = None
    draft_vocab: Optional[dict] = None
    extra: dict = field(default_factory=dict)  # fields this schema does not know (kept and written back)
    present: tuple = ()  # the known fields the file holds, in its order (a null field is kept as null)

    # -- building, reading, writing -------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, doc: dict, source: str = FILENAME) -> "SpecdraftMeta":
        """The schema of ``doc``; unknown keys go to :attr:`extra`.

        Raises:
            SpecdraftMetaError: ``doc`` is not a dict, or a known field has the wrong type (names ``source``, the
                field, the expected and the found type).
        """
        if not isinstance(doc, dict):
            raise SpecdraftMetaError(f"{source} must hold a JSON object, got {type(doc).__name__}; restore it or "
                                     f"delete it (it only describes how the checkpoint was made).")
        known = _field_types()
        values, extra = {}, {}
        for k, v in doc.items():
            if k not in known:
                extra[k] = v
                continue
            if v is not None and not isinstance(v, known[k]):
                want = " or ".join(t.__name__ for t in known[k])
                raise SpecdraftMetaError(f"{source}: field {k!r} must be {want}, got {type(v).__name__} ({v!r:.60}); "
                                         f"restore the file or delete it.")
            values[k] = v
        return cls(**values, extra=extra, present=tuple(k for k in doc if k in known))

    @classmethod
    def read(cls, path: str | os.PathLike) -> "SpecdraftMeta":
        """The ``specdraft.json`` in checkpoint directory ``path``; an empty schema when there is none.

        Raises:
            SpecdraftMetaError: the file is not valid JSON or breaks the schema (names the file).
        """
        f = Path(path) / FILENAME
        if not f.exists():
            return cls()
        try:
            doc = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SpecdraftMetaError(f"{f} is not valid JSON ({e}); restore it or delete it (it only describes how "
                                     f"the checkpoint was made).") from None
        return cls.from_dict(doc, str(f))

    def to_dict(self) -> dict:
        """The JSON object: the present known fields in their order, then the unknown ones."""
        out = {k: getattr(self, k) for k in self.present}
        out.update({f.name: getattr(self, f.name) for f in fields(self)
                    if f.name not in ("extra", "present") and f.name not in out and getattr(self, f.name) is not None})
        return {**out, **self.extra}

    def write(self, directory: str | os.PathLike) -> Path:
        """Write ``<directory>/specdraft.json`` (call it inside an atomic directory: see :func:`data.io.atomic_dir`).
        Returns the file's path."""
        f = Path(directory) / FILENAME
        f.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        return f

    def __bool__(self) -> bool:
        return bool(self.present or self.extra)

    # -- derived facts readers need ---------------------------------------------------------------------------------

    @property
    def one_off_pass_seconds(self) -> float:
        """Seconds the draft's one-off teacher passes cost (top-k cache + teacher data): each pass's ``cost_s``, the
        compute time of the shards it used whenever they were computed (a store shared with an earlier run does not
        make this draft's data free), else its ``time_s``; 0 without them."""
        return sum(float(p.get("cost_s") if p.get("cost_s") is not None else p.get("time_s", 0.0))
                   for p in (getattr(self, k) or {} for k in ONE_OFF_PASSES))

    @property
    def init_kind(self) -> Optional[str]:
        """How the draft was initialised: ``init``, else ``config`` for a draft this pipeline trained from a config."""
        return self.init or ("config" if self.kind in ("distilled", "baseline") else None)

    @property
    def is_distilled(self) -> Optional[bool]:
        """Whether it learnt from the target's soft labels (``None`` when the file does not say)."""
        if self.distilled is not None:
            return self.distilled
        return True if self.kind in ("distilled", "small_distilled") else None

    @property
    def trained_here(self) -> bool:
        """A draft trained by this pipeline: its training statistics, sizes and validation losses are recorded."""
        return (self.train is not None and self.draft_parameters is not None and self.target_parameters is not None
                and isinstance(self.validation_loss_nats_per_token, float)
                and self.target_validation_loss_nats_per_token is not None)

    @property
    def quantize_mode(self) -> str:
        """``quantize``, ``"none"`` when absent."""
        return self.quantize or "none"

    @property
    def passes_reused(self) -> bool:
        """Every one-off teacher pass it records came from the cache (``computed == 0``: stored by another stage or
        an earlier run, not paid by this draft); False without passes."""
        passes = [getattr(self, k) for k in ONE_OFF_PASSES if getattr(self, k) is not None]
        return bool(passes) and all(p.get("computed", 1) == 0 for p in passes)

    @property
    def steps_trained(self) -> Optional[int]:
        """Optimizer steps of its training (``train.steps``), ``None`` when not trained here."""
        return (self.train or {}).get("steps")


def _types_of(annotation) -> tuple[type, ...]:
    """The runtime types an ``Optional[...]`` annotation allows (``float`` also allows ``int``)."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    out = []
    for a in args:
        if a is type(None):
            continue
        a = typing.get_origin(a) or a
        out.append(a)
        if a is float:
            out.append(int)
    return tuple(out)


_FIELD_TYPES: dict[str, tuple[type, ...]] = {}


def _field_types() -> dict[str, tuple[type, ...]]:
    if not _FIELD_TYPES:
        hints = typing.get_type_hints(SpecdraftMeta)
        _FIELD_TYPES.update({f.name: _types_of(hints[f.name]) for f in fields(SpecdraftMeta)
                             if f.name not in ("extra", "present")})
    return _FIELD_TYPES


def as_meta(meta: "SpecdraftMeta | dict | None", source: str = FILENAME) -> SpecdraftMeta:
    """``meta`` as the schema (a dict is checked with :meth:`SpecdraftMeta.from_dict`)."""
    if isinstance(meta, SpecdraftMeta):
        return meta
    return SpecdraftMeta.from_dict(meta or {}, source)


__all__ = ["FILENAME", "ONE_OFF_PASSES", "SpecdraftMeta", "SpecdraftMetaError", "as_meta"]
