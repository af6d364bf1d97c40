"""`python -m train +experiment=smoke` end to end, as a user runs it (subprocess, real data root, committed
reference target), and the checkpoint contract: the draft loads with AutoModelForCausalLM and works as
transformers' assistant_model."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # whole python -m train / eval runs: outside the fast lane (pytest -m "not slow")

ROOT = Path(__file__).resolve().parents[2]


def run_train(*overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "train", *overrides], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("smoke")
    proc = run_train("+experiment=smoke", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run_dir.parent / "smoke_output.txt").write_text(proc.stdout + "\n" + proc.stderr)
    return run_dir


def test_a_run_shows_progress_and_what_matters_not_library_chatter(smoke_run):
    """No DeepSpeed accelerator-detection warning on a CPU machine, no accelerate "Removed shared tensor" at every
    tied-embedding checkpoint, no gguf template warning at each GGUF export, the prompt-truncation warning once (not once more per draft), and the progress bars
    of training and evaluation are there."""
    out = (smoke_run.parent / "smoke_output.txt").read_text()
    assert "Setting accelerator to CPU" not in out
    assert "Removed shared tensor" not in out
    assert "Unknown separator token" not in out  # gguf, at each GGUF export: a pair template, unused in generation
    assert out.count("truncated from the left") <= 1, out[-3000:]
    assert "distilled draft:" in out and "eval medical:" in out


def test_smoke_writes_every_artifact(smoke_run):
    for rel in ("report.md", "metrics.json", "per_prompt.csv", "events.jsonl", "resolved_config.json",
                "drafts/distilled/model.safetensors", "drafts/distilled/tokenizer.json",
                "drafts/baseline/model.safetensors"):
        assert (smoke_run / rel).is_file(), rel
    assert not list(smoke_run.rglob(".*tmp-*")), "a temporary file was left behind"


def test_smoke_metrics_are_consistent_and_lossless(smoke_run):
    doc = json.loads((smoke_run / "metrics.json").read_text())
    assert set(doc["drafts"]) == {"distilled", "baseline"}
    assert doc["lossless_all"] is True
    rows = list(csv.DictReader(open(smoke_run / "per_prompt.csv")))
    for name, by_domain in doc["drafts"].items():
        assert set(by_domain) == {"medical", "code"}
        for domain, e in by_domain.items():
            mine = [r for r in rows if r["draft"] == name and r["domain"] == domain]
            assert len(mine) == e["num_prompts"] == 2
            emitted = sum(int(r["emitted_tokens"]) for r in mine)
            steps = sum(int(r["verify_steps"]) for r in mine)
            accepted = sum(int(r["accepted_tokens"]) for r in mine)
            drafted = sum(int(r["drafted_tokens"]) for r in mine)
            # pooled, never a mean of per-prompt means
            assert e["mean_accepted_length"] == pytest.approx(emitted / steps)
            assert e["acceptance_rate"] == pytest.approx(accepted / drafted)
            assert 1.0 <= e["mean_accepted_length"] <= doc["num_draft_tokens"] + 1
            assert e["lossless"] is True
    report = (smoke_run / "report.md").read_text()
    assert "## medical" in report and "mean accepted length" in report
    for domain in ("medical", "code"):
        d, b = doc["drafts"]["distilled"][domain], doc["drafts"]["baseline"][domain]
        assert doc["vs_baseline"]["distilled"][domain]["mean_accepted_length_ratio"] == pytest.approx(
            d["mean_accepted_length"] / b["mean_accepted_length"])
    assert "## Against the cross-entropy baseline" in report
    lines = report.splitlines()  # it opens with the verdict table, one row per domain, then short verdict lines
    assert lines[2] == "## Verdicts" and lines[4].startswith("| domain | deploy | measured speedup")
    assert [r.split(" | ")[0].lstrip("| ") for r in lines[6:8]] == list(doc["recommendation"])
    assert all(len(v.split()) <= 40 for v in doc["verdicts"].values()) and "## How each verdict was reached" in report
    assert "training time s (one-off teacher passes s)" in report and "unique tokens (most reads)" in report
    # held-out acceptance: every draft on both domains' held-out prompts and on training prompts
    ho = doc["heldout"]
    assert ho["prompts"]["medical"] == 4 and ho["prompts"]["train:medical"] == 2 and "## Held-out acceptance" in report
    for name in ("distilled", "baseline"):
        for d in ("medical", "code", "train:medical"):
            cell = ho["drafts"][name][d]
            assert len(cell["alpha"]) == 5 and [int(g) for g in cell["tau"]] == [1, 2, 3, 4, 5]
            assert all(t is None or 1 <= t <= int(g) + 1 for g, t in cell["tau"].items())


def test_draft_checkpoint_works_as_transformers_assistant(smoke_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from decode import autoregressive_generate

    cfg = json.loads((smoke_run / "resolved_config.json").read_text())
    target = AutoModelForCausalLM.from_pretrained(cfg["target"]["name_or_path"]).eval()
    draft = AutoModelForCausalLM.from_pretrained(smoke_run / "drafts" / "distilled").eval()
    tok = AutoTokenizer.from_pretrained(smoke_run / "drafts" / "distilled")
    ids = tok("Question: What are the symptoms of diabetes ?\nAnswer:", return_tensors="pt")
    with torch.no_grad():
        assisted = target.generate(**ids, assistant_model=draft, do_sample=False, max_new_tokens=16,
                                   pad_token_id=tok.pad_token_id)
    ours = autoregressive_generate(target, ids["input_ids"], max_new_tokens=16, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id)
    n = assisted.size(1)
    assert torch.equal(assisted, ours.sequences[:, :n])


def test_resume_with_different_training_settings_is_refused(smoke_run, tmp_path):
    """Resuming must not mix configs: a changed training key is an error that names it; eval keys may change."""
    import shutil

    run_dir = tmp_path / "copy"
    shutil.copytree(smoke_run, run_dir)
    before = (run_dir / "resolved_config.json").read_text()
    proc = run_train("+experiment=smoke", f"hydra.run.dir={run_dir}", "trainer.resume=true", "distill.loss=reverse_kl",
                     "stages=[distill]")
    assert proc.returncode == 2
    assert "distill.loss" in proc.stderr and "'forward_kl' -> 'reverse_kl'" in proc.stderr, proc.stderr[-2000:]
    assert (run_dir / "resolved_config.json").read_text() == before
    ok = run_train("+experiment=smoke", f"hydra.run.dir={run_dir}", "trainer.resume=true", "stages=[distill]",
                   "eval.max_prompts=1")
    assert ok.returncode == 0, ok.stderr[-2000:]


def test_deepspeed_zero2_smoke_on_two_cpu_processes_matches_one_process(smoke_run, tmp_path):
    """The smoke experiment's distill stage under ``accelerate launch`` with DeepSpeed ZeRO-2 on two CPU processes
    (gloo, torch AdamW): micro-batch 1 x accumulation 2 x 2 processes = the smoke run's global batch of 4, so the
    loss curve and the weights are the single-process run's; the draft loads with ``from_pretrained``."""
    pytest.importorskip("deepspeed")
    import socket

    from transformers import AutoModelForCausalLM

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                     "MASTER_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "conf/accelerate/deepspeed_zero2.yaml",
         "--num_processes", "2", "--num_cpu_threads_per_process", "1", "--main_process_port", str(port),
         "-m", "train", "+experiment=smoke", "trainer=deepspeed_zero2", "stages=[distill]",
         "trainer.micro_batch_size=1", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**env, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
             "CUDA_VISIBLE_DEVICES": ""})  # two CPU processes (gloo), also on a machine with one GPU
    assert proc.returncode == 0, proc.stderr[-4000:]
    meta = json.loads((tmp_path / "drafts" / "distilled" / "specdraft.json").read_text())
    assert meta["train"]["num_processes"] == 2 and meta["train"]["grad_accum_steps"] == 2
    assert meta["train"]["global_batch_sequences"] == 4 and meta["trainer"]["strategy"] == "deepspeed_zero2"
    assert meta["train"]["optimizer_parameters"] == meta["draft_parameters"]  # the draft's parameters, only

    def curve(run_dir):
        recs = [json.loads(l) for l in (run_dir / "train" / "distilled" / "train_log.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}

    one, two = curve(smoke_run), curve(tmp_path)
    assert sorted(one) == sorted(two) and len(one) >= 3
    for step, loss in one.items():
        assert two[step] == pytest.approx(loss, rel=1e-4), step
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "drafts" / "distilled")
    ref = AutoModelForCausalLM.from_pretrained(smoke_run / "drafts" / "distilled").state_dict()
    for name, w in draft.state_dict().items():
        torch.testing.assert_close(w, ref[name], atol=5e-5, rtol=1e-4, msg=name)


def test_train_prints_the_reports_verdict_section(smoke_run):
    """`python -m train`'s stdout carries report.md's verdicts and caveats, as they are there (one renderer:
    eval.report.verdicts_section)."""
    out = (smoke_run.parent / "smoke_output.txt").read_text()
    report = (smoke_run / "report.md").read_text()
    section = report[report.index("## Verdicts"):]
    section = section[:section.index("\n## ", 1)].rstrip("\n")
    assert section.count("\n- **") == 2 and section in out  # medical and code
