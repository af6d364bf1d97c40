#!/usr/bin/env python
"""Benchmark specdraft's speculative decoder against target-only decoding and Hugging Face assisted generation.

    python scripts/bench_decode.py --target DIR --draft DIR [--prompts-file F.jsonl --text-field text]
        [--num-draft-tokens 4] [--max-new-tokens 64] [--repeats 3] [--device auto] [--dtype auto]
        [--target-dtype D] [--draft-dtype D] [--domain medical] [--block-threads auto|off|N]
        [--draft-length-policy fixed|adaptive|confidence --policy-param max_draft_tokens=8 ...] [--prompt-ids --num-prompts 4 --prompt-len 16] [--num-threads 1]
        [--fast-path auto|off] [--json-out F] [--draft-tree 3,2,1 ...] [--chain-gamma 2 ...] [--no-hf]
    python scripts/bench_decode.py --family mistral|qwen2|qwen3|gemma2|gemma3|phi3|llama [--family-layers 4]
        [--family-hidden 256] [--family-window 16] ...

On the same prompts (batch size 1, greedy) it runs, alternating the three methods in every repeat:

- ``target_only``: ours :func:`decode.autoregressive_generate` (KV cache, one token per target forward);
- ``hf_assisted``: ``target.generate(assistant_model=draft, do_sample=False)`` with ``num_assistant_tokens`` =
  ``--num-draft-tokens`` and the constant schedule (confidence stopping off);
- ``ours_speculative``: :func:`decode.speculative_generate`.

It prints tokens/s of each (new tokens / wall seconds, ``time.perf_counter`` around each call, CUDA synchronised),
ours/transformers and ours/target-only ratios, the measured acceptance rate alpha and mean accepted length tau
(pooled), the cost ratio c (one-token cached draft forward time / target forward time, medians, the two models
timed alternately), the expected
speedup of Leviathan et al. 2023, Thm 3.8, from the measured per-token acceptance alpha (accepted / tested draft
tokens, :func:`leviathan_expectation`) and c, and measured speedup / expected.

Where a step's time goes: the speculative calls' wall time split into prefill (both models), draft phase, verify
forwards and everything else (``AcceptanceStats.prefill_time_s / draft_time_s / verify_time_s / wall_time_s``); the
*loop efficiency* (time in model forwards / wall); the *verify cost ratio* v = (gamma + 1)-position target forward /
one-position target forward (medians, :func:`decode.block_forward_times_s`; also per step in the loop against the
target-only decoder's per-token time); and the expected speedup from these measured components,
``(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + v))``, beside Leviathan's (v = 1). The first row is the
machine's load while timing (other processes' busy cores, :class:`eval.evaluate.LoadMeter`): above a quarter of a
core the run is marked DISTURBED, as the evaluation marks a domain noisy. ``--row-layout`` sets how ours multiplies
several rows (``auto``: measured per model; the table names the choice and both timings), ``--row-layout-peer``
times ours with another layout in the same alternation.
``--family NAME`` benchmarks a tiny random model of that family (draft = the target's first layer) on random ids;
``--target-dtype`` / ``--draft-dtype`` run the two models in different dtypes (e.g. a bf16 target, fp32 draft).
Generation ignores EOS by default (fixed-length outputs make the three comparable); ``--stop-at-eos`` uses the
target's EOS. ``--prompt-ids`` uses random token-id prompts and needs no tokenizer (used by the tests).
``--num-threads`` sets ``torch.set_num_threads`` (default 1: timings on a shared CPU are steadier, and for
models this small more threads do not help); ``--fast-path off`` runs ours through the Hugging Face forward
instead of the lean Llama forward (:mod:`decode.fast_llama`), to measure what the lean forward buys.
``--draft-length-policy`` runs ours with a draft-length policy (the ``decode.*`` keys through ``--policy-param``,
checked like the config); transformers assisted keeps its constant schedule of ``--num-draft-tokens``.

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
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from decode import (  # noqa: E402
    AcceptanceStats,
    autoregressive_generate,
    expected_speedup,
    frozen_weights,
    speculative_generate,
)
from data.devices import runtime_record, torch_threads  # noqa: E402
from decode.stats import expected_speedup_mixture  # noqa: E402
from decode.common import output_vocab_size, sync  # noqa: E402
from decode.timing import block_forward_times_s, forward_times_s, head_share, memory_bound_s  # noqa: E402

BUILTIN_PROMPTS = [
    "The patient was admitted to the hospital with",
    "def fibonacci(n):\n    ",
    "Speculative decoding speeds up inference by",
    "Once upon a time, in a small village,",
]


def parse_args(argv=None) -> argparse.Namespace:
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
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16")
    ap.add_argument("--target-dtype", help="dtype of the target only (default: --dtype); lossless = equal to "
                                           "target-only decoding in this dtype")
    ap.add_argument("--draft-dtype", help="dtype of the draft only (default: --dtype)")
    ap.add_argument("--stop-at-eos", action="store_true", help="stop rows at the target's EOS (default: ignore)")
    ap.add_argument("--cost-steps", type=int, default=32, help="single-token forwards timed for the cost ratio")
    ap.add_argument("--seed", type=int, default=0)
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
    args = ap.parse_args(argv)
    if args.family is None and (args.target is None or args.draft is None):
        ap.error("give --target and --draft, or --family NAME")
    if args.family is not None:
        args.prompt_ids = True
    else:
        from data.checkpoints import check_checkpoint_dir
        from data.errors import CheckpointError

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
        from data.domains import get_domain

        try:
            get_domain(args.domain)
        except ValueError as e:
            ap.error(f"--domain: {e}")
    from decode.threads import parse_block_threads

    try:
        parse_block_threads(args.block_threads)
    except ValueError as e:
        ap.error(f"--block-threads: {e}")
    for name in ("num_draft_tokens", "max_new_tokens", "repeats", "num_prompts", "prompt_len", "cost_steps",
                 "num_threads", "max_prompts", "family_layers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.family is not None and args.family_hidden % (2 * max(4, args.family_hidden // 64)):
        ap.error(f"--family-hidden {args.family_hidden}: must be a multiple of twice the head count "
                 f"(max(4, hidden // 64) heads), e.g. 64, 128, 256")
    if args.family_window < 1:
        ap.error("--family-window must be >= 1")
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


def read_prompts_file(path: str, field: str, limit: int) -> list[str]:
    """The first ``limit`` non-empty ``field`` strings of a JSONL file.

    Raises:
        ValueError: the file is missing or unreadable, a line is not a JSON object, lacks ``field`` or holds a
            non-string or empty text, or no prompt remains; the message names the file, the line and the fix.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text (expected JSONL: one JSON object per line)") from None
    texts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {i}: not JSON ({e.msg}); expected one JSON object per line") from None
        if not isinstance(row, dict) or field not in row:
            raise ValueError(f"{path}, line {i}: no field {field!r} (--text-field names the prompt's field)")
        if not isinstance(row[field], str) or not row[field].strip():
            raise ValueError(f"{path}, line {i}: field {field!r} must be a non-empty string, got {row[field]!r}")
        texts.append(row[field])
        if len(texts) >= limit:
            break
    if not texts:
        raise ValueError(f"{path} holds no prompt (every line is blank)")
    return texts


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")


