"""Atomic artifact writes (shared by every stage): write to a temporary name in the same folder, then rename into place.

A write that fails (full disk, read-only or unwritable folder) removes its temporary and raises
:class:`ArtifactWriteError` naming the path, the reason and the fix; the previous version of the artifact, if any,
is left as it was.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from core.errors import ArtifactWriteError

PROJECT_ROOT = Path(__file__).resolve().parent.parent  # the repository (or installed tree) root


# errno -> what the user should do about it
_WRITE_FIXES = {
    errno.ENOSPC: "the disk is full: free space (or point hydra.run.dir at another disk) and rerun the same command",
    errno.EDQUOT: "the disk quota is exhausted: free space and rerun the same command",
    errno.EROFS: "the file system is read-only: choose a writable output folder (hydra.run.dir=...)",
    errno.EACCES: "no permission to write there: choose a writable output folder (hydra.run.dir=...) or fix its "
                  "permissions",
    errno.EPERM: "no permission to write there: choose a writable output folder (hydra.run.dir=...) or fix its "
                 "permissions",
    errno.ENOTDIR: "a parent of that path is a file, not a folder: choose another output folder (hydra.run.dir=...)",
}


def _errno_of(e: BaseException) -> int | None:
    """The errno of ``e`` or of an exception in its cause chain; libraries (safetensors, torch) wrap OSErrors."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno:
            return e.errno
        text = str(e)
        for code, name in ((errno.ENOSPC, "No space left on device"), (errno.EROFS, "Read-only file system"),
                           (errno.EDQUOT, "Disk quota exceeded"), (errno.EACCES, "Permission denied")):
            if name in text:
                return code
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def write_error(e: BaseException, path: str | os.PathLike) -> ArtifactWriteError | None:
    """An :class:`ArtifactWriteError` for a failed write of ``path`` when ``e`` is a write fault (full disk,
    read-only, permissions, ...), else ``None``."""
    if isinstance(e, ArtifactWriteError):
        return e
    code = _errno_of(e)
    if code not in _WRITE_FIXES:
        return None
    err = ArtifactWriteError(code, f"cannot write {path}: {os.strerror(code)}; {_WRITE_FIXES[code]}. Artifacts "
                                   f"written before are intact.")
    err.__cause__ = e
    return err


@contextmanager
def translate_write_errors(path: str | os.PathLike) -> Iterator[None]:
    """Re-raise write faults inside the block as :class:`ArtifactWriteError` naming ``path``."""
    try:
        yield
    except Exception as e:
        err = write_error(e, path)
        if err is None or err is e:
            raise
        raise err from e


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder next to ``final``; on success replace ``final`` with it, else delete it.

    Readers therefore see either the previous complete folder or the new complete one, never a partial one.
    """
    final = Path(final)
    with translate_write_errors(final):
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700; artifacts get the usual permissions
    try:
        yield tmp
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        err = write_error(e, final) if isinstance(e, Exception) else None
        if err is not None and err is not e:
            raise err from e
        raise


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same folder, fsync, rename)."""
    path = Path(path)
    with translate_write_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes 0600
    try:
        with translate_write_errors(path):
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


