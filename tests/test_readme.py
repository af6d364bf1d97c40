"""README and CI must not drift: .ci/run runs exactly the README's setup and test commands."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands_after(text: str, marker: str) -> str:
    lines = text.splitlines()
    i = next(i for i, l in enumerate(lines) if l.strip() == marker)
    return next(l.strip() for l in lines[i + 1 :] if l.strip() and not l.startswith("#") and not l.startswith("```"))


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    setup = _commands_after(ci, "# setup (README)")
    test = _commands_after(ci, "# test (README)")
    assert setup in readme, f"README lacks the setup command {setup!r}"
    assert test in readme, f"README lacks the test command {test!r}"
    assert "torch==2.13.0" in setup
    for doc in ("docs/devices.md", "scripts/device_check.sh"):  # the GPU machine's setup is the same command
        assert setup in (ROOT / doc).read_text(), f"{doc} lacks the README setup command {setup!r}"


def test_bad_input_table_rows_name_existing_tests():
    """Every row of docs/faults.md's "Bad input and faults: what you see" names at least one test, and each named test
    (and parametrized case) exists, so the table stays a list of tested behaviour."""
    import re

    readme = (ROOT / "docs" / "faults.md").read_text()
    section = readme.split("## Bad input and faults: what you see", 1)[1].split("\n## ", 1)[0]
    rows = [l for l in section.splitlines() if l.startswith("| ") and not l.startswith("| bad input or fault")]
    assert len(rows) >= 25
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 4, row
        assert cells[2] in {"0", "2", "3", "4", "130", "0 / 2", "-"}, row
        refs = re.findall(r"`(tests/[\w/]+\.py)::(\w+)(?:\[(\w+)\])?`", cells[3])
        assert refs, f"row names no test: {row}"
        for path, name, case in refs:
            text = (ROOT / path).read_text()
            assert f"def {name}(" in text, f"{path}::{name} does not exist"
            if case:
                assert f'"{case}"' in text, f"{path}::{name}[{case}] is not a parametrized case"


def test_setup_installs_from_the_constraints_file_and_it_agrees_with_pyproject():
    """A fresh machine installs the tested versions: every pip call of the setup command passes -c constraints.txt,
    the file pins every direct dependency (and DeepSpeed) to one version, and that version satisfies pyproject's
    range, so the pins and the declared bounds cannot drift apart."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    ci = (ROOT / ".ci" / "run").read_text()
    setup = _commands_after(ci, "# setup (README)")
    calls = [c.strip() for c in setup.split("&&")]
    assert calls and all(c.startswith("pip install -c constraints.txt ") for c in calls), calls
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[req.name.lower().replace("_", "-")] = Version(spec.version)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    for req in declared + [Requirement("deepspeed")]:
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"constraints.txt does not pin {name}"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} is outside {req}"


def test_an_install_ships_the_models_and_the_config_the_default_experiment_reads():
    """A non-editable ``pip install .`` runs the default experiment: the committed models the config names
    (``paths.reference_target``, ``paths.general_draft``, the default target) lie in a folder pyproject ships, not
    under tests/, and pyproject's package data covers every file of models/assets/ and conf/ (the wheel holds them)."""
    import tomllib

    from omegaconf import OmegaConf

    from tinymodels import compose_config

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = set(tool["packages"]["find"]["include"])
    cfg = compose_config([])
    for key in ("paths.reference_target", "paths.general_draft", "target.name_or_path"):
        path = Path(str(OmegaConf.select(cfg, key))).resolve()
        rel = path.relative_to(ROOT)
        assert rel.parts[0] != "tests" and any(s.rstrip("*") == rel.parts[0] for s in shipped), \
            f"{key}={rel} is not in a shipped folder"
        assert (path / "config.json").is_file() and list(path.glob("*.safetensors")), path
    for package, folder in (("models", "models/assets"), ("conf", "conf")):
        assert any(package == s or package + "*" == s for s in shipped), f"pyproject does not ship {package}/"
        files = {p for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts}
        covered = {p for pattern in tool["package-data"][package] for p in (ROOT / package).glob(pattern)
                   if p.is_file()}
        assert files and files <= covered, f"pyproject's package data leaves out {sorted(files - covered)}"
