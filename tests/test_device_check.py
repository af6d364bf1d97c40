"""scripts/device_check.sh stays runnable on a fresh GPU machine: it installs with the README's setup command, its
time limits add up to under 8 minutes (and match docs/devices.md), it fails when the gpu tests were skipped, and it
refuses unknown arguments. (The check itself needs a GPU; ``--cpu`` dry-runs it, see docs/devices.md, "Devices and
precision".)"""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device_check.sh"


def _setup_command() -> str:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    i = next(i for i, l in enumerate(lines) if l.strip() == "# setup (README)")
    return next(l.strip() for l in lines[i + 1:] if l.strip() and not l.startswith("#"))


def test_installs_with_the_readme_setup_command():
    text = SCRIPT.read_text()
    assert f"setup='{_setup_command()}'" in text
    assert _setup_command() in (ROOT / "README.md").read_text()


def test_time_limits_add_up_to_under_8_minutes_and_match_the_readme():
    text = SCRIPT.read_text()
    limits = [int(x) for x in re.findall(r"timeout \$\(t (\d+)\)", text)]
    bench_runs = len(re.findall(r"for dtype in float32 bfloat16", text)) * 2  # the bench step runs twice
    assert len(limits) == 6 and bench_runs == 2
    total = sum(limits) + limits[4] * (bench_runs - 1)
    assert total < 480, total
    assert f"= {total} < 480" in text
    readme = (ROOT / "docs" / "devices.md").read_text()
    assert ("time limits: install {} s, environment {} s, distillation {} s, tests {} s, benchmark 2 x {} s, "
            "evaluation {} s").format(*limits) in " ".join(readme.split())


def test_fails_when_the_gpu_tests_were_skipped():
    text = SCRIPT.read_text()
    assert 'if n == 0 or skipped:' in text and "rc[tests]=1" in text
    assert '-m "gpu or not slow"' in text and "tests/decode/test_decode_gpu.py" in text
    assert "tests/decode/test_decode_sliding_window.py" in text  # the model-family tests run there too


def test_unknown_argument_is_refused_before_anything_runs(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "--gpu-please"], capture_output=True, text=True, timeout=30,
                          env={"OUT": str(tmp_path / "out"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and proc.stderr.strip() == "error: unknown argument --gpu-please (use --cpu for " \
                                                            "the CPU dry run)"
    assert not (tmp_path / "out").exists()
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
