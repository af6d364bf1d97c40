"""Many bad-input commands of one entry point (``python -m train`` / ``python -m eval``) at the cost of one start.

Each command of a table runs in its own process, as a user's would: a child forked from one driver process that
imported the entry point once (``{module}.__main__``, as ``python -m`` runs it: its module-level setup included), then
set ``sys.argv`` and ran the module as ``__main__`` the way ``python -m`` does (``runpy.run_module``). The child's
stdout / stderr are its own files and its exit status is what the module ended with (``SystemExit`` code, 1 with a
traceback for an uncaught exception, 0 otherwise), so the assertions see what a shell would. What the children share
is the interpreter start and the imports (about 6-7 s of the 8 s a rejected command takes on the 2-core machine):
that is the time saved. Commands
that must run from a bare interpreter (``--cfg job`` in a subprocess, whole runs) keep using ``subprocess``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_DRIVER = r"""
import importlib, json, os, runpy, sys, traceback
module, jobs_file, out_dir, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
PRELOAD = {"train": ("train.run", "train.run"), "eval": ("eval.config", "eval.pipeline")}
importlib.import_module(module + ".__main__")  # its imports, once (each child runs the module itself again)
for name in PRELOAD.get(module, ()):  # what main() imports lazily on every path (the schema, the checks)
    importlib.import_module(name)
jobs = json.load(open(jobs_file))
script = os.path.join(os.getcwd(), module, "__main__.py")
running = {}


def start(i, argv):
    pid = os.fork()
    if pid:
        running[pid] = i
        return
    code = 1
    try:
        out = os.open(os.path.join(out_dir, f"{i}.out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = os.open(os.path.join(out_dir, f"{i}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.argv = [script, *argv]
        sys.modules.pop(module + ".__main__", None)  # run fresh as __main__ (its imports stay loaded)
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)  # what python -m does
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def reap():
    pid, status = os.wait()
    i = running.pop(pid)
    with open(os.path.join(out_dir, f"{i}.rc"), "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))


for i, argv in enumerate(jobs):
    while len(running) >= workers:
        reap()
    start(i, argv)
while running:
    reap()
"""


def run_commands(module: str, commands: list[list[str]], env: dict[str, str] | None = None,
                 timeout: float = 600, workers: int | None = None) -> list[subprocess.CompletedProcess]:
    """Run ``python -m {module} ARGS`` for every ``ARGS`` of ``commands`` (each in its own forked process, at most
    ``workers`` at a time: the cores by default); returns one ``CompletedProcess`` (args, returncode, stdout, stderr)
    per command, in order. A child killed by a signal reports ``-signal`` (as ``subprocess`` does).

    Raises:
        AssertionError: the driver failed, or the commands ran past ``timeout`` seconds (all of them are then killed;
            the message lists those that had not finished).
    """
    workers = workers or max(1, os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        jobs = Path(tmp) / "jobs.json"
        jobs.write_text(json.dumps(commands))
        # its own session, so that a timeout ends the driver and every command it forked (no orphans left running)
        with subprocess.Popen([sys.executable, "-c", _DRIVER, module, str(jobs), tmp, str(workers)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) as proc:
            try:
                _, stderr = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                done = sorted(int(q.stem) for q in Path(tmp).glob("*.rc"))
                raise AssertionError(f"python -m {module}: the commands took over {timeout} s; still running: "
                                     f"{[c for i, c in enumerate(commands) if i not in done]}") from None
        assert proc.returncode == 0, stderr[-3000:]
        driver = subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)
        out = []
        for i, argv in enumerate(commands):
            rc = Path(tmp, f"{i}.rc")
            assert rc.exists(), (argv, driver.stderr[-3000:])
            stdout, stderr = Path(tmp, f"{i}.out").read_text(), Path(tmp, f"{i}.err").read_text()
            out.append(subprocess.CompletedProcess([sys.executable, "-m", module, *argv], int(rc.read_text()),
                                                   stdout, stderr))
        return out
