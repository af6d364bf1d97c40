"""The decoder benchmark (``scripts/bench_decode.py``): specdraft's speculative decoder against target-only decoding
and Hugging Face assisted generation, timed side by side in one run.

On the same prompts (batch size 1, greedy) every repeat runs every method once per prompt, in the same order,
through :func:`eval.evaluate.alternated_rounds` (the evaluation's timing engine):

- ``target_only``: ours :func:`decode.autoregressive_generate` (KV cache, one token per target forward);
- ``hf_assisted``: ``target.generate(assistant_model=draft, do_sample=False)`` with ``num_assistant_tokens`` =
  gamma and the constant schedule (confidence stopping off); ``hf_target_only``: ``target.generate`` alone;
- ``ours_speculative``: :func:`decode.speculative_generate` (under the configured draft-length policy);
- peers in the same alternation: target-only with every forward at ``decode.block_threads`` threads, more chains
  and token trees (chain vs tree), ours uncompiled (``compile`` on), ours with the other row layout.

Results (:func:`run_bench`): tokens/s of each (new tokens / wall seconds, CUDA synchronised), ours / transformers
and ours / target-only (the faster target-only), the acceptance rate alpha and mean accepted length tau (pooled),
the cost ratio c (one-token cached draft forward / target forward, medians, the models alternating:
:func:`eval.evaluate.measure_cost_ratio`), the verify cost ratio v ((gamma + 1)-position target forward /
one-position forward: :func:`eval.evaluate.measure_verify_cost_ratio`), the expected speedup of Leviathan et al.
2023, Thm 3.8, from the per-token acceptance (:func:`leviathan_expectation`) and c, and from the measured
components ``(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + v))`` (:func:`decode.expected_speedup`); where the
speculative calls' wall time goes (:func:`eval.evaluate.phase_split`: prefill, draft, verify, other, loop
efficiency) and c, v per step in the loop against the target-only decoder's per-token time; the machine's load
while timing (:class:`eval.evaluate.LoadMeter`: above a quarter of a core of other processes the run is
DISTURBED); the draft head's share of a draft forward and the target's memory bound (:mod:`decode.timing`).
Generation ignores EOS unless ``stop_at_eos`` (fixed-length outputs make the methods comparable).

What the decoder benchmark (:mod:`eval.bench`) runs on: its settings (:class:`BenchConfig`, one field per flag
of ``scripts/bench_decode.py``), its prompts (random ids, a JSONL file, a domain's evaluation prompts or four
built-in texts), the tiny random models of ``--family``, the device and dtypes, the target and draft loaded with
one-line errors, and the check that prompt + new tokens + a verify block fit both models' context.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from core.runtime import runtime_record, torch_threads
from core.errors import BenchError
from decode import AcceptanceStats, autoregressive_generate, expected_speedup, frozen_weights, speculative_generate
from decode.common import output_vocab_size
from decode.fast_llama import (
    compile_enabled,
    compile_seconds,
    fast_path_supported,
    row_layout_record,
    set_compile,
    set_row_layout,
)
from decode.fast_settings import block_threads_setting, resolved_block_threads, set_block_threads
from decode.stats import expected_speedup_mixture
from decode.timing import head_share, memory_bound_s
from eval.evaluate import LoadMeter, alternated_rounds, measure_cost_ratio, measure_verify_cost_ratio, phase_split

__all__ = [
    'BUILTIN_PROMPTS', 'FAMILIES', 'BenchConfig', 'BenchError', 'check_context', 'family_models', 'load_models',
    'load_prompts', 'read_prompts_file', 'resolve_device_dtype', 'leviathan_expectation', 'run_bench',
]


BUILTIN_PROMPTS = [
    "The patient was admitted to the hospital with",
    "def fibonacci(n):\n    ",
    "Speculative decoding speeds up inference by",
    "Once upon a time, in a small village,",
]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")


@dataclass
class BenchConfig:
    """What to benchmark and how: one field per ``scripts/bench_decode.py`` flag, same names and defaults (its
    ``--help`` describes each; the script checks the values before anything loads, this class does not)."""

    target: str | None = None  # model directories; or family: a tiny random pair of that family
    draft: str | None = None
    family: str | None = None
    family_layers: int = 4
    family_hidden: int = 256
    family_window: int = 16
    domain: str | None = None  # prompts: a domain's evaluation prompts, a JSONL file, random ids or BUILTIN_PROMPTS
    prompts_file: str | None = None
    text_field: str = "text"
    max_prompts: int = 8
    prompt_texts: list[str] | None = None  # prompts_file's texts when already read (the script reads it to check it)
    prompt_ids: bool = False
    num_prompts: int = 4
    prompt_len: int = 16
    num_draft_tokens: int = 4  # decoding: gamma, new tokens, timed rounds over the prompts
    max_new_tokens: int = 64
    repeats: int = 3
    device: str = "auto"
    dtype: str = "auto"
    target_dtype: str | None = None
    draft_dtype: str | None = None
    draft_quantize: str = "auto"  # auto: the draft directory's specdraft.json "quantize" | none | int8
    stop_at_eos: bool = False
    cost_steps: int = 32
    seed: int = 0
    num_threads: int = 1
    fast_path: str = "auto"
    compile: str = "auto"
    block_threads: str = "auto"
    draft_length_policy: str = "fixed"
    policy_config: Any = None  # decode.config.DecodeConfig of ours' policy; None: the fixed policy at gamma
    trees: list = dataclasses.field(default_factory=list)  # decode.tree shapes (parsed --draft-tree) timed beside the chain
    chain_gamma: list[int] = dataclasses.field(default_factory=list)
    no_hf: bool = False
    row_layout: str = "auto"
    row_layout_peer: str | None = None

    def __post_init__(self):
        if self.policy_config is None:
            from decode.config import DecodeConfig

            self.policy_config = DecodeConfig(num_draft_tokens=max(1, self.num_draft_tokens),
                                              draft_length_policy=self.draft_length_policy)

    @classmethod
    def from_namespace(cls, ns) -> "BenchConfig":
        """The fields of an ``argparse.Namespace`` (or any object) that has them."""
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


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


def load_prompts(cfg, tokenizer, vocab: int) -> list[torch.Tensor]:
    """The prompts of ``cfg`` (a :class:`BenchConfig` or the script's arguments) as ``(1, P)`` int64 tensors:
    ``num_prompts`` random ids below ``vocab`` (``prompt_ids``), a domain's evaluation prompts
    (:func:`data.loading.eval_prompts`), a JSONL file's texts or :data:`BUILTIN_PROMPTS`, tokenized by
    ``tokenizer``."""
    if cfg.prompt_ids:
        gen = torch.Generator().manual_seed(cfg.seed)
        return [torch.randint(0, vocab, (1, cfg.prompt_len), generator=gen) for _ in range(cfg.num_prompts)]
    if cfg.domain:
        from data.loading import eval_prompts

        texts = [e.prompt for e in eval_prompts(cfg.domain, max_prompts=cfg.max_prompts, tokenizer=tokenizer)]
    elif cfg.prompts_file:
        texts = getattr(cfg, "prompt_texts", None) or read_prompts_file(cfg.prompts_file, cfg.text_field,
                                                                        cfg.max_prompts)
    else:
        texts = BUILTIN_PROMPTS
    return [tokenizer(t, return_tensors="pt").input_ids for t in texts]


def family_models(family: str, layers: int, hidden: int, window: int, vocab: int = 1024, seed: int = 0):
    """(target, draft): a random ``family`` model (``layers`` layers, max(4, hidden // 64) heads over half as many
    KV groups, windowed layers as the family lays them out, ``window`` positions) and a 1-layer draft sharing its
    embeddings, first layer, final norm and head."""
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
    """``--device`` / ``--dtype`` as eval.device / eval.dtype resolve them (:mod:`core.cli`).

    Raises:
        BenchError: an unavailable GPU or an unknown name (the message names the flag).
    """
    from core.runtime import resolve_device, resolve_dtype
    from core.errors import DeviceError

    try:
        dev = resolve_device(device, "--device")
        return dev, resolve_dtype(dtype, dev, "--dtype")
    except DeviceError as e:
        raise BenchError(str(e)) from None


def load_models(cfg: BenchConfig):
    """``(target, draft, tokenizer or None, device, {"dtype", "target_dtype", "draft_dtype"}, shared vocabulary)``:
    the pair of ``cfg`` (directories, or a tiny random ``family`` pair) on the resolved device in their dtypes.
    The shared vocabulary is the logits both models produce (a trimmed draft head still scores every id, -inf
    outside its kept ids), capped by the tokenizer.

    Raises:
        BenchError: a device or dtype this machine lacks, a missing / partial / unloadable directory, two
            tokenizers that differ.
    """
    device, dtype = resolve_device_dtype(cfg.device, cfg.dtype)
    t_dtype = resolve_device_dtype(cfg.device, cfg.target_dtype)[1] if cfg.target_dtype else dtype
    d_dtype = resolve_device_dtype(cfg.device, cfg.draft_dtype)[1] if cfg.draft_dtype else dtype
    tokenizer = None
    if cfg.family:
        target, draft = family_models(cfg.family, cfg.family_layers, cfg.family_hidden, cfg.family_window,
                                      seed=cfg.seed)
        target, draft = target.to(device=device, dtype=t_dtype), draft.to(device=device, dtype=d_dtype)
    else:
        from models.checkpoints import load_target_and_draft

        try:
            target, draft, tokenizer = load_target_and_draft(cfg.target, cfg.draft, dtype=t_dtype,
                                                             draft_dtype=d_dtype, device=device,
                                                             need_tokenizer=not cfg.prompt_ids)
        except ValueError as e:
            raise BenchError(str(e)) from None
        tokenizer = None if cfg.prompt_ids else tokenizer
    draft, quantize = _quantized(cfg, draft)
    vocab = min(output_vocab_size(target), output_vocab_size(draft))
    if tokenizer is not None:
        vocab = min(vocab, len(tokenizer))
    dtypes = {"dtype": dtype, "target_dtype": t_dtype, "draft_dtype": d_dtype if quantize == "none" else quantize}
    return target, draft, tokenizer, device, dtypes, vocab


def _quantized(cfg: BenchConfig, draft):
    """``(draft, mode)``: the draft quantized as ``cfg.draft_quantize`` says (``auto``: as its directory's
    ``specdraft.json`` records; :mod:`decode.fast_settings`), for ours and transformers' assisted generation alike.

    Raises:
        BenchError: an unknown mode, or int8 asked for a draft on a GPU or not in float32 (CPU kernels only).
    """
    from decode.fast_settings import QUANTIZE_MODES, check_quantize_meta, quantize_draft

    mode = cfg.draft_quantize
    if mode == "auto":
        try:
            mode = check_quantize_meta(cfg.draft) if cfg.draft and not cfg.family else "none"
        except ValueError as e:
            raise BenchError(str(e)) from None
    if mode not in QUANTIZE_MODES:
        raise BenchError(f"--draft-quantize must be auto or one of {', '.join(QUANTIZE_MODES)}, got {mode!r}")
    if mode != "none" and next(draft.parameters()).dtype != torch.float32:
        raise BenchError(f"--draft-quantize {mode}: the int8 kernels take a float32 draft; drop --draft-dtype / "
                         f"--dtype or use --draft-quantize none")
    try:
        return quantize_draft(draft, mode), mode
    except ValueError as e:
        raise BenchError(f"--draft-quantize {mode}: {e}") from None


def check_context(cfg: BenchConfig, target, draft, prompts: list[torch.Tensor]) -> None:
    """The decoders' caches hold prompt + new tokens + one verify block (the largest chain or tree + 2).

    Raises:
        BenchError: a prompt with no tokens, or the longest prompt + ``max_new_tokens`` + that block beyond a
            model's context (the message says how far to lower ``--max-new-tokens``).
    """
    from core.errors import CheckpointError
    from models.checkpoints import check_context_fits

    if not prompts or min(p.shape[1] for p in prompts) < 1:
        raise BenchError("a prompt tokenizes to no tokens; give prompts with text")
    longest = max(p.shape[1] for p in prompts)
    block = max([cfg.num_draft_tokens, *cfg.chain_gamma, *(t.max_nodes for t in cfg.trees)]) + 2
    try:
        for model, role in ((target, "target"), (draft, "draft")):
            limit = getattr(model.config, "max_position_embeddings", None) or 0
            check_context_fits(model, longest + cfg.max_new_tokens + block, role,
                               f"the longest prompt ({longest} tokens) + --max-new-tokens ({cfg.max_new_tokens}) + "
                               f"the largest verify block ({block})",
                               fix=f"lower --max-new-tokens to at most {limit - longest - block}"
                               if limit > longest + block else "use shorter prompts or a smaller draft tree")
    except CheckpointError as e:
        raise BenchError(str(e)) from None


NAN = float("nan")


def leviathan_expectation(stats: AcceptanceStats, gamma: int, cost_ratio: float) -> tuple[float, float]:
    """``(per-token acceptance alpha, expected speedup)`` of Leviathan et al. 2023, Thm 3.8, whose i.i.d. model
    wants the per-token acceptance probability: accepted / positions reached, summed over draft positions
    (``sum(per_position_accepted) / sum(per_position_drafted)``; as ``token_acceptance_rate`` in metrics.json),
    not accepted / drafted (which counts the positions after the first rejection as rejected too). NaN when
    nothing was drafted."""
    alpha = stats.per_token_acceptance
    return alpha, (expected_speedup(alpha, gamma, cost_ratio) if alpha == alpha else NAN)


def run_bench(cfg: BenchConfig) -> dict:
    """Benchmark ``cfg``'s pair (module docstring) and return the results: ``tokens_per_s`` per method, the
    speedups, acceptance, costs (seconds), ``time_breakdown``, ``in_loop``, ``load``, ``stats`` and
    ``chain_vs_tree`` (the keys ``scripts/bench_decode.py --json-out`` writes). Torch's threads
    (``cfg.num_threads`` while running), ``decode.block_threads``, ``decode.compile`` and the row layout are set for
    the run; the threads, block threads and row layout are restored after it.

    Raises:
        eval.bench.BenchError: a device this machine lacks, a pair that does not load, prompts that do not
            fit a model's context.
    """
    threads_before, block_before = torch.get_num_threads(), block_threads_setting()
    layout_before = row_layout_record()["setting"]
    torch.set_num_threads(cfg.num_threads)
    try:
        return _run(cfg)
    finally:
        torch.set_num_threads(threads_before)
        set_block_threads(block_before)
        set_row_layout(layout_before)


def _run(cfg: BenchConfig) -> dict:
    set_compile(cfg.compile)
    set_block_threads(cfg.block_threads)
    set_row_layout(cfg.row_layout)
    torch.manual_seed(cfg.seed)
    target, draft, tokenizer, device, dtypes, vocab = load_models(cfg)
    prompts = [p.to(device) for p in load_prompts(cfg, tokenizer, vocab)]
    check_context(cfg, target, draft, prompts)
    run = _Run(cfg, target, draft, device, dtypes, len(prompts), fast_path=None if cfg.fast_path == "auto" else False,
               block_threads=resolved_block_threads(device))
    # weights never change during the benchmark: decode calls reuse what they read from the models, as a server
    # (decode.frozen_weights; transformers' generate re-reads nothing per call either)
    with frozen_weights(target, draft):
        methods = run.methods(vocab)
        compile_s0 = compile_seconds()
        for fn in methods.values():  # warm-up (allocations, kernels; compiling when decode.compile is on), untimed
            fn(prompts[0])
        run.compile_s = (compile_s0, compile_seconds() - compile_s0)
        timed = _time_methods(methods, prompts, cfg.repeats, device)
        costs = _forward_costs(target, draft, prompts[0], cfg.num_draft_tokens, cfg.cost_steps, run.fast_path)
        return run.record(timed, costs)


def _new_tokens(out, p: torch.Tensor) -> torch.Tensor:
    """The (1, N) new tokens of a decoder's output for prompt ``p`` (1, P)."""
    return out.sequences[:, p.shape[1]: p.shape[1] + int(out.num_new_tokens[0])]


def _hf_methods(target, draft, gamma: int, max_new_tokens: int, eos, pad) -> dict[str, Callable]:
    """Transformers' assisted generation (constant schedule of ``gamma``, no confidence stopping, our EOS policy)
    and its own target-only generate: prompt (1, P) -> new tokens (1, N)."""
    gen_cfg = copy.deepcopy(target.generation_config)
    gen_cfg.eos_token_id, gen_cfg.pad_token_id = eos, pad
    gen_cfg.do_sample, gen_cfg.max_new_tokens = False, max_new_tokens
    draft.generation_config.num_assistant_tokens = gamma
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    draft.generation_config.eos_token_id = eos

    def hf_assisted(p):
        out = target.generate(p, attention_mask=torch.ones_like(p), assistant_model=draft, generation_config=gen_cfg)
        return out[:, p.shape[1]:]

    def hf_target_only(p):  # transformers' own generate, no assistant: the peer's target-only decoding
        out = target.generate(p, attention_mask=torch.ones_like(p), generation_config=gen_cfg)
        return out[:, p.shape[1]:]

    return {"hf_assisted": hf_assisted, "hf_target_only": hf_target_only}


@dataclass
class _Run:
    """One benchmark run: the pair, where and how it decodes, and the record of its results."""

    cfg: BenchConfig
    target: Any
    draft: Any
    device: torch.device
    dtypes: dict
    num_prompts: int
    fast_path: bool | None
    block_threads: int | None
    compile_s: tuple[float, float] = (0.0, 0.0)  # compile_seconds() before the warm-up, compiling in it

    @property
    def compiled(self) -> bool:
        return compile_enabled(self.device) and self.fast_path is None

    @property
    def peer_layout(self) -> str | None:
        peer = self.cfg.row_layout_peer
        return f"ours_speculative_row_layout_{peer}" if peer else None

    def methods(self, vocab: int) -> dict[str, Callable]:
        """Every timed method by name, in the order each round runs them: prompt (1, P) -> new tokens (1, N), with
        its :class:`decode.AcceptanceStats` for ours."""
        cfg, gamma, n_new = self.cfg, self.cfg.num_draft_tokens, self.cfg.max_new_tokens
        eos = self.target.generation_config.eos_token_id if cfg.stop_at_eos else None
        pad = self.target.generation_config.pad_token_id
        pad = pad if pad is not None else (eos if isinstance(eos, int) else (eos[0] if eos else 0))
        common = dict(max_new_tokens=n_new, eos_token_id=eos if eos is not None else [],  # []: never stops
                      pad_token_id=pad, vocab_size=vocab, fast_path=self.fast_path)

        def ours_ar(p):
            out = autoregressive_generate(self.target, p, **common)
            return _new_tokens(out, p), out.stats

        def ours(p, make_policy=None, **setting):  # a chain (num_draft_tokens=G) or a tree (draft_tree=T)
            out = speculative_generate(self.target, self.draft, p, **common, **setting,
                                       draft_length_policy=make_policy() if make_policy is not None else None)
            return _new_tokens(out, p), out.stats

        ours_spec = functools.partial(ours, num_draft_tokens=gamma, make_policy=cfg.policy_config.make_policy)
        hf = {} if cfg.no_hf else _hf_methods(self.target, self.draft, gamma, n_new, eos, pad)
        methods = {"target_only": ours_ar, **hf, "ours_speculative": ours_spec}
        if self.block_threads is not None and self.block_threads != torch.get_num_threads():

            def target_only_block_threads(p):  # every target-only forward at the block thread count: the peer's best?
                with torch_threads(self.block_threads):
                    return ours_ar(p)

            methods["target_only_block_threads"] = target_only_block_threads
        methods.update({name: functools.partial(ours, **setting) for name, setting in self.extra_settings().items()})
        methods.update(self._peer_methods(ours_spec))
        return methods

    def extra_settings(self) -> dict[str, dict]:
        """More chains and the token trees, by their chain-vs-tree name: their :func:`decode.speculative_generate`
        setting."""
        gamma = self.cfg.num_draft_tokens
        extra = {f"chain {g}": {"num_draft_tokens": g} for g in sorted(set(self.cfg.chain_gamma) - {gamma})}
        extra.update({f"tree {t.spec()}": {"draft_tree": t} for t in self.cfg.trees})
        return extra

    def _peer_methods(self, ours_spec: Callable) -> dict[str, Callable]:
        """Ours (the main chain) uncompiled when compiled, and with the peer row layout, in the same alternation."""
        cfg, methods = self.cfg, {}
        if self.compiled:

            def ours_spec_uncompiled(p):
                set_compile("off")
                try:
                    return ours_spec(p)
                finally:
                    set_compile(cfg.compile)

            methods["ours_speculative_uncompiled"] = ours_spec_uncompiled
        if self.peer_layout:

            def ours_spec_row_layout(p):
                set_row_layout(cfg.row_layout_peer)
                try:
                    return ours_spec(p)
                finally:
                    set_row_layout(cfg.row_layout)

            methods[self.peer_layout] = ours_spec_row_layout
        return methods

    def record(self, timed: dict, costs: dict) -> dict:
        """The results (:func:`run_bench`) from the timed rounds (:func:`_time_methods`) and the forward costs
        (:func:`_forward_costs`)."""
        cfg, gamma, tps = self.cfg, self.cfg.num_draft_tokens, timed["tokens_per_s"]
        stats = AcceptanceStats.pool(timed["stats"]["ours_speculative"])
        ar = AcceptanceStats.pool(timed["stats"]["target_only"])
        # against the faster target-only: one-token forwards at num_threads, or every forward at the block threads
        best = max(tps["target_only"], tps.get("target_only_block_threads", float("-inf")))
        return {
            **self._setup_record(stats),
            **_speed_record(cfg, stats, tps, best, costs),
            **_phase_record(stats, ar),
            "greedy_output_mismatches": timed["mismatches"],
            "compile": {"setting": cfg.compile, "compiled": self.compiled,
                        "compile_time_s": self.compile_s[1],  # first calls (warm-up), untimed
                        "compile_time_in_timed_s": compile_seconds() - sum(self.compile_s),
                        "compiled_over_uncompiled": (tps["ours_speculative"] / tps["ours_speculative_uncompiled"]
                                                     if self.compiled else None)},
            "row_layout": {**row_layout_record(), "setting": cfg.row_layout, "peer": cfg.row_layout_peer,
                           "ours_over_peer": tps["ours_speculative"] / tps[self.peer_layout]
                           if self.peer_layout else None},
            "load": timed["load"],
            "stats": stats.to_dict(),
            "chain_vs_tree": _chain_vs_tree(f"chain {gamma}", timed, list(self.extra_settings()), best),
        }

    def _setup_record(self, stats: AcceptanceStats) -> dict:
        """What ran where: family, device, dtypes, threads, runtime, lean forward, prompts, gamma, policy."""
        cfg, dt = self.cfg, {k: str(v).replace("torch.", "") for k, v in self.dtypes.items()}
        return {
            "family": cfg.family, "device": str(self.device), **dt,
            "num_threads": torch.get_num_threads(),
            "block_threads": {"setting": cfg.block_threads, "threads": self.block_threads},
            "runtime": runtime_record(self.device, self.dtypes["dtype"]),  # + torch / CUDA versions, GPU name
            "fast_path": cfg.fast_path,
            "fast_path_used": {"target": cfg.fast_path == "auto" and fast_path_supported(self.target),
                               "draft": cfg.fast_path == "auto" and fast_path_supported(self.draft)},
            "num_prompts": self.num_prompts, "repeats": cfg.repeats, "num_draft_tokens": cfg.num_draft_tokens,
            "draft_length_policy": cfg.policy_config.policy_settings(),
            "mean_draft_length": stats.drafted_tokens / stats.verify_steps if stats.verify_steps else NAN,
            "max_new_tokens": cfg.max_new_tokens,
        }


def _time_methods(methods: dict[str, Callable], prompts: list[torch.Tensor], repeats: int,
                  device: torch.device) -> dict:
    """``repeats`` times over ``prompts``, one alternated round of every method per prompt
    (:func:`eval.evaluate.alternated_rounds`, the same order every round). Returns ``{"tokens_per_s": {method:
    new tokens / wall seconds}, "stats": {method: [AcceptanceStats per call]} (ours), "mismatches": {method:
    outputs differing from target-only's}, "load": the machine's load while timing (eval.evaluate.load_record)}``."""
    seconds, tokens = {m: 0.0 for m in methods}, {m: 0 for m in methods}
    stats: dict[str, list[AcceptanceStats]] = {m: [] for m in methods}
    mismatches = {m: 0 for m in methods if m != "target_only"}  # outputs differing from target-only greedy
    # one bar step per prompt round (every method once), on stderr: the table comes only at the end
    bar = tqdm(total=repeats * len(prompts), desc=f"bench {len(methods)} methods", unit="round", dynamic_ncols=True)
    with bar, LoadMeter() as meter:  # other processes' load while timing: a disturbed run says so
        for _ in range(repeats):
            for p in prompts:
                results, times = alternated_rounds({m: functools.partial(fn, p) for m, fn in methods.items()}, device)
                outputs = {}
                for m, (res,) in results.items():
                    new = res[0] if isinstance(res, tuple) else res
                    seconds[m] += times[m][0]
                    tokens[m] += new.shape[1]
                    outputs[m] = new.cpu()
                    if isinstance(res, tuple):
                        stats[m].append(res[1])
                ref = outputs["target_only"]
                for m, o in outputs.items():
                    if m != "target_only":
                        mismatches[m] += int(o.shape != ref.shape or not torch.equal(o, ref))
                bar.update(1)
    tps = {m: tokens[m] / seconds[m] if seconds[m] > 0 else NAN for m in methods}
    for peer in ("hf_assisted", "hf_target_only"):  # skipped (no_hf): NaN, no mismatches
        tps.setdefault(peer, NAN)
        mismatches.setdefault(peer, 0)
    return {"tokens_per_s": tps, "stats": stats, "mismatches": mismatches, "load": meter.record}


def _forward_costs(target, draft, prompt: torch.Tensor, gamma: int, steps: int, fast_path: bool | None) -> dict:
    """Medians of ``steps`` cached forwards after prefilling ``prompt`` (1, T), seconds: ``{"cost": c
    (:func:`eval.evaluate.measure_cost_ratio`), "verify": v at ``gamma`` (:func:`eval.evaluate.measure_verify_cost_ratio`),
    "head": the draft head's part of a draft forward, "bound": the target's memory bound (:mod:`decode.timing`)}``."""
    return {"cost": measure_cost_ratio(target, draft, prompt, steps, fast_path),
            "verify": measure_verify_cost_ratio(target, prompt, [gamma], steps, fast_path)[str(gamma)],
            "head": head_share(draft, steps), "bound": memory_bound_s(target)}


def _speed_record(cfg: BenchConfig, stats: AcceptanceStats, tps: dict, best: float, costs: dict) -> dict:
    """Tokens/s, speedups, acceptance, forward costs and the expected speedups (Leviathan et al. 2023, Thm 3.8:
    v = 1, over the draft lengths used for a policy other than fixed; and with the measured c and v)."""
    gamma, cost, verify = cfg.num_draft_tokens, costs["cost"], costs["verify"]
    c, v, head, bound = cost["cost_ratio"], verify["verify_cost_ratio"], costs["head"], costs["bound"]
    token_alpha, expected = leviathan_expectation(stats, gamma, c)
    expected_comp = expected_speedup(token_alpha, gamma, c, v) if token_alpha == token_alpha else NAN
    if cfg.draft_length_policy != "fixed" and token_alpha == token_alpha:  # Thm 3.8 over the lengths used
        lengths = stats.draft_lengths
        expected = expected_speedup_mixture(token_alpha, [lengths.count(k) for k in range(max(lengths) + 1)], c)
    measured = tps["ours_speculative"] / best
    return {
        "tokens_per_s": tps,
        "ours_over_transformers": tps["ours_speculative"] / tps["hf_assisted"],
        "ours_over_transformers_target_only": tps["ours_speculative"] / tps["hf_target_only"],
        "draft_head": {**head, "share_of_draft_forward": head["head_forward_s"] / cost["draft_forward_s"]},
        "target_memory_bound": {**bound, "verify_over_bound": verify["verify_forward_s"] / bound["bound_s"],
                                "one_token_over_bound": verify["target_forward_s"] / bound["bound_s"]},
        "ours_over_target_only": measured,
        "acceptance_rate": stats.acceptance_rate,
        "token_acceptance_rate": token_alpha,
        "mean_accepted_length": stats.mean_accepted_length,
        "draft_forward_s": cost["draft_forward_s"],
        "target_forward_s": cost["target_forward_s"],
        "target_verify_forward_s": verify["verify_forward_s"],
        "cost_ratio": c,
        "verify_cost_ratio": v,
        "expected_speedup": expected,
        "expected_speedup_components": expected_comp,
        "measured_over_expected": measured / expected,
    }


def _phase_record(stats: AcceptanceStats, ar: AcceptanceStats) -> dict:
    """Where the wall time goes (:func:`eval.evaluate.phase_split` of ours and target-only, seconds pooled over
    the timed calls) and the costs per step in the loop against the target-only decoder's per-token time."""
    split = {name: phase_split(s.wall_time_s, s.prefill_time_s, s.draft_time_s, s.verify_time_s, missing=NAN)
             for name, s in (("ours_speculative", stats), ("target_only", ar))}
    steps = stats.verify_steps
    in_loop = {
        "verify_s_per_step": stats.verify_time_s / steps if steps else NAN,
        "draft_s_per_token": stats.draft_time_s / stats.drafted_tokens if stats.drafted_tokens else NAN,
        "other_s_per_step": split["ours_speculative"]["other_s"] / steps if steps else NAN,
        "target_s_per_token_target_only": ar.verify_time_s / ar.verify_steps if ar.verify_steps else NAN,
    }
    in_loop["verify_cost_ratio"] = in_loop["verify_s_per_step"] / in_loop["target_s_per_token_target_only"]
    in_loop["cost_ratio"] = in_loop["draft_s_per_token"] / in_loop["target_s_per_token_target_only"]
    return {"time_breakdown": split, "in_loop": in_loop}


def _chain_vs_tree(main: str, timed: dict, extra: list[str], best: float) -> dict:
    """Per chain / tree (``main``: the main chain, ours_speculative): tokens and draft nodes per target forward
    (equal target forwards: tau), tokens/s against the main chain and the faster target-only, greedy mismatches
    and phase seconds."""
    tps, out = timed["tokens_per_s"], {}
    for name in [main, *extra]:
        method = "ours_speculative" if name == main else name
        st = AcceptanceStats.pool(timed["stats"][method])
        out[name] = {
            "tokens_per_target_forward": st.mean_accepted_length,
            "nodes_per_target_forward": st.mean_nodes_verified,
            "target_forwards": st.verify_steps,
            "tokens_per_s": tps[method],
            "tokens_per_s_over_chain": tps[method] / tps["ours_speculative"],
            "tokens_per_s_over_target_only": tps[method] / best,
            "greedy_output_mismatches": timed["mismatches"][method],
            "draft_s": st.draft_time_s, "verify_s": st.verify_time_s, "wall_s": st.wall_time_s,
        }
    return out