@contextmanager
def atomic_file_set(folder: str | os.PathLike, set_name: str = "report") -> Iterator[Path]:
    """Yield a staging folder; on success, everything written there replaces the same names in ``folder`` as one
    set, in a single rename, so a reader or a killed process never sees a new ``metrics.json`` next to an old
    ``report.md``.

    Layout: ``folder/.<set_name>/<version>/`` holds each complete set, ``folder/.<set_name>/current`` is a symlink
    to the live version (replaced by one ``os.replace``), and each published name in ``folder`` (``report.md``,
    ``plots``, ...) is a relative symlink ``.<set_name>/current/<name>``. Plain files of those names from an
    earlier layout are moved into ``.<set_name>/legacy/`` first (kept, not deleted). On failure the staging folder
    is kept as ``.<set_name>/incomplete-<time>`` when it holds anything (nothing measured is lost) and the live set
    is untouched; a write fault raises :class:`ArtifactWriteError`.
    """
    folder = Path(folder)
    store = folder / f".{set_name}"
    with translate_write_errors(store):
        store.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=store, prefix="tmp-"))
        os.chmod(tmp, 0o777 & ~umask())
    try:
        yield tmp
        with translate_write_errors(store):
            version = store / f"v-{time.time_ns()}-{os.getpid()}"
            os.replace(tmp, version)
            names = sorted(p.name for p in version.iterdir())
            _link_names(folder, store, names)
            link = store / f".current-{os.getpid()}"
            link.unlink(missing_ok=True)
            os.symlink(version.name, link)
            os.replace(link, store / "current")  # the one step that switches the whole set
        for old in store.iterdir():  # earlier versions and leftovers of killed runs
            if old.name.startswith(("v-", "tmp-", ".current-")) and old.name != version.name and old.is_dir() \
                    and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
        for name in _linked_names(folder, store):  # names of the previous set that this one lacks
            if name not in names:
                (folder / name).unlink(missing_ok=True)
    except BaseException as e:
        if tmp.exists():
            if any(tmp.iterdir()):
                os.replace(tmp, store / f"incomplete-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        err = write_error(e, store) if isinstance(e, Exception) else None
        if err is not None and err is not e:
            raise err from e
        raise


def _linked_names(folder: Path, store: Path) -> list[str]:
    prefix = f"{store.name}/current/"
    return [p.name for p in folder.iterdir() if p.is_symlink() and os.readlink(p).startswith(prefix)]


def _link_names(folder: Path, store: Path, names: list[str]) -> None:
    """Make each ``folder/<name>`` the symlink ``.<set>/current/<name>`` (idempotent; legacy files are moved into
    ``.<set>/legacy/``)."""
    for name in names:
        dest = folder / name
        target = f"{store.name}/current/{name}"
        if dest.is_symlink() and os.readlink(dest) == target:
            continue
        if dest.exists() or dest.is_symlink():
            legacy = store / "legacy"
            legacy.mkdir(exist_ok=True)
            if legacy.joinpath(name).exists():
                shutil.rmtree(legacy / name, ignore_errors=True) if legacy.joinpath(name).is_dir() \
                    else legacy.joinpath(name).unlink()
            os.replace(dest, legacy / name)
        tmp_link = folder / f".{name}.link-{os.getpid()}"
        tmp_link.unlink(missing_ok=True)
        os.symlink(target, tmp_link)
        os.replace(tmp_link, dest)


class EventLog:
    """Append-only JSONL event log (``events.jsonl`` in the run directory): one JSON object per line with
    ``time`` (unix seconds), ``event`` and the event's fields. Written by ``python -m train`` and ``python -m eval``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, event: str, **fields) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"time": time.time(), "event": event, **fields}, default=str) + "\n")


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> str:
    """Hex SHA-256 of a file's bytes, read in ``chunk_bytes`` chunks (the project's one file hash)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def fmt(x: Any, spec: str = ".2f", *, missing: str = "n/a", suffix: str = "", exact_ints: bool = False,
        text: bool = False, booleans: tuple[str, str] | None = None) -> str:
    """The project's one number formatter for reports and logs: ``format(x, spec) + suffix`` for a finite real number
    (numpy scalars too), ``missing`` for None, NaN, infinities and anything else.

    Args:
        spec: a format spec (``".2f"``, ``".1%"``, ``".3g"``).
        exact_ints: integers print as themselves (``3``, not ``3.00``).
        text: strings print as themselves instead of ``missing``.
        booleans: ``(true, false)`` words for booleans; None: booleans are ``missing`` (a flag is not a number).
    """
    import math
    import numbers

    if isinstance(x, bool):
        return missing if booleans is None else booleans[0 if x else 1]
    if isinstance(x, numbers.Integral) and exact_ints:
        return str(x)
    if isinstance(x, numbers.Real):
        v = float(x)
        return format(v, spec) + suffix if math.isfinite(v) else missing
    return x if text and isinstance(x, str) else missing


def fmt_interval(ci: Any, spec: str = ".2f", **options: Any) -> str:
    """``" [lo, hi]"`` of an interval ``(lo, hi)`` with :func:`fmt` and its ``options``; ``""`` without one."""
    return f" [{fmt(ci[0], spec, **options)}, {fmt(ci[1], spec, **options)}]" if ci else ""
