"""`python -m eval` under faults and bad input, on tiny checkpoints built here.

* kill -9 during an evaluation into a run directory that already has a report: the previous report set stays
  complete and byte-identical; rerunning the same command gives the same numbers as an uninterrupted run.
* a full disk while the report is written: a clear error, the previous report set intact.
* a draft with NaN weights is refused (it would otherwise be "evaluated" with acceptance 0).
* a prompt longer than ``eval.max_prompt_tokens``: truncated from the left with a warning, or an error before any
  model loads (``eval.prompt_overflow=error``).
"""
from __future__ import annotations

import csv
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinymodels import kill_9_when, tiny_llama

pytestmark = pytest.mark.slow  # whole python -m train / eval runs: outside the fast lane (pytest -m "not slow")

ROOT = Path(__file__).resolve().parents[2]
TEXT = ["Question: What is diabetes?\nAnswer: A disease of blood sugar.", "def add(a, b):\n    return a + b",
        "User: hello there\nAssistant: hi, how can I help?", "The patient reports chest pain and cough."] * 20
TIMING = ("_time_s", "_times_s", "_tokens_per_s", "speedup", "cost_ratio", "overhead", "latency", "draft_forward_s", "target_forward_s",
          "best_num_draft_tokens", "leviathan_curve")  # the last two follow the measured speedup


def _save(tmp: Path, name: str, vocab_size: int, seed: int, tokenizer=None) -> Path:
    from data.text import train_bpe_tokenizer

    tok = tokenizer or train_bpe_tokenizer(iter(TEXT), vocab_size=vocab_size, min_frequency=1)
    model = tiny_llama(vocab_size=len(tok), seed=seed, eos_token_id=tok.eos_token_id)
    out = tmp / name
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("models")
    target = _save(tmp, "target", 300, 0)
    draft = _save(tmp, "draft", 300, 1, tokenizer=AutoTokenizer.from_pretrained(target))
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"q": f"User: tell me about item {i}\nAssistant:"}) + "\n"
                               for i in range(3)))
    return target, draft, prompts


def _args(models, run_dir: Path, *extra: str, drafts: str | None = None) -> list[str]:
    target, draft, prompts = models
    return [f"target.name_or_path={target}", f"eval.drafts={drafts or f'{{mine: {draft}}}'}", "eval.domains=[chat]",
            f"eval.extra_domains=[{{name: mine_file, path: {prompts}, text_field: q}}]", "eval.max_prompts=3",
            "eval.max_new_tokens=12", "eval.cost_ratio_trials=2", "eval.bootstrap_samples=50", "eval.plots=false",
            "eval.num_draft_tokens=[1,3]", f"hydra.run.dir={run_dir}", *extra]


def _run_in_process(models, run_dir: Path, *extra: str, drafts: str | None = None) -> dict:
    from hydra import compose, initialize_config_dir

    import eval.__main__ as em

    overrides = [a for a in _args(models, run_dir, *extra, drafts=drafts) if not a.startswith("hydra.")]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return em.run(cfg, run_dir)


def _deterministic(run_dir: Path) -> tuple:
    """What must not change between runs: every count and acceptance number (timings naturally vary)."""
    doc = json.loads((run_dir / "metrics.json").read_text())

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if not any(t in k for t in TIMING)}
        return [strip(v) for v in x] if isinstance(x, list) else x

    with open(run_dir / "per_prompt.csv", newline="") as f:
        rows = [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in csv.DictReader(f)]
    return strip(doc["drafts"]), rows


def _report_set(run_dir: Path) -> dict[str, bytes]:
    return {n: (run_dir / n).read_bytes() for n in ("report.md", "metrics.json", "per_prompt.csv")}


