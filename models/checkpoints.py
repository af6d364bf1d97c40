"""Checkpoints: loading target and draft folders with clear errors, saving them atomically, and their
``specdraft.json`` record.

``specdraft.json``: how a checkpoint was made, one typed schema written and read through one class.

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
  the ids were counted and what share of the counted tokens they cover; :mod:`models.vocab`).

Loading Hugging Face causal-LM checkpoints (target and drafts) with clear errors.
"""
from __future__ import annotations

import json
import os
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import torch

from core.errors import CheckpointError, SpecdraftMetaError, TokenizerMismatchError
from core.io import PROJECT_ROOT, atomic_dir


FILENAME = "specdraft.json"
ONE_OFF_PASSES = ("teacher_cache", "teacher_data")  # blocks of a distilled draft's one-off teacher passes
_TRAINED_KINDS = ("distilled", "baseline", "small_distilled")


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
        """Write ``<directory>/specdraft.json`` (call it inside an atomic directory: see :func:`core.io.atomic_dir`).
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


def _looks_local(name_or_path: str | os.PathLike) -> bool:
    p = Path(str(name_or_path)).expanduser()
    return p.exists() or str(name_or_path).startswith((".", "/", "~")) or str(name_or_path).count("/") > 1


def check_checkpoint_dir(name_or_path: str | os.PathLike, role: str = "model", key: str | None = None,
                         need_tokenizer: bool = True) -> None:
    """Cheap checks of a local checkpoint directory, without loading anything (a hub id passes unchecked).

    ``key`` is what the user sets to point elsewhere, named in the messages (default: the config key for ``role``;
    a script passes its flag, e.g. ``--draft``). ``need_tokenizer=False`` accepts a directory without tokenizer
    files (a draft that uses the target's).

    Raises:
        CheckpointError: the path does not exist, is not a readable directory, or lacks ``config.json``, the
            weights (``*.safetensors`` / ``*.bin``) or the tokenizer files; the message names the path, what is
            missing, and how to fix it.
    """
    if not _looks_local(name_or_path):
        return
    p = Path(str(name_or_path)).expanduser()
    key = key or (f"{role}.name_or_path" if role == "target" else
                  "draft.name_or_path" if "draft.name_or_path" in role else "eval.drafts")
    if not p.exists():
        raise CheckpointError(
            f"{role} path {p} does not exist{sibling_hint(p)}. Point {key} at a Hugging Face model directory "
            f"(config.json + *.safetensors + tokenizer files) or a hub id."
        )
    if not p.is_dir():
        raise CheckpointError(f"{role} path {p} is a file, not a model directory. Point {key} at the directory "
                              f"holding config.json, *.safetensors and the tokenizer files.")
    try:
        names = {q.name for q in p.iterdir()}
    except OSError as e:
        raise CheckpointError(f"{role} checkpoint {p} is not readable ({e.strerror}); fix its permissions or point "
                              f"{key} elsewhere.") from None
    missing = [n for n in ("config.json",) if n not in names]
    if not any(n.endswith((".safetensors", ".bin")) for n in names):
        missing.append("model weights (*.safetensors)")
    if need_tokenizer and not names & {"tokenizer.json", "tokenizer_config.json"}:
        missing.append("tokenizer files (tokenizer.json)")
    if missing:
        raise CheckpointError(
            f"{role} checkpoint {p} is incomplete: missing {', '.join(missing)}. It may be a partial or "
            f"interrupted save; re-run the stage that produced it or point {key} elsewhere."
        )
    for n in sorted(names):
        if n.endswith(".json") or n.endswith(".safetensors"):
            try:
                with open(p / n, "rb") as f:
                    f.read(1)
            except OSError as e:
                raise CheckpointError(f"{role} checkpoint file {p / n} is not readable ({e.strerror}); fix its "
                                      f"permissions or point {key} elsewhere.") from None
    try:  # a damaged config.json would otherwise surface later as a tokenizer or model error
        doc = json.loads((p / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{role} checkpoint {p}: config.json is not valid JSON ({e}); it may be a partial or "
                              f"damaged save: re-run the stage that produced it or point {key} elsewhere.") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{role} checkpoint {p}: config.json holds a JSON {type(doc).__name__}, not the object "
                              f"of a model's settings; restore the config.json saved with the weights, re-run the "
                              f"stage that produced it, or point {key} elsewhere.")


def read_model_config(name_or_path: str | os.PathLike) -> dict | None:
    """A local checkpoint's ``config.json`` as a mapping, read without loading the model; None when it is missing,
    unreadable or not a JSON object (:func:`check_checkpoint_dir` reports that in its own words)."""
    try:
        doc = json.loads((Path(str(name_or_path)).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def sibling_hint(p: Path) -> str:
    """For a missing ``p`` whose folder exists: the model folders beside it, the closest first named (``; did you
    mean``); ``""`` otherwise (a parent that is not there either says nothing useful)."""
    from core.errors import did_you_mean

    try:
        near = sorted(q.name for q in p.parent.iterdir() if q.is_dir() and (q / "config.json").is_file())
    except OSError:
        return ""
    if not near:
        return ""
    hint = did_you_mean(p.name, near, lambda c: str(p.parent / c))
    return f" ({p.parent} holds {', '.join(near[:8])}{', ...' if len(near) > 8 else ''}{f'; {hint}' if hint else ''})"


def load_tokenizer(name_or_path: str | os.PathLike, role: str = "model", key: str | None = None):
    """The tokenizer of a checkpoint (no model weights are read), after :func:`check_checkpoint_dir` (``key`` as
    there).

    Raises:
        CheckpointError: as :func:`check_checkpoint_dir`, or the tokenizer files cannot be parsed.
    """
    check_checkpoint_dir(name_or_path, role, key)
    return _read_tokenizer(name_or_path, role)


def _read_tokenizer(name_or_path: str | os.PathLike, role: str):
    """The tokenizer of an already checked checkpoint (:func:`load_tokenizer` without the directory checks)."""
    from transformers import AutoTokenizer

    src = str(Path(str(name_or_path)).expanduser()) if _looks_local(name_or_path) else str(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(src)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0].rstrip(":. ")  # transformers' messages run to 6 lines
        gone = _looks_local(name_or_path) and not (Path(src) / "tokenizer.json").is_file()
        why = "tokenizer.json is missing" if gone else f"{type(e).__name__}: {first}"
        raise CheckpointError(
            f"could not load the {role} tokenizer from {name_or_path}: {why}. Check that the directory holds complete "
            f"tokenizer files (tokenizer.json, tokenizer_config.json): copy them from the checkpoint it was trained from."
        ) from e


def check_finite_weights(model, name_or_path: str | os.PathLike, role: str = "model") -> None:
    """Raise :class:`CheckpointError` when any parameter or buffer of ``model`` holds NaN or inf (a diverged or
    damaged checkpoint would otherwise be evaluated as if valid); names up to three tensors."""
    import torch

    bad = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
           if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise CheckpointError(
            f"{role} checkpoint {name_or_path} has non-finite (NaN or inf) weights in {shown}. It comes from a "
            f"diverged or damaged run: use an earlier checkpoint, or retrain it (e.g. with a lower trainer.lr)."
        )


def load_causal_lm(name_or_path: str | os.PathLike, role: str = "model", dtype: torch.dtype = torch.float32,
                   device: torch.device | str | None = None, key: str | None = None, need_tokenizer: bool = True):
    """Load ``(model, tokenizer)`` from a Hugging Face directory or hub id, in eval mode, with weights in ``dtype``
    on ``device`` (``None``: CPU; resolve a config value with :func:`core.runtime.resolve_device` first). ``key``
    and ``need_tokenizer`` as in :func:`check_checkpoint_dir`; without tokenizer files (allowed only when
    ``need_tokenizer=False``) the tokenizer returned is ``None``.

    Raises:
        CheckpointError: the path does not exist (and does not look like a hub id), lacks config/weights/tokenizer
            files, fails to load, or holds NaN/inf weights; the message names the path, what is wrong, and how to
            fix it.
    """
    from transformers import AutoModelForCausalLM

    local = _looks_local(name_or_path)
    src = str(Path(str(name_or_path)).expanduser()) if local else name_or_path
    check_checkpoint_dir(name_or_path, role, key, need_tokenizer)
    has_tok = not local or bool({q.name for q in Path(src).iterdir()} & {"tokenizer.json", "tokenizer_config.json"})
    tok = _read_tokenizer(name_or_path, role) if need_tokenizer or has_tok else None  # checked just above
    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    except Exception as e:
        raise CheckpointError(
            f"could not load {role} from {name_or_path}: {type(e).__name__}: {e}. Check that the directory is a "
            f"complete Hugging Face causal-LM checkpoint (or that the hub is reachable for a hub id)."
        ) from e
    check_finite_weights(model, name_or_path, role)
    if local and (Path(src) / "specdraft.json").is_file():  # a trimmed draft saved as its full-vocabulary export
        from models.vocab import apply_saved_draft_vocab

        try:
            apply_saved_draft_vocab(model, read_specdraft_meta(src).draft_vocab, f"{role} {name_or_path}")
        except ValueError as e:
            raise CheckpointError(str(e)) from e
    if device is not None and torch.device(device) != torch.device("cpu"):
        model.to(device)
    return model.eval(), tok


def read_specdraft_meta(path: str | os.PathLike) -> SpecdraftMeta:
    """The ``specdraft.json`` beside a checkpoint (how it was produced; :class:`models.checkpoints.SpecdraftMeta`),
    empty when there is none.

    Raises:
        CheckpointError: the file exists but is not valid JSON or breaks the schema (names the file and field).
    """
    return SpecdraftMeta.read(path)


def check_vocab_covers_tokenizer(model, tokenizer, role: str = "draft") -> None:
    """Raise :class:`CheckpointError` when ``model`` has fewer embedding or output rows than ``tokenizer`` has
    tokens (it could not read or propose some ids). More rows (padding) are fine: the decoder compares only the
    shared ids.
    """
    n_tok = len(tokenizer)
    n_in = model.get_input_embeddings().num_embeddings
    out = model.get_output_embeddings()
    n_out = n_in if out is None else out.out_features if isinstance(getattr(out, "out_features", None), int) \
        else out.weight.shape[0]  # out_features: nn.Linear and int8 dynamic Linear (whose weight is a method)
    if min(n_in, n_out) < n_tok:
        raise CheckpointError(
            f"{role} has {n_in} input / {n_out} output embedding rows but the tokenizer has {n_tok} tokens; it cannot "
            f"represent every token. Resize it (model.resize_token_embeddings({n_tok})) and fine-tune, or use a draft "
            f"built for this tokenizer."
        )


def check_context_fits(model, tokens: int, role: str, what: str, fix: str | None = None) -> None:
    """Raise :class:`CheckpointError` when ``tokens`` positions exceed ``model.config.max_position_embeddings``;
    the message names ``what`` needs them and ``fix`` (default: lower it to the context)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and tokens > limit:
        raise CheckpointError(
            f"{what} needs {tokens} positions but the {role} has a context of {limit} "
            f"(config.max_position_embeddings); {fix or f'lower it to at most {limit}'}."
        )


def load_target_and_draft(target: str | os.PathLike, draft: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                          draft_dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                          keys: tuple[str, str] = ("--target", "--draft"), need_tokenizer: bool = True):
    """``(target, draft, tokenizer)`` for the scripts (``scripts/bench_decode.py``, ``scripts/tree_bound.py``): both
    models through :func:`load_causal_lm` (``keys``: the flags named in the messages; the draft may come without
    tokenizer files and then uses the target's; the target may too when ``need_tokenizer=False``, the tokenizer
    returned is then ``None``), the draft's tokenizer checked against the target's
    (:func:`models.vocab.check_tokenizers_compatible`) and both models' rows against the tokenizer
    (:func:`check_vocab_covers_tokenizer`). The draft is loaded in ``draft_dtype`` (default ``dtype``).

    Raises:
        CheckpointError: a directory is missing, partial or unloadable, holds NaN/inf weights, or a model has
            fewer vocabulary rows than the tokenizer.
        models.vocab.TokenizerMismatchError: the two tokenizers differ (every difference listed).
    """
    from models.vocab import check_tokenizers_compatible

    t_model, tok = load_causal_lm(target, "target", dtype, device, key=keys[0], need_tokenizer=need_tokenizer)
    d_model, d_tok = load_causal_lm(draft, "draft", draft_dtype or dtype, device, key=keys[1], need_tokenizer=False)
    if tok is not None:
        if d_tok is not None:
            check_tokenizers_compatible(tok, d_tok, target_name=f"{keys[0]} {target}", draft_name=f"{keys[1]} {draft}")
        check_vocab_covers_tokenizer(t_model, tok, role=f"{keys[0]} {target}")
        check_vocab_covers_tokenizer(d_model, tok, role=f"{keys[1]} {draft}")
    return t_model, d_model, tok


def save_hf_atomic(model, tokenizer, out_dir: str | os.PathLike, extra: Any = None) -> Path:
    """``save_pretrained`` model (safetensors) and tokenizer into ``out_dir`` atomically; ``extra`` (a
    :class:`models.checkpoints.SpecdraftMeta` or the dict of its fields, checked against the schema before anything
    is written) goes to ``specdraft.json`` beside them (what produced the checkpoint).

    Raises:
        models.checkpoints.SpecdraftMetaError: a field of ``extra`` has the wrong type.
    """
    from models.vocab import full_vocab_head

    meta = as_meta(extra) if extra is not None else None
    with atomic_dir(out_dir) as tmp, full_vocab_head(model):  # a trimmed head is saved as its full-vocabulary export
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if meta is not None:
            meta.write(tmp)
    return Path(out_dir)


def check_draft_tokenizer(tokenizer, draft_path, name: str, target: str) -> None:
    """:func:`check_tokenizers_compatible` of the target's ``tokenizer`` and the tokenizer in ``draft_path`` (draft
    ``name`` of an evaluation whose target is ``target``). When they differ and the draft's ``specdraft.json`` names
    another target, the error says so and names the target option that evaluates it, instead of advice to replace
    the draft's tokenizer (which would leave a draft of the other target, proposing ids this target does not mean).

    Raises:
        TokenizerMismatchError: every difference, with the fix; CheckpointError: an unreadable tokenizer."""
    from models.vocab import check_tokenizers_compatible

    try:
        check_tokenizers_compatible(tokenizer, load_tokenizer(draft_path, role=f"draft {name!r}"),
                                    draft_name=f"draft {name!r}")
    except TokenizerMismatchError as e:
        raise _other_target(e, name, draft_path, target) from None


def _other_target(error, name: str, path, target: str) -> TokenizerMismatchError:
    """A tokenizer mismatch of a draft whose ``specdraft.json`` names another target than this evaluation's: the
    error says so, with the command that evaluates it with its own target, instead of advice to replace the draft's
    tokenizer (which would leave a draft of the other target, mapping ids this target does not mean). Otherwise the
    error as it is."""
    try:
        own = read_specdraft_meta(path).target
    except ValueError:  # a damaged specdraft.json: the mismatch as it is
        return error
    if not own or _same_path(own, target):
        return error
    option = next((stem for stem, folder in _target_folders() if folder == Path(own).name), None)
    how = f"target={option} (or target.name_or_path={own})" if option else f"target.name_or_path={own}"
    differences = str(error).split("\nFix:", 1)[0].split("\n", 1)[1] if "\n" in str(error) else ""
    return TokenizerMismatchError(
        f"draft {name!r} was trained for another target, {own} (its specdraft.json), not this evaluation's {target}: "
        f"evaluate it with its own target ({how}); do not give it this target's tokenizer, which would not make it a "
        f"draft of this target. The tokenizers differ:\n{differences}".rstrip())


def _target_folders() -> list[tuple[str, str]]:
    """``(option, folder name)`` of each ``conf/target/<option>.yaml``: the last part of its ``name_or_path``, with a
    ``${paths.<key>}`` interpolation read from ``conf/config.yaml`` (``target=reference``: ``reference_target``)."""
    import re

    from core.groups import load_yaml

    paths = load_yaml(PROJECT_ROOT / "conf" / "config.yaml").get("paths") or {}
    out = []
    for p in sorted((PROJECT_ROOT / "conf" / "target").glob("*.yaml")):
        value = str(load_yaml(p).get("name_or_path") or "")
        m = re.fullmatch(r"\$\{paths\.(\w+)\}", value)
        value = str(paths.get(m.group(1), "")) if m else value
        if value:
            out.append((p.stem, value.rstrip("/").rpartition("/")[2]))
    return out


def _same_path(a: str, b: str) -> bool:
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except OSError:
        return a == b
