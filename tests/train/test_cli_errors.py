"""Bad input through the command line (``python -m train`` / ``python -m eval``, each command its own process; the
tables of cases fork from one process per entry point, ``tests/cliforks.py``): a non-zero exit
code, the last stderr line is our one-line ``error: ...`` message (never a traceback), and a run directory that
already holds a finished run is left byte-identical (Hydra's ``.hydra/`` and log file included: commands are
checked before Hydra touches the run directory).

The table of docs/faults.md names these tests; tests/test_readme.py checks that every
row points at a test that exists.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clierrors import assert_clean_error, cli_env
from tinymodels import tiny_llama

pytestmark = pytest.mark.slow  # whole python -m train / eval runs: outside the fast lane (pytest -m "not slow")

ROOT = Path(__file__).resolve().parents[2]
TEXT = ["Question: What is diabetes?\nAnswer: A disease of blood sugar.", "def add(a, b):\n    return a + b",
        "User: hello there\nAssistant: hi, how can I help?"] * 20


def cli(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=timeout)


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` (hidden ones too) -> its bytes (None for folders)."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoTokenizer

    from data.text import train_bpe_tokenizer

    tmp = tmp_path_factory.mktemp("models")
    tok = train_bpe_tokenizer(iter(TEXT), vocab_size=300, min_frequency=1)
    other_tok = train_bpe_tokenizer(iter([t.upper() for t in TEXT]), vocab_size=300, min_frequency=1)
    out = {}
    for name, t, seed in (("target", tok, 0), ("draft", tok, 1), ("other", other_tok, 2)):
        m = tiny_llama(vocab_size=len(t), seed=seed, eos_token_id=t.eos_token_id)
        m.save_pretrained(tmp / name)
        t.save_pretrained(tmp / name)
        out[name] = tmp / name
    partial = tmp / "partial"  # an interrupted save: config and tokenizer, no weights
    partial.mkdir()
    (partial / "config.json").write_text((tmp / "draft" / "config.json").read_text())
    AutoTokenizer.from_pretrained(tmp / "draft").save_pretrained(partial)
    out["partial"] = partial
    return out


@pytest.fixture
def finished_run(tmp_path) -> Path:
    """A run directory as a finished run leaves it (the files that matter here)."""
    return make_finished_run(tmp_path)


def make_finished_run(tmp_path: Path) -> Path:
    run = tmp_path / "finished"
    (run / "drafts" / "distilled").mkdir(parents=True)
    (run / "drafts" / "distilled" / "config.json").write_text("{}")
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (run / "__main__.log").write_text("old log\n")
    (run / "resolved_config.json").write_text(json.dumps({"seed": 0}))
    (run / "report.md").write_text("# the old report\n")
    (run / "metrics.json").write_text("{}")
    return run


TRAIN_CASES = {
    "unknown_loss": (["distill.loss=bogus"], "distill.loss"),
    "unknown_experiment": (["+experiment=does_not_exist"], "experiment/does_not_exist", "smoke"),
    "misspelt_experiment": (["+experiment=smok"], "did you mean +experiment=smoke?"),
    "eval_draft_no_stage_writes": (["stages=[eval]", "eval.drafts={x: drafts/typo}", "overwrite=true"],
                                   "eval.drafts.x is drafts/typo, which does not exist",
                                   "no stage before eval writes a draft"),
    "eval_draft_misspelt": (["eval.drafts={x: drafts/distiled}", "overwrite=true"],
                            "the stages before eval write drafts/baseline, drafts/distilled",
                            "did you mean eval.drafts.x=drafts/distilled?"),
    "eval_hybrid_draft_misspelt": (["eval.drafts={x: 'ngram:suffix+drafts/distiled'}", "overwrite=true"],
                                   "eval.drafts.x is ngram:suffix+drafts/distiled, whose trained draft",
                                   "did you mean eval.drafts.x=ngram:suffix+drafts/distilled?"),
    "eval_hybrid_behind_a_head": (["draft=eagle3", "eval.drafts={h: 'ngram:suffix+drafts/distilled'}", "overwrite=true"],
                                  "a hybrid (ngram:suffix+<dir>) needs a trained token draft behind the lookup",
                                  "drafts/distilled (draft=eagle3) is an EAGLE-3 head"),
    "misspelt_experiment_group": (["+experimnt=smoke"], "'+experimnt' is no config key or config group",
                                  "did you mean +experiment=smoke?"),
    "misspelt_draft_group": (["drat=smal"], "did you mean draft=small?"),
    "key_of_another_option": (["target_layers=[1,2,3]"], "did you mean draft=eagle3 draft.eagle3.target_layers=[1,2,3]?"),
    "key_of_an_unselected_group": (["+experiment=smoke", "lora.name=x"], "did you mean lora=default lora.name=x?"),
    "entry_of_a_null_mapping": (["+experiment=smoke", "eval.drafts.x=drafts/distilled"],
                                "eval.drafts holds no mapping in this config (null)",
                                "+eval.drafts.x=drafts/distilled"),
    "nothing_to_evaluate": (["+experiment=smoke", "eval.drafts={distilled: null, baseline: null}"],
                            "nothing to evaluate"),
    "experiments_listed_without_multirun": (["+experiment=smoke,lookup_drafts"], "a sweep: add -m"),
    "eagle3_layers_not_a_list": (["draft=eagle3", "draft.eagle3.target_layers=3"],
                                 "draft.eagle3.target_layers takes a list: draft.eagle3.target_layers='[2, 15, 27]'",
                                 "three layers in [1, N - 1]"),
    "plain_text_domain_without_prompts": (["overwrite=true", "data.domain=corpus"],
                                          "data.domain corpus: its validation split has no prompts",
                                          "set distill.eval_every=0"),
    "sampling_entry_for_a_greedy_domain": (["overwrite=true", "eval.domain_sampling={medical: {temperature: 0.5}}"],
                                           "error: invalid config: eval.domain_sampling.medical sets temperature",
                                           "add do_sample: true"),
    "misspelt_group_option": (["draft=eagle"], "did you mean draft=eagle3?"),
    "missing_target": (["target.name_or_path=/nonexistent/target"], "target path /nonexistent/target does not exist"),
    "missing_data_root": (["data.root=/nonexistent/data"], "data root /nonexistent/data (data.root) does not exist"),
    "existing_run_without_resume": ([], "already holds a run", "Continue it with its own settings (python -m train",
                                    "trainer.resume=true hydra.run.dir=", "overwrite=true"),
    # overwrite=true passes the run-dir policy: these are caught by the checks that read only config files
    "self_draft_layers_out_of_range": (["overwrite=true", "draft=layer_pruned", "draft.layers.method=list",
                                        "draft.layers.indices=[0,99]"], "draft.layers.indices [99] out of range"),
    "self_draft_keeps_every_layer": (["overwrite=true", "draft=layer_pruned", "draft.layers.k=99"],
                                     "draft.layers.k=99 would keep every layer"),
    "eagle3_layers_past_the_target": (["overwrite=true", "draft=eagle3", "draft.eagle3.target_layers=[1,2,9]"],
                                      "draft.eagle3.target_layers [1, 2, 9]: [9] outside [1, 5]", "or null for"),
    "eagle3_vocab_past_the_target": (["overwrite=true", "draft=eagle3", "draft.draft_vocab_size=5000"],
                                     "draft.draft_vocab_size=5000 is outside [1, 4096]"),
    "pretrained_draft_missing": (["overwrite=true", "draft=pretrained", "draft.name_or_path=/nonexistent/draft",
                                  "stages=[draft_init,distill]"], "/nonexistent/draft does not exist",
                                 "draft.name_or_path"),
    "lora_name_replaces_a_draft": (["overwrite=true", "lora=default", "stages=[distill,baseline,lora,eval]",
                                    "lora.name=baseline"], "would replace another draft"),
    "routing_with_training_stages": (["overwrite=true", "decode.draft_routing=/nonexistent/routing.json"],
                                     "decode.draft_routing evaluates the drafts its table names"),
    # a misspelt key names the closest valid one (Hydra's own hint, '+trainer.max_step=5', would fail next)
    "misspelt_key": (["trainer.max_step=5"], "unknown key 'trainer.max_step'", "did you mean trainer.max_steps=5?"),
    "misspelt_key_added": (["+trainer.max_step=5"], "did you mean trainer.max_steps?"),
    "misspelt_key_without_section": (["max_steps=5"], "did you mean trainer.max_steps=5"),
    "misspelt_key_in_a_list_item": (["eval.extra_domains=[{name: mine, path: /tmp/x.jsonl, text_feild: text}]"],
                                    "Key 'text_feild' not in 'ExtraDomainConfig'", "did you mean text_field?"),
    "config_group_without_plus": (["experiment=smoke"], "'experiment' is a config group", "+experiment=smoke",
                                  "distill_med"),
    # folders of conf/ that --help lists as groups but Hydra cannot select: the message names the command that works
    "accelerate_config_added": (["+accelerate=single"], "conf/accelerate/single.yaml is a launch config of "
                                "accelerate", "one process is what plain python -m train runs: python -m train "
                                "hydra.run.dir="),
    "accelerate_config_selected": (["accelerate=ddp", "trainer.max_steps=5"], "conf/accelerate/ddp.yaml is a launch "
                                   "config", "accelerate launch --config_file conf/accelerate/ddp.yaml -m train "
                                   "trainer.max_steps=5 hydra.run.dir=", " trainer=ddp"),
    "domain_added": (["+domain=byo_chat"], "'domain' is not a config group", "data.domain=byo_chat"),
    "selected_group_added": (["+draft=layer_pruned"], "use draft=layer_pruned (no '+')",
                             "python -m train hydra.run.dir="),
    "experiment_force_added": (["++experiment=smoke"], "use +experiment=smoke (one '+')"),
    # a list of dicts the shell split at spaces / brace-expanded, as an unquoted value arrives
    "unquoted_list_of_dicts": (["eval.extra_domains=[{name:", "x,", "path:", "/tmp/x.jsonl}]"],
                               "put the whole override in single quotes",
                               "'eval.extra_domains=[{name: x, path: /tmp/x.jsonl}]'"),  # the user's own, rejoined
    "unquoted_list": (["eval.domains=[medical,", "code]"], "'eval.domains=[medical, code]'"),
    "brace_expanded_list_of_dicts": (["eval.extra_domains=[name:x]", "eval.extra_domains=[path:/tmp/x.jsonl]"],
                                     "put the whole override in single quotes"),
}


def run_concurrently(jobs: dict[str, tuple[str, list[str]]], tmp_path_factory) -> dict[str, tuple]:
    """Each job ``case -> (module, args)`` as its own process against its own finished run directory
    (``hydra.run.dir`` appended): one forked child per command from a driver that imported ``{module}.__main__``
    once (``tests/cliforks.py``: own stdout, stderr and exit status per command, as from a shell). Returns ``case ->
    (completed process, snapshot before, run dir)``."""
    from cliforks import run_commands

    runs = {case: make_finished_run(tmp_path_factory.mktemp(case)) for case in jobs}
    before = {case: snapshot(run) for case, run in runs.items()}
    out = {}
    for module in sorted({m for m, _ in jobs.values()}):
        cases = [case for case, (m, _) in jobs.items() if m == module]
        procs = run_commands(module, [[*jobs[c][1], f"hydra.run.dir={runs[c]}"] for c in cases], env=cli_env())
        out.update({c: (p, before[c], runs[c]) for c, p in zip(cases, procs)})
    return out


@pytest.fixture(scope="module")
def train_case_results(tmp_path_factory):
    return run_concurrently({case: ("train", args) for case, (args, *_) in TRAIN_CASES.items()}, tmp_path_factory)


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_train_cli_rejects_bad_input_and_leaves_the_run_dir_untouched(case, train_case_results):
    _, *needles = TRAIN_CASES[case]
    proc, before, run = train_case_results[case]
    assert_clean_error(proc, 2, *needles)
    assert snapshot(run) == before


def _eval_args(models, **over) -> list[str]:
    base = {"target.name_or_path": str(models["target"]), "eval.drafts": f"{{mine: {models['draft']}}}",
            "eval.domains": "[chat]", "eval.max_prompts": "1", "eval.max_new_tokens": "4"}
    base.update(over)
    return [f"{k}={v}" for k, v in base.items()]


EVAL_CASES = {
    "negative_temperature": (dict(**{"decode.temperature": "-1"}), "decode.temperature"),
    "top_p_0": (dict(**{"decode.top_p": "0"}), "decode.top_p must be in (0, 1]"),
    "unknown_eval_domain": (dict(**{"eval.domains": "[nope]"}), "nope", "chat"),
    "tokenizer_mismatch": (dict(**{"eval.drafts": "{bad: OTHER}"}), "tokenizer", "vocabulary differs"),
    "partial_checkpoint": (dict(**{"eval.drafts": "{broken: PARTIAL}"}), "incomplete", "model weights"),
    "unknown_draft_length_policy": (dict(**{"decode.draft_length_policy": "greedy"}),
                                    "error: invalid config: decode.draft_length_policy must be one of fixed, adaptive, "
                                    "confidence, got 'greedy'"),
    "adaptive_start_outside_its_bounds": (dict(**{"decode.draft_length_policy": "adaptive",
                                                  "decode.max_draft_tokens": "2"}),
                                          "error: invalid config: decode.num_draft_tokens (the adaptive policy's "
                                          "starting draft length) must be in [decode.min_draft_tokens, "
                                          "decode.max_draft_tokens] = [1, 2], got 4"),
}


@pytest.fixture(scope="module")
def eval_case_results(models, tmp_path_factory):
    def args(over: dict) -> list[str]:
        over = {k: v.replace("OTHER", str(models["other"])).replace("PARTIAL", str(models["partial"]))
                for k, v in over.items()}
        return _eval_args(models, **over)

    return run_concurrently({case: ("eval", args(over)) for case, (over, *_) in EVAL_CASES.items()}, tmp_path_factory)


@pytest.mark.parametrize("case", list(EVAL_CASES))
def test_eval_cli_rejects_bad_input_before_any_model_and_leaves_the_run_dir_untouched(case, eval_case_results):
    _, *needles = EVAL_CASES[case]
    proc, before, run = eval_case_results[case]
    message = assert_clean_error(proc, 2, *needles)
    if case == "tokenizer_mismatch":  # every difference is listed, and the fix
        assert "special token" in message or "merges" in message or "in 'draft 'bad'' but missing" in message
        assert message.splitlines()[-1].startswith("Fix: ")
    assert snapshot(run) == before


def test_unwritable_output_dir_is_a_clear_error(models, tmp_path):
    """A real unwritable location that works as root too: the run directory's parent is a regular file."""
    (tmp_path / "a_file").write_text("x")
    proc = cli("eval", *_eval_args(models), f"hydra.run.dir={tmp_path / 'a_file' / 'run'}")
    assert_clean_error(proc, 3, "cannot write", "not a folder", "hydra.run.dir")


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    """End to end: a learning rate that makes training diverge. The run stops with exit code 4 naming the step;
    checkpoint-last holds an earlier step with finite weights; nothing is saved as a draft."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    proc = cli("train", "+experiment=smoke", "stages=[baseline]", "trainer.lr=1e6", "trainer.max_grad_norm=0",
               "trainer.warmup_steps=0", "trainer.save_every=1", "trainer.max_steps=6", "distill.eval_every=0",
               f"hydra.run.dir={run}")
    last = assert_clean_error(proc, 4, "at step", "the last good checkpoint", "trainer.lr")
    failed_at = int(last.split("at step ")[1].split(";")[0])
    state = json.loads((run / "train" / "baseline" / "checkpoint-last" / "trainer_state.json").read_text())
    assert 1 <= state["step"] < failed_at <= 6
    assert f"(step {state['step']}) is kept" in last
    weights = load_file(str(run / "train" / "baseline" / "checkpoint-last" / "model.safetensors"))
    assert weights and all(bool(torch.isfinite(t).all()) for t in weights.values())
    assert not (run / "drafts" / "baseline").exists()
    events = [json.loads(l) for l in (run / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "stage_failed" and "FloatingPointError" in events[-1]["error"]


def test_overwrite_or_resume_lets_a_run_reuse_its_directory(finished_run):
    """The refusal above has two ways on, checked in-process (no training needed)."""
    from hydra import compose, initialize_config_dir

    import train.__main__  # noqa: F401  (registers the specdraft_root resolver)
    from train.run import check_run_dir_free
    from core.errors import RunDirInUseError
    from train.run import validate

    def rc(*overrides):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return validate(compose("config", overrides=list(overrides)))

    with pytest.raises(RunDirInUseError):
        check_run_dir_free(rc(), finished_run)
    check_run_dir_free(rc("overwrite=true"), finished_run)
    check_run_dir_free(rc("trainer.resume=true"), finished_run)
    # a command that stopped on bad input after Hydra started (e.g. a LoRA target found missing once the draft
    # loaded) left its record and resolved config but no artifact: the corrected command may use the directory
    failed = finished_run.parent / "failed_attempt"
    (failed / ".hydra").mkdir(parents=True)
    (failed / "resolved_config.json").write_text(json.dumps({"seed": 0}))
    (failed / "events.jsonl").write_text('{"event": "stage_failed"}\n')
    check_run_dir_free(rc(), failed)
    (failed / "train").mkdir()  # a started training is something to resume or overwrite
    with pytest.raises(RunDirInUseError):
        check_run_dir_free(rc(), failed)
    check_run_dir_free(rc(), finished_run.parent / "fresh")


def test_a_reused_run_directory_names_the_command_that_re_evaluates_it_as_it_was(finished_run):
    """The refusal's re-evaluation command carries the run's own eval-side overrides (shell-quoted; the training
    ones, which python -m eval never reads, are left out), so pasting it evaluates with the run's settings, not the
    defaults; it composes to the run's experiment and eval settings. Its resume command keeps every override."""
    import shlex

    from core.cli import compose

    (finished_run / ".hydra" / "overrides.yaml").write_text(
        "- +experiment=smoke\n- eval.domains=[medical, code]\n- trainer.max_steps=3\n")
    msg = assert_clean_error(cli("train", "+experiment=smoke", f"hydra.run.dir={finished_run}"), 2)
    command = msg.split("with the run's own settings: ", 1)[1].strip()
    assert command == (f"python -m eval +experiment=smoke 'eval.domains=[medical, code]' "
                       f"hydra.run.dir={finished_run}"), command
    assert (f"(python -m train +experiment=smoke 'eval.domains=[medical, code]' trainer.max_steps=3 "
            f"trainer.resume=true hydra.run.dir={finished_run})") in msg, msg
    argv = shlex.split(command)[3:]
    cfg, run_dir = compose(argv, ROOT / "conf")
    assert (cfg.experiment_name, list(cfg.eval.domains), run_dir) == ("smoke", ["medical", "code"], finished_run)


