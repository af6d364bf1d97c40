"""What every command-line error test checks: the environment the CLIs run in, and that a failure is one clean
``error: ...`` message with the right exit code (no traceback)."""
from __future__ import annotations

import os
import subprocess


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(WANDB_MODE="offline", HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    return env


def assert_clean_error(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """Exit ``code``; stderr ends with our ``error: ...`` message (one line, or a few for a tokenizer mismatch that
    lists each difference) holding every needle; no traceback anywhere. Returns the message."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    start = proc.stderr.rfind("\nerror: ") + 1 if not proc.stderr.startswith("error: ") else 0
    message = proc.stderr[start:].strip()
    assert message.startswith("error: "), proc.stderr[-3000:]
    assert len(message.splitlines()) <= 12, message  # a message, not a dump
    for n in needles:
        assert n in message, (n, message)
    return message
