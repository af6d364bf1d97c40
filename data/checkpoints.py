"""Loading Hugging Face causal-LM checkpoints (target and drafts) with clear errors."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A model directory that does not exist, is partial, or cannot be read."""


def load_causal_lm(name_or_path: str | os.PathLike, role: str = "model", dtype: torch.dtype = torch.float32):
    """Load ``(model, tokenizer)`` from a Hugging Face directory or hub id, in eval mode.

    Raises:
        CheckpointError: the path does not exist (and does not look like a hub id), lacks config/weights/tokenizer
            files, or fails to load; the message names the path, what is missing, and how to fix it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(str(name_or_path)).expanduser()
    looks_local = p.exists() or str(name_or_path).startswith((".", "/", "~")) or str(name_or_path).count("/") > 1
    if looks_local:
        if not p.is_dir():
            raise CheckpointError(
                f"{role} path {p} does not exist. Point {role}.name_or_path at a Hugging Face model directory "
                f"(config.json + *.safetensors + tokenizer files) or a hub id."
            )
        missing = [n for n in ("config.json",) if not (p / n).exists()]
        if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
            missing.append("model weights (*.safetensors)")
        if not any((p / n).exists() for n in ("tokenizer.json", "tokenizer_config.json")):
            missing.append("tokenizer files (tokenizer.json)")
        if missing:
            raise CheckpointError(
                f"{role} checkpoint {p} is incomplete: missing {', '.join(missing)}. It may be a partial or "
                f"interrupted save; re-run the stage that produced it or point {role}.name_or_path elsewhere."
            )
    try:
        tok = AutoTokenizer.from_pretrained(str(p) if looks_local else name_or_path)
        model = AutoModelForCausalLM.from_pretrained(str(p) if looks_local else name_or_path, dtype=dtype)
    except Exception as e:
        raise CheckpointError(
            f"could not load {role} from {name_or_path}: {type(e).__name__}: {e}. Check that the directory is a "
            f"complete Hugging Face causal-LM checkpoint (or that the hub is reachable for a hub id)."
        ) from e
    return model.eval(), tok


def read_specdraft_meta(path: str | os.PathLike) -> dict:
    """The ``specdraft.json`` beside a checkpoint (how it was produced), ``{}`` when there is none.

    Raises:
        CheckpointError: the file exists but is not a JSON object (names the file).
    """
    f = Path(path) / "specdraft.json"
    if not f.exists():
        return {}
    try:
        meta = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} is not valid JSON ({e}); restore it or delete it (it only describes how the "
                              f"checkpoint was made).") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{f} must hold a JSON object, got {type(meta).__name__}; restore it or delete it.")
    return meta


def check_vocab_covers_tokenizer(model, tokenizer, role: str = "draft") -> None:
    """Raise :class:`CheckpointError` when ``model`` has fewer embedding or output rows than ``tokenizer`` has
    tokens (it could not read or propose some ids). More rows (padding) are fine: the decoder compares only the
    shared ids.
    """
    n_tok = len(tokenizer)
    n_in = model.get_input_embeddings().num_embeddings
    out = model.get_output_embeddings()
    n_out = out.weight.shape[0] if out is not None else n_in
    if min(n_in, n_out) < n_tok:
        raise CheckpointError(
            f"{role} has {n_in} input / {n_out} output embedding rows but the tokenizer has {n_tok} tokens; it cannot "
            f"represent every token. Resize it (model.resize_token_embeddings({n_tok})) and fine-tune, or use a draft "
            f"built for this tokenizer."
        )


def check_context_fits(model, tokens: int, role: str, what: str) -> None:
    """Raise :class:`CheckpointError` when ``tokens`` positions exceed ``model.config.max_position_embeddings``."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and tokens > limit:
        raise CheckpointError(
            f"{what} needs {tokens} positions but the {role} has a context of {limit} "
            f"(config.max_position_embeddings); lower it to at most {limit}."
        )
