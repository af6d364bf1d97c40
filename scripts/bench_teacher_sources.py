"""Teacher data by cost: each source's scored tokens per second and the held-out acceptance it buys at equal CPU
time, in one run on this machine.

    python scripts/bench_teacher_sources.py [--budget-s 120] [--busy-budget-s 40]
        [--sources fixed,ours,on_policy,engine] [--heldout-prompts 24] [--json PATH]

Sources (every one ends in the same top-32 soft labels of SmolLM2-135M-Instruct over packed 128-token blocks, the
main job's :func:`distill.teacher.build_teacher_cache`):

* ``ours``: the target's greedy answers to chat-templated medical training prompts (our decoder, batch 32, 64
  tokens; ``distill.data_source=teacher``), then scored;
* ``fixed``: the medical training split's reference answers, chat-templated, scored teacher-forced
  (``distill.data_source=dataset`` with ``distill.teacher_signal=cached``);
* ``on_policy``: the draft's own greedy answers to those prompts, scored by the target (DistillSpec, Zhou et al.
  2024: the draft learns where it will be verified);
* ``engine``: the target's answers from llama.cpp (``distill.generation.engine=llama_cpp``, 8 slots), then scored;
  skipped with a note when llama.cpp is not installed (``python scripts/install_engine.py``).

Each source runs chunk by chunk until ``--budget-s`` seconds have passed (so each spends the same wall clock on 2
cores), counting the positions that got soft labels. Then distill_med's draft (target layers [0, 1, 28, 29], frozen
embeddings, an 8,192-id trimmed head whose rows train) is trained once over each source's blocks (each read once,
forward KL, lr 2e-3) and replayed on the target's greedy answers to held-out medical prompts
(:mod:`eval.heldout`). With ``--busy-budget-s`` > 0 the throughput part is repeated while another process keeps
one core busy (a shared machine); scoring takes its threads from the free cores. Last, a distillation step is timed
idle, then with one core busy at a fixed 2 threads and at ``trainer.num_threads=0`` (the free cores).
"""
from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_teacher_data import _spin, load_smollm2  # noqa: E402

SOURCES = ("fixed", "ours", "on_policy", "engine")
BLOCK, K, LAYERS, KEPT = 128, 32, [0, 1, 28, 29], 8192


def _sources(text: str) -> list[str]:
    out = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in out if s not in SOURCES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown source(s) {bad or text!r}; choose from {', '.join(SOURCES)}")
    return out


def _answers(model, prompts, tok, max_new_tokens: int) -> list[list[int]]:
    """Greedy ``prompt + answer`` sequences from ``model`` (our decoder, one batch), EOS appended."""
    from decode import autoregressive_generate
    from decode.common import left_pad

    ids, mask = left_pad(prompts, tok.pad_token_id)
    out = autoregressive_generate(model, ids, mask, max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)
    seqs = []
    for b, p in enumerate(prompts):
        new = out.sequences[b, ids.size(1): ids.size(1) + int(out.num_new_tokens[b])].tolist()
        seqs.append(list(p) + new + ([] if new and new[-1] == tok.eos_token_id else [tok.eos_token_id]))
    return seqs


def collect(source: str, budget_s: float, ctx: dict, root: Path) -> dict:
    """Run ``source`` chunk by chunk for ``budget_s`` seconds; returns blocks, their cached top-k and the counts."""
    from distill.config import GenerationConfig
    from distill.generation import generate_teacher_sequences_engine, pack_sequences
    from distill.teacher import TeacherCache, build_teacher_cache

    target, tok, prompts, fixed = ctx["target"], ctx["tok"], ctx["prompts"], ctx["fixed_blocks"]
    t0, chunk, blocks, vals, idx = time.perf_counter(), 0, [], [], []
    while time.perf_counter() - t0 < budget_s:
        batch = prompts[(chunk * 32) % len(prompts):][:32]
        if source == "fixed":
            b = fixed[chunk * 64:(chunk + 1) * 64]
        elif source == "ours":
            b = pack_sequences(_answers(target, batch, tok, 64), BLOCK)
        elif source == "on_policy":
            b = pack_sequences(_answers(ctx["draft"], batch, tok, 64), BLOCK)
        else:
            gen = GenerationConfig(max_new_tokens=64, temperature=0, max_prompts=len(batch), batch_size=32,
                                   engine="llama_cpp", engine_slots=8)
            seqs, _ = generate_teacher_sequences_engine(ctx["target_path"], batch, gen, root / f"eng{chunk}", seed=0,
                                                        eos_token_id=tok.eos_token_id)
            b = pack_sequences(seqs, BLOCK)
        if b.numel():
            cache, _ = build_teacher_cache(target, b, root / f"{source}{chunk}", k=K, shard_blocks=64)
            blocks.append(b)
            vals.append(cache.values)
            idx.append(cache.indices)
        chunk += 1
    seconds = time.perf_counter() - t0
    blocks_t = torch.cat(blocks) if blocks else torch.zeros(0, BLOCK, dtype=torch.long)
    tokens = int(blocks_t.numel())
    cache = TeacherCache(torch.cat(vals), torch.cat(idx), ctx["shared"]) if blocks else None
    return {"source": source, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "blocks": blocks_t, "cache": cache}


