"""The Hydra config tree composes with every experiment and group option, and ``validate`` rejects bad values.

Composition goes through ``hydra.initialize_config_dir`` + ``hydra.compose`` (no subprocess) with the same
``specdraft_root`` resolver the entry point registers; two subprocess tests pin the CLI's early failures.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from core.io import PROJECT_ROOT
from train.run import KNOWN_STAGES, RootConfig, validate

CONF = PROJECT_ROOT / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
# conf/domain/ holds domain declarations (data.domain=<name> reads them, data/loading.py), not group options
GROUP_OPTIONS = sorted(
    f"{p.parent.name}={p.stem}" for p in CONF.glob("*/*.yaml")
    if p.parent.name not in ("experiment", "accelerate", "domain")
)

OmegaConf.register_new_resolver("specdraft_root", lambda: str(PROJECT_ROOT), replace=True)


# Group options with a key the user must give (no meaningful default): the value used to compose them here.
REQUIRED = {"draft=pretrained": ["draft.name_or_path=${paths.reference_target}"]}


def compose_cfg(overrides: list[str] | None = None):
    overrides = list(overrides or [])
    last = {o.split("=")[0]: o for o in overrides}  # the option of a group that wins
    overrides += [x for o in last.values() for x in REQUIRED.get(o, [])]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides)


def _targets(node, path="") -> list[tuple[str, str]]:
    """Every ``_target_`` in a composed (resolved) config, with its dotted location."""
    out = []
    if isinstance(node, dict):
        if "_target_" in node:
            out.append((path, node["_target_"]))
        for k, v in node.items():
            out += _targets(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _targets(v, f"{path}[{i}]")
    return out


def _check(cfg) -> RootConfig:
    rc = validate(cfg)
    assert isinstance(rc, RootConfig)
    assert rc.stages and set(rc.stages) <= set(KNOWN_STAGES)
    # every component named by _target_ resolves to something importable
    from hydra.utils import get_object

    for where, target in _targets(OmegaConf.to_container(cfg, resolve=True)):
        assert get_object(target) is not None, f"{where}: _target_ {target!r} is not importable"
    return rc


def test_tree_has_experiments_and_groups():
    assert {"smoke", "distill_med", "reference_target"} <= set(EXPERIMENTS)
    groups = {o.split("=")[0] for o in GROUP_OPTIONS}
    assert {"target", "draft", "trainer", "lora", "logger"} <= groups
    # the sections with one setting each are plain sections of conf/config.yaml, not groups
    root = OmegaConf.load(CONF / "config.yaml")
    assert {"paths", "data", "distill", "decode", "eval", "reference", "adapt"} <= set(root) - groups


def test_default_config_composes_and_validates():
    cfg = compose_cfg()
    rc = _check(cfg)
    assert rc.paths.project_root == str(PROJECT_ROOT)  # the specdraft_root resolver
    assert rc.decode.num_draft_tokens >= 1 and rc.stages == ["distill", "baseline", "eval"]


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_validates(name, tmp_path):
    from train.run import check_drafts_written_before_eval

    cfg = compose_cfg([f"+experiment={name}"])
    rc = _check(cfg)
    assert rc.experiment_name == name  # run directories are keyed by it
    check_drafts_written_before_eval(rc, tmp_path / "run")  # each eval.drafts entry of its own is written before eval


def test_an_eval_drafts_entry_set_to_null_is_left_out():
    """An experiment (or the command line) drops a draft its parent names by setting the entry to null."""
    rc = _check(compose_cfg(["+experiment=distill_med", "eval.drafts.baseline=null"]))
    assert rc.eval.drafts == {"distilled": "drafts/distilled_int8"}
    assert "baseline" not in _check(compose_cfg(["+experiment=selfdraft_med"])).eval.drafts


def test_evaluating_a_run_with_every_eval_drafts_entry_null_says_so(tmp_path):
    """``python -m eval eval.drafts='{a: null}'`` on a training run: the message names the null entries and
    ``eval.drafts=null`` (the run's drafts), not a missing ``drafts/`` folder."""
    from eval.pipeline import draft_paths

    (tmp_path / "drafts" / "distilled").mkdir(parents=True)
    rc = _check(compose_cfg(["eval.drafts={a: null}", "eval.lookup_drafts=[]"]))
    with pytest.raises(ValueError, match="eval.drafts names none .* set eval.drafts=null to evaluate every draft"):
        draft_paths(rc, tmp_path)
    with pytest.raises(ValueError, match="none under .* Run the distill"):
        draft_paths(rc, tmp_path / "empty")


@pytest.mark.parametrize("override", GROUP_OPTIONS)
def test_every_group_option_composes_and_validates(override):
    _check(compose_cfg([override]))


def test_required_keys_are_named_when_missing():
    with pytest.raises(ValueError, match="draft.init=pretrained needs draft.name_or_path"):
        validate(_compose_raw(["draft=pretrained"]))


def _compose_raw(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides)


def _overridden_groups(experiment: str) -> set[str]:
    """Groups an experiment picks itself (``override /draft: layer_pruned`` in its defaults list)."""
    defaults = OmegaConf.to_container(OmegaConf.load(CONF / "experiment" / f"{experiment}.yaml")).get("defaults", [])
    inherited = set().union(*(_overridden_groups(d) for d in defaults  # an experiment built on another one
                              if isinstance(d, str) and (CONF / "experiment" / f"{d}.yaml").is_file()))
    return inherited | {k.split("/")[-1] for d in defaults if isinstance(d, dict) for k in d
                        if k.startswith("override /")}


# Each group option composed with PAIRINGS experiments (rotating, so every experiment meets several options):
# Hydra keeps only the last option of a group given twice, so one command line with every option would test one
# option per group. The full matrix costs about 0.3 s per composition, ~60 s in all; three per option cover each
# option under different experiments at a fifth of that.
PAIRINGS = 3


@pytest.mark.parametrize("option", GROUP_OPTIONS)
def test_every_group_option_with_experiments(option):
    group, choice = option.split("=")
    usable = [e for e in EXPERIMENTS if group not in _overridden_groups(e)]  # e.g. selfdraft_med fixes its draft
    start = GROUP_OPTIONS.index(option) * PAIRINGS
    chosen = [usable[(start + k) % len(usable)] for k in range(min(PAIRINGS, len(usable)))]
    assert chosen, f"no experiment leaves group {group} free"
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):  # one Hydra context for all of them
        cfgs = [compose("config", overrides=[f"+experiment={e}", option, *REQUIRED.get(option, [])]) for e in chosen]
    for experiment, cfg in zip(chosen, cfgs):
        rc = _check(cfg)
        assert rc.experiment_name == experiment
        if group == "trainer":  # the option really is in the composed run, not overridden by the experiment
            assert rc.trainer.strategy == choice
        if group == "draft":
            assert rc.draft.init == OmegaConf.load(CONF / "draft" / f"{choice}.yaml").get("init", "config")


