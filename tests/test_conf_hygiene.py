"""The config tree stays small and honest: groups have options to choose from, experiments state only what differs,
the draft kinds agree on what they share, and comments describe keys instead of quoting measurements.

Fast (a few Hydra compositions, no models): numbers measured on one machine at one commit live in docs/decisions.md
and docs/results.md with their commands, not in conf/ comments where they rot.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from core.io import PROJECT_ROOT

CONF = PROJECT_ROOT / "conf"
DOCS = PROJECT_ROOT / "docs"
# folders under conf/ that are not Hydra groups: domain declarations (data/loading.py reads conf/domain/<name>.yaml)
# and accelerate launch configs (distill/launch.py)
NOT_GROUPS = {"domain", "accelerate"}
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
DRAFTS = sorted(p.stem for p in (CONF / "draft").glob("*.yaml"))
YAML_FILES = sorted(CONF.rglob("*.yaml"))

OmegaConf.register_new_resolver("specdraft_root", lambda: str(PROJECT_ROOT), replace=True)


def _rel(path: Path) -> str:
    return str(path.relative_to(PROJECT_ROOT))


def _comments(path: Path) -> list[tuple[int, str]]:
    """``(line number, comment text)`` of every YAML comment in ``path``: a ``#`` that starts the line or follows
    whitespace (no value in conf/ holds `` #``)."""
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        m = re.search(r"(?:^|\s)#(.*)$", line)
        if m:
            out.append((i, m.group(1).strip()))
    return out


def _leaves(node, prefix: str = "") -> dict:
    """Dotted key -> value for every leaf of a plain container (an empty mapping is a leaf)."""
    out = {}
    for k, v in node.items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


_MISSING = object()


def _get(node, key: str):
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _same(a, b) -> bool:
    return a is not _MISSING and isinstance(a, bool) == isinstance(b, bool) and a == b


# (a) ---------------------------------------------------------------------------------------------------------------

def test_every_config_group_offers_a_choice():
    """A group with one option is a section of conf/config.yaml in disguise: one more file and one more defaults
    entry for a key set nobody selects."""
    groups = [d for d in sorted(CONF.iterdir()) if d.is_dir() and d.name not in NOT_GROUPS]
    assert {"experiment", "target", "draft", "trainer"} <= {d.name for d in groups}
    for d in groups:
        options = sorted(p.name for p in d.glob("*.yaml"))
        assert len(options) >= 2, (
            f"conf/{d.name}/ is a Hydra group with one option ({', '.join(options) or 'none'}): move its keys into "
            f"conf/config.yaml as a plain '{d.name}:' section, drop '- {d.name}: ...' from its defaults list, "
            f"delete the folder, and replace any 'override /{d.name}: ...' in an experiment by the keys it sets")


# (b) ---------------------------------------------------------------------------------------------------------------

# A measured number: a decimal (0.30, 1.56; not a version such as Apache-2.0), a duration (12 s, 4 ms, 30 min, 2 h),
# a rate (tokens/s), a speedup (1.4x, 3x) or a percentage. Plain integers (counts, ranges, sizes) are allowed.
MEASURED = re.compile(r"""
    (?<![\w.\-/])\d+\.\d+(?![\w.])
  | \d(?:[\d,]*\d)?\s*(?:ms|s|sec|secs|seconds?|min|mins|minutes?|h|hours?|days?)\b(?!-)
  | \d[\d,.]*\s*(?:tok/s|tokens/s|tokens\ per\ second|blocks/s|it/s|steps/s)
  | \d(?:[\d.]*\d)?x\b
  | \d\s*%
""", re.X)


@pytest.mark.parametrize("text", ["tau 1.70 vs 1.60", "about 0.7 s", "30 min 15 s", "20 tokens/s", "1.41x -> 1.56x",
                                  "4x fewer", "2-3% over 1 thread", "~30% more", "took 4 ms"])
def test_the_measured_number_pattern_catches_measurements(text):
    assert MEASURED.search(text)


@pytest.mark.parametrize("text", ["0: off", "gamma in {2, 4}", "8 x 128 tokens", "Apache-2.0", "[0, 1, 28, 29]",
                                  "30 + 2 x 29 + 2 x 28 candidates", "top-32 logits", "ACL 2024", "(>= 1)",
                                  "seconds (0: off)", "1 - TVD", "SmolLM2-135M-Instruct", "draft.quantize=int8"])
def test_the_measured_number_pattern_lets_descriptions_pass(text):
    assert not MEASURED.search(text)


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: _rel(p))
def test_config_comments_quote_no_measured_numbers(path):
    """Comments say what a key does and why; the numbers behind a choice belong in docs/decisions.md (with the
    commit) or docs/results.md (with the command), where they are kept current."""
    bad = [f"{_rel(path)}:{i}: {m.group(0)!r} in '# {text}'" for i, text in _comments(path)
           if (m := MEASURED.search(text))]
    assert not bad, ("config comments quote measured numbers (they rot): rewrite each as what the key does and why, "
                     "and cite docs/decisions.md or docs/results.md for the measurement:\n" + "\n".join(bad))


