"""Where the data lives: the data root (``data.root`` / ``SPECDRAFT_DATA_ROOT`` / ``../shared/data``)."""
from __future__ import annotations

import os
from pathlib import Path

ENV_DATA_ROOT = "SPECDRAFT_DATA_ROOT"
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def default_data_root() -> Path | None:
    """The data root used when ``data.root`` is not set.

    Order: the environment variable ``SPECDRAFT_DATA_ROOT``; else the folder ``../shared/data`` next to the
    repository when it exists; else ``None`` (then only the hub can supply data).
    """
    env = os.environ.get(ENV_DATA_ROOT)
    if env:
        return Path(env).expanduser()
    beside = PROJECT_ROOT.parent / "shared" / "data"
    return beside if beside.is_dir() else None


def resolve_data_root(root: str | os.PathLike | None) -> Path | None:
    """``root`` if given (``~`` expanded), else :func:`default_data_root`."""
    if root not in (None, "", "null"):
        return Path(root).expanduser()
    return default_data_root()
