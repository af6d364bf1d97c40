"""Model builders: Llama configs from a small architecture spec, loading HF checkpoints with clear errors."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass
class LlamaArch:
    """Architecture of a Llama-style causal LM built from config (vocab size comes from the tokenizer)."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int | None = None
    intermediate_size: int = 344
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
        if min(self.hidden_size, self.num_layers, self.num_heads, self.intermediate_size) < 1:
            raise ValueError(f"every architecture size must be >= 1, got {asdict(self)}")


def build_llama(arch: LlamaArch, tokenizer, seed: int = 0, vocab_size: int | None = None):
    """A freshly initialised ``LlamaForCausalLM`` for ``tokenizer`` (vocab = ``len(tokenizer)`` unless given)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads or arch.num_heads,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        rope_theta=arch.rope_theta,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def count_parameters(model) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


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
    f = Path(path) / "specdraft.json"
    return json.loads(f.read_text()) if f.exists() else {}
