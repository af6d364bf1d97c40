#!/usr/bin/env python
"""Benchmark specdraft's speculative decoder against target-only decoding and Hugging Face assisted generation.

    python scripts/bench_decode.py --target DIR --draft DIR [--prompts-file F.jsonl --text-field text]
        [--num-draft-tokens 4] [--max-new-tokens 64] [--repeats 3] [--device auto] [--dtype auto]
        [--target-dtype D] [--draft-dtype D] [--draft-quantize auto|none|int8] [--domain medical] [--block-threads auto|off|N]
        [--draft-length-policy fixed|adaptive|confidence --policy-param max_draft_tokens=8 ...]
        [--prompt-ids --num-prompts 4 --prompt-len 16] [--num-threads 1]
        [--fast-path auto|off] [--json-out F] [--draft-tree 3,2,1 ...] [--chain-gamma 2 ...] [--no-hf]
    python scripts/bench_decode.py --family mistral|qwen2|qwen3|gemma2|gemma3|phi3|llama [--family-layers 4]
        [--family-hidden 256] [--family-window 16] ...

On the same prompts (batch size 1, greedy) it times, alternated in every repeat and side by side in one run,
target-only decoding (ours), transformers' assisted generation (``num_assistant_tokens`` = ``--num-draft-tokens``,
constant schedule) and its plain generate, and ours speculative, and prints a ``| metric | value |`` table:
tokens/s, speedups, acceptance alpha and tau, the cost ratios c and v, the expected speedup (Leviathan et al. 2023,
Thm 3.8) and where the time goes, the machine's load first (DISTURBED above a quarter of a core). The engine, what
each number is and how it is measured: :mod:`eval.bench` (timing: :mod:`eval.evaluate`, the evaluation's); the table:
:mod:`eval.sections`.

``--family NAME`` benchmarks a tiny random model of that family (draft = the target's first layer) on random ids;
``--target-dtype`` / ``--draft-dtype`` run the two models in different dtypes (e.g. a bf16 target, fp32 draft).
Generation ignores EOS by default (fixed-length outputs make the methods comparable); ``--stop-at-eos`` uses the
target's EOS. ``--prompt-ids`` uses random token-id prompts and needs no tokenizer (used by the tests).
``--num-threads`` sets ``torch.set_num_threads`` (default 1: timings on a shared CPU are steadier, and for
models this small more threads do not help); ``--fast-path off`` runs ours through the Hugging Face forward
instead of the lean Llama forward (:mod:`decode.fast_llama`), to measure what the lean forward buys.
``--draft-length-policy`` runs ours with a draft-length policy (the ``decode.*`` keys through ``--policy-param``,
checked like the config); transformers assisted keeps its constant schedule of ``--num-draft-tokens``.
``--row-layout`` sets how ours multiplies several rows (``auto``: measured per model), ``--row-layout-peer``
times ours with another layout in the same alternation.

Chain vs tree: ``--draft-tree SPEC`` (repeatable; ``b1,b2,...``, ``b1,b2/max_nodes`` or ``dynamic:depth,top_k,
max_nodes``, :func:`decode.parse_draft_tree`) adds token-tree speculative decoding of each shape, and
``--chain-gamma G`` (repeatable) more chains, all alternated with the others on every prompt and repeat. The
"chain vs tree" table gives, per method, tokens per target forward (= mean accepted length tau: equal target
forwards), draft nodes verified per target forward, tokens/s and tokens/s over the main chain's
(``--num-draft-tokens``), and greedy outputs differing from target-only. ``--no-hf`` skips transformers assisted
generation (its columns are then NaN).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from decode import expected_speedup  # noqa: E402,F401  (re-exported: the tests check the expectation with it)
from eval.bench import leviathan_expectation, run_bench  # noqa: E402,F401
from eval.bench import FAMILIES, BenchConfig, load_prompts, read_prompts_file  # noqa: E402,F401
from core.errors import BenchError  # noqa: E402,F401
from eval.bench import resolve_device_dtype as _resolve_device_dtype  # noqa: E402
from core.io import write_text_atomic  # noqa: E402
from eval.sections import format_compare, format_table  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="target model directory (or hub id where reachable)")
    ap.add_argument("--draft", help="draft model directory")
    ap.add_argument("--family", choices=FAMILIES,
                    help="instead of --target/--draft: a tiny random model of this family (target: "
                         "--family-layers layers; draft: its first layer, embeddings and head), random-id prompts")
    ap.add_argument("--family-layers", type=int, default=4, help="target layers for --family (default 4)")
    ap.add_argument("--family-hidden", type=int, default=256, help="hidden size for --family (default 256)")
    ap.add_argument("--family-window", type=int, default=16,
                    help="sliding window for --family models that have one (default 16: shorter than prompt + "
                         "generation, so the window is exercised)")
    ap.add_argument("--domain", help="use a domain's evaluation prompts (data.loading.eval_prompts: the test split's "
                                     "prompts, rendered with the target's chat template where they are chats; "
                                     "the data root as for python -m eval), at most --max-prompts of them")
    ap.add_argument("--prompts-file", help="JSONL file with one prompt per line")
    ap.add_argument("--text-field", default="text", help="JSONL field holding the prompt text (default: text)")
    ap.add_argument("--max-prompts", type=int, default=8, help="use at most this many prompts from the file")
    ap.add_argument("--prompt-ids", action="store_true", help="random token-id prompts, no tokenizer needed")
    ap.add_argument("--num-prompts", type=int, default=4, help="number of random prompts (--prompt-ids)")
    ap.add_argument("--prompt-len", type=int, default=16, help="tokens per random prompt (--prompt-ids)")
    ap.add_argument("--num-draft-tokens", type=int, default=4, help="gamma: tokens the draft proposes per verify step "
                    "(default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per decode (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over the prompts, every method once per prompt "
                    "per round (default 3)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16")
    ap.add_argument("--target-dtype", help="dtype of the target only (default: --dtype); lossless = equal to "
                                           "target-only decoding in this dtype")
    ap.add_argument("--draft-dtype", help="dtype of the draft only (default: --dtype)")
    ap.add_argument("--draft-quantize", choices=("auto", "none", "int8"), default="auto",
                    help="the draft's weights: int8 = dynamic int8 Linear layers (decode/fast_settings.py, CPU), for "
                         "ours and transformers' assisted generation alike; auto (default) = as the draft "
                         "directory's specdraft.json records (drafts/<name>_int8 from draft.quantize=int8)")
    ap.add_argument("--stop-at-eos", action="store_true", help="stop rows at the target's EOS (default: ignore)")
    ap.add_argument("--cost-steps", type=int, default=32, help="single-token forwards timed for the cost ratio "
                    "(default 32)")
    ap.add_argument("--seed", type=int, default=0, help="seed of --prompt-ids and of the random --family "
                    "models (default 0)")
    ap.add_argument("--num-threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--fast-path", choices=("auto", "off"), default="auto",
                    help="ours: lean forward where supported (Llama, Mistral, Qwen2/3, Gemma-2/3, Phi-3; auto) or the "
                         "Hugging Face forward (off)")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                    help="decode.compile for ours: torch.compile of the lean forward (auto: on for CUDA, off on CPU); "
                         "when on, ours also runs uncompiled in the same alternation (compiled / uncompiled)")
    ap.add_argument("--block-threads", default="auto",
                    help="decode.block_threads: CPU threads for forwards over more than one token (verify blocks, "
                         "prefills): auto (the caller's threads, never above the cores) | off | N; target-only is also timed with every forward at "
                         "that many threads, and the faster target-only is the speedup's denominator")
    ap.add_argument("--json-out", help="also write the results as JSON here")
    ap.add_argument("--draft-length-policy", choices=("fixed", "adaptive", "confidence"), default="fixed",
                    help="ours: draft-length policy (decode.draft_length_policy; adaptive starts at "
                         "--num-draft-tokens)")
    ap.add_argument("--draft-tree", action="append", default=[], metavar="SPEC",
                    help="also run token-tree speculative decoding with this shape (repeatable): b1,b2,... | "
                         "b1,b2/max_nodes | dynamic:depth,top_k,max_nodes")
    ap.add_argument("--chain-gamma", action="append", default=[], type=int, metavar="G",
                    help="also run the chain with this num_draft_tokens (repeatable), for chain vs tree")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers assisted generation")
    ap.add_argument("--row-layout", choices=("auto", "weight_left", "activation_left"), default="auto",
                    help="ours (lean forward, CPU): how forwards over several positions multiply (auto: both forms "
                         "timed once on the model's shapes, the faster kept; decode/fast_llama.py)")
    ap.add_argument("--row-layout-peer", choices=("auto", "weight_left", "activation_left"),
                    help="also run ours (the main chain) with this row layout, in the same alternation: "
                         "ours / that (tokens/s)")
    ap.add_argument("--policy-param", action="append", default=[], metavar="KEY=VALUE",
                    help="a decode.* policy key, e.g. max_draft_tokens=8, adaptive_window=4, "
                         "confidence_threshold=0.6")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked before anything loads: a bad value is a one-line usage error (exit 2).
    Adds ``policy_config`` (decode.config.DecodeConfig), ``trees`` (parsed --draft-tree) and ``prompt_texts``
    (--prompts-file's texts)."""
    ap = _parser()
    args = ap.parse_args(argv)
    if args.family is None and (args.target is None or args.draft is None):
        ap.error("give --target and --draft, or --family NAME")
    if args.family is not None:
        args.prompt_ids = True
    else:
        from models.checkpoints import check_checkpoint_dir
        from core.errors import CheckpointError

        try:  # before anything loads: a path that is not a model directory
            check_checkpoint_dir(args.target, "target", "--target", need_tokenizer=not args.prompt_ids)
            check_checkpoint_dir(args.draft, "draft", "--draft", need_tokenizer=False)
        except CheckpointError as e:
            ap.error(str(e))
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
    from decode import parse_draft_tree

    try:
        args.trees = [parse_draft_tree(s) for s in args.draft_tree]
    except ValueError as e:
        ap.error(f"--draft-tree: {e}")
    if any(t is None for t in args.trees):
        ap.error("--draft-tree: an empty shape; give b1,b2,... or dynamic:depth,top_k,max_nodes")
    if any(g < 1 for g in args.chain_gamma):
        ap.error("--chain-gamma must be >= 1")
    if sum(bool(x) for x in (args.domain, args.prompts_file, args.prompt_ids)) > 1:
        ap.error("--domain, --prompts-file and --prompt-ids are alternatives: give one of them")
    if args.domain:
        from data.loading import get_domain

        try:
            get_domain(args.domain)
        except ValueError as e:
            # the fix is this flag, not the Hydra keys the shared message names
            ap.error(f"--domain: {e}".replace("Fix eval.domains / data.domain", "Fix --domain"))
    from decode.fast_settings import parse_block_threads

    try:
        parse_block_threads(args.block_threads)
    except ValueError as e:
        ap.error(f"--block-threads: {e}")
    for name in ("num_draft_tokens", "max_new_tokens", "repeats", "num_prompts", "prompt_len", "cost_steps",
                 "num_threads", "max_prompts", "family_layers", "family_hidden"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.family is not None and args.family_hidden % (2 * max(4, args.family_hidden // 64)):
        ap.error(f"--family-hidden {args.family_hidden}: must be a multiple of twice the head count "
                 f"(max(4, hidden // 64) heads), e.g. 64, 128, 256")
    if args.family_window < 1:
        ap.error("--family-window must be >= 1")
    if args.json_out and not os.access(Path(args.json_out).resolve().parent, os.W_OK):
        ap.error(f"--json-out {args.json_out}: its folder does not exist or is not writable; create it or name "
                 f"another file")
    if args.row_layout_peer is not None:
        if args.row_layout_peer == args.row_layout:
            ap.error(f"--row-layout-peer {args.row_layout_peer} is --row-layout itself: name the other layout")
        if args.fast_path == "off":
            ap.error("--row-layout-peer needs the lean forward (--fast-path auto): the Hugging Face forward has no "
                     "row layout")
    if args.prompts_file:
        try:
            args.prompt_texts = read_prompts_file(args.prompts_file, args.text_field, args.max_prompts)
        except ValueError as e:
            ap.error(f"--prompts-file: {e}")
    return args


def resolve_device_dtype(device: str, dtype: str):
    """``--device`` / ``--dtype`` resolved (:func:`eval.bench.resolve_device_dtype`); an unavailable GPU or
    an unknown name ends the script with a one-line error."""
    try:
        return _resolve_device_dtype(device, dtype)
    except BenchError as e:
        raise SystemExit(f"error: {e}") from None


def run(args: argparse.Namespace) -> dict:
    """The benchmark of the parsed command line (:func:`eval.bench.run_bench`); input it cannot run on (a missing
    GPU, a pair that does not load, prompts too long) ends the script with a one-line ``error:``."""
    try:
        return run_bench(BenchConfig.from_namespace(args))
    except BenchError as e:
        raise SystemExit(f"error: {e}") from None


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    print(format_table(result))
    if len(result["chain_vs_tree"]) > 1:
        print()
        print(format_compare(result))
    if args.json_out:
        write_text_atomic(args.json_out, json.dumps(result, indent=2, default=float) + "\n")
    return result


if __name__ == "__main__":
    main()
