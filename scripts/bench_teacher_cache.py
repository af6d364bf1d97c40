"""Time distillation steps with the online teacher against the cached top-k teacher, side by side.

    python scripts/bench_teacher_cache.py --target models/assets/reference_target [--steps 20] [--repeats 3]

Both variants run the real training loop (:func:`distill.trainer.train`, forward KL, the config-built draft of
``conf/draft/small.yaml``) on the same blocks from a fresh copy of the same initial draft; online and cached runs
alternate ``--repeats`` times so machine load hits both alike. A step's time is the wall clock between consecutive
optimizer steps (the trainer's ``elapsed_s``), the first ``--warmup`` steps of each run dropped; the medians are
compared. The one-off cache pass (teacher forward + top-k + shard writes) is timed and reported separately: it is
paid once per (teacher, data, k) and reused by every later run.

Prints a table and ``speedup (online / cached per-step time)``; ``--json PATH`` also writes the numbers.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _blocks(args, tokenizer, vocab: int):
    import torch

    n = args.micro_batch_size * (args.steps + args.warmup)
    if not args.random_tokens:
        try:
            from data.loading import DataOptions
            from data.blocks import domain_blocks

            return domain_blocks(args.domain, "train", tokenizer, args.block_size, DataOptions(), n), args.domain
        except Exception as e:  # no data root here: timing does not depend on the text
            print(f"note: using random tokens ({type(e).__name__}: {e})", file=sys.stderr)
    return torch.randint(0, vocab, (n, args.block_size), generator=torch.Generator().manual_seed(0)), "random tokens"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="target HF directory (e.g. models/assets/reference_target)")
    ap.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps per run")
    ap.add_argument("--repeats", type=int, default=2, help="alternating online/cached runs")
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--domain", default="medical")
    ap.add_argument("--random-tokens", action="store_true", help="random blocks instead of the domain's text")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)

    import torch

    from models.checkpoints import load_causal_lm
    from distill.losses import forward_kl
    from distill.drafts import LlamaArch, build_llama, count_parameters
    from distill.teacher import build_teacher_cache, make_cached_distill_step
    from distill.trainer import TrainerConfig, make_distill_step, train
    from distill.teacher import shared_vocab_size

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_causal_lm(args.target, role="target")
    draft0 = build_llama(LlamaArch(), tokenizer, seed=0)
    shared = shared_vocab_size(target.config.vocab_size, draft0.config.vocab_size, len(tokenizer))
    cut = shared if shared < max(target.config.vocab_size, draft0.config.vocab_size) else None
    blocks, source = _blocks(args, tokenizer, shared)
    cfg = TrainerConfig(max_steps=args.warmup + args.steps, micro_batch_size=args.micro_batch_size,
                        warmup_steps=1, log_every=1, save_every=0)
    with tempfile.TemporaryDirectory() as tmp:
        cache, info = build_teacher_cache(target, blocks, Path(tmp) / "cache", k=args.top_k, vocab_size=shared)
        variants = {"online": (make_distill_step(forward_kl, 1.0, cut), target),
                    "cached": (make_cached_distill_step("forward_kl", 1.0), cache)}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(args.repeats):
            for name, (step, teacher) in variants.items():
                elapsed = []
                train(copy.deepcopy(draft0), blocks, Path(tmp) / f"{name}-{r}", cfg, step, teacher=teacher,
                      desc=f"{name} {r + 1}/{args.repeats}", on_step=lambda s, rec: elapsed.append(rec["elapsed_s"]))
                diffs = [b - a for a, b in zip(elapsed, elapsed[1:])]  # per-step wall clock
                times[name].extend(diffs[max(0, args.warmup - 1):])
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "target": str(args.target), "target_parameters": count_parameters(target),
        "draft_parameters": count_parameters(draft0), "data": source, "micro_batch_size": args.micro_batch_size,
        "block_size": args.block_size, "top_k": args.top_k, "timed_steps_per_variant": len(times["online"]),
        "online_step_s": med["online"], "cached_step_s": med["cached"], "speedup": med["online"] / med["cached"],
        "cache_build_s": info["time_s"], "cache_bytes": info["bytes"], "torch_threads": torch.get_num_threads(),
    }
    print(f"\ntarget {args.target} ({result['target_parameters']:,} params), draft {result['draft_parameters']:,} "
          f"params, {args.micro_batch_size} x {args.block_size} tokens per step, top-{args.top_k}, {source}")
    print("| variant | median step (s) | timed steps |\n|---|---|---|")
    for k in ("online", "cached"):
        print(f"| {k} | {med[k]:.4f} | {len(times[k])} |")
    print(f"speedup (online / cached per-step time): {result['speedup']:.2f}x; one-off cache pass "
          f"{info['time_s']:.1f} s, {info['bytes'] / 2**20:.1f} MiB")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
