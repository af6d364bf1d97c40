"""A resumable, checksummed store of tensor shards on disk (teacher top-k cache, teacher generations).

Layout of a store folder::

    <root>/manifest.json          {"format": 1, "meta": {...}, "num_shards": n,
                                   "shards": {"0": {"file": "shard-00000.safetensors", "sha256": "...", "bytes": b,
                                                    "seconds": s}}}
    <root>/shard-00000.safetensors ...

Guarantees
    * Atomic shards: a shard is written to a temporary name in the same folder, fsynced and renamed, and only then
      entered into the manifest (itself written atomically). A process killed at any point leaves complete shards
      and a manifest that lists a subset of them.
    * Resumable: :meth:`ShardStore.ensure` skips every shard that the manifest lists *and* whose file still has the
      recorded SHA-256; it computes the others (missing, unlisted, or corrupt: the checksum differs).
    * ``meta`` identifies the content (e.g. model and data fingerprints, k). A manifest with different ``meta`` is
      stale: its shards are recomputed.

Shards hold named tensors (``safetensors``), which load without unpickling.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from data.io import write_json_atomic

log = logging.getLogger(__name__)

FORMAT = 1


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _save_shard_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    os.close(fd)
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ShardStore:
    """``num_shards`` shards of named tensors under ``root``, identified by ``meta`` (JSON-serialisable dict)."""

    def __init__(self, root: str | os.PathLike, meta: dict, num_shards: int):
        if num_shards < 1:
            raise ValueError(f"a shard store needs at least one shard, got num_shards={num_shards}")
        self.root = Path(root)
        self.meta = json.loads(json.dumps(meta, default=str))  # normalise (tuples -> lists) for comparison
        self.num_shards = int(num_shards)

    def shard_path(self, i: int) -> Path:
        return self.root / f"shard-{i:05d}.safetensors"

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    def _read_manifest(self) -> dict:
        empty = {"format": FORMAT, "meta": self.meta, "num_shards": self.num_shards, "shards": {}}
        if not self.manifest_path.exists():
            return empty
        try:
            m = json.loads(self.manifest_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            log.warning("unreadable shard manifest %s (%s); recomputing every shard", self.manifest_path, e)
            return empty
        if m.get("format") != FORMAT or m.get("meta") != self.meta or m.get("num_shards") != self.num_shards:
            log.warning("shard manifest %s describes different content; recomputing every shard", self.manifest_path)
            return empty
        return m

    def status(self) -> dict[int, str]:
        """Shard index -> ``ok`` (listed, checksum matches), ``missing`` (not listed or no file) or ``corrupt``."""
        m = self._read_manifest()
        out = {}
        for i in range(self.num_shards):
            entry, path = m["shards"].get(str(i)), self.shard_path(i)
            if entry is None or not path.exists():
                out[i] = "missing"
            else:
                out[i] = "ok" if sha256_file(path) == entry["sha256"] else "corrupt"
        return out

    def ensure(self, compute: Callable[[int], dict[str, torch.Tensor]], desc: str = "shards",
               only: int | None = None) -> dict:
        """Compute every shard that is not ``ok`` with ``compute(i) -> {name: tensor}``; with ``only``, just the
        first ``only`` shards (the others stay as they are: a later call may compute them). Returns counts
        ``{"reused", "computed", "corrupt"}`` over those shards (``corrupt`` ones are also counted in ``computed``)
        and ``cost_s``: the seconds their computation took, whenever it ran (recorded per shard in the manifest;
        None when a shard written by an older version has no record)."""
        self.root.mkdir(parents=True, exist_ok=True)
        status = self.status()
        manifest = self._read_manifest()
        wanted = range(self.num_shards if only is None else min(only, self.num_shards))
        todo = [i for i in wanted if status[i] != "ok"]
        corrupt = [i for i in todo if status[i] == "corrupt"]
        for i in corrupt:
            log.warning("%s: shard %s failed its SHA-256 check; recomputing it", desc, self.shard_path(i))
        manifest["shards"] = {k: v for k, v in manifest["shards"].items() if status.get(int(k)) == "ok"}
        for i in tqdm(todo, desc=desc, disable=not todo, dynamic_ncols=True):
            path = self.shard_path(i)
            t0 = time.perf_counter()
            _save_shard_atomic(compute(i), path)
            manifest["shards"][str(i)] = {"file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size,
                                          "seconds": round(time.perf_counter() - t0, 3)}
            write_json_atomic(self.manifest_path, manifest)
        if not todo and not self.manifest_path.exists():  # pragma: no cover - num_shards >= 1 makes todo non-empty
            write_json_atomic(self.manifest_path, manifest)
        cost = [manifest["shards"][str(i)].get("seconds") for i in wanted]
        return {"reused": len(wanted) - len(todo), "computed": len(todo), "corrupt": len(corrupt),
                "cost_s": None if None in cost else float(sum(cost))}

    def load(self, i: int) -> dict[str, torch.Tensor]:
        """Tensors of shard ``i`` (call :meth:`ensure` first; this does not re-verify the checksum)."""
        from safetensors.torch import load_file

        return load_file(str(self.shard_path(i)))
