"""Export a draft (or any Llama-family checkpoint) to GGUF for llama.cpp, with the target's tokenizer.

    python scripts/export_gguf.py DRAFT_DIR OUT.gguf [--outtype q8_0] [--target TARGET_DIR]

``--target``: the target's Hugging Face folder. When it was converted from a GGUF file (``target=smollm2``), that
file's tokenizer is copied key for key and the export is checked against it with llama.cpp's own vocabulary rules
(the ones ``llama-server -md`` applies); otherwise the folder's ``tokenizer.json`` is written. ``serving.json``
prints this command for each recommended draft. Exit 2 with one line on bad input or a failed check.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from decode.llamacpp import OUTTYPES, export_gguf, source_gguf, vocab_compatibility

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="the draft's Hugging Face folder (e.g. <run>/drafts/distilled_int8)")
    ap.add_argument("out", type=Path, help="the .gguf file to write")
    ap.add_argument("--outtype", choices=OUTTYPES, default="q8_0", help="weight type (default q8_0)")
    ap.add_argument("--target", type=Path, default=None, help="the target's folder: tokenizer and vocabulary check")
    ap.add_argument("--tokenizer-gguf", type=Path, default=None, help="copy the tokenizer of this GGUF file")
    args = ap.parse_args(argv)
    if args.target is not None and not (args.target / "config.json").is_file():
        print(f"error: --target {args.target} is not a Hugging Face model folder (no config.json)", file=sys.stderr)
        return 2
    source = args.tokenizer_gguf or (source_gguf(args.target) if args.target else None)
    if source is None:
        print("note: no GGUF file of the target to copy the tokenizer from or check against (pass --target of a "
              "target converted from GGUF, or --tokenizer-gguf): writing the folder's tokenizer.json", file=sys.stderr)
    try:
        res = export_gguf(args.folder, args.out, outtype=args.outtype, tokenizer_gguf=source)
        bad = vocab_compatibility(source, res.path) if source else []
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if bad:
        print(f"error: {res.path} fails llama.cpp's vocabulary check against {source}: {bad[0]}", file=sys.stderr)
        return 2
    print(f"wrote {res.path} ({res.arch}, {res.outtype}, {res.n_tensors} tensors, {res.size_bytes / 2**20:.1f} MiB; "
          f"tokenizer from {res.tokenizer_from}{'; passes llama.cpp vocabulary check' if source else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
