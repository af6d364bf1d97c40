"""core.io under faults: a full disk or an unwritable folder is a clear ``ArtifactWriteError`` that leaves the earlier
artifact intact and no temporary behind; a report set is replaced as one set (``atomic_file_set``), whatever
step a crash hits; two processes building the same token-block cache entry at once both read complete data.

Full disk (ENOSPC) and a read-only file system (EROFS) are simulated by making the write path raise that errno
in-process: the suite may run as root, where ``chmod`` does not block writes, and no read-only mount is ours to
use. A real unwritable location (a path under a regular file) is tested through the CLI in
tests/train/test_cli_errors.py.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import core.io as dio
from core.io import atomic_dir, atomic_file_set, write_json_atomic
from core.errors import ArtifactWriteError
from models.checkpoints import save_hf_atomic

ROOT = Path(__file__).resolve().parents[2]


def _tree(folder: Path) -> dict[str, bytes]:
    """Every regular file under ``folder`` (symlinks followed) -> its bytes."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(folder))] = p.read_bytes()
    return out


def _fail_writes(monkeypatch, code: int):
    """Every ``os.fsync`` (the step before each atomic rename) raises ``code``, as a full disk or read-only file
    system would on the data write."""
    def boom(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(dio.os, "fsync", boom)


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "disk is full"), (errno.EROFS, "read-only"),
                                         (errno.EACCES, "no permission")])
def test_write_fault_is_clear_and_keeps_the_earlier_file(tmp_path, monkeypatch, code, words):
    path = tmp_path / "metrics.json"
    write_json_atomic(path, {"v": 1})
    before = path.read_bytes()
    _fail_writes(monkeypatch, code)
    with pytest.raises(ArtifactWriteError) as ei:
        write_json_atomic(path, {"v": 2})
    msg = ei.value.strerror
    assert str(path) in msg and words in msg and "intact" in msg, msg
    assert ei.value.errno == code
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]  # no temporary left


def test_full_disk_while_saving_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    """``save_hf_atomic`` (drafts) and ``atomic_dir`` (trainer checkpoints): a write failing half-way through the
    folder leaves the previous complete folder, and the error names the folder."""
    from tinymodels import tiny_llama

    out = tmp_path / "drafts" / "distilled"
    model = tiny_llama(seed=0)
    save_hf_atomic(model, None, out, extra={"step": 1})
    before = _tree(out)
    real_write = Path.write_text

    def full_disk(self, *a, **k):  # specdraft.json is written after the weights: the folder is half complete
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(ArtifactWriteError) as ei:
        save_hf_atomic(tiny_llama(seed=1), None, out, extra={"step": 2})
    monkeypatch.setattr(Path, "write_text", real_write)
    assert str(out) in ei.value.strerror and "disk is full" in ei.value.strerror
    assert _tree(out) == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["distilled"]


