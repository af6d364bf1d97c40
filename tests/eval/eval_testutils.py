"""Helpers for the eval tests: ``tiny_llama`` from ``tests/conftest.py``, imported by path (``from conftest import``
is ambiguous when another package's conftest.py was collected first, e.g. ``pytest tests/eval tests/data``)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "conftest.py"


def _load():
    name = "specdraft_tests_root_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _PATH)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


tiny_llama = _load().tiny_llama