def test_kill_9_during_eval_keeps_the_old_report_and_rerun_gives_the_same_numbers(models, tmp_path):
    run_dir = tmp_path / "run"
    _run_in_process(models, run_dir)
    before, numbers = _report_set(run_dir), _deterministic(run_dir)
    n_events = len((run_dir / "events.jsonl").read_text().splitlines())

    # the same command, killed mid-way (after the models are loaded, while the cost ratio is being timed)
    proc = subprocess.Popen([sys.executable, "-m", "eval", *_args(models, run_dir, "eval.cost_ratio_trials=400")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "TQDM_DISABLE": "1"})
    def eval_started() -> bool:
        lines = (run_dir / "events.jsonl").read_text().splitlines()[n_events:]
        return any(json.loads(l)["event"] == "eval_start" for l in lines)

    kill_9_when(proc, eval_started, timeout_s=120, what="the evaluation did not start", poll_s=0.02)
    assert _report_set(run_dir) == before  # the previous complete set, byte for byte
    # the killed command left only its attempt record; the record behind the current report is unchanged
    assert (run_dir / ".hydra-eval-last").is_dir() and not (run_dir / ".hydra").exists()

    _run_in_process(models, run_dir)  # rerun: same numbers, the set replaced whole, no staging left behind
    assert _deterministic(run_dir) == numbers
    store = run_dir / ".report"
    assert sorted(p.name.split("-")[0] for p in store.iterdir()) == ["current", "v"], list(store.iterdir())


def test_full_disk_while_writing_the_report_keeps_the_previous_set(models, tmp_path, monkeypatch):
    import core.io as dio
    from core.cli import EXIT_WRITE_FAULT, classify
    from core.errors import ArtifactWriteError

    run_dir = tmp_path / "run"
    _run_in_process(models, run_dir)
    before = _report_set(run_dir)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dio.os, "fsync", full)
    with pytest.raises(ArtifactWriteError) as ei:
        _run_in_process(models, run_dir, "eval.max_new_tokens=6")
    monkeypatch.undo()
    assert _report_set(run_dir) == before
    code, msg = classify(ei.value)
    assert code == EXIT_WRITE_FAULT and "disk is full" in msg and "intact" in msg, msg


def test_draft_with_nan_weights_is_refused(models, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, draft, _ = models
    bad = tmp_path / "nan_draft"
    m = AutoModelForCausalLM.from_pretrained(draft)
    with torch.no_grad():
        m.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
        m.lm_head.weight[1, 1] = float("inf")
    m.save_pretrained(bad)
    AutoTokenizer.from_pretrained(draft).save_pretrained(bad)
    args = _args(models, tmp_path / "run", drafts=f"{{diverged: {bad}}}")
    proc = subprocess.run([sys.executable, "-m", "eval", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last.startswith("error: draft 'diverged' checkpoint") and "non-finite (NaN or inf)" in last, last
    assert "up_proj" in last and "lm_head" in last
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_long_prompts_are_truncated_with_a_warning_or_refused(models, tmp_path, caplog):
    from core.errors import PromptTooLongError

    target, draft, _ = models
    long_file = tmp_path / "long.jsonl"
    long_file.write_text(json.dumps({"q": "the patient reports chest pain " * 40}) + "\n"
                         + json.dumps({"q": "short"}) + "\n")
    extra = [f"eval.extra_domains=[{{name: long, path: {long_file}, text_field: q}}]", "eval.domains=[]",
             "eval.max_prompt_tokens=32", "eval.num_draft_tokens=[2]"]
    with caplog.at_level("WARNING"):
        _run_in_process(models, tmp_path / "ok", *extra)
    doc = json.loads((tmp_path / "ok" / "metrics.json").read_text())
    assert doc["truncated_prompts"] == 1
    assert any("truncated from the left" in r.getMessage() for r in caplog.records)
    with open(tmp_path / "ok" / "per_prompt.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert max(int(r["prompt_tokens"]) for r in rows) == 32

    with pytest.raises(PromptTooLongError) as ei:
        _run_in_process(models, tmp_path / "err", *extra, "eval.prompt_overflow=error")
    msg = str(ei.value)
    assert "long prompt" in msg and "eval.max_prompt_tokens=32" in msg and "truncate_left" in msg, msg
    assert not (tmp_path / "err" / "metrics.json").exists()


def test_truncated_weights_file_is_a_clear_error(models, tmp_path):
    """A checkpoint whose weights file was cut short (a killed copy): the error names the draft and the folder."""
    import shutil

    from models.checkpoints import CheckpointError

    _, draft, _ = models
    bad = tmp_path / "cut"
    shutil.copytree(draft, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError) as ei:
        _run_in_process(models, tmp_path / "run", drafts=f"{{cut: {bad}}}")
    msg = str(ei.value)
    assert msg.startswith(f"could not load draft 'cut' from {bad}") and "complete Hugging Face" in msg, msg
    assert not (tmp_path / "run" / "metrics.json").exists()
