"""Loading Hugging Face causal-LM checkpoints (target and drafts) with clear errors."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .errors import CheckpointError
from .specdraft_meta import SpecdraftMeta


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
            f"{role} path {p} does not exist. Point {key} at a Hugging Face model directory "
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
        json.loads((p / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{role} checkpoint {p}: config.json is not valid JSON ({e}); it may be a partial or "
                              f"damaged save: re-run the stage that produced it or point {key} elsewhere.") from None


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
        raise CheckpointError(
            f"could not load the {role} tokenizer from {name_or_path}: {type(e).__name__}: {e}. Check that the "
            f"directory holds complete tokenizer files (tokenizer.json, tokenizer_config.json)."
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
    on ``device`` (``None``: CPU; resolve a config value with :func:`data.devices.resolve_device` first). ``key``
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
        from .draft_vocab import apply_saved_draft_vocab

        try:
            apply_saved_draft_vocab(model, read_specdraft_meta(src).draft_vocab, f"{role} {name_or_path}")
        except ValueError as e:
            raise CheckpointError(str(e)) from e
    if device is not None and torch.device(device) != torch.device("cpu"):
        model.to(device)
    return model.eval(), tok


def read_specdraft_meta(path: str | os.PathLike) -> SpecdraftMeta:
    """The ``specdraft.json`` beside a checkpoint (how it was produced; :class:`data.specdraft_meta.SpecdraftMeta`),
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
    (:func:`data.tokenizer_check.check_tokenizers_compatible`) and both models' rows against the tokenizer
    (:func:`check_vocab_covers_tokenizer`). The draft is loaded in ``draft_dtype`` (default ``dtype``).

    Raises:
        CheckpointError: a directory is missing, partial or unloadable, holds NaN/inf weights, or a model has
            fewer vocabulary rows than the tokenizer.
        data.tokenizer_check.TokenizerMismatchError: the two tokenizers differ (every difference listed).
    """
    from .tokenizer_check import check_tokenizers_compatible

    t_model, tok = load_causal_lm(target, "target", dtype, device, key=keys[0], need_tokenizer=need_tokenizer)
    d_model, d_tok = load_causal_lm(draft, "draft", draft_dtype or dtype, device, key=keys[1], need_tokenizer=False)
    if tok is not None:
        if d_tok is not None:
            check_tokenizers_compatible(tok, d_tok, target_name=f"{keys[0]} {target}", draft_name=f"{keys[1]} {draft}")
        check_vocab_covers_tokenizer(t_model, tok, role=f"{keys[0]} {target}")
        check_vocab_covers_tokenizer(d_model, tok, role=f"{keys[1]} {draft}")
    return t_model, d_model, tok
