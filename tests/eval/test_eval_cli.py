"""`python -m eval` on tiny checkpoints built here: a mismatched draft tokenizer stops before any decoding with
an error that says what differs; a matching draft produces the report files."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_llama

ROOT = Path(__file__).resolve().parents[2]
TEXT = ["Question: What is diabetes?\nAnswer: A disease of blood sugar.", "def add(a, b):\n    return a + b",
        "User: hello there\nAssistant: hi, how can I help?", "The patient reports chest pain and cough."] * 20


def _save(tmp: Path, name: str, texts, vocab_size: int, seed: int) -> Path:
    from data.tokenization import train_bpe_tokenizer

    tok = train_bpe_tokenizer(iter(texts), vocab_size=vocab_size, min_frequency=1)
    model = tiny_llama(vocab_size=len(tok), seed=seed, eos_token_id=tok.eos_token_id)
    out = tmp / name
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eval", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "WANDB_MODE": "offline"})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("models")
    target = _save(tmp, "target", TEXT, 300, 0)
    same = _save(tmp, "draft_same", TEXT, 300, 1)
    other = _save(tmp, "draft_other", [t.upper() for t in TEXT], 300, 2)
    return target, same, other


def test_tokenizer_mismatch_is_a_clear_error(models, tmp_path):
    target, _, other = models
    proc = _eval(f"target.name_or_path={target}", f"eval.drafts={{bad: {other}}}", "eval.domains=[chat]",
                 "eval.max_prompts=1", "eval.max_new_tokens=4", f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert "tokenizer" in proc.stderr.lower() and "vocabulary" in proc.stderr.lower(), proc.stderr[-2000:]
    assert not (tmp_path / "metrics.json").exists()


def test_eval_cli_writes_report(models, tmp_path):
    target, same, _ = models
    proc = _eval(f"target.name_or_path={target}", f"eval.drafts={{mine: {same}}}", "eval.domains=[chat,math]",
                 "eval.max_prompts=2", "eval.max_new_tokens=6", "eval.cost_ratio_trials=2",
                 f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "metrics.json").read_text())
    assert set(doc["drafts"]["mine"]) == {"chat", "math"}
    assert doc["lossless_all"] is True


@pytest.mark.parametrize("override, needle", [
    ("decode.num_draft_tokens=0", "num_draft_tokens"),
    ("eval.domains=[nope]", "nope"),
    ("target.name_or_path=/does/not/exist", "/does/not/exist"),
])
def test_bad_eval_input_exits_nonzero(models, tmp_path, override, needle):
    _, same, _ = models
    proc = _eval(f"eval.drafts={{mine: {same}}}", "eval.domains=[chat]", override, f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert needle in proc.stderr, proc.stderr[-2000:]