def test_a_parent_that_is_a_file_is_a_clear_error(tmp_path):
    """A real unwritable location (works as root too): the output folder's parent is a regular file."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(ArtifactWriteError) as ei:
        with atomic_dir(tmp_path / "file" / "run" / "ckpt"):
            pass
    assert "not a folder" in ei.value.strerror and "hydra.run.dir" in ei.value.strerror


# ---------------------------------------------------------------------------------------- report sets

NAMES = ("report.md", "metrics.json", "per_prompt.csv")


def _publish(folder: Path, version: int, plots: bool = True) -> None:
    with atomic_file_set(folder) as staging:
        for n in NAMES:
            (staging / n).write_text(f"{n} v{version}")
        if plots:
            (staging / "plots").mkdir()
            (staging / "plots" / "a.png").write_text(f"png v{version}")


def _visible_versions(folder: Path) -> set[str]:
    """The versions the top-level names show (a consistent set shows exactly one)."""
    seen = set()
    for n in NAMES:
        p = folder / n
        if p.exists():
            seen.add(p.read_text().split(" v")[1])
    if (folder / "plots" / "a.png").exists():
        seen.add((folder / "plots" / "a.png").read_text().split(" v")[1])
    return seen


def test_report_set_is_replaced_as_one_set(tmp_path):
    _publish(tmp_path, 1)
    assert _visible_versions(tmp_path) == {"1"}
    json.loads(json.dumps(sorted(os.listdir(tmp_path))))
    _publish(tmp_path, 2)
    assert _visible_versions(tmp_path) == {"2"}
    store = tmp_path / ".report"
    assert len([p for p in store.iterdir() if p.name.startswith("v-")]) == 1  # old versions are removed
    _publish(tmp_path, 3, plots=False)  # a set without plots/ drops the plots link, not leaves it dangling
    assert _visible_versions(tmp_path) == {"3"} and not (tmp_path / "plots").is_symlink()


def test_legacy_plain_report_files_are_kept_and_replaced(tmp_path):
    for n in NAMES:
        (tmp_path / n).write_text(f"{n} v0")
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "a.png").write_text("png v0")
    (tmp_path / "drafts").mkdir()  # other artifacts are never touched
    _publish(tmp_path, 1)
    assert _visible_versions(tmp_path) == {"1"}
    assert (tmp_path / ".report" / "legacy" / "report.md").read_text() == "report.md v0"
    assert (tmp_path / "drafts").is_dir()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(crash_at=st.integers(min_value=0, max_value=12), in_body=st.booleans())
def test_a_crash_at_any_step_leaves_one_complete_set(tmp_path_factory, crash_at, in_body):
    """Crash (an exception standing in for kill -9) at the n-th filesystem step of publishing version 2, or
    while its files are being written: the names show all of version 1 or all of version 2, never a mix, and the
    next publish repairs everything."""
    folder = tmp_path_factory.mktemp("set")
    _publish(folder, 1)
    calls = {"n": 0}
    real = {"replace": os.replace, "symlink": os.symlink}

    def counted(name):
        def f(*a, **k):
            calls["n"] += 1
            if calls["n"] == crash_at:
                raise KeyboardInterrupt("killed")
            return real[name](*a, **k)
        return f

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dio.os, "replace", counted("replace"))
        mp.setattr(dio.os, "symlink", counted("symlink"))
        try:
            with atomic_file_set(folder) as staging:
                for i, n in enumerate(NAMES):
                    if in_body and i == crash_at % len(NAMES):
                        raise KeyboardInterrupt("killed while writing")
                    (staging / n).write_text(f"{n} v2")
                (staging / "plots").mkdir()
                (staging / "plots" / "a.png").write_text("png v2")
        except KeyboardInterrupt:
            pass
    assert _visible_versions(folder) in ({"1"}, {"2"})
    if _visible_versions(folder) == {"1"}:
        assert all((folder / n).exists() for n in NAMES)
    _publish(folder, 3)
    assert _visible_versions(folder) == {"3"}


# ---------------------------------------------------------------------------------------- shared caches

_BUILD = """
import json, sys
sys.path[:0] = [{root!r}, {tests!r}]
from data.text import cached_pack_blocks, train_bpe_tokenizer
texts = ["the patient reports chest pain and cough number %d" % i for i in range(400)]
tok = train_bpe_tokenizer(iter(texts), vocab_size=300, min_frequency=1)
ds = cached_pack_blocks(["race-test"], lambda: texts, tok, 16)
print(json.dumps(ds.to_dict()["input_ids"]))
"""


@pytest.mark.slow
def test_two_processes_building_the_same_cache_entry_read_complete_data(tmp_path):
    """Two runs at once share $SPECDRAFT_CACHE: both build the same token-block entry concurrently; each reads a
    complete entry (the loser of the rename race reads the winner's), equal to the other's, and no temporary
    is left."""
    env = {**os.environ, "SPECDRAFT_CACHE": str(tmp_path / "cache"), "TQDM_DISABLE": "1",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    code = _BUILD.format(root=str(ROOT), tests=str(ROOT / "tests"))
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    a, b = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert a == b and len(a) > 10 and all(len(r) == 16 for r in a)
    entries = list((tmp_path / "cache" / "blocks").iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(".")
