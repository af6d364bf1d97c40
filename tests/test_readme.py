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
