"""`python -m eval` on tiny checkpoints built here.

One real CLI run (two drafts, a gamma sweep, a Spec-Bench domain, a user JSONL domain, ``logger=wandb`` offline)
feeds several tests: the report files exist and agree with each other (pooled numbers recomputed from
``per_prompt.csv`` equal ``metrics.json``), the sweep recommends a gamma per domain, the plots are readable PNGs,
events.jsonl and the offline wandb run directory hold the metrics. Bad input is a clear error: a mismatched draft
tokenizer stops before any decoding and says what differs; a bad target path exits non-zero through the CLI;
config errors are rejected before any model loads (in-process, through the same ``run``).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tinymodels import compose_config, save_tiny_lm

pytestmark = pytest.mark.slow  # whole python -m train / eval runs: outside the fast lane (pytest -m "not slow")

ROOT = Path(__file__).resolve().parents[2]
TEXT = ["Question: What is diabetes?\nAnswer: A disease of blood sugar.", "def add(a, b):\n    return a + b",
        "User: hello there\nAssistant: hi, how can I help?", "The patient reports chest pain and cough."] * 20
SWEEP = [1, 2, 3]


def _save(tmp: Path, name: str, texts, vocab_size: int, seed: int) -> Path:
    return save_tiny_lm(tmp / name, texts, vocab_size, seed)


def _eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eval", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "WANDB_MODE": "offline"})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("models")
    target = _save(tmp, "target", TEXT, 300, 0)
    same = _save(tmp, "draft_same", TEXT, 300, 1)
    other = _save(tmp, "draft_other", [t.upper() for t in TEXT], 300, 2)
    twin = tmp / "draft_twin"  # the target itself as a draft: every drafted token is accepted
    shutil.copytree(target, twin)
    return target, same, other, twin


def test_tokenizer_mismatch_is_a_clear_error(models, tmp_path):
    from eval.__main__ import run

    target, _, other, _ = models
    cfg = compose_config([f"target.name_or_path={target}", f"eval.drafts={{bad: {other}}}", "eval.domains=[chat]",
                    "eval.max_prompts=1", "eval.max_new_tokens=4"])
    with pytest.raises(ValueError) as ei:
        run(cfg, tmp_path)
    msg = str(ei.value).lower()
    assert "tokenizer" in msg and "vocabulary" in msg, msg
    assert list(tmp_path.iterdir()) == []  # checked before any model loads or anything is written


@pytest.mark.parametrize("own, option", [("/somewhere/.cache/specdraft/targets/SmolLM2-135M-Instruct-Q4_1", "smollm2"),
                                         ("/elsewhere/specdraft/models/assets/reference_target", "reference")])
def test_a_draft_of_another_target_is_named_as_such_not_told_to_take_this_tokenizer(models, tmp_path, own, option):
    """A draft whose specdraft.json names another target (here the converted SmolLM2's cache folder) and whose
    tokenizer differs: the error names that target and the option that evaluates the draft with it, still lists what
    differs, and gives no advice to save this target's tokenizer into the draft (which would damage it)."""
    from eval.__main__ import run

    target, _, other, _ = models
    draft = tmp_path / "draft"
    shutil.copytree(other, draft)
    (draft / "specdraft.json").write_text(json.dumps({"kind": "distilled", "target": own}))
    cfg = compose_config([f"target.name_or_path={target}", f"eval.drafts={{bad: {draft}}}", "eval.domains=[chat]",
                          "eval.max_prompts=1", "eval.max_new_tokens=4"])
    with pytest.raises(ValueError) as ei:
        run(cfg, tmp_path / "run")
    msg = str(ei.value)
    assert f"draft 'bad' was trained for another target, {own}" in msg, msg
    assert f"target={option} (or target.name_or_path={own})" in msg and "vocabulary" in msg, msg
    assert "save_pretrained" not in msg, msg


@pytest.fixture(scope="module")
def cli_run(models, tmp_path_factory):
    """One `python -m eval` run with two drafts, a sweep, a Spec-Bench domain and a user domain, wandb offline."""
    target, same, _, twin = models
    run_dir = tmp_path_factory.mktemp("cli_run")
    user = run_dir.parent / "user_prompts.jsonl"
    user.write_text("".join(json.dumps({"q": f"User: tell me about item {i}\nAssistant:"}) + "\n" for i in range(3)))
    proc = _eval(f"target.name_or_path={target}", f"eval.drafts={{mine: {same}, twin: {twin}}}",
                 "eval.domains=[chat,specbench_qa]", f"eval.extra_domains=[{{name: mine_file, path: {user}, "
                 f"text_field: q}}]", f"eval.num_draft_tokens={SWEEP}", "eval.max_prompts=2",
                 "eval.max_new_tokens=8", "eval.cost_ratio_trials=2", "eval.bootstrap_samples=200",
                 "eval.num_threads=1", "logger=wandb", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


def test_eval_cli_writes_report(cli_run):
    run_dir, proc = cli_run
    doc = json.loads((run_dir / "metrics.json").read_text())
    domains = ["chat", "specbench_qa", "mine_file"]
    assert list(doc["drafts"]) == ["mine", "twin", "prompt_lookup", "suffix"]  # eval.lookup_drafts beside them
    for draft in doc["drafts"].values():
        assert list(draft) == domains
        for e in draft.values():
            assert sorted(map(int, e["sweep"])) == SWEEP
            for f in ("acceptance_rate", "mean_accepted_length", "measured_speedup", "expected_speedup",
                      "target_tokens_per_s", "speculative_tokens_per_s", "draft_time_s", "verify_time_s"):
                # a lookup draft that found no match in a domain drafted nothing: no acceptance rate
                assert isinstance(e[f], float) or (f in ("acceptance_rate", "expected_speedup") and e[f] is None
                                                   and e.get("mean_draft_length") == 0), f
            lo, hi = e["mean_accepted_length_ci"]
            assert lo <= e["mean_accepted_length"] <= hi
            assert set(e["speculative_latency_s"]) == {"p50", "p95", "p99"}
            assert len(e["per_position_acceptance"]) <= e["num_draft_tokens"]
    for draft in doc["drafts"].values():  # eval.max_prompts caps the built-in domains; a user file: every record
        assert [draft[d]["num_prompts"] for d in domains] == [2, 2, 3]
    assert doc["lossless_all"] is True
    twin = doc["drafts"]["twin"]["chat"]
    assert twin["acceptance_rate"] == 1.0 and twin["token_acceptance_rate"] == 1.0
    assert doc["num_draft_tokens"] == 3 and doc["num_draft_tokens_swept"] == SWEEP  # closest to decode's 4
    # decode.compile is applied and recorded: auto is off on the CPU, so nothing compiled and no compile time
    assert doc["context"]["decode_compile"] == {"setting": "auto", "compiled": False, "compile_time_s": 0.0}
    report = (run_dir / "report.md").read_text()
    for d in domains:  # one verdict line per domain: a draft and setting, or the target alone
        assert f"- **{d}**: use `" in report or f"- **{d}**: decode with the target alone" in report
    assert "plots/acceptance_by_domain.png" in report and "mine_file" in report
    section = report[report.index("## Verdicts"):]
    section = section[:section.index("\n## ", 1)].rstrip("\n")
    assert section in proc.stdout  # the stdout summary is report.md's verdict section, caveats included
    assert "'mine_file' (user file " in proc.stdout and "3 of its 3 records are evaluation prompts" in proc.stdout


def test_per_prompt_csv_recomputes_metrics_json(cli_run):
    """Numbers agree across files: pooled tau from per_prompt.csv equals metrics.json, for every cell."""
    import csv

    from eval.metrics import aggregate, json_clean, read_per_prompt_csv

    run_dir, _ = cli_run
    doc = json.loads((run_dir / "metrics.json").read_text())
    with open(run_dir / "per_prompt.csv", newline="") as f:
        raw = list(csv.DictReader(f))
    assert len(raw) == 4 * len(SWEEP) * (2 + 2 + 3)  # drafts (2 + the 2 lookup drafts) x gammas x prompts (2 per
    # built-in domain, 3 records)
    cells: dict = {}
    for r in raw:
        c = cells.setdefault((r["draft"], r["domain"], r["num_draft_tokens"]), [0, 0])
        c[0] += int(r["emitted_tokens"])
        c[1] += int(r["verify_steps"])
    for (draft, domain, g), (emitted, steps) in cells.items():
        assert doc["drafts"][draft][domain]["sweep"][g]["mean_accepted_length"] == pytest.approx(emitted / steps,
                                                                                                 abs=1e-12)
    # and the whole document's numbers, bootstrap intervals included, are a function of the CSV
    rows = read_per_prompt_csv(run_dir / "per_prompt.csv")
    again = json_clean(aggregate(rows, {n: c["cost_ratio"] for n, c in doc["cost_ratio"].items()},
                                 primary_num_draft_tokens=doc["num_draft_tokens"], bootstrap_samples=200,
                                 seed=doc["context"]["seed"], verify_cost_ratio=doc["verify_cost_ratio"],
                                 target_forward_s={n: c["target_forward_s"] for n, c in doc["cost_ratio"].items()}))
    assert again["drafts"] == doc["drafts"]
    assert again["recommendation"] == doc["best_measured"]  # the fastest measured setting; the verdict's decision
    import copy

    from eval.report import add_decisions  # is a function of the document's numbers

    fresh = copy.deepcopy(doc)
    for k in ("recommendation", "noisy", "verdicts"):
        fresh.pop(k, None)
    add_decisions(fresh, doc["noisy_relative_width"])
    assert json_clean(fresh["recommendation"]) == doc["recommendation"]


def test_sweep_recommends_num_draft_tokens_per_domain(cli_run):
    run_dir, _ = cli_run
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert set(doc["recommendation"]) == {"chat", "specbench_qa", "mine_file"}
    from eval.decision import MIN_MEAN_ACCEPTED_LENGTH, candidates, paying_settings
    from decision_oracle import check_consistent

    floor = doc.get("min_mean_accepted_length")
    floor = MIN_MEAN_ACCEPTED_LENGTH if floor is None else float(floor)
    for domain, r in doc["recommendation"].items():
        kept, dropped = paying_settings(candidates(doc, domain), floor, doc.get("verify_cost_ratio"))
        assert len(dropped) == len(r["set_aside"])
        if kept:  # the decision follows from the numbers of the settings that can pay for themselves
            check_consistent(r, kept)
        measured = {(n, int(g)): e["measured_speedup"] for n in doc["drafts"]
                    for g, e in doc["drafts"][n][domain]["sweep"].items()}
        best = doc["best_measured"][domain]
        assert best["measured_speedup"] == max(measured.values())
        assert measured[(best["draft"], best["num_draft_tokens"])] == best["measured_speedup"]
        if r["draft"] is None:  # the target alone: the fastest setting that could pay measured below 1 (or none could)
            assert all(c["measured_speedup"] < 1 for c in kept) and "decode with the target alone" in doc["verdicts"][
                domain]
            continue
        assert r["num_draft_tokens"] in SWEEP and r["draft"] in doc["drafts"]
        for n in doc["drafts"]:
            e = doc["drafts"][n][domain]
            assert e["best_num_draft_tokens"] == max(SWEEP, key=lambda g: e["sweep"][str(g)]["measured_speedup"])
            curve = e["leviathan_curve"]
            assert curve["num_draft_tokens"][0] == 1 and len(curve["expected_speedup"]) >= max(SWEEP)
        assert f"num_draft_tokens={r['num_draft_tokens']}" in doc["verdicts"][domain]


def test_plots_events_and_wandb_offline_run(cli_run):
    import matplotlib.image as mpimg

    run_dir, _ = cli_run
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert set(doc["plots"]) == {"acceptance_by_domain", "accepted_length_histograms",
                                 "speedup_vs_num_draft_tokens", "per_position_acceptance"}
    for rel in doc["plots"].values():
        img = mpimg.imread(run_dir / rel)
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 300
    assert not list((run_dir / "plots").glob(".*tmp*"))  # atomic writes leave no temp files

    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    names = [e["event"] for e in events]
    assert names[0] == "stage_start" and names[-1] == "stage_end"
    assert sorted(e["domain"] for e in events if e["event"] == "eval_domain_done") == sorted(
        ["chat", "specbench_qa", "mine_file"])
    assert "eval_wandb" in names

    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((run_dir / "wandb").iterdir())
    wandb_file = next(runs[0].glob("run-*.wandb"))
    blob = wandb_file.read_bytes()
    # the summary (same metrics as metrics.json) is in the offline run's log
    assert b"eval/twin/chat/mean_accepted_length" in blob and b"eval/recommendation/chat/num_draft_tokens" in blob
    saved = json.loads((runs[0] / "files" / "specdraft_metrics.json").read_text())
    assert saved["drafts"]["twin"]["chat"]["mean_accepted_length"] == doc["drafts"]["twin"]["chat"][
        "mean_accepted_length"]
    media = list((runs[0] / "files" / "media").rglob("*.png"))
    assert len(media) >= 4


def test_bad_target_exits_nonzero(models, tmp_path):
    _, same, _, _ = models
    proc = _eval(f"eval.drafts={{mine: {same}}}", "eval.domains=[chat]", "target.name_or_path=/does/not/exist",
                 f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert "/does/not/exist" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("override, needle", [
    ("decode.num_draft_tokens=0", "num_draft_tokens"),
    ("eval.domains=[nope]", "nope"),
    ("eval.num_draft_tokens=[2,0]", "eval.num_draft_tokens"),
    ("eval.num_draft_tokens=[2,100000]", "exceed eval.max_new_tokens"),  # a gamma no step can reach
    ("eval.bootstrap_samples=-1", "bootstrap_samples"),
    ("eval.extra_domains=[{name: chat, path: x.jsonl, text_field: q}]", "registered domain"),
    ("eval.extra_domains=[{name: mine, path: /no/such/file.jsonl, text_field: q}]", "/no/such/file.jsonl"),
    ("logger.name=bogus", "logger.name"),
])
def test_bad_eval_input_is_rejected_before_decoding(models, tmp_path, override, needle):
    from eval.__main__ import run

    _, same, _, _ = models
    cfg = compose_config([f"eval.drafts={{mine: {same}}}", "eval.domains=[chat]", override])
    with pytest.raises(ValueError) as ei:
        run(cfg, tmp_path)
    assert needle in str(ei.value)
    assert not (tmp_path / "metrics.json").exists()


def test_unreadable_draft_checkpoint_is_a_clear_error(models, tmp_path):
    from eval.__main__ import run

    target = models[0]
    partial = tmp_path / "partial_draft"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    cfg = compose_config([f"target.name_or_path={target}", f"eval.drafts={{broken: {partial}}}", "eval.domains=[chat]"])
    with pytest.raises(ValueError) as ei:
        run(cfg, tmp_path / "run")
    msg = str(ei.value)
    assert str(partial) in msg and "incomplete" in msg and "weights" in msg


def test_draft_with_fewer_rows_than_the_tokenizer_is_rejected_before_decoding(models, tmp_path):
    """A draft whose embedding matrix cannot hold every tokenizer id is an error up front, not an IndexError later."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eval.__main__ import run

    target, same, _, _ = models
    small = tmp_path / "small_vocab"
    model = AutoModelForCausalLM.from_pretrained(same)
    model.resize_token_embeddings(len(AutoTokenizer.from_pretrained(same)) - 10)
    model.save_pretrained(small)
    AutoTokenizer.from_pretrained(same).save_pretrained(small)
    cfg = compose_config([f"target.name_or_path={target}", f"eval.drafts={{small: {small}}}", "eval.domains=[chat]",
                    "eval.max_prompts=1", "eval.max_new_tokens=4"])
    with pytest.raises(ValueError) as ei:
        run(cfg, tmp_path / "run")
    assert "embedding rows" in str(ei.value) and "resize_token_embeddings" in str(ei.value)


@pytest.mark.parametrize("name", ["event", "time", "self"])
def test_any_draft_name_works_and_a_foreign_specdraft_json_is_fine(models, tmp_path, name):
    """Draft names are data, never keyword arguments; a draft whose specdraft.json is not a trained draft's
    (here: the reference-target kind) still gets a report."""
    from eval.__main__ import run

    target, _, _, twin = models
    (twin / "specdraft.json").write_text(json.dumps({"kind": "reference_target", "train": {"steps": 3}}))
    try:
        cfg = compose_config([f"target.name_or_path={target}", f"eval.drafts={{{name}: {twin}}}", "eval.domains=[chat]",
                        "eval.max_prompts=1", "eval.max_new_tokens=4", "eval.cost_ratio_trials=2",
                        "eval.bootstrap_samples=0"])
        run(cfg, tmp_path)
    finally:
        (twin / "specdraft.json").unlink()
    doc = json.loads((tmp_path / "metrics.json").read_text())
    assert doc["drafts"][name]["chat"]["acceptance_rate"] == 1.0
    events = [json.loads(l) for l in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert all(isinstance(e["time"], float) and e["time"] > 1e9 for e in events)


def test_prompt_plus_generation_beyond_the_context_is_rejected(models, tmp_path):
    from eval.__main__ import run

    target, same, _, _ = models  # tiny_llama: max_position_embeddings 256
    cfg = compose_config([f"target.name_or_path={target}", f"eval.drafts={{mine: {same}}}", "eval.domains=[chat]",
                    "eval.max_prompt_tokens=250", "eval.max_new_tokens=10"])
    with pytest.raises(ValueError) as ei:
        run(cfg, tmp_path)
    assert "max_position_embeddings" in str(ei.value) and "260" in str(ei.value)


def test_a_failed_evaluation_keeps_the_record_of_the_command_behind_the_current_report(cli_run):
    """`.hydra-eval/` is published with the report set it describes; a later python -m eval that fails after Hydra
    wrote its record (a prompt too long with prompt_overflow=error) leaves it, and the report, as they were; the
    failed attempt's record is in `.hydra-eval-last/`."""
    import yaml

    run_dir, _ = cli_run
    record = (run_dir / ".hydra-eval" / "overrides.yaml").read_text()
    report = (run_dir / "report.md").read_bytes()
    assert "eval.max_prompts=2" in record
    args = [a for a in yaml.safe_load(record) if not a.startswith("hydra.")]
    proc = _eval(*args, "eval.prompt_overflow=error", "eval.max_prompt_tokens=2", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2 and "eval.max_prompt_tokens" in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert (run_dir / ".hydra-eval" / "overrides.yaml").read_text() == record
    assert (run_dir / "report.md").read_bytes() == report
    assert "eval.prompt_overflow=error" in (run_dir / ".hydra-eval-last" / "overrides.yaml").read_text()


@pytest.mark.parametrize("recorded", [True, False])
def test_reevaluating_a_run_with_another_experiments_settings_is_refused(tmp_path, recorded):
    """`python -m eval hydra.run.dir=<a smoke run>` without `+experiment=smoke` would replace the run's report with
    one made under the default settings (48 prompts, other gammas): refused, naming the run's own command (from
    Hydra's record of it, or from its experiment name) and the new-folder alternative; the same experiment passes."""
    from types import SimpleNamespace

    from eval.__main__ import _check_same_experiment

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "resolved_config.json").write_text(json.dumps({"experiment_name": "smoke"}))
    if recorded:
        (run / ".hydra" / "overrides.yaml").write_text("- +experiment=smoke\n- seed=3\n- hydra.run.dir=x\n")
    with pytest.raises(ValueError) as e:
        _check_same_experiment(SimpleNamespace(experiment_name="default"), run)
    msg = str(e.value)
    assert "'smoke' run" in msg and "python -m eval +experiment=smoke" in msg and f"hydra.run.dir={run}" in msg
    assert ("seed=3" in msg) == recorded and "into a new folder" in msg
    _check_same_experiment(SimpleNamespace(experiment_name="smoke"), run)  # its own settings: fine
    _check_same_experiment(SimpleNamespace(experiment_name="default"), tmp_path)  # not a training run: fine


@pytest.mark.parametrize("make_dir", [False, True])
def test_a_run_dir_without_drafts_is_named_in_the_error(tmp_path, make_dir):
    """No eval.drafts and a hydra.run.dir without drafts/: the message says whether the folder is missing (a typo in
    the run's path) or holds no drafts/ folder."""
    from eval.__main__ import check_before_eval

    run_dir = tmp_path / "outputs" / "smoke" / "typo"
    if make_dir:
        run_dir.mkdir(parents=True)
    with pytest.raises(ValueError) as ei:
        check_before_eval(compose_config(["eval.domains=[chat]"]), run_dir)
    assert f"{run_dir} {'has no drafts/ folder' if make_dir else 'does not exist'}" in str(ei.value)
    assert "eval.drafts={} to decode only the lookup drafts" in str(ei.value)


def test_an_empty_eval_drafts_evaluates_the_lookup_drafts_alone(tmp_path):
    """eval.drafts={} says "no trained drafts": the lookup drafts need no checkpoint, so the check passes and the
    evaluation's drafts are the lookups alone (a run folder's drafts/ is not read); with no lookup drafts either, the
    error stands."""
    from eval.__main__ import check_before_eval
    from eval.pipeline import draft_paths, lookup_specs

    run_dir = tmp_path / "run"
    (run_dir / "drafts" / "old").mkdir(parents=True)
    (run_dir / "drafts" / "old" / "config.json").write_text("{}")
    rc = check_before_eval(compose_config(["eval.domains=[chat]", "eval.drafts={}"]), tmp_path / "fresh")
    assert draft_paths(rc, run_dir) == {} and set(lookup_specs(rc)) == {"prompt_lookup", "suffix"}
    with pytest.raises(ValueError, match="eval.lookup_drafts"):
        check_before_eval(compose_config(["eval.domains=[chat]", "eval.drafts={}", "eval.lookup_drafts=[]"]),
                          tmp_path / "fresh")