@pytest.mark.slow
def test_ctrl_c_ends_with_the_interrupted_line_and_no_progress_bar_after_it(tmp_path):
    """Ctrl-C during training: exit 130 and `interrupted: ... trainer.resume=true` is the last thing on stderr
    (an open progress bar used to redraw itself after it)."""
    import signal

    from tinymodels import signal_when

    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "TQDM_DISABLE")}
    env.update(WANDB_MODE="offline", HF_HUB_OFFLINE="1")
    log = tmp_path / "stderr.txt"  # a file, not a pipe: progress bars could fill a pipe and block the child
    with open(log, "wb") as err:
        # SIGINT back to its default in the child: a suite started in the background by a non-interactive shell
        # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler (Ctrl-C reaches no one)
        proc = subprocess.Popen([sys.executable, "-m", "train", "+experiment=smoke", "stages=[distill]",
                                 "trainer.max_steps=400", f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def training() -> bool:
        events = run_dir / "events.jsonl"
        return events.exists() and '"train_step"' in events.read_text()

    signal_when(proc, training, signal.SIGINT, timeout_s=300, what="training did not start")
    stderr = log.read_text(errors="replace")
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    last = [l for l in stderr.replace("\r", "\n").splitlines() if l.strip()][-1]
    assert last.startswith("interrupted: ") and "trainer.resume=true" in last, stderr[-2000:]
    # the command it names is the one that resumes: the run's own overrides, then trainer.resume=true
    assert last.endswith(f"python -m train +experiment=smoke 'stages=[distill]' trainer.max_steps=400 "
                         f"trainer.resume=true hydra.run.dir={run_dir}"), last


def test_eval_cli_refuses_a_draft_whose_cache_cannot_be_rolled_back(models, tmp_path):
    """A draft with chunked attention (Llama 4): speculative decoding could not crop its cache exactly, so eval
    stops with the one-line error (exit 2) before decoding anything, instead of a traceback mid-run."""
    import sys as _sys

    from transformers import AutoTokenizer

    _sys.path.insert(0, str(ROOT / "tests" / "decode"))
    from test_decode_sliding_window import tiny_chunked_llama4

    tok = AutoTokenizer.from_pretrained(models["target"])
    chunked = tiny_chunked_llama4(vocab=len(tok))
    chunked.save_pretrained(tmp_path / "chunked")
    tok.save_pretrained(tmp_path / "chunked")
    proc = cli("eval", *_eval_args(models, **{"eval.drafts": f"{{chunked: {tmp_path / 'chunked'}}}"}),
               f"hydra.run.dir={tmp_path / 'run'}")
    assert_clean_error(proc, 2, "draft 'chunked'", "cannot roll back the KV cache", "chunked_attention")


def test_every_group_help_lists_is_either_selectable_or_refused_with_the_command_that_works(tmp_path):
    """``python -m train --help`` lists every folder of conf/ as a group; each one typed the way Hydra rejects it
    (``+G=O`` for every group but experiment, ``G=O`` where the defaults select none, ``++experiment=O``) exits 2 with
    our one line (never Hydra's "Key 'accelerate' not in 'RootConfig'" or "appears more than once"), and the command
    the line names composes into a valid config (a ``python -m train`` one), or is an ``accelerate launch`` of an
    existing launch config with the trainer of the same name."""
    import re
    import shlex

    from cliforks import run_commands
    from core.groups import _selected_groups
    from tinymodels import compose_config
    from train.run import validate

    help_out = cli("train", "--help")
    assert help_out.returncode == 0, help_out.stderr[-2000:]
    listed = help_out.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    groups = {m.group(1): m.group(2).split(", ") for line in listed.splitlines()
              if (m := re.fullmatch(r"(\w+): (\w+(?:, \w+)*)", line.strip()))}
    assert {"accelerate", "domain", "draft", "experiment", "trainer"} <= set(groups), groups
    assert "conf/accelerate/NAME.yaml is a launch config" in help_out.stdout  # --help says how those are used
    assert "python -m eval +experiment=NAME hydra.run.dir=RUN" in help_out.stdout  # what each entry point runs
    assert "powered by Hydra" not in help_out.stdout
    selected = _selected_groups(ROOT / "conf")
    commands = [f"++{g}={o[0]}" if g == "experiment" else f"+{g}={o[0]}" for g, o in groups.items()]
    commands += [f"{g}={o[0]}" for g, o in groups.items() if g not in selected and g != "experiment"]
    run = make_finished_run(tmp_path)  # nothing may start: a command that got through would be refused here
    procs = run_commands("train", [[c, "trainer.max_steps=5", f"hydra.run.dir={run}"] for c in commands],
                         env=cli_env())
    for command, proc in zip(commands, procs):
        message = assert_clean_error(proc, 2, "invalid config: ")
        assert "RootConfig" not in message and "more than once" not in message, (command, message)
        fix = shlex.split(message.rsplit(": ", 1)[1])
        if fix[:3] == ["python", "-m", "train"]:
            assert command not in fix and "trainer.max_steps=5" in fix, (command, message)
            validate(compose_config([a for a in fix[3:] if not a.startswith("hydra.")]))
        else:
            assert fix[:3] == ["accelerate", "launch", "--config_file"] and (ROOT / fix[3]).is_file(), message
            assert f"trainer={Path(fix[3]).stem}" in fix, message
            validate(compose_config([a for a in fix[6:] if not a.startswith("hydra.")]))


@pytest.mark.parametrize("key,value,suggestion", [
    ("eval.draft_length_policy", "adaptive", "eval.draft_length_policies='[adaptive]'"),  # null default: list type
    ("eval.num_draft_token", "4", "eval.num_draft_tokens='[4]'"),
    ("eval.domain", "medical", "eval.domains='[medical]'"),
    ("eval.draft", "x", "eval.drafts='{name: x}'"),
    ("eval.draft", "{a: x}", "eval.drafts={a: x}"),  # already a mapping: kept as written
    ("trainer.max_step", "5", "trainer.max_steps=5"),  # scalar to scalar: unchanged
])
def test_a_suggested_key_gets_the_value_in_the_shape_it_takes(key, value, suggestion):
    """"did you mean" names a key that may take a list or a mapping where the typo had a scalar: the suggestion is
    written so that pasting it works (the typed schema decides, also for keys whose default is null)."""
    from core.cli import unknown_key_message
    from core.io import PROJECT_ROOT
    from train.run import RootConfig

    msg = unknown_key_message(key, [f"{key}={value}"], PROJECT_ROOT / "conf", RootConfig)
    assert f"did you mean {suggestion}?" in msg


@pytest.mark.parametrize("override,expected", [
    ("eval.domains=medical", "eval.domains takes a list: eval.domains='[medical]'"),
    ("eval.num_draft_tokens=4", "eval.num_draft_tokens takes a list: eval.num_draft_tokens='[4]'"),
    ("eval.drafts=x", "eval.drafts takes a mapping: eval.drafts='{name: value}'"),
    ("eval.domain_sampling=[chat]", "eval.domain_sampling takes a mapping: eval.domain_sampling='{name: value}'"),
    ("eval.num_draft_tokens={a: 1}", "eval.num_draft_tokens takes a list"),
    ("eval.max_prompts=-1", "eval.max_prompts must be >= 1, got -1"),
    ("eval.max_prompt_tokens=1", "eval.max_prompt_tokens must be >= 2, got 1"),
])
def test_a_value_of_the_wrong_shape_or_range_names_the_key_and_the_fix(override, expected):
    """A single value where the key takes a list or a mapping gets the pasteable form; a range error names the one
    key that is out of range and its value (validated in-process: the command line turns it into `error:`)."""
    from tinymodels import compose_config
    from train.run import validate

    with pytest.raises(ValueError) as e:
        validate(compose_config([override]))
    assert str(e.value).startswith("invalid config: ") and expected in str(e.value), str(e.value)


@pytest.mark.parametrize("override,expected", [
    ("distill.generation=[a]", "distill.generation is a mapping, not a list: set its keys (distill.generation.<key>"),
    ("eval.engine=[a]", "eval.engine is a mapping, not a list"),
    ("eval.domains={a: 1}", "eval.domains is a list, not a mapping: eval.domains='[a, b]'"),
])
def test_a_list_given_to_a_section_names_the_key_and_the_fix(override, expected):
    """Hydra refuses to merge a list onto a section of conf/config.yaml with "Error merging override", naming neither
    the shape nor the fix; the command line says both, exit 2, before any work."""
    proc = subprocess.run([sys.executable, "-m", "train", override], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=120)
    assert_clean_error(proc, 2, expected)


@pytest.mark.parametrize("override,expected", [
    ("~draft", "~draft deletes the draft section, and the run would go on with built-in defaults that no config file "
               "shows: pick an option (draft=NAME with NAME one of eagle3, layer_pruned"),
    ("~trainer", "trainer=NAME with NAME one of ddp"),
    ("~eval", "~eval deletes the eval section"),
])
def test_deleting_a_whole_section_is_refused_before_any_work(override, expected, tmp_path):
    """`~draft` (Hydra's delete) would drop the section and its config group, and the typed config would fill in
    built-in defaults no config file shows: refused with the fix, exit 2, no run folder."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "train", override, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                          env=cli_env(), capture_output=True, text=True, timeout=120)
    assert_clean_error(proc, 2, expected)
    assert not run_dir.exists()


def test_a_data_root_without_the_domain_files_is_refused_before_any_stage(tmp_path):
    """A data root that exists but lacks the training domain's files stops the command before any model loads and
    before stage draft_init builds a draft (no run folder), naming the file and both ways to supply it."""
    empty = tmp_path / "data"
    empty.mkdir()
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "train", "+experiment=smoke", f"data.root={empty}",
                           f"hydra.run.dir={run_dir}"], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                          timeout=120)
    assert_clean_error(proc, 2, "missing data file for domain", f"looked in data root {empty}", "data.source=hub")
    assert not run_dir.exists()


def _damage(case: str, root):
    """Damage one file of a copy of the data root; returns the text the error must hold."""
    if case == "eval_domain_line_not_json":  # smoke evaluates code but trains on medical
        damaged = sorted((root / "code").glob("*.jsonl"))[0]
        lines = damaged.read_text().splitlines()
        damaged.write_text("\n".join(lines[:2] + ['{"task_id": "cut here'] + lines[3:]) + "\n")
        return f"{damaged}:3: not valid JSON"
    if case == "training_csv_row_missing_a_field":
        damaged = root / "medical" / "mtsdialog_MTS-Dialog-TrainingSet.csv"
        lines = damaged.read_text().splitlines(keepends=True)
        header = lines[0].rstrip("\n").split(",")
        damaged.write_text(",".join(header[:1] + header[2:]) + "\n" + "".join(lines[1:]))
        return str(damaged)
    if case == "training_field_not_text":
        damaged = root / "medical" / "meqsum.jsonl"
        lines = damaged.read_text().splitlines()
        record = json.loads(lines[1])
        record["CHQ"] = {"a": [1, 2]}
        damaged.write_text("\n".join(lines[:1] + [json.dumps(record)] + lines[2:]) + "\n")
        return f"{damaged}:2: a text field holds a JSON object, not text"
    damaged = root / "medical" / "meqsum.jsonl"  # training_file_is_a_folder
    damaged.unlink()
    damaged.mkdir()
    return f"{damaged}: a folder, not a file"


@pytest.mark.parametrize("case, module", [("eval_domain_line_not_json", "train"),
                                          ("training_csv_row_missing_a_field", "train"),
                                          ("training_file_is_a_folder", "train"),
                                          ("training_field_not_text", "train"),
                                          ("eval_domain_line_not_json", "eval")])
def test_a_damaged_data_file_is_refused_before_any_stage(case, module, tmp_path):
    """A data file that exists but cannot be read as its domain's records, of a training domain (medical) or of an
    evaluation domain the training stages never read (code): refused before Hydra writes the run folder and before
    any model loads, naming the file (and line), not after the drafts train."""
    import shutil

    from data.loading import default_data_root

    src, root = default_data_root(), tmp_path / "data"
    root.mkdir()
    for folder in src.iterdir():
        if folder.is_dir() and folder.name not in ("code", "medical"):
            (root / folder.name).symlink_to(folder)
    for name in ("code", "medical"):
        shutil.copytree(src / name, root / name)
        (root / name).chmod(0o755)  # the shared data root is read-only
        for f in (root / name).iterdir():
            f.chmod(0o644)
    needle = _damage(case, root)
    run_dir = tmp_path / "run"
    only = ["eval.drafts={}", "eval.lookup_drafts=[prompt_lookup]"] if module == "eval" else []  # no trained draft
    proc = subprocess.run([sys.executable, "-m", module, "+experiment=smoke", *only, f"data.root={root}",
                           f"hydra.run.dir={run_dir}"], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                          timeout=120)
    assert_clean_error(proc, 2, needle)
    assert not run_dir.exists()


@pytest.mark.parametrize("case", ["teacher_engine", "eval_engine"])
def test_an_engine_the_config_needs_but_is_not_installed_is_refused_before_any_work(case, tmp_path):
    """distill.generation.engine=llama_cpp or eval.engine.enabled=true without llama.cpp: one error line naming the
    install command, exit 2, no run folder (eval.engine.enabled=auto only skips the check; tests/eval/test_engine.py)."""
    env = {**cli_env(), "SPECDRAFT_CACHE": str(tmp_path / "cache")}
    env.pop("SPECDRAFT_LLAMA_SERVER", None)
    args = {"teacher_engine": ["distill.data_source=teacher", "distill.generation.engine=llama_cpp"],
            "eval_engine": ["eval.engine.enabled=true"]}[case]
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "train", "+experiment=smoke", *args, f"hydra.run.dir={run_dir}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert_clean_error(proc, 2, "llama.cpp is not installed", "python scripts/install_engine.py")
    assert not run_dir.exists()