def family_models(family: str, layers: int, hidden: int, window: int, vocab: int = 1024, seed: int = 0):
    """(target, draft): a random ``family`` model (``layers`` layers, 4 heads of 2 KV groups, windowed layers as the
    family lays them out) and a 1-layer draft sharing its embeddings, first layer, final norm and head."""
    import transformers as tf

    heads = max(4, hidden // 64)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=heads,
                  num_key_value_heads=heads // 2, max_position_embeddings=2048, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hd = hidden // heads

    def build(n):
        if family == "llama":
            return tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_hidden_layers=n))
        if family == "mistral":
            return tf.MistralForCausalLM(tf.MistralConfig(**common, num_hidden_layers=n, sliding_window=window))
        if family in ("qwen2", "qwen3"):
            cfg_cls, cls = (tf.Qwen2Config, tf.Qwen2ForCausalLM) if family == "qwen2" else (tf.Qwen3Config,
                                                                                             tf.Qwen3ForCausalLM)
            return cls(cfg_cls(**common, num_hidden_layers=n, use_sliding_window=True, sliding_window=window,
                               max_window_layers=0))  # every layer windowed
        types = [("sliding_attention" if i % 2 == 0 else "full_attention") for i in range(n)]
        if family == "gemma2":
            return tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, num_hidden_layers=n, head_dim=hd,
                                                        sliding_window=window, layer_types=types))
        if family == "gemma3":
            return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common, num_hidden_layers=n, head_dim=hd,
                                                            sliding_window=window, layer_types=types))
        return tf.Phi3ForCausalLM(tf.Phi3Config(**common, num_hidden_layers=n, sliding_window=window))

    torch.manual_seed(seed)
    target = build(layers).eval()
    draft = build(1).eval()
    draft.load_state_dict(target.state_dict(), strict=False)
    return target, draft


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """``--device`` / ``--dtype`` as eval.device / eval.dtype resolve them (:mod:`data.devices`); an unavailable
    GPU or an unknown name ends the script with a one-line error."""
    from data.devices import DeviceError, resolve_device, resolve_dtype

    try:
        dev = resolve_device(device, "--device")
        return dev, resolve_dtype(dtype, dev, "--dtype")
    except DeviceError as e:
        raise SystemExit(f"error: {e}") from None


