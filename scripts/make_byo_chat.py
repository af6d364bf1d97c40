"""Make a folder laid out like a user's own chat logs, for ``+experiment=byo_chat`` (docs/own-traffic.md, "Train a draft for your
own traffic").

From the data root's ``chat/`` files it writes, OUTSIDE the repository:

- ``chat_logs.jsonl``: OpenAI-style ``messages`` records (a system turn, then user / assistant turns): every
  root-to-leaf path of the OASST conversation trees that ends with an assistant reply (multi-turn);
- ``instructions.parquet``: ShareGPT-style ``conversations`` records (``from`` / ``value``) from the Self-Instruct
  seed tasks.

The folder: ``--out``, else ``$SPECDRAFT_BYO_DIR``, else ``$SPECDRAFT_CACHE/byo_chat`` (default
``~/.cache/specdraft/byo_chat``): the same rule as ``conf/domain/byo_chat.yaml``'s ``root``.

    python scripts/make_byo_chat.py            # then: python -m train +experiment=byo_chat
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SYSTEM = "You are a helpful assistant."
MAX_PATHS_PER_TREE = 6


def default_out() -> Path:
    """``$SPECDRAFT_BYO_DIR``, else ``$SPECDRAFT_CACHE/byo_chat``, else ``~/.cache/specdraft/byo_chat``."""
    if os.environ.get("SPECDRAFT_BYO_DIR"):
        return Path(os.environ["SPECDRAFT_BYO_DIR"]).expanduser()
    from data.text import cache_root

    return cache_root() / "byo_chat"


def tree_paths(node: dict, prefix: list) -> list[list]:
    """Every root-to-leaf path of an OASST message tree as ``[(role, text), ...]``, best-ranked replies first."""
    role = "user" if node.get("role") == "prompter" else "assistant"
    path = prefix + [(role, node["text"])]
    replies = sorted(node.get("replies") or [], key=lambda r: (r.get("rank") is None, r.get("rank") or 0))
    if not replies:
        return [path]
    out = []
    for r in replies:
        out += tree_paths(r, path)
    return out


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: see the module docstring)")
    ap.add_argument("--data-root", type=Path, default=None, help="data root (default: $SPECDRAFT_DATA_ROOT)")
    args = ap.parse_args(argv)
    from data.loading import resolve_data_root
    from core.io import PROJECT_ROOT

    root = resolve_data_root(args.data_root)
    if root is None or not (root / "chat").is_dir():
        sys.exit(f"error: no data root with chat/ (got {root}); set SPECDRAFT_DATA_ROOT or --data-root")
    out = (args.out or default_out()).expanduser().resolve()
    if out == PROJECT_ROOT or PROJECT_ROOT in out.parents:
        sys.exit(f"error: {out} is inside the repository; a user's logs live outside it (choose another --out)")
    out.mkdir(parents=True, exist_ok=True)

    n = 0
    with open(out / "chat_logs.jsonl", "w", encoding="utf-8") as f:
        for line in open(root / "chat" / "oasst_en_100_trees.jsonl", encoding="utf-8"):
            tree = json.loads(line)
            paths = [p for p in tree_paths(tree["prompt"], []) if p[-1][0] == "assistant"]
            for i, p in enumerate(paths[:MAX_PATHS_PER_TREE]):
                messages = [{"role": "system", "content": SYSTEM}] + [{"role": r, "content": t} for r, t in p]
                f.write(json.dumps({"id": f"{tree['message_tree_id']}-{i}", "messages": messages}) + "\n")
                n += 1

    import datasets

    rows = []
    for line in open(root / "chat" / "selfinstruct_seed_tasks.jsonl", encoding="utf-8"):
        r = json.loads(line)
        inst = (r.get("instances") or [{}])[0]
        user = r["instruction"] + (("\n" + inst["input"]) if inst.get("input") else "")
        rows.append({"id": r["id"], "conversations": [{"from": "human", "value": user},
                                                      {"from": "gpt", "value": inst.get("output") or ""}]})
    datasets.Dataset.from_list(rows).to_parquet(str(out / "instructions.parquet"))
    print(f"wrote {n} conversations to {out / 'chat_logs.jsonl'} and {len(rows)} to {out / 'instructions.parquet'}")
    return out


if __name__ == "__main__":
    main()
