#!/usr/bin/env python
"""Benchmark specdraft's speculative decoder against target-only decoding and Hugging Face assisted generation.

    python scripts/bench_decode.py --target DIR --draft DIR [--prompts-file F.jsonl --text-field text]
        [--num-draft-tokens 4] [--max-new-tokens 64] [--repeats 3] [--device auto] [--dtype auto]
        [--prompt-ids --num-prompts 4 --prompt-len 16] [--num-threads 1] [--fast-path auto|off] [--json-out F]
        [--draft-length-policy fixed|adaptive|confidence --policy-param max_draft_tokens=8 ...]

On the same prompts (batch size 1, greedy) it runs, alternating the three methods in every repeat:

- ``target_only``: ours :func:`decode.autoregressive_generate` (KV cache, one token per target forward);
- ``hf_assisted``: ``target.generate(assistant_model=draft, do_sample=False)`` with ``num_assistant_tokens`` =
  ``--num-draft-tokens`` and the constant schedule (confidence stopping off);
- ``ours_speculative``: :func:`decode.speculative_generate`.

It prints tokens/s of each (new tokens / wall seconds, ``time.perf_counter`` around each call, CUDA synchronised),
ours/transformers and ours/target-only ratios, the measured acceptance rate alpha and mean accepted length tau
(pooled), the cost ratio c (one-token cached draft forward time / target forward time, medians, the two models
timed alternately), the expected
speedup of Leviathan et al. 2023, Thm 3.8, from the measured alpha and c, and measured speedup / expected.
Generation ignores EOS by default (fixed-length outputs make the three comparable); ``--stop-at-eos`` uses the
target's EOS. ``--prompt-ids`` uses random token-id prompts and needs no tokenizer (used by the tests).
``--num-threads`` sets ``torch.set_num_threads`` (default 1: timings on a shared CPU are steadier, and for
models this small more threads do not help); ``--fast-path off`` runs ours through the Hugging Face forward
instead of the lean Llama forward (:mod:`decode.fast_llama`), to measure what the lean forward buys.
``--draft-length-policy`` runs ours with a draft-length policy (the ``decode.*`` keys through ``--policy-param``,
checked like the config); transformers assisted keeps its constant schedule of ``--num-draft-tokens``.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from decode import (  # noqa: E402
    AcceptanceStats,
    autoregressive_generate,
    expected_speedup,
    speculative_generate,
)
from decode.stats import expected_speedup_mixture  # noqa: E402
from decode._common import sync  # noqa: E402
from decode.timing import forward_times_s  # noqa: E402

BUILTIN_PROMPTS = [
    "The patient was admitted to the hospital with",
    "def fibonacci(n):\n    ",
    "Speculative decoding speeds up inference by",
    "Once upon a time, in a small village,",
]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="target model directory (or hub id where reachable)")
    ap.add_argument("--draft", required=True, help="draft model directory")
    ap.add_argument("--prompts-file", help="JSONL file with one prompt per line")
    ap.add_argument("--text-field", default="text", help="JSONL field holding the prompt text (default: text)")
    ap.add_argument("--max-prompts", type=int, default=8, help="use at most this many prompts from the file")
    ap.add_argument("--prompt-ids", action="store_true", help="random token-id prompts, no tokenizer needed")
    ap.add_argument("--num-prompts", type=int, default=4, help="number of random prompts (--prompt-ids)")
    ap.add_argument("--prompt-len", type=int, default=16, help="tokens per random prompt (--prompt-ids)")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16")
    ap.add_argument("--stop-at-eos", action="store_true", help="stop rows at the target's EOS (default: ignore)")
    ap.add_argument("--cost-steps", type=int, default=32, help="single-token forwards timed for the cost ratio")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--fast-path", choices=("auto", "off"), default="auto",
                    help="ours: lean Llama forward where supported (auto) or always the Hugging Face forward (off)")
    ap.add_argument("--json-out", help="also write the results as JSON here")
    ap.add_argument("--draft-length-policy", choices=("fixed", "adaptive", "confidence"), default="fixed",
                    help="ours: draft-length policy (decode.draft_length_policy; adaptive starts at "
                         "--num-draft-tokens)")
    ap.add_argument("--policy-param", action="append", default=[], metavar="KEY=VALUE",
                    help="a decode.* policy key, e.g. max_draft_tokens=8, adaptive_window=4, "
                         "confidence_threshold=0.6")
    args = ap.parse_args(argv)
    from decode.config import DecodeConfig

    params = {}
    for kv in args.policy_param:
        key, _, value = kv.partition("=")
        if key not in ("min_draft_tokens", "max_draft_tokens", "adaptive_window", "adaptive_step",
                       "confidence_threshold") or not value:
            ap.error(f"--policy-param {kv!r}: expected KEY=VALUE with KEY one of min_draft_tokens, max_draft_tokens, "
                     f"adaptive_window, adaptive_step, confidence_threshold")
        try:
            params[key] = float(value) if key == "confidence_threshold" else int(value)
        except ValueError:
            ap.error(f"--policy-param {kv!r}: {value!r} is not a number")
    try:  # the same checks as the config keys
        args.policy_config = DecodeConfig(num_draft_tokens=max(1, args.num_draft_tokens),
                                          draft_length_policy=args.draft_length_policy, **params)
    except ValueError as e:
        ap.error(str(e))
    for name in ("num_draft_tokens", "max_new_tokens", "repeats", "num_prompts", "prompt_len", "cost_steps",
                 "num_threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    if dtype == "auto":
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    else:
        dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    return dev, dt


def load_prompts(args, tokenizer, vocab: int) -> list[torch.Tensor]:
    """List of ``(1, P)`` int64 prompts."""
    if args.prompt_ids:
        gen = torch.Generator().manual_seed(args.seed)
        return [torch.randint(0, vocab, (1, args.prompt_len), generator=gen) for _ in range(args.num_prompts)]
    if args.prompts_file:
        texts = []
        with open(args.prompts_file, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    if args.text_field not in row:
                        raise SystemExit(f"{args.prompts_file}: a line has no field {args.text_field!r} (--text-field)")
                    texts.append(row[args.text_field])
                if len(texts) >= args.max_prompts:
                    break
    else:
        texts = BUILTIN_PROMPTS
    return [tokenizer(t, return_tensors="pt").input_ids for t in texts]


def check_tokenizers(target_dir: str, draft_dir: str):
    """Load both tokenizers and fail clearly if they differ (speculative decoding needs a shared vocabulary)."""
    from transformers import AutoTokenizer

    tok_t = AutoTokenizer.from_pretrained(target_dir)
    try:
        tok_d = AutoTokenizer.from_pretrained(draft_dir)
    except (OSError, ValueError):
        return tok_t  # draft saved without a tokenizer: it uses the target's
    if tok_t.get_vocab() != tok_d.get_vocab():
        raise SystemExit(f"tokenizer mismatch: {target_dir} and {draft_dir} have different vocabularies")
    return tok_t


def run(args) -> dict:
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.num_threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads_before)


def _run(args) -> dict:
    from transformers import AutoModelForCausalLM

    from decode.fast_llama import fast_path_supported

    torch.manual_seed(args.seed)
    fast_path = None if args.fast_path == "auto" else False
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    tokenizer = None if args.prompt_ids else check_tokenizers(args.target, args.draft)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype).to(device).eval()
    shared_vocab = min(target.get_output_embeddings().weight.shape[0], draft.get_output_embeddings().weight.shape[0])
    if tokenizer is not None:
        shared_vocab = min(shared_vocab, len(tokenizer))
    prompts = [p.to(device) for p in load_prompts(args, tokenizer, shared_vocab)]
    gamma, n_new = args.num_draft_tokens, args.max_new_tokens
    eos = target.generation_config.eos_token_id if args.stop_at_eos else None
    pad = target.generation_config.pad_token_id
    pad = pad if pad is not None else (eos if isinstance(eos, int) else (eos[0] if eos else 0))

    # Hugging Face assisted generation: constant schedule, no confidence stopping, same EOS policy as ours
    gen_cfg = copy.deepcopy(target.generation_config)
    gen_cfg.eos_token_id = eos
    gen_cfg.pad_token_id = pad
    gen_cfg.do_sample = False
    gen_cfg.max_new_tokens = n_new
    draft.generation_config.num_assistant_tokens = gamma
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    draft.generation_config.eos_token_id = eos

    def hf_assisted(p):
        out = target.generate(p, attention_mask=torch.ones_like(p), assistant_model=draft, generation_config=gen_cfg)
        return out[:, p.shape[1]:]

    def ours_ar(p):
        out = autoregressive_generate(target, p, max_new_tokens=n_new, eos_token_id=eos, pad_token_id=pad,
                                      vocab_size=shared_vocab, fast_path=fast_path)
        return out.sequences[:, p.shape[1]: p.shape[1] + int(out.num_new_tokens[0])], out.stats

    def ours_spec(p):
        out = speculative_generate(target, draft, p, max_new_tokens=n_new, num_draft_tokens=gamma, eos_token_id=eos,
                                   pad_token_id=pad, vocab_size=shared_vocab, fast_path=fast_path,
                                   draft_length_policy=args.policy_config.make_policy())
        return out.sequences[:, p.shape[1]: p.shape[1] + int(out.num_new_tokens[0])], out.stats

    methods = {"target_only": ours_ar, "hf_assisted": hf_assisted, "ours_speculative": ours_spec}
    # warm-up (allocations, kernels), untimed
    for fn in methods.values():
        fn(prompts[0])

    seconds = {m: 0.0 for m in methods}
    tokens = {m: 0 for m in methods}
    spec_stats: list[AcceptanceStats] = []
    mismatches = {m: 0 for m in methods if m != "target_only"}  # outputs differing from target-only greedy
    for _ in range(args.repeats):
        for p in prompts:
            outputs = {}
            for name, fn in methods.items():  # alternate the three methods on every prompt and repeat
                sync(device)
                t0 = time.perf_counter()
                res = fn(p)
                sync(device)
                seconds[name] += time.perf_counter() - t0
                new = res[0] if isinstance(res, tuple) else res
                tokens[name] += new.shape[1]
                outputs[name] = new.cpu()
                if name == "ours_speculative":
                    spec_stats.append(res[1])
            ref = outputs["target_only"]
            for n, o in outputs.items():
                if n != "target_only":
                    mismatches[n] += int(o.shape != ref.shape or not torch.equal(o, ref))

    stats = AcceptanceStats.pool(spec_stats)
    tps = {m: tokens[m] / seconds[m] if seconds[m] > 0 else float("nan") for m in methods}
    t_draft, t_target = forward_times_s([draft, target], prompts[0], args.cost_steps, fast_path)
    cost_ratio = t_draft / t_target
    alpha = stats.acceptance_rate
    expected = expected_speedup(alpha, gamma, cost_ratio) if alpha == alpha else float("nan")
    if args.draft_length_policy != "fixed" and alpha == alpha:  # Thm 3.8 over the draft lengths the policy used
        lengths = stats.draft_lengths
        expected = expected_speedup_mixture(alpha, [lengths.count(k) for k in range(max(lengths) + 1)], cost_ratio)
    measured = tps["ours_speculative"] / tps["target_only"]
    return {
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "num_threads": torch.get_num_threads(),
        "fast_path": args.fast_path,
        "fast_path_used": {"target": args.fast_path == "auto" and fast_path_supported(target),
                           "draft": args.fast_path == "auto" and fast_path_supported(draft)},
        "num_prompts": len(prompts),
        "repeats": args.repeats,
        "num_draft_tokens": gamma,
        "draft_length_policy": args.policy_config.policy_settings(),
        "mean_draft_length": stats.drafted_tokens / stats.verify_steps if stats.verify_steps else float("nan"),
        "max_new_tokens": n_new,
        "tokens_per_s": tps,
        "ours_over_transformers": tps["ours_speculative"] / tps["hf_assisted"],
        "ours_over_target_only": measured,
        "acceptance_rate": alpha,
        "mean_accepted_length": stats.mean_accepted_length,
        "draft_forward_s": t_draft,
        "target_forward_s": t_target,
        "cost_ratio": cost_ratio,
        "expected_speedup": expected,
        "measured_over_expected": measured / expected,
        "greedy_output_mismatches": mismatches,
        "stats": stats.to_dict(),
    }


def format_table(r: dict) -> str:
    tps = r["tokens_per_s"]
    rows = [
        ("device / dtype / threads", f"{r['device']} / {r['dtype']} / {r['num_threads']}"),
        ("ours: lean Llama forward (target, draft)",
         f"{r['fast_path']} ({'yes' if r['fast_path_used']['target'] else 'no'}, "
         f"{'yes' if r['fast_path_used']['draft'] else 'no'})"),
        ("prompts x repeats", f"{r['num_prompts']} x {r['repeats']}"),
        ("num_draft_tokens (gamma)", f"{r['num_draft_tokens']}"),
        ("ours: draft-length policy (mean draft length)",
         f"{r['draft_length_policy']['draft_length_policy']} ({r['mean_draft_length']:.2f})"),
        ("max_new_tokens", f"{r['max_new_tokens']}"),
        ("tokens/s target-only (ours AR)", f"{tps['target_only']:.1f}"),
        ("tokens/s transformers assisted", f"{tps['hf_assisted']:.1f}"),
        ("tokens/s ours speculative", f"{tps['ours_speculative']:.1f}"),
        ("ours / transformers", f"{r['ours_over_transformers']:.2f}x"),
        ("ours / target-only (measured speedup)", f"{r['ours_over_target_only']:.2f}x"),
        ("acceptance rate alpha", f"{r['acceptance_rate']:.3f}"),
        ("mean accepted length tau", f"{r['mean_accepted_length']:.2f}"),
        ("cost ratio c (draft / target forward)", f"{r['cost_ratio']:.3f}"),
        ("expected speedup (Leviathan Thm 3.8)", f"{r['expected_speedup']:.2f}x"),
        ("measured / expected", f"{r['measured_over_expected']:.2f}"),
        ("ours: greedy outputs differing from target-only", f"{r['greedy_output_mismatches']['ours_speculative']}"),
        ("transformers: outputs differing from target-only", f"{r['greedy_output_mismatches']['hf_assisted']}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    print(format_table(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2, default=float))
    return result


if __name__ == "__main__":
    main()