def leviathan_expectation(stats: AcceptanceStats, gamma: int, cost_ratio: float) -> tuple[float, float]:
    """``(per-token acceptance alpha, expected speedup)`` of Leviathan et al. 2023, Thm 3.8, whose i.i.d. model
    wants the per-token acceptance probability: accepted / positions reached, summed over draft positions
    (``sum(per_position_accepted) / sum(per_position_drafted)``; as ``token_acceptance_rate`` in metrics.json),
    not accepted / drafted (which counts the positions after the first rejection as rejected too). NaN when
    nothing was drafted."""
    alpha = stats.per_token_acceptance
    return alpha, (expected_speedup(alpha, gamma, cost_ratio) if alpha == alpha else float("nan"))


def load_prompts(args, tokenizer, vocab: int) -> list[torch.Tensor]:
    """List of ``(1, P)`` int64 prompts."""
    if args.prompt_ids:
        gen = torch.Generator().manual_seed(args.seed)
        return [torch.randint(0, vocab, (1, args.prompt_len), generator=gen) for _ in range(args.num_prompts)]
    if args.domain:
        from data.loading import eval_prompts

        texts = [e.prompt for e in eval_prompts(args.domain, max_prompts=args.max_prompts, tokenizer=tokenizer)]
    elif args.prompts_file:
        texts = getattr(args, "prompt_texts", None) or read_prompts_file(args.prompts_file, args.text_field,
                                                                         args.max_prompts)
    else:
        texts = BUILTIN_PROMPTS
    return [tokenizer(t, return_tensors="pt").input_ids for t in texts]


def run(args) -> dict:
    from decode.threads import block_threads_setting, set_block_threads

    from decode.fast_llama import row_layout_record, set_row_layout

    threads_before, block_before = torch.get_num_threads(), block_threads_setting()
    layout_before = row_layout_record()["setting"]
    torch.set_num_threads(args.num_threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads_before)
        set_block_threads(block_before)
        set_row_layout(layout_before)


