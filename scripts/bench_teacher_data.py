"""Teacher answers per second: our decoder against llama.cpp's llama-server, side by side in one run.

    python scripts/bench_teacher_data.py [--prompts 64] [--max-new-tokens 64] [--slots 1,4,8,16] [--busy]

Both sides run the production code path of ``distill.data_source=teacher`` on the same chat-templated medical
training prompts of SmolLM2-135M-Instruct (``target=smollm2``): :func:`distill.generation.generate_teacher_sequences`
(our decoder, the float32 target, batches of ``--batch-sizes``: the main job uses 32) and
:func:`distill.generation.generate_teacher_sequences_engine` (``distill.generation.engine=llama_cpp``: the target's own
Q4_1 file in llama-server with each ``--slots`` count of parallel requests), greedy, each into a fresh store (nothing
reused). Tokens/s counts generated answer tokens over the wall time of the whole pass (server start included for the
engine). ``--busy`` first starts a process that keeps one core busy for the whole run (a shared machine).

Prints one table with each setting's tokens/s and its ratio to ours at the main job's batch size; ``--json PATH``
also writes the numbers. Needs llama.cpp (``python scripts/install_engine.py``) and the data root.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100000):
            x += 1


def load_smollm2(num_prompts: int) -> tuple:
    """``(target, tokenizer, target folder, prompts)``: SmolLM2-135M-Instruct (``target=smollm2``, converted once
    into the cache) and the token ids of its first ``num_prompts`` chat-templated medical training prompts (hash
    order, at most 192 tokens), as the main job reads them."""
    from omegaconf import OmegaConf

    from data.blocks import training_prompts
    from models.checkpoints import load_causal_lm
    from models.target import TargetConfig
    from models.target import prepare_target
    from data.loading import DataOptions
    from data.text import encode_prompt

    tc = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TargetConfig),
                                             OmegaConf.load(ROOT / "conf" / "target" / "smollm2.yaml")))
    target_path = prepare_target(tc)
    target, tok = load_causal_lm(target_path, role="target")
    texts = training_prompts({"medical": 1.0}, "train", DataOptions(), num_prompts, tok, 0)
    return target, tok, target_path, [encode_prompt(tok, t, 192)[0][0].tolist() for t in texts]


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64, help="medical training prompts (default 64)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="answer tokens per prompt (default 64)")
    ap.add_argument("--batch-sizes", type=_ints, default=[32, 1], help="our decoder's batch sizes (default 32,1)")
    ap.add_argument("--slots", type=_ints, default=[1, 4, 8, 16], help="llama-server slot counts (default 1,4,8,16)")
    ap.add_argument("--busy", action="store_true", help="keep one core busy with another process meanwhile")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)

    from decode.llamacpp import find_engine
    from core.errors import EngineError
    from distill.config import GenerationConfig
    from distill.generation import generate_teacher_sequences, generate_teacher_sequences_engine

    try:
        engine = find_engine()
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    target, tok, target_path, prompts = load_smollm2(args.prompts)
    stop = multiprocessing.Event()
    busy = multiprocessing.Process(target=_spin, args=(stop,), daemon=True) if args.busy else None
    if busy:
        busy.start()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for bs in args.batch_sizes:
                gen = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=0, max_prompts=len(prompts),
                                       batch_size=bs)
                t0 = time.perf_counter()
                _, info = generate_teacher_sequences(target, prompts, gen, Path(tmp) / f"ours{bs}", seed=0,
                                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
                rows.append({"source": f"ours, batch {bs}", "tokens": info["generated_tokens"],
                             "seconds": time.perf_counter() - t0})
            for slots in args.slots:
                gen = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=0, max_prompts=len(prompts),
                                       batch_size=max(slots, 32), engine="llama_cpp", engine_slots=slots)
                t0 = time.perf_counter()
                _, info = generate_teacher_sequences_engine(target_path, prompts, gen, Path(tmp) / f"eng{slots}",
                                                            seed=0, eos_token_id=tok.eos_token_id)
                rows.append({"source": f"llama.cpp, {slots} slot(s)", "tokens": info["generated_tokens"],
                             "seconds": time.perf_counter() - t0})
    finally:
        if busy:
            stop.set()
            busy.join(5)
    ref = next(r for r in rows if r["source"] == f"ours, batch {args.batch_sizes[0]}")
    ref_tps = ref["tokens"] / ref["seconds"]
    print(f"\nteacher answers: {len(prompts)} medical prompts x <= {args.max_new_tokens} tokens, greedy, "
          f"{os.cpu_count()} cores{', one kept busy by another process' if args.busy else ''}; {engine.describe()}\n")
    print(f"| source | answer tokens | seconds | tokens/s | vs ours, batch {args.batch_sizes[0]} |")
    print("|---|---|---|---|---|")
    for r in rows:
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        r["ratio"] = r["tokens_per_s"] / ref_tps
        print(f"| {r['source']} | {r['tokens']} | {r['seconds']:.1f} | {r['tokens_per_s']:.1f} | {r['ratio']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"busy": args.busy, "prompts": len(prompts), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
