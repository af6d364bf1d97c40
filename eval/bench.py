"""The decoder benchmark (``scripts/bench_decode.py``): specdraft's speculative decoder against target-only decoding
and Hugging Face assisted generation, timed side by side in one run.

On the same prompts (batch size 1, greedy) every repeat runs every method once per prompt, in the same order,
through :func:`eval.timing.alternated_rounds` (the evaluation's timing engine):

- ``target_only``: ours :func:`decode.autoregressive_generate` (KV cache, one token per target forward);
- ``hf_assisted``: ``target.generate(assistant_model=draft, do_sample=False)`` with ``num_assistant_tokens`` =
  gamma and the constant schedule (confidence stopping off); ``hf_target_only``: ``target.generate`` alone;
- ``ours_speculative``: :func:`decode.speculative_generate` (under the configured draft-length policy);
- peers in the same alternation: target-only with every forward at ``decode.block_threads`` threads, more chains
  and token trees (chain vs tree), ours uncompiled (``compile`` on), ours with the other row layout.

Results (:func:`run_bench`): tokens/s of each (new tokens / wall seconds, CUDA synchronised), ours / transformers
and ours / target-only (the faster target-only), the acceptance rate alpha and mean accepted length tau (pooled),
the cost ratio c (one-token cached draft forward / target forward, medians, the models alternating:
:func:`eval.timing.measure_cost_ratio`), the verify cost ratio v ((gamma + 1)-position target forward /
one-position forward: :func:`eval.timing.measure_verify_cost_ratio`), the expected speedup of Leviathan et al.
2023, Thm 3.8, from the per-token acceptance (:func:`leviathan_expectation`) and c, and from the measured
components ``(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + v))`` (:func:`decode.expected_speedup`); where the
speculative calls' wall time goes (:func:`eval.breakdown.phase_split`: prefill, draft, verify, other, loop
efficiency) and c, v per step in the loop against the target-only decoder's per-token time; the machine's load
while timing (:class:`eval.timing.LoadMeter`: above a quarter of a core of other processes the run is
DISTURBED); the draft head's share of a draft forward and the target's memory bound (:mod:`decode.timing`).
Generation ignores EOS unless ``stop_at_eos`` (fixed-length outputs make the methods comparable).
"""
from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from data.devices import runtime_record, torch_threads
from decode import AcceptanceStats, autoregressive_generate, expected_speedup, frozen_weights, speculative_generate
from decode.fast_llama import (compile_enabled, compile_seconds, fast_path_supported, row_layout_record, set_compile,
                               set_row_layout)
from decode.stats import expected_speedup_mixture
from decode.threads import block_threads_setting, resolved_block_threads, set_block_threads
from decode.timing import head_share, memory_bound_s

from .bench_setup import BenchConfig, check_context, load_models, load_prompts
from .breakdown import phase_split
from .timing import LoadMeter, alternated_rounds, measure_cost_ratio, measure_verify_cost_ratio

__all__ = ["leviathan_expectation", "run_bench"]

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
        eval.bench_setup.BenchError: a device this machine lacks, a pair that does not load, prompts that do not
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
    (:func:`eval.timing.alternated_rounds`, the same order every round). Returns ``{"tokens_per_s": {method:
    new tokens / wall seconds}, "stats": {method: [AcceptanceStats per call]} (ours), "mismatches": {method:
    outputs differing from target-only's}, "load": the machine's load while timing (eval.timing.load_record)}``."""
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
    (:func:`eval.timing.measure_cost_ratio`), "verify": v at ``gamma`` (:func:`eval.timing.measure_verify_cost_ratio`),
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
    """Where the wall time goes (:func:`eval.breakdown.phase_split` of ours and target-only, seconds pooled over
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