def _headings(doc: Path) -> set[str]:
    return {m.strip() for m in re.findall(r"^#+\s+(.+?)\s*$", doc.read_text(), re.M)}


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: _rel(p))
def test_docs_sections_cited_in_config_comments_exist(path):
    """``docs/X.md, "Section"`` in a comment (possibly wrapped over comment lines) names a heading of that file."""
    text = " ".join(t for _, t in _comments(path))
    bad = []
    for doc, section in re.findall(r"(docs/[\w./-]+\.md),?\s+\"([^\"]+)\"", text):
        if not (PROJECT_ROOT / doc).is_file():
            bad.append(f"{doc} does not exist")
        elif section not in _headings(PROJECT_ROOT / doc):
            bad.append(f"{doc} has no heading {section!r}")
    assert not bad, f"{_rel(path)} cites docs that are not there: {'; '.join(bad)}: point the comment at an " \
                    f"existing heading (grep '^#' docs/*.md) or drop the citation"


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: _rel(p))
def test_files_cited_in_config_comments_exist(path):
    """``pkg/module.py`` (or ``pkg/module.py::Name``) and ``docs/X.md`` in a comment name a file of the repository
    (and a class or function defined in it)."""
    text = " ".join(t for _, t in _comments(path))
    bad = []
    for file, name in re.findall(r"(?<![\w/.~$<>-])((?:[\w-]+/)+[\w-]+\.(?:py|md))(?:::(\w+))?", text):
        if not (PROJECT_ROOT / file).is_file():
            bad.append(f"{file} does not exist")
        elif name and not re.search(rf"^\s*(?:class|def)\s+{name}\b", (PROJECT_ROOT / file).read_text(), re.M):
            bad.append(f"{file} defines no {name}")
    assert not bad, f"{_rel(path)} cites files that are not there: {'; '.join(bad)}: point the comment at where " \
                    f"the code lives now (modules move) or drop the citation"


# (c) ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def conf_copy(tmp_path_factory) -> Path:
    """A private copy of conf/ in which one experiment at a time is cut down to its defaults list."""
    dst = tmp_path_factory.mktemp("conf")
    shutil.copytree(CONF, dst, dirs_exist_ok=True)
    return dst


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiments_state_only_what_differs(experiment, conf_copy):
    """Every value an experiment sets differs from what the composition gives without it (conf/config.yaml, the
    group options its defaults list picks, the experiment it builds on). A restated default hides which settings make
    the experiment, and goes stale when the default moves."""
    source = CONF / "experiment" / f"{experiment}.yaml"
    raw = OmegaConf.to_container(OmegaConf.load(source))
    own = _leaves({k: v for k, v in raw.items() if k not in ("defaults", "hydra")})
    target = conf_copy / "experiment" / f"{experiment}.yaml"
    stripped = {"defaults": raw["defaults"]} if "defaults" in raw else {}
    target.write_text("# @package _global_\n" + OmegaConf.to_yaml(OmegaConf.create(stripped)))
    try:
        with initialize_config_dir(config_dir=str(conf_copy), version_base="1.3"):
            base = OmegaConf.to_container(compose("config", overrides=[f"+experiment={experiment}"]))
    finally:
        shutil.copy2(source, target)
    restated = {k: v for k, v in own.items() if _same(_get(base, k), v)}
    assert not restated, (
        f"conf/experiment/{experiment}.yaml restates values the composition already gives without it: "
        + ", ".join(f"{k}: {v!r}" for k, v in restated.items())
        + ": delete these lines (keep a comment's reason on the key it explains, or in the header)")


# (d) ---------------------------------------------------------------------------------------------------------------

def test_draft_kinds_agree_on_the_fields_they_share():
    """conf/draft/small.yaml states the settings every draft kind shares (arch, quantize, train_embeddings, ...);
    layer_pruned.yaml and pretrained.yaml start from it and state only their kind's keys (init, layers,
    name_or_path). Composed alone, the kinds differ only in those."""
    assert "small" in DRAFTS and len(DRAFTS) >= 2
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        kinds = {d: _leaves(OmegaConf.to_container(compose("config", overrides=[f"draft={d}"]).draft))
                 for d in DRAFTS}
    shared = {k for d in kinds for k in kinds[d] if k != "init" and sum(k in kinds[e] for e in kinds) >= 2}
    bad = []
    for key in sorted(shared):
        values = {d: kinds[d][key] for d in DRAFTS if key in kinds[d]}
        if len({repr(v) for v in values.values()}) > 1:
            bad.append(f"draft.{key}: " + ", ".join(f"conf/draft/{d}.yaml {v!r}" for d, v in values.items()))
    assert not bad, ("the draft kinds disagree on fields they share: state each shared field once in "
                     "conf/draft/small.yaml (the other kinds list '- small' in their defaults and state only their "
                     "own keys), and let an experiment that needs another value set it itself:\n" + "\n".join(bad))
    for d in DRAFTS:
        if d == "small":
            continue
        raw = OmegaConf.to_container(OmegaConf.load(CONF / "draft" / f"{d}.yaml"))
        assert "small" in raw.get("defaults", []), \
            f"conf/draft/{d}.yaml: add 'defaults: [small, _self_]' so the shared draft settings are stated once"
        restated = sorted(set(_leaves({k: v for k, v in raw.items() if k != "defaults"})) & set(kinds["small"])
                          - {"init"})
        assert not restated, (f"conf/draft/{d}.yaml restates shared fields {restated} of conf/draft/small.yaml: "
                              f"delete them there (an experiment that needs another value sets it itself)")
