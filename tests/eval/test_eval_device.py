"""``eval.device`` / ``eval.dtype``: resolved on this machine, refused when the machine cannot provide them, and
recorded in ``metrics.json`` / ``report.md`` (device, dtype, threads, torch / CUDA versions, GPU name).

The end-to-end run is ``python -m eval eval.device=cpu eval.dtype=bfloat16`` on tiny checkpoints built here (the
models really run in bfloat16: their weights are checked after loading through the same code path).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinymodels import tiny_llama

ROOT = Path(__file__).resolve().parents[2]
TEXT = ["Question: What is diabetes?\nAnswer: A disease of blood sugar.", "def add(a, b):\n    return a + b",
        "User: hello there\nAssistant: hi, how can I help?"] * 20


def _eval(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eval", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "WANDB_MODE": "offline", **(env or {})})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from data.text import train_bpe_tokenizer

    tmp = tmp_path_factory.mktemp("pair")
    tok = train_bpe_tokenizer(iter(TEXT), vocab_size=300, min_frequency=1)
    out = {}
    for name, seed in (("target", 0), ("draft", 1)):
        tiny_llama(vocab_size=len(tok), seed=seed, eos_token_id=tok.eos_token_id).save_pretrained(tmp / name)
        tok.save_pretrained(tmp / name)
        out[name] = tmp / name
    shutil.copytree(out["target"], tmp / "twin")
    out["twin"] = tmp / "twin"
    return out


@pytest.mark.slow
def test_bfloat16_on_cpu_end_to_end_and_the_report_says_so(pair, tmp_path):
    proc = _eval(f"target.name_or_path={pair['target']}", f"eval.drafts={{mine: {pair['draft']}, twin: {pair['twin']}}}",
                 "eval.domains=[chat]", "eval.max_prompts=2", "eval.max_new_tokens=6", "eval.cost_ratio_trials=2",
                 "eval.bootstrap_samples=20", "eval.num_threads=1", "eval.device=cpu", "eval.dtype=bfloat16",
                 "eval.plots=false", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "metrics.json").read_text())
    rt = doc["context"]["runtime"]
    assert rt["device"] == "cpu" and rt["dtype"] == "bfloat16" and rt["threads"] == 1
    assert rt["torch"] == torch.__version__ and rt["cuda"] is None and rt["gpu"] is None
    report = (tmp_path / "report.md").read_text()
    assert rt["block_threads"] is None  # decode.block_threads auto: the caller's 1 thread for every forward
    blocks_text = ""
    assert f"- runtime: cpu, bfloat16, 1 torch CPU threads{blocks_text}, torch {torch.__version__}" in report
    twin = doc["drafts"]["twin"]["chat"]
    assert twin["num_prompts"] == 2 and twin["mean_accepted_length"] > 1.0  # the decoder ran on the bf16 models
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["dtype"] for e in events if e["event"] == "eval_runtime"] == ["bfloat16"]


def test_models_load_in_the_requested_dtype_and_device(pair):
    from models.checkpoints import load_causal_lm
    from decode.fast_settings import load_draft

    model, _ = load_causal_lm(pair["target"], role="target", dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    draft, _, _ = load_draft(pair["draft"], dtype=torch.bfloat16, device=torch.device("cpu"))
    assert {p.dtype for p in draft.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in draft.parameters()} == {"cpu"}


@pytest.mark.slow
def test_unavailable_cuda_is_refused_with_one_line_and_exit_2(pair, tmp_path):
    """A machine without a visible GPU (CUDA_VISIBLE_DEVICES= hides one where there is one) refuses eval.device=cuda
    before Hydra writes anything."""
    run_dir = tmp_path / "run"
    proc = _eval(f"target.name_or_path={pair['target']}", f"eval.drafts={{mine: {pair['draft']}}}",
                 "eval.domains=[chat]", "eval.device=cuda", f"hydra.run.dir={run_dir}",
                 env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "eval.device=cuda" in last and "no CUDA device is available" in last
    assert "set eval.device=cpu" in last
    assert not run_dir.exists()


def test_a_cuda_index_beyond_the_device_count_is_refused(monkeypatch):
    """Faked: one visible GPU; cuda:1 names a device that is not there (cuda:0 and null resolve)."""
    from core.runtime import resolve_device, resolve_dtype
    from core.errors import DeviceError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_device("cuda:0") == torch.device("cuda", 0) == resolve_device("cuda")
    assert resolve_device(None) == torch.device("cuda") and resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    with pytest.raises(DeviceError, match=r"eval.device=cuda:1 but this machine has 1 CUDA device\(s\)"):
        resolve_device("cuda:1")


@pytest.mark.parametrize("device,dtype,match", [("mps", None, "not supported; use cpu, cuda"),
                                                ("cpu", "int4", "eval.dtype='int4' is not supported"),
                                                ("gpu0", None, "not a device")])
def test_bad_device_or_dtype_names_are_config_errors(device, dtype, match):
    from eval.config import EvalConfig

    with pytest.raises(ValueError, match=match):
        EvalConfig(device=device, dtype=dtype)


def test_defaults_follow_the_machine(monkeypatch):
    from core.runtime import resolve_device, resolve_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == torch.device("cpu") == resolve_device("auto")
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_int8_draft_on_bfloat16_is_refused_before_loading(pair, tmp_path):
    from models.checkpoints import CheckpointError
    from decode.fast_settings import check_quantize_device

    d = tmp_path / "int8"
    shutil.copytree(pair["draft"], d)
    (d / "specdraft.json").write_text(json.dumps({"quantize": "int8"}))
    assert check_quantize_device(d, "cpu", torch.float32) == "int8"
    with pytest.raises(CheckpointError, match="set eval.device=cpu eval.dtype=float32"):
        check_quantize_device(d, "cpu", torch.bfloat16)


def test_a_bad_device_from_the_environment_says_where_it_came_from(monkeypatch):
    """conf/config.yaml takes eval.device from $SPECDRAFT_EVAL_DEVICE: a bad value there names the variable,
    so the user does not look for an eval.device they never wrote; the same value given as eval.device does not."""
    from eval.config import EvalConfig

    monkeypatch.setenv("SPECDRAFT_EVAL_DEVICE", "gpu")
    with pytest.raises(ValueError, match=r"'gpu' is not a device.*came from the environment variable "
                                         r"SPECDRAFT_EVAL_DEVICE: unset it"):
        EvalConfig(device="gpu")
    monkeypatch.delenv("SPECDRAFT_EVAL_DEVICE")
    with pytest.raises(ValueError, match="'gpu' is not a device") as e:
        EvalConfig(device="gpu")
    assert "SPECDRAFT_EVAL_DEVICE" not in str(e.value)
