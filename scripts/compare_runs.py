"""Write the comparison report of a Hydra multirun folder: ``python scripts/compare_runs.py SWEEP_DIR``.

A multirun of ``python -m train`` already writes it when the sweep ends; this reruns it (e.g. after adding jobs or
for a sweep that was interrupted). See :mod:`eval.sections` for what ``comparison.md`` / ``comparison.json`` hold.
Exit status 2 with a message when SWEEP_DIR holds no finished run.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from eval.sections import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