def _run(args) -> dict:
    from decode.fast_llama import (compile_enabled, compile_seconds, fast_path_supported, row_layout_record,
                                   set_compile, set_row_layout)
    from decode.threads import resolved_block_threads, set_block_threads

    set_compile(args.compile)
    set_block_threads(args.block_threads)
    set_row_layout(args.row_layout)
    torch.manual_seed(args.seed)
    fast_path = None if args.fast_path == "auto" else False
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    t_dtype = resolve_device_dtype(args.device, args.target_dtype)[1] if args.target_dtype else dtype
    d_dtype = resolve_device_dtype(args.device, args.draft_dtype)[1] if args.draft_dtype else dtype
    if args.family:
        target, draft = family_models(args.family, args.family_layers, args.family_hidden, args.family_window,
                                      seed=args.seed)
        target, draft = target.to(device=device, dtype=t_dtype), draft.to(device=device, dtype=d_dtype)
        tokenizer = None
    else:
        from data.checkpoints import load_target_and_draft

        try:  # clear errors for a missing / partial / unloadable directory or two tokenizers that differ
            target, draft, tokenizer = load_target_and_draft(args.target, args.draft, dtype=t_dtype,
                                                             draft_dtype=d_dtype, device=device,
                                                             need_tokenizer=not args.prompt_ids)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        tokenizer = None if args.prompt_ids else tokenizer
    # logits each model produces (a trimmed draft head still scores the whole vocabulary, -inf outside its kept ids)
    shared_vocab = min(output_vocab_size(target), output_vocab_size(draft))
    if tokenizer is not None:
        shared_vocab = min(shared_vocab, len(tokenizer))
    prompts = [p.to(device) for p in load_prompts(args, tokenizer, shared_vocab)]
    if not prompts or min(p.shape[1] for p in prompts) < 1:
        raise SystemExit("error: a prompt tokenizes to no tokens; give prompts with text")
    from data.checkpoints import check_context_fits
    from data.errors import CheckpointError

    longest = max(p.shape[1] for p in prompts)
    block = max([args.num_draft_tokens, *args.chain_gamma, *(t.max_nodes for t in args.trees)]) + 2
    try:  # the decoders' caches hold prompt + new tokens + one verify block
        for model, role in ((target, "target"), (draft, "draft")):
            limit = getattr(model.config, "max_position_embeddings", None) or 0
            check_context_fits(model, longest + args.max_new_tokens + block, role,
                               f"the longest prompt ({longest} tokens) + --max-new-tokens ({args.max_new_tokens}) + "
                               f"the largest verify block ({block})",
                               fix=f"lower --max-new-tokens to at most {limit - longest - block}"
                               if limit > longest + block else "use shorter prompts or a smaller draft tree")
    except CheckpointError as e:
        raise SystemExit(f"error: {e}") from None
    gamma, n_new = args.num_draft_tokens, args.max_new_tokens
    eos = target.generation_config.eos_token_id if args.stop_at_eos else None
    pad = target.generation_config.pad_token_id
    pad = pad if pad is not None else (eos if isinstance(eos, int) else (eos[0] if eos else 0))
    ours_eos = eos if eos is not None else []  # our decoders: [] never stops (None would take the target's EOS)
    # weights never change during the benchmark: decode calls reuse what they read from the models, as a server
    # (decode.frozen_weights; transformers' generate re-reads nothing per call either)
    with frozen_weights(target, draft):

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
            out = target.generate(p, attention_mask=torch.ones_like(p), assistant_model=draft,
                                  generation_config=gen_cfg)
            return out[:, p.shape[1]:]

        def ours_ar(p):
            out = autoregressive_generate(target, p, max_new_tokens=n_new, eos_token_id=ours_eos, pad_token_id=pad,
                                          vocab_size=shared_vocab, fast_path=fast_path)
            return out.sequences[:, p.shape[1]: p.shape[1] + int(out.num_new_tokens[0])], out.stats

        def ours_spec(p):
            out = speculative_generate(target, draft, p, max_new_tokens=n_new, num_draft_tokens=gamma, eos_token_id=ours_eos,
                                       pad_token_id=pad, vocab_size=shared_vocab, fast_path=fast_path,
                                       draft_length_policy=args.policy_config.make_policy())
            return out.sequences[:, p.shape[1]: p.shape[1] + int(out.num_new_tokens[0])], out.stats

        def spec_fn(**setting):  # one more speculative setting: num_draft_tokens=G (a chain) or draft_tree=T
            def fn(p):
                out = speculative_generate(target, draft, p, max_new_tokens=n_new, eos_token_id=ours_eos, pad_token_id=pad,
                                           vocab_size=shared_vocab, fast_path=fast_path, **setting)
                return out.sequences[:, p.shape[1]: p.shape[1] + int(out.num_new_tokens[0])], out.stats
            return fn

        def hf_target_only(p):  # transformers' own generate, no assistant: the peer's target-only decoding
            out = target.generate(p, attention_mask=torch.ones_like(p), generation_config=gen_cfg)
            return out[:, p.shape[1]:]

        methods = {"target_only": ours_ar, "hf_assisted": hf_assisted, "hf_target_only": hf_target_only,
                   "ours_speculative": ours_spec}
        block_threads = resolved_block_threads(device)
        if block_threads is not None and block_threads != torch.get_num_threads():

            def target_only_block_threads(p):  # every target-only forward at the block thread count: the peer's best?
                with torch_threads(block_threads):
                    return ours_ar(p)

            methods["target_only_block_threads"] = target_only_block_threads
        if args.no_hf:
            del methods["hf_assisted"], methods["hf_target_only"]
        extra = {f"chain {g}": spec_fn(num_draft_tokens=g) for g in sorted(set(args.chain_gamma) - {gamma})}
        extra.update({f"tree {t.spec()}": spec_fn(draft_tree=t) for t in args.trees})
        methods.update(extra)
        extra_stats: dict[str, list[AcceptanceStats]] = {m: [] for m in extra}
        compiled = compile_enabled(device) and fast_path is None
        if compiled:  # the same decoder uncompiled, in the same alternation

            def ours_spec_uncompiled(p):
                set_compile("off")
                try:
                    return ours_spec(p)
                finally:
                    set_compile(args.compile)

            methods["ours_speculative_uncompiled"] = ours_spec_uncompiled
        peer_layout = f"ours_speculative_row_layout_{args.row_layout_peer}" if args.row_layout_peer else None
        if peer_layout:  # the same decoder with the other several-row layout, in the same alternation

            def ours_spec_row_layout(p):
                set_row_layout(args.row_layout_peer)
                try:
                    return ours_spec(p)
                finally:
                    set_row_layout(args.row_layout)

            methods[peer_layout] = ours_spec_row_layout
        # warm-up (allocations, kernels; compiling when decode.compile is on), untimed
        compile_s0 = compile_seconds()
        for fn in methods.values():
            fn(prompts[0])
        compile_warmup_s = compile_seconds() - compile_s0

        seconds = {m: 0.0 for m in methods}
        tokens = {m: 0 for m in methods}
        spec_stats: list[AcceptanceStats] = []
        ar_stats: list[AcceptanceStats] = []
        mismatches = {m: 0 for m in methods if m != "target_only"}  # outputs differing from target-only greedy
        from eval.evaluate import LoadMeter

        meter = LoadMeter().start()  # other processes' load while timing: a disturbed run says so
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
                    if name in extra_stats:
                        extra_stats[name].append(res[1])
                    if name == "ours_speculative":
                        spec_stats.append(res[1])
                    elif name == "target_only":
                        ar_stats.append(res[1])
                ref = outputs["target_only"]
                for n, o in outputs.items():
                    if n != "target_only":
                        mismatches[n] += int(o.shape != ref.shape or not torch.equal(o, ref))

        load = meter.stop()
        stats = AcceptanceStats.pool(spec_stats)
        ar = AcceptanceStats.pool(ar_stats)
        tps = {m: tokens[m] / seconds[m] if seconds[m] > 0 else float("nan") for m in methods}
        for peer in ("hf_assisted", "hf_target_only"):
            tps.setdefault(peer, float("nan"))
            mismatches.setdefault(peer, 0)
        # against the faster target-only: one-token forwards at --num-threads, or every forward at the block threads
        best_target_only = max(tps["target_only"], tps.get("target_only_block_threads", float("-inf")))
        compare = {}
        for name, st_list in [(f"chain {gamma}", spec_stats)] + list(extra_stats.items()):
            method = "ours_speculative" if name == f"chain {gamma}" else name
            st = AcceptanceStats.pool(st_list)
            compare[name] = {
                "tokens_per_target_forward": st.mean_accepted_length,
                "nodes_per_target_forward": st.mean_nodes_verified,
                "target_forwards": st.verify_steps,
                "tokens_per_s": tps[method],
                "tokens_per_s_over_chain": tps[method] / tps["ours_speculative"],
                "tokens_per_s_over_target_only": tps[method] / best_target_only,
                "greedy_output_mismatches": mismatches[method],
                "draft_s": st.draft_time_s, "verify_s": st.verify_time_s, "wall_s": st.wall_time_s,
            }
        t_draft, t_target = forward_times_s([draft, target], prompts[0], args.cost_steps, fast_path)
        blocks = block_forward_times_s(target, prompts[0], [1, gamma + 1], args.cost_steps, fast_path)
        cost_ratio = t_draft / t_target
        verify_ratio = blocks[gamma + 1] / blocks[1]
        head = head_share(draft, args.cost_steps)
        bound = memory_bound_s(target)
        alpha = stats.acceptance_rate
        token_alpha, expected = leviathan_expectation(stats, gamma, cost_ratio)
        nan = float("nan")
        expected_comp = expected_speedup(token_alpha, gamma, cost_ratio, verify_ratio) \
            if token_alpha == token_alpha else nan
        if args.draft_length_policy != "fixed" and token_alpha == token_alpha:  # Thm 3.8 over the lengths used
            lengths = stats.draft_lengths
            expected = expected_speedup_mixture(token_alpha, [lengths.count(k) for k in range(max(lengths) + 1)],
                                                cost_ratio)
        measured = tps["ours_speculative"] / best_target_only

        def breakdown(st: AcceptanceStats) -> dict:
            """Seconds per phase (pooled over the timed calls) and the loop efficiency (time in forwards / wall)."""
            fwd = st.prefill_time_s + st.draft_time_s + st.verify_time_s
            return {"wall_s": st.wall_time_s, "prefill_s": st.prefill_time_s, "draft_s": st.draft_time_s,
                    "verify_s": st.verify_time_s, "other_s": st.wall_time_s - fwd,
                    "loop_efficiency": fwd / st.wall_time_s if st.wall_time_s > 0 else nan}

        spec_bd = breakdown(stats)
        steps = stats.verify_steps
        in_loop = {
            "verify_s_per_step": stats.verify_time_s / steps if steps else nan,
            "draft_s_per_token": stats.draft_time_s / stats.drafted_tokens if stats.drafted_tokens else nan,
            "other_s_per_step": spec_bd["other_s"] / steps if steps else nan,
            "target_s_per_token_target_only": ar.verify_time_s / ar.verify_steps if ar.verify_steps else nan,
        }
        in_loop["verify_cost_ratio"] = in_loop["verify_s_per_step"] / in_loop["target_s_per_token_target_only"]
        in_loop["cost_ratio"] = in_loop["draft_s_per_token"] / in_loop["target_s_per_token_target_only"]
        return {
            "family": args.family,
            "device": str(device),
            "dtype": str(dtype).replace("torch.", ""),
            "target_dtype": str(t_dtype).replace("torch.", ""),
            "draft_dtype": str(d_dtype).replace("torch.", ""),
            "num_threads": torch.get_num_threads(),
            "block_threads": {"setting": args.block_threads, "threads": block_threads},
            "runtime": runtime_record(device, dtype),  # + torch / CUDA versions and the GPU name (data.devices)
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
            "ours_over_transformers_target_only": tps["ours_speculative"] / tps["hf_target_only"],
            "draft_head": {**head, "share_of_draft_forward": head["head_forward_s"] / t_draft},
            "target_memory_bound": {**bound, "verify_over_bound": blocks[gamma + 1] / bound["bound_s"],
                                    "one_token_over_bound": blocks[1] / bound["bound_s"]},
            "ours_over_target_only": measured,
            "acceptance_rate": alpha,
            "token_acceptance_rate": token_alpha,
            "mean_accepted_length": stats.mean_accepted_length,
            "draft_forward_s": t_draft,
            "target_forward_s": t_target,
            "target_verify_forward_s": blocks[gamma + 1],
            "cost_ratio": cost_ratio,
            "verify_cost_ratio": verify_ratio,
            "expected_speedup": expected,
            "expected_speedup_components": expected_comp,
            "measured_over_expected": measured / expected,
            "time_breakdown": {"ours_speculative": spec_bd, "target_only": breakdown(ar)},
            "in_loop": in_loop,
            "greedy_output_mismatches": mismatches,
            "compile": {"setting": args.compile, "compiled": compiled,
                        "compile_time_s": compile_warmup_s,  # first calls (warm-up), untimed
                        "compile_time_in_timed_s": compile_seconds() - compile_s0 - compile_warmup_s,
                        "compiled_over_uncompiled": (tps["ours_speculative"] / tps["ours_speculative_uncompiled"]
                                                     if compiled else None)},
            "row_layout": {**row_layout_record(), "setting": args.row_layout, "peer": args.row_layout_peer,
                           "ours_over_peer": tps["ours_speculative"] / tps[peer_layout] if peer_layout else None},
            "load": load,
            "stats": stats.to_dict(),
            "chain_vs_tree": compare,
        }