def test_lora_stages_need_the_lora_settings():
    for stages in ("[distill,lora,eval]", "[distill,adapt]"):
        with pytest.raises(ValueError, match="lora=default"):
            validate(compose_cfg([f"stages={stages}"]))
        _check(compose_cfg([f"stages={stages}", "lora=default"]))
    with pytest.raises(ValueError, match="lora.domain 'specbench_qa' has no training split"):
        validate(compose_cfg(["stages=[lora]", "lora=default", "lora.domain=specbench_qa"]))


@pytest.mark.parametrize("override, want", [
    ([], "all-linear"),
    (["lora.target_modules=null"], None),  # peft's default for the draft's model family
    (["lora.target_modules=[c_attn,lm_head]"], ["c_attn", "lm_head"]),
    (["lora.target_modules=ALL-LINEAR"], "all-linear"),
])
def test_lora_target_modules_forms_from_the_command_line(override, want):
    assert validate(compose_cfg(["lora=default", *override])).lora.target_modules == want


@pytest.mark.parametrize(
    "override, key",
    [
        ("decode.num_draft_tokens=0", "decode.num_draft_tokens"),
        ("decode.temperature=-1", "decode.temperature"),
        ("decode.do_sample=true decode.temperature=nan", "decode.temperature must be a finite number"),
        ("decode.do_sample=true decode.temperature=inf", "decode.temperature must be a finite number"),
        ("eval.domain_sampling={medical:{do_sample:true,temperature:inf}} eval.domains=[medical]",
         "eval.domain_sampling.medical: temperature must be a finite float"),
        ("distill.temperature=inf", "distill.temperature must be a finite number"),
        ("decode.lookup=5", "set its keys instead (decode.lookup.<key>=<value>"),
        ("data.mixture={medical:[1]}", "data.mixture must map domains to finite weights > 0"),
        ("data.mixture={medical:inf}", "data.mixture must map domains to finite weights > 0"),
        ("data.mixture={medical:1e308,code:1e308}", "data.mixture must map domains to finite weights > 0"),
        ("draft=eagle3 draft.eagle3.ttt_steps=17", "draft.eagle3.ttt_steps must be an int in [1, 16]"),
        ("data.mixture={nope:1}", "Fix data.mixture, or declare it"),
        ("distill.generation.temperature=nan", "distill.generation.temperature must be a finite number"),
        ("decode.top_p=0", "decode.top_p"),
        ("decode.top_p=1.5", "decode.top_p"),
        ("decode.top_k=-1", "decode.top_k"),
        ("distill.loss=bogus", "distill.loss"),
        ("distill=forward_kl", "'distill' is a section of conf/config.yaml, not a config group"),  # a folded group
        ("distill.temperature=0", "distill.temperature"),
        ("distill.train_on_prompts=false", "distill.train_on_prompts"),  # the default data_source is dataset
        ("eval.domains=[nope]", "eval.domains"),
        ("eval.domains=[]", "eval.domains"),
        ("data.domain=nope", "data.domain"),
        ("data.source=ftp", "data.source"),
        ("data.test_fraction=1.0", "data.test_fraction"),
        ("stages=[bogus]", "stages"),
        ("stages=[distil,evl]", "did you mean stages='[distill, eval]'?"),
        ("data.domain=medicl", "unknown domain 'medicl' (did you mean medical?)"),
        ("eval.domains=[cod]", "unknown domain 'cod' (did you mean code?)"),
        ("eval.domains=[specbench]", "did you mean one of specbench_math_reasoning, specbench_mt_bench, specbench_qa, "
                                     "specbench_rag, specbench_summarization, specbench_translation?"),
        ("trainer.max_steps=0", "trainer.max_steps"),
        ("trainer.lr=0", "trainer.lr"),
        ("+trainer.bogus=1", "trainer.bogus"),
        ("+bogus_top_level=1", "bogus_top_level"),
        ("decode.num_draft_tokens=abc", "decode.num_draft_tokens"),
        ("lora=default lora.rank=0", "lora.rank"),
        ("lora=default lora.dropout=1.0", "lora.dropout"),
        ("lora=default lora.target_modules=[]", "lora.target_modules"),
        ("lora=default lora.target_modules=q_proj", "lora.target_modules"),
        ("lora=default lora.domain=nope", "nope"),
        ("lora=default lora.max_steps=0", "lora.max_steps"),
        ("adapt.min_mean_accepted_length=0.5", "adapt.min_mean_accepted_length"),
        ("eval.min_mean_accepted_length=-1", "eval.min_mean_accepted_length"),
        ("eval.min_mean_accepted_length=cheap", "break_even"),
        ("eval.lookup_drafts=[prompt_lookups]", "unknown lookup kind 'prompt_lookups'"),
        ("eval.hybrid_lookups=[sufix]", "eval.hybrid_lookups: unknown lookup kind 'sufix' (the kinds: prompt_lookup, "
                                        "suffix); did you mean suffix?"),
        ("eval.hybrid_lookups=[suffix,suffix]", "eval.hybrid_lookups must list each of"),
    ],
)
def test_validate_rejects_bad_values_naming_the_key(override, key):
    cfg = compose_cfg(override.split(" "))  # composing succeeds: the checks live in the typed schema
    with pytest.raises(ValueError) as ei:
        validate(cfg)
    msg = str(ei.value)
    assert key in msg, msg
    assert "\n" not in msg  # one clear line


