"""Atomic artifact writes (shared by every stage): write to a temporary name in the same folder, then rename into place."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder next to ``final``; on success replace ``final`` with it, else delete it.

    Readers therefore see either the previous complete folder or the new complete one, never a partial one.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; artifacts get the usual permissions
    try:
        yield tmp
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same folder, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600
    try:
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


def save_hf_atomic(model, tokenizer, out_dir: str | os.PathLike, extra: dict[str, Any] | None = None) -> Path:
    """``save_pretrained`` model (safetensors) and tokenizer into ``out_dir`` atomically; ``extra`` goes to
    ``specdraft.json`` beside them (what produced the checkpoint)."""
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if extra is not None:
            (tmp / "specdraft.json").write_text(json.dumps(extra, indent=2, default=str) + "\n")
    return Path(out_dir)
