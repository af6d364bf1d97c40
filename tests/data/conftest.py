"""Fixtures for the data-layer tests: the real data root, and writers for small synthetic data roots."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from data.loading import default_data_root


@pytest.fixture(scope="session")
def real_data_root() -> Path:
    """The real data root (``$SPECDRAFT_DATA_ROOT`` or ``../shared/data``); read-only, skipped where absent."""
    root = default_data_root()
    if root is None or not (root / "medical").is_dir():
        pytest.skip("no data root (set SPECDRAFT_DATA_ROOT or provide ../shared/data beside the repo)")
    return root


@pytest.fixture
def medquad_record():
    """``medquad_record(i, **overrides)``: one record shaped like the converted MedQuAD JSONL (id field ``qid``)."""

    def _make(i: int, **overrides) -> dict:
        rec = {"qid": f"{i:07d}-{i % 7}", "question": f"What causes condition number {i}?",
               "answer": f"Condition {i} is caused by factor {i * 3}.", "qtype": "causes"}
        rec.update(overrides)
        return rec

    return _make


@pytest.fixture
def write_jsonl():
    """``write_jsonl(path, records, mode="w")``: write (or append) one JSON value per line, creating parents."""

    def _write(path: Path, records, mode: str = "w") -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, mode, encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        return path

    return _write