@pytest.mark.parametrize("overrides,named", [
    (["decode.temperature=0.7"], "decode.temperature=0.7"),
    (["decode.top_k=50", "decode.top_p=0.9"], "decode.top_k=50, decode.top_p=0.9"),
])
def test_a_sampling_setting_without_do_sample_is_refused(overrides, named):
    """decode.temperature / top_k / top_p away from their no-op values while decode.do_sample=false would decode
    greedily in silence (transformers only warns): refused, naming the keys and the fix."""
    with pytest.raises(ValueError) as ei:
        validate(compose_cfg(overrides))
    msg = str(ei.value)
    assert named in msg and "add decode.do_sample=true" in msg, msg
    validate(compose_cfg(["decode.do_sample=true", *overrides]))  # the same settings, sampling: accepted


def test_validate_accepts_edge_values():
    for overrides in (["decode.top_p=1.0", "decode.temperature=0"], ["decode.do_sample=true", "decode.top_p=0.01"],
                      ["decode.num_draft_tokens=1", "trainer.max_steps=1", "stages=[eval]"],
                      ["eval.min_mean_accepted_length=break_even"], ["eval.min_mean_accepted_length=0"]):
        _check(compose_cfg(overrides))
    with pytest.raises(ValueError, match="decode.temperature"):
        validate(compose_cfg(["decode.do_sample=true", "decode.temperature=0"]))


