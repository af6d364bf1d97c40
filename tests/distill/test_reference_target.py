"""The committed reference target (the default target) and the stage that rebuilds it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from models.checkpoints import SpecdraftMeta

pytestmark = pytest.mark.slow  # whole python -m train / eval runs: outside the fast lane (pytest -m "not slow")

ROOT = Path(__file__).resolve().parents[2]
REF = ROOT / "models" / "assets" / "reference_target"


def test_committed_reference_target_is_complete_and_small():
    from models.checkpoints import load_causal_lm

    weights = list(REF.glob("*.safetensors"))
    assert weights, "models/assets/reference_target has no safetensors"
    assert sum(w.stat().st_size for w in weights) <= 25 * 2**20
    meta = json.loads((REF / "specdraft.json").read_text())
    assert SpecdraftMeta.read(REF).extra == {}  # every field the committed target's file holds is in the schema
    assert len(meta["data_fingerprint_sha256"]) == 64
    assert set(meta["validation_loss_nats_per_token"]) >= {"corpus", "medical", "code", "chat", "math"}
    assert meta["config"]["arch"]["num_layers"] >= 4
    model, tok = load_causal_lm(REF, role="target")
    assert model.config.model_type == "llama"
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>" and tok.pad_token == "<pad>"
    assert model.config.vocab_size == len(tok)
    from data.text import REFERENCE_CHAT_TEMPLATE

    assert tok.chat_template == REFERENCE_CHAT_TEMPLATE  # renders the plain format it was trained on


def test_reference_target_stage_rebuilds_with_one_command(tmp_path):
    """The rebuild command with tiny sizes: tokenizer + model + specdraft.json with the data fingerprint."""
    out = tmp_path / "ref"
    proc = subprocess.run(
        [sys.executable, "-m", "train", "+experiment=reference_target", f"reference.output_dir={out}",
         "reference.domains=[chat]", "reference.vocab_size=400", "reference.block_size=32",
         "reference.arch.hidden_size=32", "reference.arch.num_layers=1", "reference.arch.num_heads=2",
         "reference.arch.intermediate_size=64", "reference.trainer.max_steps=2", "reference.trainer.micro_batch_size=2",
         "reference.trainer.warmup_steps=1", "reference.eval_blocks_per_domain=2", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "SPECDRAFT_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((out / "specdraft.json").read_text())
    assert meta["kind"] == "reference_target" and "chat" in meta["validation_loss_nats_per_token"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 1
    assert len(AutoTokenizer.from_pretrained(out)) <= 400