def train_draft(ctx: dict, got: dict, out: Path):
    """distill_med's draft trained once over ``got``'s blocks (forward KL on the cached top-k)."""
    from models.vocab import install_trimmed_head
    from distill.teacher import make_cached_distill_step, over_kept_ids
    from distill.trainer import TrainerConfig, train

    draft = copy.deepcopy(ctx["draft"])
    draft.get_input_embeddings().weight.requires_grad_(False)
    install_trimmed_head(draft, ctx["kept"])
    steps = max(1, got["blocks"].size(0) // 8)
    cfg = TrainerConfig(max_steps=steps, micro_batch_size=8, lr=2e-3, warmup_steps=min(20, steps // 5 + 1),
                        save_every=0, log_every=max(1, steps))
    stats = train(draft.train(), got["blocks"], out, cfg, make_cached_distill_step("forward_kl", 1.0),
                  teacher=over_kept_ids(got["cache"], draft), desc=got["source"])
    return draft.eval(), stats


def step_seconds(ctx: dict, got: dict, threads: int, steps: int, out: Path) -> float:
    """Seconds per distillation step of distill_med's draft on ``got``'s first blocks at ``trainer.num_threads =
    threads`` (0: the cores other processes leave free), after one warm-up step."""
    from models.vocab import install_trimmed_head
    from distill.teacher import make_cached_distill_step, over_kept_ids
    from distill.trainer import TrainerConfig, train

    draft = copy.deepcopy(ctx["draft"])
    draft.get_input_embeddings().weight.requires_grad_(False)
    install_trimmed_head(draft, ctx["kept"])
    step = make_cached_distill_step("forward_kl", 1.0)
    times = []
    for n in (1, 1 + steps):
        cfg = TrainerConfig(max_steps=n, micro_batch_size=8, lr=2e-3, warmup_steps=0, save_every=0, log_every=n,
                            num_threads=threads)
        stats = train(draft.train(), got["blocks"][:8 * n], out / f"t{threads}-{n}", cfg, step,
                      teacher=over_kept_ids(got["cache"], draft), desc=f"steps@{threads}")
        times.append(stats["train_time_s"])
    return (times[1] - times[0]) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=120.0, help="seconds each source runs (default 120)")
    ap.add_argument("--busy-budget-s", type=float, default=40.0, help="seconds each source runs with one core busy "
                    "(throughput only; 0: skip)")
    ap.add_argument("--sources", type=_sources, default=list(SOURCES))
    ap.add_argument("--heldout-prompts", type=int, default=24)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.budget_s <= 0 or args.busy_budget_s < 0 or args.heldout_prompts < 1:
        print("error: --budget-s must be > 0, --busy-budget-s >= 0, --heldout-prompts >= 1", file=sys.stderr)
        return 2

    from data.blocks import domain_blocks
    from models.vocab import kept_token_ids
    from data.loading import DataOptions
    from decode.llamacpp import engine_available
    from distill.drafts import build_layer_pruned
    from distill.trainer import batch_indices
    from distill.teacher import forced_ids
    from eval.config import HeldoutConfig
    from eval.heldout import measure_heldout

    target, tok, target_path, prompts = load_smollm2(256)
    fixed = domain_blocks("medical", "train", tok, BLOCK, DataOptions())
    fixed = fixed[batch_indices(fixed.size(0), 0, fixed.size(0), 0)]  # the main job's read order
    counts = torch.bincount(fixed.flatten(), minlength=target.config.vocab_size).double()
    ctx = {"target": target, "tok": tok, "prompts": prompts, "fixed_blocks": fixed, "target_path": target_path,
           "draft": build_layer_pruned(target, LAYERS).eval(), "shared": target.config.vocab_size,
           "kept": kept_token_ids(counts, KEPT, forced_ids(tok, target))}
    installed = engine_available()[0]
    sources = [s for s in args.sources if s != "engine" or installed]
    notes = [] if installed or "engine" not in args.sources else [
        "engine: llama.cpp is not installed (python scripts/install_engine.py); not measured"]
    rows, busy_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        got = {}
        for s in sources:
            got[s] = collect(s, args.budget_s, ctx, Path(tmp))
            print(f"{s}: {got[s]['tokens']} scored tokens in {got[s]['seconds']:.1f} s", flush=True)
        first = next(got[s] for s in sources if got[s]["cache"] is not None)
        steps = {"idle, free cores": step_seconds(ctx, first, 0, 4, Path(tmp))}
        if args.busy_budget_s:
            stop = multiprocessing.Event()
            busy = multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
            busy.start()
            try:
                for s in sources:
                    r = collect(s, args.busy_budget_s, ctx, Path(tmp) / "busy")
                    busy_rows.append({k: r[k] for k in ("source", "tokens", "seconds", "tokens_per_s")})
                steps["one core busy, 2 threads"] = step_seconds(ctx, first, 2, 4, Path(tmp))
                steps["one core busy, free cores"] = step_seconds(ctx, first, 0, 4, Path(tmp))
            finally:
                stop.set()
                busy.join(5)
        drafts, train_s = {}, {}
        for s in sources:
            if got[s]["cache"] is None:
                continue
            t0 = time.perf_counter()
            drafts[s], _ = train_draft(ctx, got[s], Path(tmp) / f"train-{s}")
            train_s[s] = time.perf_counter() - t0
        cfg = HeldoutConfig(max_prompts=args.heldout_prompts, train_prompts=0, max_new_tokens=48, max_gamma=3)
        record = measure_heldout(target, tok, drafts, ["medical"], ["medical"], DataOptions(), cfg,
                                 max_prompt_tokens=192, samples=1000, confidence=0.95, seed=0)
    busy_by = {r["source"]: r for r in busy_rows}
    print(f"\nteacher data by cost on {torch.get_num_threads()} threads / 2 cores: {args.budget_s:.0f} s per source "
          f"idle ({args.busy_budget_s:.0f} s with one core busy); held-out: {record['prompts']['medical']} medical "
          f"test prompts ({record['near_duplicates_removed']['medical']} near-duplicates of training records "
          f"removed), the target's greedy answers (<= 48 tokens)\n")
    print("| source | scored tokens | tokens/s idle | tokens/s, one core busy | training s | held-out alpha_1 | "
          "tau g=3 |")
    print("|---|---|---|---|---|---|---|")
    for s in sources:
        h = record["drafts"].get(s, {}).get("medical")
        b = busy_by.get(s)
        row = {"source": s, "tokens": got[s]["tokens"], "seconds": got[s]["seconds"],
               "tokens_per_s": got[s]["tokens_per_s"], "busy_tokens_per_s": b["tokens_per_s"] if b else None,
               "train_s": train_s.get(s), "alpha_1": h["alpha"][0] if h else None,
               "alpha_1_ci": h["alpha_ci"][0] if h else None, "tau_3": h["tau"][3] if h else None}
        rows.append(row)
        ci = row["alpha_1_ci"]
        print(f"| {s} | {row['tokens']:,} | {row['tokens_per_s']:.0f} | "
              f"{'-' if b is None else format(b['tokens_per_s'], '.0f')} | {train_s.get(s, 0):.0f} | "
              + (f"{row['alpha_1']:.3f} [{ci[0]:.2f}, {ci[1]:.2f}] | {row['tau_3']:.2f} |" if h else "- | - |"))
    print("\n| distillation step (8 x 128 tokens, distill_med's draft) | seconds | vs idle |\n|---|---|---|")
    for k, v in steps.items():
        print(f"| {k} | {v:.2f} | {v / steps['idle, free cores']:.2f}x |")
    for n in notes:
        print(f"\n{n}")
    if args.json:
        args.json.write_text(json.dumps({"budget_s": args.budget_s, "busy_budget_s": args.busy_budget_s,
                                         "rows": rows, "step_seconds": steps, "notes": notes}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