def format_table(r: dict) -> str:
    tps = r["tokens_per_s"]
    hf_ran = tps["hf_assisted"] == tps["hf_assisted"]  # NaN: skipped (--no-hf)
    bd, il = r["time_breakdown"]["ours_speculative"], r["in_loop"]
    wall = bd["wall_s"] or float("nan")
    peer = r["row_layout"]["peer"]
    load = r["load"]
    other = load.get("other_load")
    rows = [
        ("machine load while timing (other processes' busy cores)",
         ("unknown" if other is None else f"{other:.2f} of {load['cores']}")
         + (": DISTURBED, other processes kept more than a quarter of a core busy; re-run on a quiet machine "
            "before trusting these timings" if load.get("overloaded") else "")),
        ("model family (tiny random, --family)", r["family"] or "-"),
        ("device / dtype (target, draft) / threads (one-token, block)",
         f"{r['device']} / {r['target_dtype']}, {r['draft_dtype']} / {r['num_threads']}, "
         f"{r['block_threads']['threads'] or r['num_threads']}"),
        ("ours: lean forward (target, draft)",
         f"{r['fast_path']} ({'yes' if r['fast_path_used']['target'] else 'no'}, "
         f"{'yes' if r['fast_path_used']['draft'] else 'no'})"),
        ("prompts x repeats", f"{r['num_prompts']} x {r['repeats']}"),
        ("num_draft_tokens (gamma)", f"{r['num_draft_tokens']}"),
        ("ours: draft-length policy (mean draft length)",
         f"{r['draft_length_policy']['draft_length_policy']} ({r['mean_draft_length']:.2f})"),
        ("max_new_tokens", f"{r['max_new_tokens']}"),
        ("tokens/s target-only (ours AR)", f"{tps['target_only']:.1f}"),
        *([(f"tokens/s target-only, every forward at {r['block_threads']['threads']} threads",
            f"{tps['target_only_block_threads']:.1f}")] if "target_only_block_threads" in tps else []),
        (f"tokens/s transformers assisted (num_assistant_tokens {r['num_draft_tokens']}, constant)",
         f"{tps['hf_assisted']:.1f}" if hf_ran else "skipped (--no-hf)"),
        ("tokens/s ours speculative", f"{tps['ours_speculative']:.1f}"),
        ("tokens/s transformers generate (target only)", f"{tps['hf_target_only']:.1f}" if hf_ran
         else "skipped (--no-hf)"),
        ("ours / transformers", f"{r['ours_over_transformers']:.2f}x" if hf_ran else "skipped (--no-hf)"),
        ("ours / transformers generate (target only)", f"{r['ours_over_transformers_target_only']:.2f}x" if hf_ran
         else "skipped (--no-hf)"),
        ("ours / target-only (measured speedup; the faster target-only)", f"{r['ours_over_target_only']:.2f}x"),
        ("acceptance rate (accepted / drafted)", f"{r['acceptance_rate']:.3f}"),
        ("per-token acceptance alpha (accepted / tested)", f"{r['token_acceptance_rate']:.3f}"),
        ("mean accepted length tau", f"{r['mean_accepted_length']:.2f}"),
        ("one-position forward ms (target, draft)", f"{1e3 * r['target_forward_s']:.3f}, {1e3 * r['draft_forward_s']:.3f}"),
        ("verify forward ms (gamma + 1 positions)", f"{1e3 * r['target_verify_forward_s']:.3f}"),
        ("cost ratio c (draft / target forward)", f"{r['cost_ratio']:.3f} (in loop {il['cost_ratio']:.3f})"),
        ("draft head: rows, ms per position, share of the draft forward",
         f"{r['draft_head']['head_rows']}, {1e3 * r['draft_head']['head_forward_s']:.3f}, "
         f"{r['draft_head']['share_of_draft_forward']:.0%}"),
        ("target memory bound: MB read / GB/s measured / bound ms; verify and 1-pos forward over it",
         f"{r['target_memory_bound']['weight_bytes'] / 1e6:.0f} / {r['target_memory_bound']['bandwidth_gb_s']:.1f} / "
         f"{1e3 * r['target_memory_bound']['bound_s']:.2f}; {r['target_memory_bound']['verify_over_bound']:.2f}x, "
         f"{r['target_memory_bound']['one_token_over_bound']:.2f}x"),
        ("verify cost ratio v (verify / 1-pos forward)",
         f"{r['verify_cost_ratio']:.2f} (in loop {il['verify_cost_ratio']:.2f})"),
        ("spec wall: prefill / draft / verify / other",
         f"{bd['prefill_s'] / wall:.0%} / {bd['draft_s'] / wall:.0%} / {bd['verify_s'] / wall:.0%} / "
         f"{bd['other_s'] / wall:.0%}"),
        ("loop efficiency (time in forwards / wall)",
         f"{bd['loop_efficiency']:.2f} (target-only {r['time_breakdown']['target_only']['loop_efficiency']:.2f})"),
        ("expected speedup (Leviathan Thm 3.8, v = 1)", f"{r['expected_speedup']:.2f}x"),
        ("expected speedup (measured c and v)", f"{r['expected_speedup_components']:.2f}x"),
        ("measured / expected (Leviathan)", f"{r['measured_over_expected']:.2f}"),
        ("ours: greedy outputs differing from target-only (of prompts x repeats)",
         f"{r['greedy_output_mismatches']['ours_speculative']} of {r['num_prompts'] * r['repeats']}"),
        ("decode.compile (compiled; compile s warm-up / timed)",
         f"{r['compile']['setting']} ({'yes' if r['compile']['compiled'] else 'no'}; "
         f"{r['compile']['compile_time_s']:.1f} / {r['compile']['compile_time_in_timed_s']:.1f})"),
        *([("ours compiled / uncompiled (tokens/s)", f"{r['compile']['compiled_over_uncompiled']:.2f}x"),
           ("ours uncompiled: outputs differing from target-only",
            f"{r['greedy_output_mismatches']['ours_speculative_uncompiled']}")] if r["compile"]["compiled"] else []),
        ("ours: several-row products (row layout; auto: per model, the timed set of its products)",
         f"{r['row_layout']['setting']}" + ("".join(
             f"; hidden {m['shapes'][0][0]}: {m['chosen']} (weight-left {m['weight_left_us']:.0f} us, "
             f"activation-left {m['activation_left_us']:.0f} us)" for m in r["row_layout"]["measured"]))),
        *([(f"ours / ours with row layout {peer} (tokens/s; its mismatches)",
            f"{r['row_layout']['ours_over_peer']:.2f}x; "
            f"{r['greedy_output_mismatches'][f'ours_speculative_row_layout_{peer}']}")] if peer else []),
        ("transformers: outputs differing from target-only (of prompts x repeats)",
         f"{r['greedy_output_mismatches']['hf_assisted']} of {r['num_prompts'] * r['repeats']}" if hf_ran
         else "skipped (--no-hf)"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)


def format_compare(r: dict) -> str:
    """Chain vs tree: one row per chain / tree method (equal target forwards: tokens per target forward)."""
    lines = ["| method | tokens / target forward (tau) | nodes / target forward | target forwards | tokens/s | "
             "tokens/s vs chain | vs target-only | vs transformers | greedy mismatches |",
             "|---|---|---|---|---|---|---|---|---|"]
    hf = r["tokens_per_s"]["hf_assisted"]
    for name, c in r["chain_vs_tree"].items():
        vs_hf = f"{c['tokens_per_s'] / hf:.2f}x" if hf == hf else "skipped"
        lines.append(f"| {name} | {c['tokens_per_target_forward']:.2f} | {c['nodes_per_target_forward']:.1f} | "
                     f"{c['target_forwards']} | {c['tokens_per_s']:.1f} | {c['tokens_per_s_over_chain']:.2f}x | "
                     f"{c['tokens_per_s_over_target_only']:.2f}x | {vs_hf} | {c['greedy_output_mismatches']} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run(args)
    print(format_table(result))
    if len(result["chain_vs_tree"]) > 1:
        print()
        print(format_compare(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2, default=float))
    return result


if __name__ == "__main__":
    main()
