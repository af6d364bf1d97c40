"""The docs name only what exists: every ``+experiment=NAME`` is a file in conf/experiment/, and every config key
written in README.md or docs/*.md (an override ``key.sub=value`` or a dotted key in backticks) is a key of the
composed config, or lies under a mapping whose keys the user chooses (``eval.drafts.NAME``)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import DictConfig

from tinymodels import compose_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
# keys docs/faults.md shows on purpose as mistakes, to show the error a user gets
SHOWN_AS_MISTAKES = {"trainer.max_step", "eval.domain", "eval.draft"}
GROUPS = {g.name: sorted(o.stem for o in g.glob("*.yaml")) for g in (ROOT / "conf").iterdir()
          if g.is_dir() and g.name not in {"experiment", "domain", "accelerate"}}


def _code_spans(text: str) -> list[str]:
    """Inline code and the lines of fenced code blocks."""
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        spans += block.splitlines()
    return spans


# mappings whose keys the user names (a draft name, a domain name)
OPEN_MAPPINGS = {"eval.drafts", "data.declared_domains", "data.mixture"}


def _keys_of(node, prefix: str, out: dict[str, bool]) -> None:
    """``out[dotted key] = True`` where the user may name keys below it (an open mapping, or null), else False."""
    for k in node.keys():
        full = f"{prefix}{k}"
        child = node._get_node(k)
        out[full] = full in OPEN_MAPPINGS
        if isinstance(child, DictConfig) and not child._is_none():
            _keys_of(child, full + ".", out)


@pytest.fixture(scope="module")
def known_keys() -> dict[str, bool]:
    out: dict[str, bool] = {}
    options = [[f"{g.name}={o.stem}"] for g in (ROOT / "conf").iterdir() if g.is_dir()
               and g.name not in {"experiment", "domain", "accelerate"} for o in g.glob("*.yaml")]
    for overrides in [[]] + [[f"+experiment={e}"] for e in EXPERIMENTS] + options:
        _keys_of(compose_config(overrides), "", out)
    return out


def test_every_experiment_named_in_the_docs_exists():
    missing = sorted({f"{p.relative_to(ROOT)}: +experiment={m}" for p in DOCS
                      for m in re.findall(r"\+experiment=([\w-]+)", p.read_text()) if m not in EXPERIMENTS})
    assert not missing, "docs name experiments that conf/experiment/ lacks:\n" + "\n".join(missing)
    assert len(EXPERIMENTS) >= 5


def test_every_config_key_named_in_the_docs_exists(known_keys):
    sections = {k for k in known_keys if "." not in k}
    key_re = re.compile(r"(?<![\w/.$-])\+{0,2}((?:%s)(?:\.[A-Za-z_][\w]*|\.\*)+)(?==|\b|$)" % "|".join(sorted(sections)))
    bad, checked = [], 0
    for p in DOCS:
        for span in _code_spans(p.read_text()):
            if re.match(r"\s*(from|import) \w", span):  # Python in a code block: module names, not keys
                continue
            for m in key_re.finditer(span):
                key = m.group(1).removesuffix(".*")
                if key.rsplit(".", 1)[-1] in {"py", "md", "yaml", "json"} or (
                        key in SHOWN_AS_MISTAKES and p.name == "faults.md"):
                    continue
                checked += 1
                parts = key.split(".")
                prefixes = [".".join(parts[:i]) for i in range(1, len(parts))]
                if key not in known_keys and not any(known_keys.get(q) for q in prefixes):
                    bad.append(f"{p.relative_to(ROOT)}: {key}")
    assert checked >= 50, f"only {checked} keys found: the pattern no longer reads the docs"
    assert not bad, "docs name config keys that do not exist (rename them or fix the docs):\n" + \
        "\n".join(sorted(set(bad)))


def test_docs_describe_the_product_as_it_is_without_history():
    """History (what was tried, when, in which work period) goes to CHANGELOG.md; README and docs/ say what is."""
    history = re.compile(r"(?i)\bissue #?\d+|#\d{2,}\b|\bsessions?\b|\bpreviously\b|\bused to\b|\bno longer\b|"
                         r"\bwork period|\b20\d\d-\d\d-\d\d\b|\bsuperseded\b|\bthis time\b|\bbefore the (fix|change)")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}" for p in DOCS
             for i, line in enumerate(p.read_text().splitlines(), 1) if history.search(line)]
    assert not found, "history in the docs (move it to CHANGELOG.md):\n" + "\n".join(found)
    assert (ROOT / "CHANGELOG.md").is_file()
    assert len((ROOT / "docs" / "results.md").read_text().splitlines()) <= 250


def _known(key: str, known_keys: dict[str, bool]) -> bool:
    parts = key.split(".")
    return key in known_keys or any(known_keys.get(".".join(parts[:i])) for i in range(1, len(parts)))


def test_every_override_in_a_docs_command_exists(known_keys):
    """Each ``key=value`` of a ``python -m train`` / ``python -m eval`` command in the docs: a group takes one of its
    options, ``experiment`` names experiment files (a comma list too), any other key exists (Hydra's own
    ``hydra.*`` keys aside)."""
    bad, checked = [], 0
    for p in DOCS:
        for span in _code_spans(p.read_text()):
            for cmd in re.findall(r"python -m (?:train|eval)\b([^`|;&]*)", span):
                for tok in cmd.split():
                    tok = tok.strip("'\"")
                    m = re.fullmatch(r"[+~]{0,2}([A-Za-z_][\w.]*)=(.*)", tok)
                    if not m or m.group(1).startswith("hydra."):
                        continue
                    key, value = m.groups()
                    checked += 1
                    if key == "experiment":
                        bad += [f"{p.relative_to(ROOT)}: experiment={e}" for e in value.split(",")
                                if e not in EXPERIMENTS and not e.startswith("<")]
                    elif key in GROUPS:
                        bad += [f"{p.relative_to(ROOT)}: {key}={o}" for o in value.split(",")
                                if o not in GROUPS[key] and not o.startswith("<")]
                    elif not _known(key, known_keys) and not (key in SHOWN_AS_MISTAKES and p.name == "faults.md"):
                        bad.append(f"{p.relative_to(ROOT)}: {key}")
    assert checked >= 30, f"only {checked} overrides found: the pattern no longer reads the docs"
    assert not bad, "docs commands with options, experiments or keys that do not exist:\n" + "\n".join(sorted(set(bad)))