def _run_train(args: list[str], tmp_path: Path, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["SPECDRAFT_OUTPUT_ROOT"] = str(tmp_path / "outputs")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "train", *args, f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - t0


@pytest.mark.slow  # a python -m train subprocess
def test_cli_unknown_experiment_fails_naming_it(tmp_path):
    proc, _ = _run_train(["+experiment=does_not_exist"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "does_not_exist" in out and "experiment" in out
    for name in EXPERIMENTS:  # Hydra lists the available options
        assert name in out


@pytest.mark.slow  # a python -m train subprocess
def test_cli_invalid_value_fails_fast_before_any_model(tmp_path):
    proc, seconds = _run_train(["decode.num_draft_tokens=0", "stages=[eval]"], tmp_path, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "error: invalid config: decode.num_draft_tokens must be >= 1, got 0"
    assert seconds < 30
    assert not (tmp_path / "run").exists()  # rejected before Hydra creates the run directory


@pytest.mark.slow  # a python -m train subprocess
def test_cli_strategy_that_does_not_fit_the_launch_fails_before_any_model(tmp_path):
    """trainer=deepspeed_zero2 under plain python (no DeepSpeed launch) is refused before any work, naming the fix."""
    proc, _ = _run_train(["+experiment=smoke", "trainer=deepspeed_zero2"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "not launched with DeepSpeed" in out, out[-2000:]
    assert "accelerate launch --config_file conf/accelerate/deepspeed_zero2.yaml" in out
    assert out.count("not launched with DeepSpeed") == 1, out[-2000:]  # one error line, not a log line and a copy
    assert proc.stderr.strip().splitlines()[-1].startswith("error: trainer.strategy=deepspeed_zero2")
    assert not (tmp_path / "run").exists()  # refused before Hydra creates the run directory


def _leaves(node, prefix: str = "") -> dict:
    out = {}
    for k, v in node.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# Keys whose YAML value is a group's *selector* rather than a default (lora=default turns LoRA on, logger=wandb
# names the logger), or an interpolation (paths, env variables) that the dataclass states as its plain fallback.
SELECTORS = {"lora.enabled", "logger.name"}


@pytest.mark.parametrize("options", [[], ["lora=default", "logger=wandb"]])
def test_yaml_defaults_agree_with_the_dataclass_defaults(options):
    """One default per key: Python callers (``TrainerConfig()``, ``RootConfig()``) and the command line get the
    same run. Every key the default group files set literally must equal the dataclass default."""
    from dataclasses import asdict

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=options)
    yaml = _leaves(OmegaConf.to_container(cfg, resolve=False))
    python = _leaves(asdict(RootConfig()))
    compared = [k for k in yaml if k in python and k not in SELECTORS
                and not (isinstance(yaml[k], str) and "${" in yaml[k])]
    assert len(compared) > 100  # most of the tree is compared, not a handful of keys
    differ = {k: (yaml[k], python[k]) for k in compared if yaml[k] != python[k]}
    assert not differ, f"YAML default != dataclass default (yaml, python): {differ}"


@pytest.mark.parametrize("experiment,value", [
    ("lora_med", "{mine: /some/draft}"),  # a new name: Hydra's merge refused it ("Could not override")
    ("lora_med", "{general: /some/draft}"),  # a name the experiment has: Hydra kept the other three beside it
    ("adapt_domains", "{a: /x, b: /y}"),
    ("distill_med", "{mine: /some/draft}"),  # it names its int8 drafts: replaced the same way
])
def test_a_mapping_of_names_on_the_command_line_replaces_the_experiments(experiment, value):
    """``eval.drafts={...}`` evaluates exactly the drafts typed, whatever the experiment names (the rewritten
    command composes to that mapping, with Hydra flags too); one entry is still changed alone with
    ``eval.drafts.NAME=PATH``; a config section typed as a mapping keeps Hydra's merge, so the keys left out keep
    the experiment's values (distill_med's greedy teacher continuations, its memory-bound deployment)."""
    from core.cli import compose as cli_compose, replace_mapping_overrides

    argv = replace_mapping_overrides([f"+experiment={experiment}", f"eval.drafts={value}"], RootConfig)
    assert argv[1:] == ["eval.drafts=null", f"eval.drafts={value}"]
    cfg, _ = cli_compose(argv, CONF)
    assert OmegaConf.to_container(cfg.eval.drafts) == OmegaConf.to_container(OmegaConf.create(value))
    one = replace_mapping_overrides(["+experiment=lora_med", "eval.drafts.general=/x"], RootConfig)
    assert one == ["+experiment=lora_med", "eval.drafts.general=/x"]
    cfg, _ = cli_compose(one, CONF)
    assert cfg.eval.drafts.general == "/x" and "lora_medical" in cfg.eval.drafts
    mixture = replace_mapping_overrides(["+experiment=general_draft", "data.mixture={code: 1}"], RootConfig)
    assert OmegaConf.to_container(cli_compose(mixture, CONF)[0].data.mixture) == {"code": 1}
    sections = ["+experiment=distill_med", "distill.generation={max_new_tokens: 32}",
                "eval.deployment={cost_ratio: 0.1}"]
    assert replace_mapping_overrides(sections, RootConfig) == sections
    cfg = validate(cli_compose(sections, CONF)[0])
    assert (cfg.distill.generation.temperature, cfg.distill.generation.max_prompts) == (0.0, 256)
    assert cfg.eval.deployment["memory_bound"] if isinstance(cfg.eval.deployment, dict) else \
        cfg.eval.deployment.memory_bound


def test_overrides_python_m_eval_never_reads_are_named_and_left_out_of_its_replay(tmp_path):
    """``draft=small`` or ``trainer.lr=...`` on ``python -m eval`` is named (it reads only its own sections), and
    the command that re-evaluates a training run keeps the training command's eval-side overrides only."""
    from core.cli import ignored_overrides, run_command
    from eval.config import EVAL_SECTIONS

    argv = ["+experiment=distill_med", "draft=small", "+trainer.lr=1e-3", "~distill.cache_dir", "eval.max_prompts=2",
            "target@target=smollm2", "hydra.run.dir=/x", "overwrite=true", "--cfg", "data.root=/d", "stages=[eval]"]
    assert ignored_overrides(argv, EVAL_SECTIONS) == ["draft=small", "+trainer.lr=1e-3", "stages=[eval]"]
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text(
        "- +experiment=distill_med\n- draft=eagle3\n- trainer.max_steps=3\n- eval.max_prompts=2\n")
    cmd = run_command(tmp_path, "eval", sections=EVAL_SECTIONS)
    assert cmd == f"python -m eval +experiment=distill_med eval.max_prompts=2 hydra.run.dir={tmp_path}"
    assert "draft=eagle3 trainer.max_steps=3" in run_command(tmp_path, "train")


def test_eval_with_hydra_flags_after_the_overrides_composes_as_a_run_would():
    """``python -m eval OVERRIDES --cfg job`` prints the config a run would use (the entry point's own override
    goes first, where Hydra's parser accepts it), the mapping of drafts replaced as typed; a training-only override
    (``draft=small``) is named on stderr as ignored."""
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "eval", "+experiment=lora_med", "eval.drafts={x: /n1}", "draft=small",
                           "--cfg", "job"], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning: python -m eval reads only seed, experiment_name" in proc.stderr
    assert "ignored: draft=small (" in proc.stderr
    drafts = OmegaConf.create(proc.stdout).eval.drafts
    assert OmegaConf.to_container(drafts) == {"x": "/n1"}


def test_int8_drafts_named_in_eval_drafts_need_draft_quantize_int8(tmp_path):
    """distill_med evaluates drafts/<name>_int8, which the run writes only with draft.quantize=int8: with it
    switched off the run stops before any model loads (not after training), naming both fixes; with it on, the
    drafts the stages will write are not looked for yet."""
    from eval.pipeline import check_eval_inputs

    rc = _check(compose_cfg(["+experiment=distill_med", "draft.quantize=none"]))
    with pytest.raises(ValueError, match=r"eval.drafts.distilled is drafts/distilled_int8, which this run writes "
                                         r"only with draft.quantize=int8 \(it is none\): set draft.quantize=int8, "
                                         r"or evaluate the fp32 draft with eval.drafts.distilled=drafts/distilled"):
        check_eval_inputs(rc, tmp_path, need_drafts=False)
    rc = _check(compose_cfg(["+experiment=distill_med", "target=reference"]))
    assert rc.draft.quantize == "int8"
    assert check_eval_inputs(rc, tmp_path, need_drafts=False)[0] == {}


def test_int8_eval_drafts_without_quantize_are_refused_before_the_target_is_converted(tmp_path, monkeypatch):
    """python -m train's checks refuse distill_med with draft.quantize=none before resolving (converting) the
    target: with an empty cache the mistake must not cost the minute of conversion first."""
    import models.target
    from train.run import check_before_run

    def no_conversion(rc):
        raise AssertionError("the target was resolved before the config was refused")

    monkeypatch.setattr(models.target, "resolve_target", no_conversion)
    with pytest.raises(ValueError, match="drafts/distilled_int8, which this run writes only with draft.quantize=int8"):
        check_before_run(compose_cfg(["+experiment=distill_med", "draft.quantize=none"]), tmp_path / "run")


def test_self_draft_indices_without_method_list_are_named_not_silently_ignored(caplog):
    """draft.layers.indices only acts with draft.layers.method=list: given with another method, a warning names the
    key, the method that chooses instead, and the fix (once per process, though the config is validated twice)."""
    import logging

    from distill import drafts

    drafts._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="distill.drafts"):
        validate(compose_cfg(["draft=layer_pruned", "draft.layers.indices=[0,3]"]))
        validate(compose_cfg(["draft=layer_pruned", "draft.layers.indices=[0,3]"]))
        validate(compose_cfg(["draft=layer_pruned", "draft.layers.method=list", "draft.layers.indices=[0,4]"]))
    said = [r.getMessage() for r in caplog.records if "is not read" in r.getMessage()]
    assert said == ["draft.layers.indices [0, 3] is not read: draft.layers.method=first_k chooses the layers; add "
                    "draft.layers.method=list to keep exactly those layers"], said
